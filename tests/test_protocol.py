"""Unit tests of the sans-IO wire protocol: framing, codec, error codes, no trio inside."""

from __future__ import annotations

import ast
import struct
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest

import protocol
from protocol import messages as m
from protocol.codec import decode_reply, decode_request, encode, request_id_of
from protocol.errors import (
    ERRORS_BY_CODE,
    BlockNotLeased,
    ConnectionClosed,
    FrameTooLarge,
    HandshakeRequired,
    InternalError,
    KvdError,
    OutOfBlocks,
    ProtocolError,
    VersionMismatch,
    error_from_code,
)
from protocol.framing import DEFAULT_MAX_FRAME_SIZE, HEADER, FrameBuffer, frame
from protocol.layout import KVLayout

PROTOCOL_DIR = Path(protocol.__file__).parent

LAYOUT = KVLayout(4, 8, 64, 32, "bfloat16", tp_size=2, num_blocks=16)
POOL = m.PoolInfo(
    name="gpu0",
    kind="device",
    device=0,
    fallback_reason="fabric: CUDA_ERROR_NOT_PERMITTED",
    num_blocks=16,
    blocks_used=3,
    blocks_free=13,
    sessions=2,
    block_bytes=4096,
    pool_bytes=65536,
    dtype="bfloat16",
    shape=(16, 4, 2, 4, 32, 64),
    axis_order=LAYOUT.axis_order,
    layout=LAYOUT,
    rank=1,
)
STATS = m.DaemonStats(
    version="0.1.0",
    node="n",
    uptime_s=1.5,
    draining=False,
    sessions=1,
    requests_registered=2,
    transfers_active=0,
    transfers_done=3,
    transfers_failed=1,
    bytes_sent=10,
    bytes_received=20,
    blocks_leased=3,
    bounce_chunks_total=8,
    bounce_chunks_in_use=1,
    peers_connected=1,
    pools=[POOL],
)

#: One instance of every request, with every non-default field set.
REQUESTS: list[m.Message] = [
    m.Hello(id=1, version=m.PROTOCOL_VERSION, client="ctx-rank0", pid=1234),
    m.AttachPool(id=2, pool="gpu0"),
    m.Alloc(id=3, pool="gpu0", count=7),
    m.Free(id=4, pool="gpu0", block_ids=[1, 2, 3]),
    m.Expect(
        id=5,
        request_id="r1",
        pool="gpu0",
        layout=LAYOUT,
        rank=1,
        block_ids=[4, 5],
        ranks=[0, 1],
        deadline_s=3.0,
    ),
    m.Publish(
        id=6, request_id="r1", pool="gpu0", layout=LAYOUT, rank=0, block_ids=[1], peer="gen", ranks=None
    ),
    m.Wait(id=7, request_id="r1", timeout_s=2.5),
    m.Cancel(id=8, request_id="r1"),
    m.Ping(id=9, payload=b"\x00\xffpayload"),
    m.Stats(id=10),
    m.ListPools(id=11),
    m.ListSessions(id=12),
    m.ListTransfers(id=13),
    m.ListPeers(id=16),
    m.Drain(id=14),
    m.GetConfig(id=15),
    m.AttachWords(id=16, writable=True),
]

#: One instance of every reply.
REPLIES: list[m.Message] = [
    m.Welcome(id=1, version=1, server="kvd 0.1.0", node="n", session_id=5, max_frame_size=1 << 20),
    m.Attached(id=2, pool=POOL, handle_kind="cuda_ipc", handle=b"\x01" * 64, map_bytes=1 << 21),
    m.Allocated(id=3, pool="gpu0", block_ids=[0, 1, 2]),
    m.Freed(id=4, pool="gpu0", count=3),
    m.Registered(id=5, request_id="r1"),
    m.Completion(
        id=6,
        request_id="r1",
        ok=False,
        bytes=123,
        duration_s=0.5,
        path="bounce",
        chunks=4,
        fallback="fragment",
        peer="gen",
        error_code="transfer_timeout",
        error_message="late",
    ),
    m.Pong(id=7, payload=b"abc"),
    m.StatsReply(id=8, stats=STATS),
    m.PoolsReply(id=9, pools=[POOL, POOL]),
    m.SessionsReply(
        id=10,
        sessions=[
            m.SessionInfo(
                session_id=1, client="c", pid=2, uid=3, blocks_leased=4, requests=5, connected_s=6.0
            )
        ],
    ),
    m.TransfersReply(
        id=11,
        transfers=[
            m.TransferInfo(
                request_id="r1",
                role="ctx",
                peer="gen",
                state="running",
                bytes_total=100,
                bytes_done=50,
                chunks_total=4,
                chunks_done=2,
                path="bounce",
                started_s=1.0,
                duration_s=2.0,
                error="",
            )
        ],
    ),
    m.PeersReply(
        id=15,
        peers=[
            m.PeerInfo(node="gen", state="up", direction="outgoing", remote="127.0.0.1:5701", last_heard_s=0.4,
                       transfers_active=2, mapped=True),
            m.PeerInfo(node="ctx2", state="connecting", direction="outgoing", remote="127.0.0.2:5701",
                       error="connection refused"),
        ],
    ),
    m.ConfigReply(id=12, config_json='{"node": "n"}'),
    m.Ok(id=13),
    m.Error(id=14, code="out_of_blocks", message="no"),
    m.WordsAttached(id=15, slots=8192, slot_words=4),
]


def _union_members(union: Any) -> set[type]:
    return set(typing.get_args(union))


# --- message catalogue -------------------------------------------------------------------


def test_every_message_type_has_an_example() -> None:
    assert {type(msg) for msg in REQUESTS} == _union_members(m.Request)
    assert {type(msg) for msg in REPLIES} == _union_members(m.Reply)


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda msg: type(msg).__name__)
def test_request_round_trip(msg: m.Message) -> None:
    data = encode(msg)
    (length,) = HEADER.unpack_from(data)
    assert length == len(data) - HEADER.size
    out = decode_request(data[HEADER.size :])
    assert out == msg
    assert type(out) is type(msg)
    assert request_id_of(data[HEADER.size :]) == msg.id


@pytest.mark.parametrize("msg", REPLIES, ids=lambda msg: type(msg).__name__)
def test_reply_round_trip(msg: m.Message) -> None:
    data = encode(msg)
    out = decode_reply(data[HEADER.size :])
    assert out == msg
    assert type(out) is type(msg)


def test_requests_and_replies_use_separate_decoders() -> None:
    # A reply on the request direction (and vice versa) is an unknown tag there.
    with pytest.raises(ProtocolError, match="invalid message"):
        decode_request(encode(m.Pong(id=1))[HEADER.size :])
    with pytest.raises(ProtocolError, match="invalid message"):
        decode_reply(encode(m.Ping(id=1))[HEADER.size :])


def test_unknown_tag_is_a_protocol_error() -> None:
    payload = msgspec.msgpack.encode({"type": "launch_missiles", "id": 3})
    with pytest.raises(ProtocolError, match="invalid message") as info:
        decode_request(payload)
    assert info.value.code == "protocol"
    assert request_id_of(payload) == 3
    with pytest.raises(ProtocolError):
        decode_reply(payload)


@pytest.mark.parametrize(
    "raw",
    [
        {"type": "alloc", "id": 1, "pool": "p", "count": "seven"},  # wrong field type
        {"type": "alloc", "id": 1, "pool": "p"},  # missing field
        {"type": "ping", "id": "x"},  # wrong id type
        {"id": 1},  # no tag
        [1, 2, 3],  # not a map
        {
            "type": "expect",
            "id": 1,
            "request_id": "r",
            "pool": "p",
            "rank": 0,
            "block_ids": [1],
            "layout": {
                "num_layers": 3,
                "num_kv_heads": 8,
                "head_dim": 64,
                "tokens_per_block": 32,
                "dtype": "bfloat16",
                "pp_size": 2,
            },
        },  # layout invalid (3 layers / PP2)
    ],
)
def test_invalid_messages_are_protocol_errors(raw: Any) -> None:
    with pytest.raises(KvdError) as info:
        decode_request(msgspec.msgpack.encode(raw))
    assert info.value.code in ("protocol", "bad_request")


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"\x92\x01", b"\xdf\xff\xff\xff\xff", bytes(range(256))])
def test_undecodable_bytes_are_protocol_errors(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_request(payload)
    assert request_id_of(payload) == 0


def test_request_id_of_rejects_odd_ids() -> None:
    assert request_id_of(msgspec.msgpack.encode({"id": -1})) == 0
    assert request_id_of(msgspec.msgpack.encode({"id": True})) == 0
    assert request_id_of(msgspec.msgpack.encode({"id": 2**64 - 1})) == 0
    assert request_id_of(msgspec.msgpack.encode({"id": 42, "type": "nope"})) == 42


def test_messages_are_frozen() -> None:
    msg = m.Ping(id=1, payload=b"x")
    with pytest.raises(AttributeError):
        msg.id = 2  # type: ignore[misc]


# --- framing -----------------------------------------------------------------------------


def test_frame_prefixes_length() -> None:
    assert frame(b"abc") == b"\x00\x00\x00\x03abc"
    assert frame(b"") == b"\x00\x00\x00\x00"


def test_frame_refuses_oversize_payload() -> None:
    with pytest.raises(FrameTooLarge):
        frame(b"x" * 11, max_frame_size=10)
    with pytest.raises(FrameTooLarge):
        encode(m.Ping(id=1, payload=b"x" * 100), max_frame_size=50)


def test_concatenated_frames_split() -> None:
    payloads = [b"", b"a", b"bb" * 100, bytes(range(256))]
    buf = FrameBuffer()
    assert buf.feed(b"".join(frame(p) for p in payloads)) == payloads
    assert buf.pending == 0


def test_split_frames_reassembled_byte_by_byte() -> None:
    payloads = [b"hello", b"", b"world" * 50]
    stream = b"".join(frame(p) for p in payloads)
    buf = FrameBuffer()
    out: list[bytes] = []
    for i in range(len(stream)):
        out.extend(buf.feed(stream[i : i + 1]))
    assert out == payloads
    assert buf.pending == 0


@pytest.mark.parametrize("cut", [1, 3, 4, 5, 9])
def test_split_at_every_boundary(cut: int) -> None:
    stream = frame(b"0123456789") + frame(b"xy")
    buf = FrameBuffer()
    first = buf.feed(stream[:cut])
    assert first == []
    assert buf.pending == cut
    assert buf.feed(stream[cut:]) == [b"0123456789", b"xy"]


@pytest.mark.parametrize("cut", [14, 15, 17, 19])
def test_whole_frames_then_a_partial_one_keep_its_tail(cut: int) -> None:
    """Nothing pending: the whole frames of a read are cut from it and only the partial
    frame after them is buffered, then completed by the next read."""
    stream = frame(b"0123456789") + frame(b"xyz") + frame(b"")
    buf = FrameBuffer()
    assert buf.feed(stream[:cut]) == [b"0123456789"]
    assert buf.pending == cut - 14
    assert buf.feed(stream[cut:]) == [b"xyz", b""]
    assert buf.pending == 0


def test_oversize_length_prefix_raises_before_buffering() -> None:
    buf = FrameBuffer(max_frame_size=1024)
    # Only the header has arrived: the announced length alone must be refused.
    with pytest.raises(FrameTooLarge, match="exceeds the maximum"):
        buf.feed(struct.pack(">I", 1025))
    assert buf.pending == 0
    # The buffer is broken for good: the stream is no longer aligned.
    with pytest.raises(ProtocolError):
        buf.feed(frame(b"ok"))


def test_oversize_length_prefix_after_good_frames() -> None:
    buf = FrameBuffer(max_frame_size=8)
    with pytest.raises(FrameTooLarge):
        buf.feed(frame(b"fine") + struct.pack(">I", 2**32 - 1) + b"x" * 3)
    assert buf.pending == 0


def test_max_size_frame_accepted() -> None:
    buf = FrameBuffer(max_frame_size=16)
    assert buf.feed(frame(b"x" * 16)) == [b"x" * 16]
    assert DEFAULT_MAX_FRAME_SIZE == 16 * 1024 * 1024


def test_frame_buffer_rejects_bad_limit() -> None:
    with pytest.raises(ValueError):
        FrameBuffer(max_frame_size=0)


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("code", sorted(ERRORS_BY_CODE))
def test_error_code_round_trip(code: str) -> None:
    cls = ERRORS_BY_CODE[code]
    assert cls.code == code
    original = cls("something failed")
    wire = m.Error(id=3, code=original.code, message=original.message)
    back = decode_reply(encode(wire)[HEADER.size :])
    assert isinstance(back, m.Error)
    err = error_from_code(back.code, back.message)
    assert type(err) is cls
    assert err.message == "something failed"
    assert str(err) == f"[{code}] something failed"


def test_error_codes_are_unique_and_complete() -> None:
    def subclasses(cls: type[KvdError]) -> list[type[KvdError]]:
        out = []
        for sub in cls.__subclasses__():
            out.append(sub)
            out.extend(subclasses(sub))
        return out

    in_protocol = [c for c in subclasses(KvdError) if c.__module__ == "protocol.errors"]
    codes = [c.code for c in in_protocol]
    assert len(codes) == len(set(codes))
    for cls in in_protocol:
        assert ERRORS_BY_CODE[cls.code] is cls


def test_error_from_code_specifics() -> None:
    assert type(error_from_code("internal", "x")) is InternalError
    closed = error_from_code("connection_closed", "gone")
    assert isinstance(closed, ConnectionClosed) and closed.by_peer
    unknown = error_from_code("from_the_future", "hi")
    assert type(unknown) is KvdError
    assert "from_the_future" in str(unknown)
    # the hierarchy lets callers catch broad classes
    assert isinstance(error_from_code("frame_too_large", ""), ProtocolError)
    assert isinstance(error_from_code("handshake_required", ""), ProtocolError)
    assert not isinstance(error_from_code("version_mismatch", ""), ProtocolError)
    for cls in (OutOfBlocks, BlockNotLeased, VersionMismatch, HandshakeRequired):
        assert isinstance(error_from_code(cls.code, ""), cls)


# --- sans-IO: no trio in protocol/ -------------------------------------------------------


def test_protocol_does_not_import_trio_at_runtime() -> None:
    code = (
        "import sys, protocol, protocol.codec, protocol.framing, protocol.errors, protocol.messages, "
        "protocol.layout, protocol.peer, protocol.transfer; "
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in ('trio', 'asyncio')); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_protocol_sources_never_import_trio() -> None:
    files = sorted(PROTOCOL_DIR.glob("*.py"))
    assert files
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert name.split(".")[0] not in ("trio", "socket", "asyncio", "kvd", "clients"), (
                    f"{path.name} imports {name}"
                )
        assert "import trio" not in path.read_text()


def test_the_first_frame_has_its_own_tighter_bound() -> None:
    """``first_frame_size`` bounds the first frame only, as soon as its length arrives; the
    frames after it, in the same read too, have ``max_frame_size``."""
    buf = FrameBuffer(max_frame_size=1024, first_frame_size=16)
    assert buf.feed(frame(b"x" * 16) + frame(b"y" * 1000)) == [b"x" * 16, b"y" * 1000]
    assert buf.feed(frame(b"z" * 1024)) == [b"z" * 1024]
    refused = FrameBuffer(max_frame_size=1024, first_frame_size=16)
    with pytest.raises(FrameTooLarge, match="maximum first frame size 16"):
        refused.feed(struct.pack(">I", 17))
    assert refused.pending == 0
    with pytest.raises(ValueError):
        FrameBuffer(max_frame_size=1024, first_frame_size=0)
