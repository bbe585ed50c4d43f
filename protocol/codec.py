"""Encoding and decoding of framed messages (msgpack), one decoder per direction, built once."""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.errors import KvdError, ProtocolError
from protocol.framing import DEFAULT_MAX_FRAME_SIZE, frame
from protocol.messages import Message, Reply, Request

_encoder = msgspec.msgpack.Encoder()
_request_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(Request)
_reply_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(Reply)


def encode(msg: Message, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """Serialize and frame one message."""
    return frame(_encoder.encode(msg), max_frame_size)


def _decode(decoder: msgspec.msgpack.Decoder[Any], payload: bytes) -> Message:
    try:
        msg = decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from None
    except KvdError:
        raise
    except (ValueError, TypeError) as exc:  # e.g. raised from a Struct's __post_init__
        raise ProtocolError(f"invalid message: {exc}") from None
    assert isinstance(msg, Message)
    return msg


def decode_request(payload: bytes) -> Message:
    """Decode a client → daemon frame payload; raises :class:`ProtocolError`/:class:`KvdError`."""
    return _decode(_request_decoder, payload)


def decode_reply(payload: bytes) -> Message:
    """Decode a daemon → client frame payload."""
    return _decode(_reply_decoder, payload)


def request_id_of(payload: bytes) -> int:
    """Best-effort recovery of the ``id`` of an undecodable request, for the Error reply."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return 0
    if isinstance(raw, dict):
        rid = raw.get("id", 0)
        if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < 2**63:
            return rid
    return 0
