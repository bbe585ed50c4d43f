"""Encoding and decoding of framed messages (msgpack), one decoder per direction, built once.

The decoders are the protocol's trust boundary: whatever bytes arrive, they return a message
whose every field is within :mod:`protocol.limits` or raise :class:`ProtocolError` (or the
:class:`BadRequest` of a layout's own validation) — never anything else. In particular input
nested deeper than the interpreter's recursion limit makes msgspec raise ``RecursionError``;
that is caught here (:func:`decode_guarded`) and reported as a ``ProtocolError`` like any other
malformed frame.
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.errors import KvdError, ProtocolError
from protocol.framing import DEFAULT_MAX_FRAME_SIZE, frame
from protocol.messages import Message, Reply, Request

_encoder = msgspec.msgpack.Encoder()
_request_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(Request)
_reply_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(Reply)


class _IdOnly(msgspec.Struct):
    """Just the ``id`` of a request map; every other field is skipped, not built."""

    id: int = 0


_id_decoder = msgspec.msgpack.Decoder(_IdOnly)


def decode_guarded(decoder: msgspec.msgpack.Decoder[Any], payload: bytes, what: str) -> Any:
    """``decoder.decode(payload)`` with every failure turned into a :class:`ProtocolError`.

    :class:`KvdError` raised by a Struct's validation (``KVLayout``'s ``BadRequest``) passes
    through; msgspec's errors, ``ValueError``/``TypeError`` from ``__post_init__`` and the
    ``RecursionError`` of deeply nested input become ``ProtocolError`` naming ``what``.
    """
    try:
        return decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid {what}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable {what} frame: {exc}") from None
    except KvdError:
        raise
    except RecursionError:
        raise ProtocolError(f"invalid {what}: nested too deeply") from None
    except (ValueError, TypeError) as exc:  # e.g. raised from a Struct's __post_init__
        raise ProtocolError(f"invalid {what}: {exc}") from None


def encode(msg: Message, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """Serialize and frame one message."""
    return frame(_encoder.encode(msg), max_frame_size)


def _decode(decoder: msgspec.msgpack.Decoder[Any], payload: bytes) -> Message:
    msg = decode_guarded(decoder, payload, "message")
    assert isinstance(msg, Message)
    return msg


def decode_request(payload: bytes) -> Message:
    """Decode a client → daemon frame payload; raises :class:`ProtocolError`/:class:`KvdError`."""
    return _decode(_request_decoder, payload)


def decode_reply(payload: bytes) -> Message:
    """Decode a daemon → client frame payload."""
    return _decode(_reply_decoder, payload)


def request_id_of(payload: bytes) -> int:
    """Best-effort recovery of the ``id`` of an undecodable request, for the Error reply.

    Only ``id`` is decoded (the rest is skipped without building it), so a hostile payload
    costs no memory here; anything that is not a map with a small non-negative integer
    ``id`` gives 0.
    """
    try:
        rid = _id_decoder.decode(payload).id
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return 0
    return rid if 0 <= rid < 2**63 else 0
