"""protocol.limits: every value that crosses the wire is bounded at decode time.

Sans-IO, no daemon: the request decoder, the peer decoder and the NIXL notification decoder
are fed hostile payloads (non-finite and out-of-range floats, overlong strings, oversized
arrays, deep nesting, absurd layouts) and must answer each with a ``ProtocolError`` (or a
layout's ``BadRequest``), never anything else. A structural test walks every message type and
fails when a new field arrives without a bound.
"""

from __future__ import annotations

import sys
import typing
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest

from protocol import messages as m
from protocol import peer as p
from protocol import transfer as x
from protocol.codec import decode_request, encode, request_id_of
from protocol.errors import BadRequest, KvdError, ProtocolError
from protocol.framing import HEADER
from protocol.layout import KVLayout
from protocol.limits import (
    MAX_BLOCK_IDS,
    MAX_DEADLINE_S,
    MAX_NAME_LEN,
    MAX_POOLS,
    MAX_REQUEST_ID_LEN,
    MAX_TEXT_LEN,
    MAX_WORLD_SIZE,
    clip_text,
)

LAYOUT = KVLayout(4, 8, 64, 32, "bfloat16")
NAN, INF = float("nan"), float("inf")

p.register_peer_messages(*x.XFER_MESSAGES)  # as the daemon's peer links do

#: Fields bounded only by the frame size (their size is what the frame limit is for).
FRAME_BOUNDED = {("Ping", "payload"), ("PeerWelcome", "nixl_metadata")}


def _body(msg: msgspec.Struct, **fields: Any) -> bytes:
    raw = msgspec.to_builtins(msg, builtin_types=(bytes,))
    raw.update(fields)
    return msgspec.msgpack.encode(raw)


def _expect(**fields: Any) -> bytes:
    return _body(m.Expect(id=7, request_id="r", pool="p", layout=LAYOUT, rank=0, block_ids=[0]), **fields)


def _publish(**fields: Any) -> bytes:
    msg = m.Publish(id=7, request_id="r", pool="p", layout=LAYOUT, rank=0, block_ids=[0], peer="g")
    return _body(msg, **fields)


def _refused(payload: bytes, *, field: str) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_request(payload)
    assert f"$.{field}" in info.value.message, info.value.message
    return info.value


# --- floats -------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [NAN, INF, -INF, 0.0, -1.0, MAX_DEADLINE_S * 2])
@pytest.mark.parametrize("make", [_expect, _publish], ids=["expect", "publish"])
def test_deadlines_must_be_finite_positive_and_bounded(make: Any, value: float) -> None:
    _refused(make(deadline_s=value), field="deadline_s")


@pytest.mark.parametrize("value", [NAN, INF, -INF, -0.5, MAX_DEADLINE_S + 1])
def test_wait_timeout_must_be_finite_non_negative_and_bounded(value: float) -> None:
    _refused(_body(m.Wait(id=3, request_id="r"), timeout_s=value), field="timeout_s")


def test_in_range_floats_decode() -> None:
    msg = decode_request(_expect(deadline_s=MAX_DEADLINE_S))
    assert isinstance(msg, m.Expect) and msg.deadline_s == MAX_DEADLINE_S
    wait = decode_request(_body(m.Wait(id=3, request_id="r"), timeout_s=0.0))
    assert isinstance(wait, m.Wait) and wait.timeout_s == 0.0


@pytest.mark.parametrize("value", [NAN, INF, -1.0])
def test_peer_offer_deadline_is_validated(value: float) -> None:
    offer = x.XferOffer(request_id="r", layout=LAYOUT, blocks={0: [1]}, deadline_s=1.0)
    with pytest.raises(ProtocolError, match=r"deadline_s"):
        p.decode_peer(_body(offer, deadline_s=value))


# --- strings, arrays --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (_body(m.Hello(version=1), client="c" * (MAX_NAME_LEN + 1)), "client"),
        (_expect(request_id="r" * (MAX_REQUEST_ID_LEN + 1)), "request_id"),
        (_expect(request_id=""), "request_id"),
        (_publish(request_id=""), "request_id"),
        (_body(m.Wait(request_id="r"), request_id=""), "request_id"),
        (_expect(pool="p" * (MAX_NAME_LEN + 1)), "pool"),
        (_publish(peer="g" * (MAX_NAME_LEN + 1)), "peer"),
        (_body(m.Wait(request_id="r"), request_id="r" * (MAX_REQUEST_ID_LEN + 1)), "request_id"),
        (_body(m.Cancel(request_id="r"), request_id="r" * (MAX_REQUEST_ID_LEN + 1)), "request_id"),
        (_body(m.Alloc(pool="p", count=1), pool="p" * (MAX_NAME_LEN + 1)), "pool"),
        (_body(m.Free(pool="p", block_ids=[]), block_ids=[0] * (MAX_BLOCK_IDS + 1)), "block_ids"),
        (_expect(block_ids=[0] * (MAX_BLOCK_IDS + 1)), "block_ids"),
        (_expect(ranks=list(range(MAX_WORLD_SIZE + 1))), "ranks"),
    ],
)
def test_strings_and_arrays_are_bounded(payload: bytes, field: str) -> None:
    err = _refused(payload, field=field)
    assert len(err.message) < 200  # the refusal does not echo the oversized value


def test_values_at_the_bound_decode() -> None:
    rid = "r" * MAX_REQUEST_ID_LEN
    msg = decode_request(_expect(request_id=rid, pool="p" * MAX_NAME_LEN))
    assert isinstance(msg, m.Expect) and msg.request_id == rid
    hello = decode_request(_body(m.Hello(version=1), client="c" * MAX_NAME_LEN))
    assert isinstance(hello, m.Hello) and len(hello.client) == MAX_NAME_LEN


@pytest.mark.parametrize(
    "msg",
    [
        p.PeerHello(version=1, node="n" * (MAX_NAME_LEN + 1), nonce=b"x" * 32),
        p.PeerHello(version=1, node="n", nonce=b"x" * (p.MAX_NONCE_BYTES + 1)),
        p.PeerAuth(mac=b"m" * (p.MAX_MAC_BYTES + 1)),
        p.PeerError(code="x", message="e" * (MAX_TEXT_LEN + 1)),
        p.PeerBye(reason="b" * (MAX_TEXT_LEN + 1)),
        p.PeerWelcome(node="n", pools=[p.PoolDesc(name="q", addr=0, nbytes=0)] * (MAX_POOLS + 1)),
        p.Heartbeat(seq=-1),
        x.XferFail(request_id="r", code="c", message="m" * (MAX_TEXT_LEN + 1)),
        x.XferGrant(request_id="r", slot=-1),
        x.XferOffer(request_id="r", layout=LAYOUT, blocks={MAX_WORLD_SIZE: [0]}, deadline_s=1.0),
        x.XferDone(request_id="r" * (MAX_REQUEST_ID_LEN + 1), writes=0, bytes=0, chunks=0),
    ],
    ids=lambda msg: type(msg).__name__,
)
def test_peer_messages_are_bounded(msg: msgspec.Struct) -> None:
    with pytest.raises(ProtocolError, match="invalid peer message"):
        p.decode_peer(p.encode_peer_payload(msg))


def test_notification_fields_are_bounded() -> None:
    assert x.decode_notif(x.encode_notif(x.Notif("r", 1, 0))) == x.Notif("r", 1, 0)
    assert x.decode_notif(x.encode_notif(x.Notif("r" * (MAX_REQUEST_ID_LEN + 1), 1, 0))) is None
    assert x.decode_notif(x.encode_notif(x.Notif("r", -1, 0))) is None


def _unbounded(t: mi.Type, path: str, seen: set[type], out: list[str]) -> None:
    """Collect the paths of strings, containers and floats without a bound."""
    if isinstance(t, mi.StructType):
        if t.cls in seen:
            return
        seen.add(t.cls)
        for f in t.fields:
            if (t.cls.__name__, f.name) in FRAME_BOUNDED:
                continue
            _unbounded(f.type, f"{t.cls.__name__}.{f.name}", seen, out)
    elif isinstance(t, mi.UnionType):
        for sub in t.types:
            _unbounded(sub, path, seen, out)
    elif isinstance(t, mi.StrType | mi.BytesType):
        if t.max_length is None:
            out.append(path)
    elif isinstance(t, mi.ListType | mi.VarTupleType | mi.SetType | mi.FrozenSetType):
        if t.max_length is None:
            out.append(path)
        _unbounded(t.item_type, f"{path}[]", seen, out)
    elif isinstance(t, mi.DictType):
        if t.max_length is None:
            out.append(path)
        _unbounded(t.key_type, f"{path}{{key}}", seen, out)
        _unbounded(t.value_type, f"{path}{{}}", seen, out)
    elif isinstance(t, mi.FloatType):
        if (t.ge is None and t.gt is None) or (t.le is None and t.lt is None):
            out.append(path)
    elif isinstance(t, mi.AnyType):
        out.append(path)


def test_every_incoming_field_is_bounded() -> None:
    """Requests and every peer message: a new unbounded str/bytes/list/dict/float fails here."""
    types = [*typing.get_args(m.Request), *p.PEER_MESSAGES, x.Notif]
    out: list[str] = []
    seen: set[type] = set()
    for t in types:
        _unbounded(mi.type_info(t), t.__name__, seen, out)
    assert out == []


# --- nesting and huge containers ----------------------------------------------------------------


def _nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]


def _with_extra(body: bytes, extra: bytes) -> bytes:
    """``body`` (a msgpack map of fewer than 15 keys) with one more key whose value is ``extra``."""
    assert 0x80 <= body[0] < 0x8F
    return bytes([body[0] + 1]) + body[1:] + msgspec.msgpack.encode("extra") + extra


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_deep_nesting_is_a_protocol_error(depth: int) -> None:
    deep = _nested(depth)
    payloads = [
        deep,
        _with_extra(encode(m.Hello(id=5, version=1))[HEADER.size :], deep),
        _with_extra(_expect(), deep),
        _expect(layout=None)[:-1] + deep,  # nesting where a layout belongs
    ]
    for payload in payloads:
        with pytest.raises(ProtocolError, match=r"nested too deeply|invalid message"):
            decode_request(payload)
        assert request_id_of(payload) in (0, 5, 7)
    hello = p.encode_peer_payload(p.PeerHello(version=1, node="a", nonce=b"n" * 32))
    with pytest.raises(ProtocolError, match="nested too deeply"):
        p.decode_peer(_with_extra(hello, deep))
    assert x.decode_notif(deep) is None


def test_deep_nesting_is_caught_near_the_recursion_limit() -> None:
    """The guard holds however deep the caller's own stack already is."""
    payload = _with_extra(_expect(), _nested(5000))

    def at_depth(n: int) -> str:
        if n:
            return at_depth(n - 1)
        try:
            decode_request(payload)
        except ProtocolError as exc:
            return exc.code
        return "decoded"

    assert at_depth(sys.getrecursionlimit() - 60) == "protocol"


@pytest.mark.parametrize(
    "payload",
    [
        b"\xdd\xff\xff\xff\xff",  # array32 claiming 4G items, none sent
        b"\xdf\xff\xff\xff\xff",  # map32 claiming 4G entries
        b"\xc6\xff\xff\xff\xff",  # bin32 claiming 4 GiB
        msgspec.msgpack.encode({"type": "ping", "id": 1, "extra": [None] * 200_000}),
    ],
)
def test_huge_containers_are_cheap_to_refuse(payload: bytes) -> None:
    try:
        decode_request(payload)
    except KvdError as exc:
        assert exc.code == "protocol"
    assert request_id_of(payload) in (0, 1)


# --- layouts ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"tp_size": 2**24, "attention_dp": True}, "tp_size=16777216 exceeds the protocol limit"),
        ({"tp_size": 64, "pp_size": 128, "num_layers": 128}, "ranks exceed the protocol limit"),
        ({"num_layers": 2**40}, "num_layers=1099511627776 exceeds"),
        ({"head_dim": 2**20}, "head_dim=1048576 exceeds"),
        ({"num_blocks": 2**40}, "num_blocks must be in"),
    ],
)
def test_absurd_layouts_are_refused(fields: dict[str, Any], match: str) -> None:
    raw = {**msgspec.to_builtins(LAYOUT), **fields}
    with pytest.raises(BadRequest, match=match):
        decode_request(_expect(layout=raw))
    with pytest.raises(BadRequest, match=match):
        msgspec.convert(raw, KVLayout)


def test_layout_string_fields_are_bounded() -> None:
    raw = {**msgspec.to_builtins(LAYOUT), "dtype": "f" * 33}
    _refused(_expect(layout=raw), field="layout.dtype")
    raw = {**msgspec.to_builtins(LAYOUT), "axis_order": ["block"] * 7}
    _refused(_expect(layout=raw), field="layout.axis_order")


# --- text we send -------------------------------------------------------------------------------


def test_clip_text() -> None:
    assert clip_text("short") == "short"
    long = "x" * (MAX_TEXT_LEN * 3)
    clipped = clip_text(long)
    assert len(clipped) <= MAX_TEXT_LEN
    assert clipped.endswith(f"({len(long) - (MAX_TEXT_LEN - 40)} more characters)")
    assert clip_text("y" * 100, limit=50).startswith("y" * 10)
    assert len(clip_text("y" * 100, limit=50)) <= 50
