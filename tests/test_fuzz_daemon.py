"""Fuzz a live kvd with malformed input: it answers or hangs up, never hangs or dies.

More than 10,000 hypothesis-generated inputs go to one daemon subprocess over its Unix socket:
random bytes, truncated frames, oversized length prefixes, well-framed msgpack with unknown tags
or wrong field types, input nested far deeper than the decoder recurses, NaN/infinite/negative
deadlines and wait timeouts, requests before ``Hello``, wrong protocol versions. The expected answer
to every input comes from the sans-IO protocol package itself (the daemon decodes with the same
code), so most checks are exact:

- after the handshake, a malformed but well-framed payload gets ``Error(id, code)`` and the
  connection stays open, so those are sent many to a connection;
- an input that breaks the stream or comes before ``Hello`` gets an ``Error`` and a disconnect,
  or (a truncated frame) a clean disconnect when we close our side: a fresh connection each;
- every read has a timeout (a hang fails the test), a fresh client's ping succeeds after every
  example, and the daemon's resident memory after warm-up grows by less than 30 MiB.
"""

from __future__ import annotations

import shutil
import socket
import struct
import tempfile
import time
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.demo.launch import DaemonProcess, start_daemon
from protocol import messages as m
from protocol.codec import decode_reply, decode_request, encode, request_id_of
from protocol.errors import ERRORS_BY_CODE, FrameTooLarge, KvdError
from protocol.framing import HEADER, FrameBuffer, frame
from protocol.layout import KVLayout

MAX_FRAME = 65536  # the fuzzed daemon's [limits] max_frame_size
IO_TIMEOUT = 10.0  # any read that waits longer than this is a hang: the test fails
MIN_INPUTS = 10_000
RSS_GROWTH_LIMIT = 30 * 2**20

REQUEST_TYPES: dict[str, type[m.Message]] = {
    t.__struct_config__.tag: t
    for t in typing.get_args(m.Request)
}
LAYOUT = KVLayout(4, 8, 64, 32, "bfloat16")
#: Valid requests of every kind: sent before Hello, each must be refused (even Drain).
VALID_REQUESTS: list[m.Message] = [
    m.AttachPool(pool="host0"),
    m.Alloc(pool="host0", count=1),
    m.Free(pool="host0", block_ids=[0]),
    m.Expect(request_id="r", pool="host0", layout=LAYOUT, rank=0, block_ids=[0]),
    m.Publish(request_id="r", pool="host0", layout=LAYOUT, rank=0, block_ids=[0], peer="p"),
    m.Wait(request_id="r", timeout_s=1.0),
    m.Cancel(request_id="r"),
    m.Ping(payload=b"early"),
    m.Stats(),
    m.ListPools(),
    m.ListSessions(),
    m.ListTransfers(),
    m.ListPeers(),
    m.Drain(),
    m.GetConfig(),
]


def _host_pool() -> dict[str, Any]:
    return {
        "name": "host0", "memory": "host", "device": -1, "num_layers": 4, "num_kv_heads": 8,
        "head_dim": 64, "tokens_per_block": 32, "dtype": "bfloat16", "num_blocks": 64,
    }  # fmt: skip


@pytest.fixture(scope="module")
def fuzz_daemon() -> Iterator[DaemonProcess]:
    workdir = tempfile.mkdtemp(prefix="kvdf-", dir="/tmp")
    cfg = {
        "pools": [_host_pool()],
        "transfer": {"bounce_size_mb": 16, "chunk_mb": 2},
        "limits": {"max_frame_size": MAX_FRAME},
        "log_level": "warning",
    }
    d = start_daemon(cfg, workdir=workdir, name="fuzz")
    try:
        yield d
    finally:
        d.kill()
        shutil.rmtree(workdir, ignore_errors=True)


# --- the model: what the daemon must answer, computed with the protocol package ---------------

Expected = tuple[int, str]  # (reply id, error code)


def expected_after_handshake(payload: bytes) -> Expected | None:
    """The Error a handshaken session answers ``payload`` with; None if it is a valid request."""
    try:
        msg = decode_request(payload)
    except KvdError as exc:
        return request_id_of(payload), exc.code
    if isinstance(msg, m.Hello):
        return msg.id, "protocol"  # Hello sent twice
    return None


def expected_before_handshake(payload: bytes) -> Expected | None:
    """The Error a fresh connection answers its first frame with (then it hangs up)."""
    try:
        msg = decode_request(payload)
    except KvdError as exc:
        return request_id_of(payload), exc.code
    if not isinstance(msg, m.Hello):
        return msg.id, "handshake_required"
    if msg.version != m.PROTOCOL_VERSION:
        return msg.id, "version_mismatch"
    return None  # a good Hello: not malformed


def frames_of(stream: bytes) -> list[bytes] | None:
    """The whole frames in ``stream``; None if it announces an oversized frame."""
    try:
        return FrameBuffer(MAX_FRAME).feed(stream)
    except FrameTooLarge:
        return None


# --- strategies -------------------------------------------------------------------------------

ids = st.one_of(st.integers(0, 2**31), st.integers(-(2**63), 2**64 - 1))
anything = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=16),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=6,
)


@st.composite
def known_tag_wrong_fields(draw: st.DrawFn) -> bytes:
    """A known request tag whose fields are random values (mostly of the wrong type)."""
    tag = draw(st.sampled_from(sorted(REQUEST_TYPES)))
    fields = [f for f in REQUEST_TYPES[tag].__struct_fields__ if f != "id"]
    body: dict[str, Any] = {"type": tag}
    if draw(st.booleans()):
        body["id"] = draw(ids | anything)
    for name in fields:
        if draw(st.integers(0, 9)) > 0:
            body[name] = draw(anything)
    return msgspec.msgpack.encode(body)


@st.composite
def one_field_wrong(draw: st.DrawFn) -> bytes:
    """A valid request with exactly one field replaced by a random value."""
    msg = draw(st.sampled_from([*VALID_REQUESTS, m.Hello(version=1)]))
    body = msgspec.to_builtins(msg, builtin_types=(bytes,))
    keys = sorted(body)
    key = draw(st.sampled_from(keys))
    body[key] = draw(anything)
    body["id"] = draw(ids)
    return msgspec.msgpack.encode(body)


@st.composite
def bad_layout(draw: st.DrawFn) -> bytes:
    """An Expect/Publish whose layout is well-typed but invalid (or wrongly typed inside)."""
    layout: dict[str, Any] = {
        "num_layers": draw(st.integers(-2, 80)),
        "num_kv_heads": draw(st.integers(-1, 16)),
        "head_dim": draw(st.integers(-1, 128)),
        "tokens_per_block": draw(st.integers(-1, 64)),
        "dtype": draw(st.sampled_from(["bfloat16", "float32", "int4", ""])),
        "tp_size": draw(st.integers(-1, 32)),
        "pp_size": draw(st.integers(0, 8)),
        "axis_order": draw(st.permutations(["block", "layer", "kv", "head", "token", "dim"])),
    }
    if draw(st.booleans()):
        layout[draw(st.sampled_from(sorted(layout)))] = draw(anything)
    if draw(st.booleans()):
        layout["layer_split"] = draw(st.lists(st.integers(-2, 40), max_size=4))
    body = {
        "type": draw(st.sampled_from(["expect", "publish"])),
        "id": draw(ids),
        "request_id": "r",
        "pool": "host0",
        "layout": layout,
        "rank": draw(st.integers(-1, 4)),
        "block_ids": [0],
        "peer": "p",
    }
    return msgspec.msgpack.encode(body)


@st.composite
def deeply_nested(draw: st.DrawFn) -> bytes:
    """Arrays or maps nested far deeper than the decoder recurses: alone, as an extra field of
    a valid request, or in place of one of its fields."""
    depth = draw(st.sampled_from([100, 2_000, 5_000]))
    opener = draw(st.sampled_from([b"\x91", b"\x81\xa1k"]))
    deep = opener * depth + b"\xc0"
    where = draw(st.sampled_from(["alone", "extra", "field"]))
    if where == "alone":
        return deep
    msg = draw(st.sampled_from([*VALID_REQUESTS, m.Hello(version=1)]))
    body = msgspec.to_builtins(msgspec.structs.replace(msg, id=draw(st.integers(0, 2**31))), builtin_types=(bytes,))
    key = "zz"
    if where == "field":
        key = draw(st.sampled_from(sorted(body)))
        del body[key]
    encoded = msgspec.msgpack.encode(body)  # a fixmap: fewer than 15 keys
    return bytes([encoded[0] + 1]) + encoded[1:] + msgspec.msgpack.encode(key) + deep


@st.composite
def non_finite_floats(draw: st.DrawFn) -> bytes:
    """A deadline or wait timeout that is NaN, infinite, negative or beyond the protocol bound."""
    value = draw(st.sampled_from([float("nan"), float("inf"), -float("inf"), -1.0, -0.0, 1e300, 86400.5]))
    rid = draw(st.integers(0, 2**31))
    if draw(st.booleans()):
        msg = draw(st.sampled_from([r for r in VALID_REQUESTS if isinstance(r, m.Expect | m.Publish)]))
        body = {**msgspec.to_builtins(msg), "id": rid, "deadline_s": value}
    else:
        body = {"type": "wait", "id": rid, "request_id": "r", "timeout_s": value}
    return msgspec.msgpack.encode(body)


unknown_tag = st.builds(
    lambda tag, rid, extra: msgspec.msgpack.encode({**extra, "type": tag, "id": rid}),
    st.text(max_size=16).filter(lambda t: t not in REQUEST_TYPES),
    ids,
    st.dictionaries(st.text(max_size=6), anything, max_size=3),
)
tag_not_a_string = st.builds(
    lambda tag, rid: msgspec.msgpack.encode({"type": tag, "id": rid}),
    anything.filter(lambda v: not isinstance(v, str)),
    ids,
)
not_a_map = anything.filter(lambda v: not isinstance(v, dict)).map(msgspec.msgpack.encode)
random_payload = st.binary(max_size=300)
hello_again = st.builds(
    lambda rid, v: encode(m.Hello(id=rid, version=v))[HEADER.size :],
    st.integers(0, 2**31),
    st.integers(-5, 5),
)

#: Well-framed payloads a handshaken session must answer with an Error and survive.
framed_payload = st.one_of(
    random_payload, known_tag_wrong_fields(), one_field_wrong(), bad_layout(), unknown_tag,
    tag_not_a_string, not_a_map, hello_again, deeply_nested(), non_finite_floats(),
)  # fmt: skip


@st.composite
def truncated_frame(draw: st.DrawFn) -> bytes:
    """A frame cut short: its header promises more than ever arrives."""
    whole = frame(draw(framed_payload | st.binary(min_size=1, max_size=200)))
    return whole[: draw(st.integers(1, len(whole) - 1))]


oversize_prefix = st.builds(
    lambda n, tail: struct.pack(">I", n) + tail, st.integers(MAX_FRAME + 1, 2**32 - 1), st.binary(max_size=64)
)


@st.composite
def before_hello(draw: st.DrawFn) -> tuple[str, bytes]:
    """One input for a fresh connection: (kind, bytes)."""
    kind = draw(
        st.sampled_from(
            ["framed", "request", "version", "truncated", "oversize", "random_stream", "empty_frame"]
        )
    )
    if kind == "framed":
        data = frame(draw(framed_payload))
    elif kind == "request":
        msg = msgspec.structs.replace(draw(st.sampled_from(VALID_REQUESTS)), id=draw(st.integers(0, 2**31)))
        data = encode(msg)
    elif kind == "version":
        version = draw(st.integers(-(2**31), 2**31).filter(lambda v: v != m.PROTOCOL_VERSION))
        data = encode(m.Hello(id=draw(st.integers(0, 2**31)), version=version, client="old"))
    elif kind == "truncated":
        data = draw(truncated_frame())
    elif kind == "oversize":
        data = draw(oversize_prefix)
    elif kind == "empty_frame":
        data = frame(b"")
    else:
        data = draw(st.binary(min_size=1, max_size=400))
    return kind, data


@dataclass
class Example:
    batch: list[bytes]
    tail_kind: str
    tail: bytes
    fresh: list[tuple[str, bytes]] = field(default_factory=list)


examples = st.builds(
    Example,
    batch=st.lists(framed_payload, min_size=40, max_size=80),
    tail_kind=st.sampled_from(["none", "truncated", "oversize", "random"]),
    tail=st.binary(max_size=200),
    fresh=st.lists(before_hello(), min_size=2, max_size=8),
)


# --- talking to the daemon ----------------------------------------------------------------------


class Conn:
    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(IO_TIMEOUT)
        self.sock.connect(path)
        self.frames = FrameBuffer(1 << 24)
        self.ready: list[m.Message] = []
        self.eof = False

    def receive(self) -> m.Message | None:
        """Next reply, None at EOF; a socket timeout (hang) propagates and fails the test."""
        while not self.ready:
            if self.eof:
                return None
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                self.eof = True
                return None
            self.ready.extend(decode_reply(p) for p in self.frames.feed(data))
        return self.ready.pop(0)

    def rest(self) -> list[m.Message]:
        """Every reply until the daemon hangs up."""
        out = []
        while (reply := self.receive()) is not None:
            out.append(reply)
        return out

    def close(self) -> None:
        self.sock.close()


@dataclass
class Fuzzer:
    path: str
    inputs: int = 0
    connections: int = 0
    pings: int = 0
    kinds: dict[str, int] = field(default_factory=dict)

    def count(self, kind: str, n: int = 1) -> None:
        self.inputs += n
        self.kinds[kind] = self.kinds.get(kind, 0) + n

    def connect(self) -> Conn:
        self.connections += 1
        return Conn(self.path)

    def ping(self) -> None:
        """A fresh client's round trip: the daemon still serves."""
        c = self.connect()
        try:
            c.sock.sendall(
                encode(m.Hello(id=1, version=m.PROTOCOL_VERSION, client="probe"))
                + encode(m.Ping(id=2, payload=b"alive"))
            )
            assert isinstance(c.receive(), m.Welcome)
            assert c.receive() == m.Pong(id=2, payload=b"alive")
        finally:
            c.close()
        self.pings += 1

    def handshaken_batch(self, ex: Example) -> None:
        expected: list[Expected] = []
        nested: list[bool] = []
        stream = bytearray()
        for payload in ex.batch:
            want = expected_after_handshake(payload)
            if want is None:
                continue  # by chance a valid request: not malformed, not sent
            expected.append(want)
            nested.append(b"\x91" * 500 in payload or b"\x81\xa1k" * 500 in payload)
            stream += frame(payload)
        c = self.connect()
        try:
            c.sock.sendall(encode(m.Hello(id=1, version=m.PROTOCOL_VERSION, client="fuzz")))
            assert isinstance(c.receive(), m.Welcome)
            c.sock.sendall(stream)
            got = []
            for want, deep in zip(expected, nested, strict=True):
                reply = c.receive()
                assert isinstance(reply, m.Error), f"expected an Error, got {reply!r}"
                # a frame nested deeper than the decoder recurses may not give its id back (how
                # far msgspec skips before RecursionError depends on the stack): 0 is also right
                got.append(want if deep and reply.id == 0 and reply.code == want[1] else (reply.id, reply.code))
            assert got == expected
            self.count("framed-after-hello", len(expected))
            # The session survived all of that.
            c.sock.sendall(encode(m.Ping(id=77, payload=b"after")))
            assert c.receive() == m.Pong(id=77, payload=b"after")
            self.tail(c, ex)
        finally:
            c.close()

    def tail(self, c: Conn, ex: Example) -> None:
        """End the session with one more malformed input (or none), then check the hang-up."""
        if ex.tail_kind == "truncated":
            data = encode(m.Ping(id=5, payload=ex.tail))
            data = data[: max(1, len(data) // 2)]
            allowed: set[str] = set()
        elif ex.tail_kind == "oversize":
            data = struct.pack(">I", MAX_FRAME + 1 + len(ex.tail)) + ex.tail
            allowed = {"frame_too_large"}
        elif ex.tail_kind == "random":
            data = ex.tail
            frames = frames_of(data)
            if frames is not None and any(expected_after_handshake(p) is None for p in frames):
                data = b""  # would hold a valid request: skip
            allowed = set(ERRORS_BY_CODE)
        else:
            data = b""
            allowed = set()
        if data:
            c.sock.sendall(data)
            self.count(f"tail-{ex.tail_kind}")
        c.sock.shutdown(socket.SHUT_WR)
        replies = c.rest()  # ends in EOF: the daemon hung up (or saw our EOF), no hang
        assert all(isinstance(r, m.Error) and r.code in allowed for r in replies), replies
        if ex.tail_kind == "oversize":
            assert [r.code for r in replies if isinstance(r, m.Error)] == ["frame_too_large"]

    def fresh(self, kind: str, data: bytes) -> None:
        """One malformed input on a new connection, before any Hello."""
        frames = frames_of(data)
        want: Expected | None
        if frames is None:
            want = (0, "frame_too_large")
        elif frames:
            want = expected_before_handshake(frames[0])
            if want is None:
                return  # a good Hello: not malformed
        else:
            want = None  # an incomplete frame: no answer, a clean hang-up after our EOF
        c = self.connect()
        try:
            try:
                c.sock.sendall(data)
                c.sock.shutdown(socket.SHUT_WR)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the daemon already hung up; its answer is still readable
            replies = c.rest()
        finally:
            c.close()
        if kind == "random_stream":
            # Chunking decides whether whole frames before an oversized header are seen first.
            assert len(replies) <= 1 and all(isinstance(r, m.Error) for r in replies), replies
        elif want is None:
            assert replies == [], replies
        else:
            assert len(replies) == 1 and isinstance(replies[0], m.Error), replies
            got = (replies[0].id, replies[0].code)
            deep = b"\x91" * 500 in data or b"\x81\xa1k" * 500 in data
            assert got == want or (deep and got == (0, want[1])), (got, want)  # see handshaken_batch
        self.count(f"fresh-{kind}")

    def run(self, ex: Example) -> None:
        self.handshaken_batch(ex)
        for kind, data in ex.fresh:
            self.fresh(kind, data)
        self.ping()


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")  # pragma: no cover


_SETTINGS = {
    "deadline": None,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
}


def test_fuzz_live_daemon(fuzz_daemon: DaemonProcess) -> None:
    fuzzer = Fuzzer(fuzz_daemon.socket_path)
    t0 = time.monotonic()

    @settings(max_examples=25, **_SETTINGS)  # type: ignore[arg-type]
    @given(ex=examples)
    def warm_up(ex: Example) -> None:
        fuzzer.run(ex)

    @settings(max_examples=220, **_SETTINGS)  # type: ignore[arg-type]
    @given(ex=examples)
    def fuzz(ex: Example) -> None:
        fuzzer.run(ex)

    warm_up()
    rss_before = _rss(fuzz_daemon.pid)
    fuzz()
    rss_after = _rss(fuzz_daemon.pid)
    elapsed = time.monotonic() - t0
    print(
        f"fuzz: {fuzzer.inputs} malformed inputs over {fuzzer.connections} connections, "
        f"{fuzzer.pings} pings, {elapsed:.1f}s; RSS {rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB; "
        f"{dict(sorted(fuzzer.kinds.items()))}"
    )
    assert fuzzer.inputs >= MIN_INPUTS
    assert fuzz_daemon.proc.poll() is None, "the daemon died"
    assert rss_after - rss_before < RSS_GROWTH_LIMIT, (rss_before, rss_after)
    # Every session ended and returned its (zero) leases; the daemon still serves. The
    # fuzzer's last connections have hung up, but the daemon ends a session when it reads
    # that: ask until only ours is left (a session that never ends times the wait out).
    c = Conn(fuzz_daemon.socket_path)
    try:
        c.sock.sendall(encode(m.Hello(id=1, version=m.PROTOCOL_VERSION)))
        assert isinstance(c.receive(), m.Welcome)
        deadline = time.monotonic() + 20
        while True:
            c.sock.sendall(encode(m.Stats(id=2)))
            reply = c.receive()
            assert isinstance(reply, m.StatsReply)
            if reply.stats.sessions == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert reply.stats.sessions == 1
        assert reply.stats.blocks_leased == 0
        assert not reply.stats.draining
    finally:
        c.close()
