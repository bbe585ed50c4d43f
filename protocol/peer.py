"""Daemon ↔ daemon (peer link) wire messages, sans-IO.

A separate tagged union from the executor protocol (:mod:`protocol.messages`): the same
conventions (frozen msgspec Structs, tag field ``type``, keyword-only, ``id`` pairs a reply
with its request, msgpack, length-prefixed frames from :mod:`protocol.framing`), but its own
version and its own decoder.

The link starts with a mutual challenge-response handshake over a shared secret (the secret
never crosses the wire; see :mod:`kvd.peer.auth` for the MACs)::

    client (connecting daemon)                   server (listening daemon)
    PeerHello(version, node, nonce_c)      ──▶
                                           ◀──   PeerChallenge(version, node, nonce_s, mac_s)
    PeerAuth(mac_c)                        ──▶
                                           ◀──   PeerWelcome(node, NIXL metadata, regions)
    PeerWelcome(node, NIXL metadata, ...)  ──▶
    ... Heartbeat(seq) / HeartbeatAck(seq) either way, transfer control, PeerBye ...

Either side answers a failure with ``PeerError(code, message)`` (codes of
:mod:`protocol.errors`) and closes.

Every field is bounded (:mod:`protocol.limits`): names, free text, nonces, the lists of a
welcome; :func:`decode_peer` refuses anything else — deeply nested input included — with a
:class:`~protocol.errors.ProtocolError`, whether or not the peer has authenticated yet.

Extending the union: transfer-control messages are Structs tagged on ``type`` (subclass
:class:`PeerMessage`, or any Struct base with ``tag_field="type"``) registered once at import
time with :func:`register_peer_messages`; the decoder is rebuilt then. Rules as for the
executor protocol: new fields get defaults, a field's type never changes, new messages get
new tags, :data:`PEER_PROTOCOL_VERSION` is bumped only for incompatible changes.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

from protocol.codec import decode_guarded
from protocol.framing import DEFAULT_MAX_FRAME_SIZE, frame
from protocol.layout import KVLayout
from protocol.limits import MAX_POOLS, MAX_REGIONS, MAX_SLOTS, ByteCount, Count, Name, Text

__all__ = [
    "MAX_NONCE_BYTES",
    "MIN_NONCE_BYTES",
    "PEER_MESSAGES",
    "PEER_PROTOCOL_VERSION",
    "PRE_AUTH_MAX_FRAME_SIZE",
    "Heartbeat",
    "HeartbeatAck",
    "PeerAuth",
    "PeerBye",
    "PeerChallenge",
    "PeerError",
    "PeerHello",
    "PeerMessage",
    "PeerWelcome",
    "PoolDesc",
    "RegionDesc",
    "decode_peer",
    "encode_peer",
    "encode_peer_payload",
    "register_peer_messages",
]

#: Version of the peer-link protocol; both daemons must speak the same one.
PEER_PROTOCOL_VERSION = 1
#: Nonce sizes accepted in the handshake (32 random bytes are sent).
MIN_NONCE_BYTES = 16
MAX_NONCE_BYTES = 64
#: Longest MAC accepted (HMAC-SHA256 sends 32 bytes).
MAX_MAC_BYTES = 64
Nonce = Annotated[bytes, msgspec.Meta(max_length=MAX_NONCE_BYTES)]
Mac = Annotated[bytes, msgspec.Meta(max_length=MAX_MAC_BYTES)]
Device = Annotated[int, msgspec.Meta(ge=-1, lt=1 << 16)]
#: Frame limit before the peer has authenticated: an unauthenticated peer cannot make us buffer more.
PRE_AUTH_MAX_FRAME_SIZE = 64 * 1024


class PeerMessage(msgspec.Struct, frozen=True, tag_field="type", kw_only=True):
    """Base of the peer-link messages. ``id`` pairs a reply with its request (0 = none)."""

    id: int = 0


# --- data carried in the welcome ---------------------------------------------------------


class RegionDesc(msgspec.Struct, frozen=True, kw_only=True):
    """A NIXL-registered region the peer may write into (a bounce receive region).

    The region is ``slots`` slots of ``slot_bytes`` each (0 = not slotted).
    """

    name: Name = ""
    addr: ByteCount
    nbytes: ByteCount
    device: Device = -1  # -1 = host memory (DRAM), else CUDA ordinal (VRAM)
    slot_bytes: ByteCount = 0
    slots: Annotated[int, msgspec.Meta(ge=0, le=MAX_SLOTS)] = 0


class PoolDesc(msgspec.Struct, frozen=True, kw_only=True):
    """A KV pool of the peer: where its blocks are, for direct (no-bounce) writes."""

    name: Name
    addr: ByteCount
    nbytes: ByteCount
    device: Device = -1
    kind: Name = ""  # "fabric" | "device" | "posix_fd" | "host"
    block_bytes: ByteCount = 0
    num_blocks: Count = 0
    layout: KVLayout | None = None
    rank: Count = 0


# --- handshake ---------------------------------------------------------------------------


class PeerHello(PeerMessage, frozen=True, tag="peer_hello"):
    """First message of the connecting daemon."""

    version: int
    node: Name
    nonce: Nonce


class PeerChallenge(PeerMessage, frozen=True, tag="peer_challenge"):
    """The listening daemon's answer: its own nonce and its proof of the secret."""

    version: int
    node: Name
    nonce: Nonce
    mac: Mac


class PeerAuth(PeerMessage, frozen=True, tag="peer_auth"):
    """The connecting daemon's proof of the secret."""

    mac: Mac


class PeerWelcome(PeerMessage, frozen=True, tag="peer_welcome"):
    """What a daemon offers its peer once both are authenticated (sent by both sides)."""

    node: Name
    software: Text = ""  # kvd version string, informational
    nixl_agent: Name = ""  # NIXL agent name (the key of its notifications)
    nixl_metadata: bytes = b""  # bounded by the frame size
    bounce: Annotated[list[RegionDesc], msgspec.Meta(max_length=MAX_REGIONS)] = []
    pools: Annotated[list[PoolDesc], msgspec.Meta(max_length=MAX_POOLS)] = []
    host_id: Text = ""  # boot id + hostname: equal on both sides = same node (pools mappable)
    socket_path: Text = ""  # the daemon's executor socket, to attach its pools on the same node


# --- link life ---------------------------------------------------------------------------


class Heartbeat(PeerMessage, frozen=True, tag="heartbeat"):
    seq: Count


class HeartbeatAck(PeerMessage, frozen=True, tag="heartbeat_ack"):
    seq: Count


class PeerError(PeerMessage, frozen=True, tag="peer_error"):
    """A failure; ``code`` is a :mod:`protocol.errors` code. ``id`` names the failed request."""

    code: Name
    message: Text = ""


class PeerBye(PeerMessage, frozen=True, tag="peer_bye"):
    """Orderly close ("closed by us" on the sender's side, not a failure)."""

    reason: Text = ""


#: Every message type the peer decoder accepts. Extend with :func:`register_peer_messages`.
PEER_MESSAGES: list[type[msgspec.Struct]] = [
    PeerHello,
    PeerChallenge,
    PeerAuth,
    PeerWelcome,
    Heartbeat,
    HeartbeatAck,
    PeerError,
    PeerBye,
]

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Any]


def _build_decoder() -> None:
    global _decoder
    union: Any = Union[tuple(PEER_MESSAGES)]  # noqa: UP007 - a runtime-built union
    _decoder = msgspec.msgpack.Decoder(union)


def _tag_of(cls: type[msgspec.Struct]) -> tuple[str | None, object]:
    cfg = cls.__struct_config__
    return cfg.tag_field, cfg.tag


def register_peer_messages(*types: type[msgspec.Struct]) -> None:
    """Add message types to the peer union (idempotent per type); rebuilds the decoder.

    Each must be a frozen Struct tagged on ``type`` with a tag no other message uses.
    """
    known = {_tag_of(t)[1]: t for t in PEER_MESSAGES}
    added = False
    for t in types:
        if not (isinstance(t, type) and issubclass(t, msgspec.Struct)):
            raise TypeError(f"{t!r} is not a msgspec Struct")
        tag_field, tag = _tag_of(t)
        if tag_field != "type" or tag is None:
            raise TypeError(f"{t.__name__} must be tagged on the field 'type'")
        if not t.__struct_config__.frozen:
            raise TypeError(f"{t.__name__} must be frozen")
        if tag in known:
            if known[tag] is t:
                continue
            raise TypeError(f"tag {tag!r} of {t.__name__} is already used by {known[tag].__name__}")
        PEER_MESSAGES.append(t)
        known[tag] = t
        added = True
    if added:
        _build_decoder()


_build_decoder()


def encode_peer_payload(msg: msgspec.Struct) -> bytes:
    """Serialize one peer message (msgpack, no frame header)."""
    return _encoder.encode(msg)


def encode_peer(msg: msgspec.Struct, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """Serialize and frame one peer message (like :func:`protocol.codec.encode`)."""
    return frame(_encoder.encode(msg), max_frame_size)


def decode_peer(payload: bytes) -> msgspec.Struct:
    """Decode one frame payload into a peer message.

    Raises :class:`~protocol.errors.ProtocolError` (or a layout's ``BadRequest``), never
    anything else, whatever the payload (see :func:`protocol.codec.decode_guarded`).
    """
    msg = decode_guarded(_decoder, payload, "peer message")
    assert isinstance(msg, msgspec.Struct)
    return msg
