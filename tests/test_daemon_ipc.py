"""Integration tests of the executor IPC: a real kvd subprocess, real Unix sockets.

Every test talks to a daemon started with ``python -m kvd serve`` (readiness observed on a
NOTIFY_SOCKET, never a sleep) through its socket: the async client, the blocking client, or a
raw socket speaking the wire protocol by hand.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from clients import Client, open_client
from kvd.demo.launch import DaemonProcess, LaunchError, start_daemon
from protocol import messages as m
from protocol.codec import decode_reply, encode
from protocol.errors import (
    BadRequest,
    BlockNotLeased,
    HandshakeRequired,
    KvdError,
    LimitExceeded,
    NotFound,
    OutOfBlocks,
    VersionMismatch,
)
from protocol.framing import FrameBuffer

IO_TIMEOUT = 10.0


def host_pool(name: str = "host0", **overrides: Any) -> dict[str, Any]:
    """The host pool of ``conftest.host_pool`` (64 blocks of 256 KiB)."""
    pool: dict[str, Any] = {
        "name": name, "memory": "host", "device": -1, "num_layers": 4, "num_kv_heads": 8,
        "head_dim": 64, "tokens_per_block": 32, "dtype": "bfloat16", "num_blocks": 64,
    }  # fmt: skip
    pool.update(overrides)
    return pool


def _config(**extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"pools": [host_pool()], "transfer": {"bounce_size_mb": 16, "chunk_mb": 2}}
    cfg.update(extra)
    return cfg


@pytest.fixture(scope="module")
def shared_daemon() -> Iterator[DaemonProcess]:
    """One daemon for the tests that leave it serving (each cleans up its own leases)."""
    workdir = tempfile.mkdtemp(prefix="kvdm-", dir="/tmp")
    d = start_daemon(_config(limits={"max_blocks_per_session": 100}), workdir=workdir, name="shared")
    try:
        yield d
    finally:
        d.kill()
        shutil.rmtree(workdir, ignore_errors=True)


class RawConn:
    """A client socket speaking the wire protocol by hand (no client library)."""

    def __init__(self, path: str, timeout: float = IO_TIMEOUT) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.frames = FrameBuffer()
        self.ready: list[m.Message] = []

    def send(self, msg: m.Message) -> None:
        self.sock.sendall(encode(msg))

    def receive(self) -> m.Message | None:
        """The next reply, or None at EOF (a clean disconnect). Times out instead of hanging."""
        while not self.ready:
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                return None
            if not data:
                return None
            self.ready.extend(decode_reply(p) for p in self.frames.feed(data))
        return self.ready.pop(0)

    def call(self, msg: m.Message) -> m.Message:
        self.send(msg)
        reply = self.receive()
        assert reply is not None, f"daemon closed the connection instead of answering {msg!r}"
        return reply

    def hello(self) -> m.Welcome:
        reply = self.call(m.Hello(id=1, version=m.PROTOCOL_VERSION, client="raw"))
        assert isinstance(reply, m.Welcome), reply
        return reply

    def close(self) -> None:
        self.sock.close()


def _stats(path: str) -> m.DaemonStats:
    with Client(path, timeout=IO_TIMEOUT) as c:
        return c.stats()


def _wait_for(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _flags(messages: list[str]) -> list[str]:
    """Every KEY=VALUE assignment of the notify datagrams, in order."""
    return [line for msg in messages for line in msg.split("\n")]


# --- handshake ---------------------------------------------------------------------------


def test_handshake_welcome(shared_daemon: DaemonProcess) -> None:
    raw = RawConn(shared_daemon.socket_path)
    try:
        welcome = raw.hello()
        assert welcome.version == m.PROTOCOL_VERSION
        assert welcome.node == "shared"
        assert welcome.server.startswith("kvd ")
        assert welcome.session_id > 0
        pong = raw.call(m.Ping(id=2, payload=b"raw"))
        assert pong == m.Pong(id=2, payload=b"raw")
        # A second Hello is an error, not a disconnect.
        again = raw.call(m.Hello(id=3, version=m.PROTOCOL_VERSION))
        assert isinstance(again, m.Error) and again.id == 3 and again.code == "protocol"
        assert raw.call(m.Ping(id=4)) == m.Pong(id=4)
    finally:
        raw.close()


def test_version_mismatch_raw_socket(shared_daemon: DaemonProcess) -> None:
    raw = RawConn(shared_daemon.socket_path)
    try:
        reply = raw.call(m.Hello(id=7, version=m.PROTOCOL_VERSION + 1, client="future"))
        assert isinstance(reply, m.Error)
        assert reply.id == 7
        assert reply.code == VersionMismatch.code
        assert f"version {m.PROTOCOL_VERSION + 1}" in reply.message
        assert raw.receive() is None  # then the daemon disconnects
    finally:
        raw.close()


def test_request_before_hello_raw_socket(shared_daemon: DaemonProcess) -> None:
    raw = RawConn(shared_daemon.socket_path)
    try:
        reply = raw.call(m.Alloc(id=5, pool="host0", count=1))
        assert isinstance(reply, m.Error) and reply.id == 5 and reply.code == HandshakeRequired.code
        assert raw.receive() is None
    finally:
        raw.close()
    assert _stats(shared_daemon.socket_path).blocks_leased == 0


async def test_version_mismatch_clients(
    shared_daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(m, "PROTOCOL_VERSION", m.PROTOCOL_VERSION + 41)
    with pytest.raises(VersionMismatch, match="client speaks protocol version 42"):
        async with open_client(shared_daemon.socket_path):
            pass  # pragma: no cover
    with pytest.raises(VersionMismatch, match="client speaks protocol version 42"):
        Client(shared_daemon.socket_path, timeout=IO_TIMEOUT)


# --- many clients ------------------------------------------------------------------------


async def test_200_concurrent_clients_100_round_trips_each(shared_daemon: DaemonProcess) -> None:
    clients, rounds = 200, 100
    pongs = [0] * clients
    errors: list[str] = []

    async def one(i: int) -> None:
        async with open_client(shared_daemon.socket_path, client=f"c{i}") as kvd:
            for k in range(rounds):
                payload = f"client {i} round {k}".encode()
                got = await kvd.ping(payload)
                if got != payload:
                    errors.append(f"client {i} round {k}: {got!r}")
                pongs[i] += 1

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for i in range(clients):
                nursery.start_soon(one, i)
    assert errors == []
    assert sum(pongs) == clients * rounds == 20_000
    # a Client's close does not wait for the daemon to end the session: wait for it to
    async with open_client(shared_daemon.socket_path) as kvd:
        with trio.fail_after(20):
            while (st := await kvd.stats()).sessions != 1:
                await trio.sleep(0.01)
    assert st.sessions == 1  # every one of the 200 sessions ended


async def test_many_requests_in_flight_on_one_client(shared_daemon: DaemonProcess) -> None:
    async with open_client(shared_daemon.socket_path) as kvd:
        results: dict[int, bytes] = {}

        async def ping(i: int) -> None:
            results[i] = await kvd.ping(i.to_bytes(4, "big"))

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i in range(500):
                    nursery.start_soon(ping, i)
    assert results == {i: i.to_bytes(4, "big") for i in range(500)}


# --- a client killed mid-request ---------------------------------------------------------

_DOOMED_CLIENT = textwrap.dedent(
    """
    import socket, sys
    from protocol import messages as m
    from protocol.codec import decode_reply, encode
    from protocol.framing import FrameBuffer

    path, pool = sys.argv[1], sys.argv[2]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    buf = FrameBuffer()
    ready = []

    def call(msg):
        s.sendall(encode(msg))
        while not ready:
            data = s.recv(65536)
            if not data:
                raise SystemExit("daemon closed")
            ready.extend(decode_reply(p) for p in buf.feed(data))
        return ready.pop(0)

    assert isinstance(call(m.Hello(id=1, version=m.PROTOCOL_VERSION, client="doomed")), m.Welcome)
    blocks = call(m.Alloc(id=2, pool=pool, count=12)).block_ids
    pools = call(m.ListPools(id=3)).pools
    layout = pools[0].layout
    reg = call(m.Expect(id=4, request_id="doomed-1", pool=pool, layout=layout, rank=0, block_ids=blocks[:4]))
    assert isinstance(reg, m.Registered), reg
    # A Wait that will never complete (no ctx side) stays in flight ...
    s.sendall(encode(m.Wait(id=5, request_id="doomed-1")))
    # ... and half a frame: the daemon is in the middle of reading a request.
    partial = encode(m.Alloc(id=6, pool=pool, count=1))
    s.sendall(partial[: len(partial) // 2])
    print("READY", len(blocks), flush=True)
    sys.stdin.read()  # until killed
    """
)


async def test_client_killed_mid_request_does_not_disturb_others(shared_daemon: DaemonProcess) -> None:
    path = shared_daemon.socket_path
    rounds_done = 0
    stop = trio.Event()

    async def pinger(kvd: Any) -> None:
        nonlocal rounds_done
        while not stop.is_set():
            payload = rounds_done.to_bytes(8, "big")
            assert await kvd.ping(payload) == payload
            rounds_done += 1
            await trio.sleep(0)

    async with open_client(path, client="survivor") as kvd:
        # the module's daemon: an earlier test's closed session may not have ended yet (the
        # daemon ends it when it reads the hang-up); the counts below are of this test's two
        with trio.fail_after(20):
            while (await kvd.stats()).sessions != 1:
                await trio.sleep(0.01)
        mine = await kvd.alloc("host0", 3)
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pinger, kvd)
                proc = await trio.lowlevel.open_process(
                    [sys.executable, "-c", _DOOMED_CLIENT, path, "host0"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                )
                try:
                    assert proc.stdout is not None
                    line = b""
                    while not line.endswith(b"\n"):
                        chunk = await proc.stdout.receive_some(100)
                        assert chunk, "doomed client died before it was ready"
                        line += chunk
                    assert line.split() == [b"READY", b"12"]
                    st = await kvd.stats()
                    assert st.blocks_leased == 15
                    assert st.sessions == 2
                    before = rounds_done
                    proc.send_signal(signal.SIGKILL)
                    assert await proc.wait() == -signal.SIGKILL
                finally:
                    if proc.returncode is None:  # pragma: no cover - cleanup after a failure
                        proc.kill()
                        await proc.wait()
                    for stream in (proc.stdin, proc.stdout):
                        if stream is not None:
                            await stream.aclose()
                # The dead session's leases come back; our own stay.
                while (st := await kvd.stats()).blocks_leased != 3:
                    await trio.sleep(0.01)
                assert st.sessions == 1
                pools = await kvd.pools()
                assert pools[0].blocks_used == 3 and pools[0].sessions == 1
                sessions = await kvd.sessions()
                assert [s.client for s in sessions] == ["survivor"]
                # Our round trips went on while it died, and keep going.
                target = rounds_done + 200
                while rounds_done < target:
                    await trio.sleep(0.01)
                assert rounds_done > before
                stop.set()
        # A request of the dead session no longer exists.
        with pytest.raises(NotFound):
            await kvd.wait("doomed-1", timeout_s=1)
        assert await kvd.free("host0", mine) == 3
        assert (await kvd.stats()).blocks_leased == 0


def test_abrupt_disconnects_return_leases(shared_daemon: DaemonProcess) -> None:
    path = shared_daemon.socket_path
    for i in range(20):
        raw = RawConn(path)
        raw.hello()
        reply = raw.call(m.Alloc(id=2, pool="host0", count=2))
        assert isinstance(reply, m.Allocated)
        if i % 2:  # hang up in the middle of a request frame
            raw.sock.sendall(encode(m.Ping(id=3))[:3])
        raw.close()
    _wait_for(lambda: _stats(path).blocks_leased == 0, what="leases returned")


# --- errors: the blocking and the async client agree --------------------------------------


def _error_cases(layout: Any) -> list[tuple[str, Callable[[Any], Any], type[KvdError], str]]:
    return [
        ("unknown pool", lambda c: c.alloc("nope", 1), NotFound, "no pool named 'nope'"),
        ("out of blocks", lambda c: c.alloc("host0", 65), OutOfBlocks, "asked for 65 blocks, only 64 free"),
        ("per-session limit", lambda c: c.alloc("host0", 101), LimitExceeded, "max_blocks_per_session=100"),
        ("zero count", lambda c: c.alloc("host0", 0), BadRequest, "positive integer"),
        ("free unleased", lambda c: c.free("host0", [5]), BlockNotLeased, "block 5 is not leased"),
        ("free out of range", lambda c: c.free("host0", [1000]), BlockNotLeased, "out of range"),
        ("wait unknown", lambda c: c.wait("no-such-request"), NotFound,
         "no request 'no-such-request' is registered by this session"),
        ("cancel unknown", lambda c: c.cancel("no-such-request"), NotFound, "no request"),
        ("attach unknown", lambda c: c.attach("nope"), NotFound, "no pool named"),
        (
            "expect unleased",
            lambda c: c.expect("r-x", "host0", layout, 0, [7]),
            BlockNotLeased,
            "block 7 is not leased",
        ),
    ]


def _no_session_id(message: str) -> str:
    return re.sub(r"session \d+", "session N", message)


async def test_blocking_and_async_clients_raise_the_same_errors(shared_daemon: DaemonProcess) -> None:
    path = shared_daemon.socket_path
    with Client(path, timeout=IO_TIMEOUT) as blocking:
        layout = blocking.pools()[0].layout
        seen_blocking: list[tuple[type[KvdError], str, str]] = []
        for name, call, cls, text in _error_cases(layout):
            with pytest.raises(cls, match=text) as info:
                call(blocking)
            assert type(info.value) is cls, name
            seen_blocking.append((type(info.value), info.value.code, _no_session_id(info.value.message)))
        assert blocking.ping(b"still here") == b"still here"
    async with open_client(path) as kvd:
        seen_async: list[tuple[type[KvdError], str, str]] = []
        for name, call, cls, text in _error_cases(layout):
            with pytest.raises(cls, match=text) as info:
                await call(kvd)
            assert type(info.value) is cls, name
            seen_async.append((type(info.value), info.value.code, _no_session_id(info.value.message)))
        assert await kvd.ping(b"still here") == b"still here"
    assert seen_async == seen_blocking
    assert _stats(path).blocks_leased == 0


async def test_session_limit_same_error_in_both_clients(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory(_config(limits={"max_sessions": 1, "operator_reserve": 0}), name="one")  # root: no reserve
    with Client(d.socket_path, timeout=IO_TIMEOUT) as first:
        with pytest.raises(LimitExceeded, match="max_sessions=1 reached") as blocking_err:
            Client(d.socket_path, timeout=IO_TIMEOUT)
        with pytest.raises(LimitExceeded, match="max_sessions=1 reached") as async_err:
            async with open_client(d.socket_path):
                pass  # pragma: no cover
        assert blocking_err.value.message == async_err.value.message
        assert first.ping(b"first") == b"first"
    # the slot is free again once the first session ends
    _wait_for(lambda: _try_ping(d.socket_path), what="a new session accepted")


def _try_ping(path: str) -> bool:
    try:
        with Client(path, timeout=IO_TIMEOUT) as c:
            return c.ping(b"x") == b"x"
    except LimitExceeded:
        return False


# --- socket file -------------------------------------------------------------------------


def test_socket_mode_is_0660(shared_daemon: DaemonProcess) -> None:
    st = os.stat(shared_daemon.socket_path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660


def test_stale_socket_replaced_and_mode_honoured(
    daemon_factory: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    path = str(short_tmp / "stale.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)  # bound, never listening: what a crashed daemon leaves behind
    dead.close()
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    d = daemon_factory(_config(socket_path=path, socket_mode=0o600), name="fresh")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with Client(path, timeout=IO_TIMEOUT) as c:
        assert c.ping(b"new") == b"new"
    assert d.stop() == 0
    assert not os.path.exists(path)


def test_live_socket_refused(
    daemon_factory: Callable[..., DaemonProcess], shared_daemon: DaemonProcess
) -> None:
    with pytest.raises(LaunchError, match="another kvd is already serving") as info:
        daemon_factory(_config(socket_path=shared_daemon.socket_path), name="intruder")
    assert "exited with 1" in str(info.value)
    # The first daemon is unharmed and still owns its socket.
    with Client(shared_daemon.socket_path, timeout=IO_TIMEOUT) as c:
        assert c.ping(b"mine") == b"mine"
        assert c.welcome.node == "shared"


def test_socket_path_that_is_not_a_socket_refused(
    daemon_factory: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    path = short_tmp / "file.sock"
    path.write_text("precious")
    with pytest.raises(LaunchError, match="is not a socket"):
        daemon_factory(_config(socket_path=str(path)), name="nosock")
    assert path.read_text() == "precious"


# --- shutdown ----------------------------------------------------------------------------


def test_sigterm_stops_cleanly(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory(name="term")
    idle = Client(d.socket_path, timeout=IO_TIMEOUT)  # a connected session must not hold up the exit
    idle.alloc("host0", 4)
    assert "READY=1" in _flags(d.messages)
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(20) == 0
    flags = _flags(d.messages + d.read_notify(1.0))
    assert "STOPPING=1" in flags
    assert flags.index("STOPPING=1") > flags.index("READY=1")
    assert not os.path.exists(d.socket_path)
    with pytest.raises(KvdError):
        idle.ping()
    idle.close()
    log = d.log()
    assert "daemon.draining" in log and "signal SIGTERM" in log and "daemon.stopped" in log


def test_drain_request(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory(name="drain")
    with Client(d.socket_path, timeout=IO_TIMEOUT) as c:
        c.alloc("host0", 2)
        c.drain()
    assert d.proc.wait(20) == 0
    flags = _flags(d.messages + d.read_notify(1.0))
    assert "STOPPING=1" in flags
    assert not os.path.exists(d.socket_path)
    assert "drain requested by client" in d.log()
    with pytest.raises(KvdError, match="cannot connect"):
        Client(d.socket_path, timeout=IO_TIMEOUT)
