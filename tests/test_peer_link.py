"""kvd.peer + protocol.peer: the authenticated daemon-to-daemon link.

Handshakes over trio's memory streams and over real loopback TCP; virtual time
(``autojump_clock``) for timeouts and heartbeats; structlog's ``capture_logs`` for the
``peer.auth_failed`` warnings.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import select
import shutil
import stat
import subprocess
from collections.abc import MutableMapping
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from structlog.testing import capture_logs

from kvd.peer import (
    PeerConnection,
    accept_peer,
    connect_peer,
    connect_with_backoff,
    handshake_client,
    handshake_mac,
    handshake_server,
    load_secret,
    run_heartbeats,
    verify_mac,
)
from protocol.errors import (
    AuthFailed,
    BadRequest,
    ConnectionClosed,
    FrameTooLarge,
    KvdError,
    PeerUnavailable,
    PermissionDenied,
    ProtocolError,
    VersionMismatch,
)
from protocol.framing import FrameBuffer
from protocol.layout import KVLayout
from protocol.peer import (
    PEER_PROTOCOL_VERSION,
    Heartbeat,
    PeerChallenge,
    PeerError,
    PeerHello,
    PeerMessage,
    PeerWelcome,
    PoolDesc,
    RegionDesc,
    decode_peer,
    encode_peer,
    encode_peer_payload,
    register_peer_messages,
)
from tests.ports import unused_port

SECRET = b"0123456789abcdef-shared-secret"
OTHER_SECRET = b"fedcba9876543210-other-secret!"


def welcome(node: str, tag: bytes) -> PeerWelcome:
    return PeerWelcome(
        node=node,
        nixl_agent=f"{node}-nixl",
        nixl_metadata=b"nixl-metadata-of-" + tag,
        bounce=[
            RegionDesc(name="bounce", addr=0x1000, nbytes=1 << 20, device=-1, slot_bytes=1 << 18, slots=4)
        ],
        pools=[
            PoolDesc(
                name="pool0",
                addr=0x200000,
                nbytes=1 << 24,
                device=0,
                kind="device",
                block_bytes=1 << 16,
                num_blocks=256,
                layout=KVLayout(4, 8, 64, 32, "bfloat16", num_blocks=256),
            )
        ],
    )


def _unnamed(w: PeerWelcome) -> PeerWelcome:
    """The handshake fills in the node name."""
    return msgspec.structs.replace(w, node="")


class Ping(PeerMessage, frozen=True, tag="test_ping"):
    """An application message, as the transfer engine will add."""

    payload: bytes = b""


register_peer_messages(Ping)


def _auth_events(logs: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["event"] == "peer.auth_failed"]


# --- protocol.peer (sans-IO) -------------------------------------------------------------------


def test_encode_decode_roundtrip_and_errors() -> None:
    msgs: list[msgspec.Struct] = [
        PeerHello(version=1, node="a", nonce=b"n" * 32, id=3),
        welcome("b", b"x"),
        Heartbeat(seq=9),
        PeerError(code="auth_failed", message="no"),
        Ping(payload=b"p"),
    ]
    buf = FrameBuffer()
    frames = buf.feed(b"".join(encode_peer(m) for m in msgs))
    assert [decode_peer(f) for f in frames] == msgs
    with pytest.raises(ProtocolError, match="invalid peer message"):
        decode_peer(msgspec.msgpack.encode({"type": "no_such_message"}))
    with pytest.raises(ProtocolError, match="undecodable"):
        decode_peer(b"\xc1")
    with pytest.raises(ProtocolError):
        decode_peer(msgspec.msgpack.encode({"type": "heartbeat", "seq": "not an int"}))
    assert decode_peer(encode_peer_payload(Heartbeat(seq=1))) == Heartbeat(seq=1)


def test_register_peer_messages_validates() -> None:
    register_peer_messages(Ping)  # idempotent

    class Clash(PeerMessage, frozen=True, tag="heartbeat"):
        pass

    class Untagged(msgspec.Struct, frozen=True):
        x: int = 0

    class Mutable(msgspec.Struct, tag_field="type", tag="test_mutable"):
        x: int = 0

    with pytest.raises(TypeError, match="already used by Heartbeat"):
        register_peer_messages(Clash)
    with pytest.raises(TypeError, match="tagged on the field 'type'"):
        register_peer_messages(Untagged)
    with pytest.raises(TypeError, match="frozen"):
        register_peer_messages(Mutable)


def test_macs_bind_role_nodes_nonces_and_secret() -> None:
    base: dict[str, Any] = dict(
        version=1, client_node="a", server_node="b", client_nonce=b"c" * 32, server_nonce=b"s" * 32
    )
    server = handshake_mac(SECRET, "server", **base)
    assert len(server) == 32
    assert verify_mac(server, handshake_mac(SECRET, "server", **base))
    assert not verify_mac(server, handshake_mac(SECRET, "client", **base))
    assert not verify_mac(server, handshake_mac(OTHER_SECRET, "server", **base))
    for key, value in [
        ("version", 2),
        ("client_node", "x"),
        ("server_node", "x"),
        ("client_nonce", b"d" * 32),
        ("server_nonce", b"t" * 32),
    ]:
        assert not verify_mac(server, handshake_mac(SECRET, "server", **{**base, key: value}))
    # length-prefixed fields: moving bytes between adjacent fields changes the MAC
    shifted = {**base, "client_node": "ab", "server_node": ""}
    assert handshake_mac(SECRET, "server", **shifted) != handshake_mac(
        SECRET, "server", **{**base, "client_node": "a", "server_node": "b"}
    )


# --- the secret file ---------------------------------------------------------------------------


def _write_secret(path: Path, data: bytes, mode: int) -> Path:
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def test_load_secret_accepts_owner_only_file(tmp_path: Path) -> None:
    p = _write_secret(tmp_path / "secret", SECRET + b"\n", 0o600)
    assert load_secret(p) == SECRET
    assert load_secret(_write_secret(tmp_path / "ro", SECRET, 0o400)) == SECRET


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644, 0o610])
def test_load_secret_refuses_group_or_world_access(tmp_path: Path, mode: int) -> None:
    p = _write_secret(tmp_path / "secret", SECRET, mode)
    with pytest.raises(PermissionDenied, match=f"mode {mode:04o}: group/others may access it.*chmod 600"):
        load_secret(p)


def test_load_secret_names_the_file_a_relative_path_meant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative peer_secret_file is taken from the working directory; the error says where."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadRequest) as err:
        load_secret("peer.secret")
    assert f"peer secret file peer.secret (relative to the working directory: {tmp_path / 'peer.secret'})" \
        " does not exist" in str(err.value)
    _write_secret(tmp_path / "peer.secret", SECRET, 0o600)
    assert load_secret("peer.secret") == SECRET  # and that is the file it reads
    with pytest.raises(BadRequest) as err:
        load_secret(tmp_path / "absent.secret")
    assert "working directory" not in str(err.value)  # an absolute path needs no explanation


def test_load_secret_refuses_missing_short_foreign_and_linked(tmp_path: Path) -> None:
    with pytest.raises(BadRequest, match="does not exist"):
        load_secret(tmp_path / "missing")
    with pytest.raises(BadRequest, match="no peer secret file configured"):
        load_secret("")
    with pytest.raises(BadRequest, match="at least 16 are needed"):
        load_secret(_write_secret(tmp_path / "short", b"tooshort\n", 0o600))
    with pytest.raises(BadRequest, match="not a regular file"):
        os.mkdir(tmp_path / "dir", 0o700)
        load_secret(tmp_path / "dir")
    target = _write_secret(tmp_path / "target", SECRET, 0o600)
    os.symlink(target, tmp_path / "link")
    with pytest.raises(PermissionDenied, match="symbolic link"):
        load_secret(tmp_path / "link")
    if os.geteuid() == 0:
        foreign = _write_secret(tmp_path / "foreign", SECRET, 0o600)
        os.chown(foreign, 4242, -1)
        with pytest.raises(PermissionDenied, match="owned by uid 4242"):
            load_secret(foreign)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600


# --- handshake over memory streams -------------------------------------------------------------


async def _pair_handshake(
    client_secret: bytes = SECRET,
    server_secret: bytes = SECRET,
    client_version: int = PEER_PROTOCOL_VERSION,
    server_node: str = "gen-node",
) -> tuple[dict[str, Any], PeerConnection, PeerConnection]:
    a, b = trio.testing.memory_stream_pair()
    ca, cb = PeerConnection(a, remote_addr="mem:server"), PeerConnection(b, remote_addr="mem:client")
    out: dict[str, Any] = {}

    async def client() -> None:
        try:
            out["client"] = await handshake_client(
                ca, node="ctx-node", secret=client_secret, local_welcome_payload=_unnamed(welcome("ctx-node", b"ctx")),
                version=client_version,
            )  # fmt: skip
        except Exception as exc:
            out["client"] = exc

    async def server() -> None:
        try:
            out["server"] = await handshake_server(
                cb, node=server_node, secret=server_secret, local_welcome_payload=welcome(server_node, b"gen")
            )
        except Exception as exc:
            out["server"] = exc

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client)
            nursery.start_soon(server)
    return out, ca, cb


async def test_handshake_memory_right_secret_and_first_messages_kept() -> None:
    out, ca, cb = await _pair_handshake()
    node, w = out["client"]
    assert node == "gen-node" and w == welcome("gen-node", b"gen")
    node, w = out["server"]
    assert node == "ctx-node" and w == welcome("ctx-node", b"ctx")  # node filled in by the handshake
    assert ca.remote_node == "gen-node" and cb.remote_node == "ctx-node"
    assert ca.welcome is not None and ca.welcome.pools[0].layout == KVLayout(
        4, 8, 64, 32, "bfloat16", num_blocks=256
    )
    # the link carries application messages both ways right away
    await ca.send(Ping(payload=b"one", id=1))
    await ca.send(Ping(payload=b"two", id=2))
    assert await cb.receive() == Ping(payload=b"one", id=1)
    assert await cb.receive() == Ping(payload=b"two", id=2)
    await cb.send(PeerError(code="not_found", message="x", id=2))
    assert await ca.receive() == PeerError(code="not_found", message="x", id=2)


async def test_handshake_memory_wrong_secret_fails_on_both_sides() -> None:
    with capture_logs() as logs:
        out, _ca, _cb = await _pair_handshake(client_secret=OTHER_SECRET)
    assert isinstance(out["client"], AuthFailed)
    assert isinstance(out["server"], AuthFailed)
    assert "its MAC does not match our secret" in str(out["client"])
    assert "the peer refused us" in str(out["server"])
    for side in ("client", "server"):  # both say what to do, not only that a MAC failed
        assert "give every daemon of the deployment the same peer_secret_file content" in str(out[side])
    events = _auth_events(logs)
    assert {e["side"] for e in events} == {"client", "server"}
    assert all(e["log_level"] == "warning" for e in events)
    assert {e["remote"] for e in events} == {"mem:server", "mem:client"}


async def test_version_mismatch_on_both_sides() -> None:
    with capture_logs() as logs:
        out, _ca, _cb = await _pair_handshake(client_version=PEER_PROTOCOL_VERSION + 1)
    assert isinstance(out["client"], VersionMismatch)
    assert isinstance(out["server"], VersionMismatch)
    assert f"speaks peer protocol {PEER_PROTOCOL_VERSION + 1}, we speak {PEER_PROTOCOL_VERSION}" in str(
        out["server"]
    )
    assert len([e for e in logs if e["event"] == "peer.version_mismatch"]) == 2


async def test_silent_peer_times_out(autojump_clock: trio.testing.MockClock) -> None:
    a, b = trio.testing.memory_stream_pair()
    t0 = trio.current_time()
    with pytest.raises(PeerUnavailable, match="did not complete the handshake within 7"):
        await handshake_server(
            b, node="gen", secret=SECRET, local_welcome_payload=welcome("gen", b""), timeout=7
        )
    assert trio.current_time() - t0 == pytest.approx(7)
    # and a client whose server never answers its hello
    c, _d = trio.testing.memory_stream_pair()
    with pytest.raises(PeerUnavailable, match="did not complete the handshake within 3"):
        await handshake_client(
            c, node="ctx", secret=SECRET, local_welcome_payload=welcome("ctx", b""), timeout=3
        )
    del a


async def test_client_refuses_a_reflected_nonce() -> None:
    """A fake server that echoes the client's own nonce (and MAC-less) is refused."""
    a, b = trio.testing.memory_stream_pair()
    ca, fake = PeerConnection(a, remote_addr="mem:fake"), PeerConnection(b)

    async def fake_server() -> None:
        hello = await fake.receive_any()
        assert isinstance(hello, PeerHello)
        await fake.send(PeerChallenge(version=1, node="fake", nonce=hello.nonce, mac=b"x" * 32))
        err = await fake.receive_any()
        assert isinstance(err, PeerError) and err.code == "auth_failed"

    with capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fake_server)
            with pytest.raises(AuthFailed, match="echoed our own nonce"):
                await handshake_client(
                    ca, node="ctx", secret=SECRET, local_welcome_payload=welcome("ctx", b"")
                )
    assert [(e["remote"], e["side"]) for e in _auth_events(logs)] == [("mem:fake", "client")]


async def test_same_node_name_refused_on_both_sides() -> None:
    out, _ca, _cb = await _pair_handshake(server_node="ctx-node")
    assert isinstance(out["server"], BadRequest) and "has our own node name 'ctx-node'" in str(out["server"])
    assert isinstance(out["client"], BadRequest)


# --- over real loopback TCP --------------------------------------------------------------------


async def _serve(nursery: trio.Nursery, handler: Any) -> int:
    listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    port: int = listeners[0].socket.getsockname()[1]
    return port


async def test_tcp_handshake_right_secret() -> None:
    got: dict[str, Any] = {}
    done = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        conn = await accept_peer(stream, node="gen-node", secret=SECRET, welcome=welcome("gen-node", b"gen"))
        got["server"] = conn
        got["first"] = await conn.receive()
        await conn.send(Ping(payload=b"pong", id=got["first"].id))
        done.set()
        with pytest.raises(ConnectionClosed, match="closed the link: bye") as info:
            await conn.receive()
        assert info.value.by_peer
        got["closed"] = True

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, handler)
            conn = await connect_peer(
                "127.0.0.1",
                port,
                node="ctx-node",
                secret=SECRET,
                welcome=_unnamed(welcome("ctx-node", b"ctx")),
                expect_node="gen-node",
            )
            assert conn.remote_node == "gen-node" and conn.remote_addr == f"127.0.0.1:{port}"
            assert conn.welcome == welcome("gen-node", b"gen")
            await conn.send(Ping(payload=b"ping", id=5))
            assert await conn.receive() == Ping(payload=b"pong", id=5)
            await done.wait()
            await conn.aclose("bye")
            with pytest.raises(ConnectionClosed, match="closed by us") as info:
                await conn.send(Ping())
            assert not info.value.by_peer
            while "closed" not in got:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    server: PeerConnection = got["server"]
    assert server.remote_node == "ctx-node" and server.welcome == welcome("ctx-node", b"ctx")
    assert server.remote_addr.startswith("127.0.0.1:")


async def test_tcp_handshake_wrong_secret_refused_and_logged() -> None:
    server_err: list[BaseException] = []

    async def handler(stream: trio.SocketStream) -> None:
        try:
            await accept_peer(stream, node="gen-node", secret=SECRET, welcome=welcome("gen-node", b""))
        except AuthFailed as exc:
            server_err.append(exc)

    with capture_logs() as logs, trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, handler)
            with pytest.raises(
                AuthFailed, match=f"peer 'gen-node' at 127.0.0.1:{port} failed the shared-secret"
            ):
                await connect_peer(
                    "127.0.0.1", port, node="ctx-node", secret=OTHER_SECRET, welcome=welcome("", b"")
                )
            while not server_err:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert isinstance(server_err[0], AuthFailed) and "'ctx-node'" in str(server_err[0])
    events = _auth_events(logs)
    assert len(events) == 2
    by_side = {e["side"]: e for e in events}
    assert by_side["client"]["remote"] == f"127.0.0.1:{port}"
    assert by_side["server"]["remote"].startswith("127.0.0.1:") and by_side["server"]["node"] == "ctx-node"


async def test_tcp_unauthenticated_peer_cannot_send_big_frames() -> None:
    errors: list[BaseException] = []

    async def handler(stream: trio.SocketStream) -> None:
        try:
            await accept_peer(stream, node="gen-node", secret=SECRET, welcome=welcome("gen-node", b""))
        except FrameTooLarge as exc:
            errors.append(exc)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, handler)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            with contextlib.suppress(trio.BrokenResourceError):  # the server hangs up mid-frame
                await stream.send_all(encode_peer(PeerHello(version=1, node="x", nonce=b"n" * 1_000_000)))
            while not errors:
                await trio.sleep(0.01)
            await stream.aclose()
            nursery.cancel_scope.cancel()
    assert "exceeds the maximum frame size 65536" in str(errors[0])


# --- heartbeats --------------------------------------------------------------------------------


async def _receive_forever(conn: PeerConnection) -> None:
    while True:
        await conn.receive()


async def test_heartbeats_keep_a_live_link(autojump_clock: trio.testing.MockClock) -> None:
    a, b = trio.testing.memory_stream_pair()
    ca, cb = PeerConnection(a), PeerConnection(b)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_receive_forever, ca)
        nursery.start_soon(_receive_forever, cb)
        nursery.start_soon(run_heartbeats, cb, 1.0, 3.0)
        with trio.move_on_after(60):
            await run_heartbeats(ca, 1.0, 3.0)
        nursery.cancel_scope.cancel()
    assert ca.last_ack_seq >= 59 and cb.last_ack_seq >= 59


async def test_heartbeat_loss_detected(autojump_clock: trio.testing.MockClock) -> None:
    a, b = trio.testing.memory_stream_pair()
    ca, cb = PeerConnection(a, remote_addr="mem:b"), PeerConnection(b)
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_receive_forever, ca)
        nursery.start_soon(_receive_forever, cb)
        # the peer answers for a while, then hangs (stops receiving, like a stuck process)
        await trio.sleep(10)
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_receive_forever, ca)
        with capture_logs() as logs, pytest.raises(PeerUnavailable, match=r"sent nothing for 4\.0 s"):
            await run_heartbeats(ca, 1.0, 4.0)
        nursery.cancel_scope.cancel()
    assert trio.current_time() - t0 == pytest.approx(14)
    assert [e["event"] for e in logs] == ["peer.heartbeat_lost"]
    del cb


async def test_peer_bye_and_broken_links_are_told_apart() -> None:
    a, b = trio.testing.memory_stream_pair()
    ca, cb = PeerConnection(a), PeerConnection(b, max_frame_size=1024)
    await ca.send(Ping(payload=b"x" * 2000))
    with pytest.raises(FrameTooLarge):
        await cb.receive()
    a, b = trio.testing.memory_stream_pair()
    ca, cb = PeerConnection(a), PeerConnection(b)
    await a.aclose()  # the other side vanishes without a goodbye
    with pytest.raises(ConnectionClosed, match="closed the connection") as info:
        await cb.receive()
    assert info.value.by_peer
    await cb.aclose()
    with pytest.raises(ConnectionClosed, match="closed by us") as info:
        await cb.receive()
    assert not info.value.by_peer
    del ca


# --- reconnect ---------------------------------------------------------------------------------


async def test_connect_with_backoff_reaches_a_server_that_starts_later() -> None:
    port = unused_port()
    accepted = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        accepted.set()
        await stream.aclose()

    with capture_logs() as logs, trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def start_server_later() -> None:
                # "later": once the client was refused and is backing off (its log line)
                while not any(e["event"] == "peer.connect_retry" for e in logs):
                    await trio.sleep(0.005)
                server_started.set()
                await nursery.start(partial(trio.serve_tcp, handler, port, host="127.0.0.1"))

            server_started = trio.Event()
            nursery.start_soon(start_server_later)
            stream = await connect_with_backoff(
                "127.0.0.1", port, initial=0.02, maximum=0.08, rng=random.Random(0)
            )
            assert server_started.is_set(), "connected before the server was started"
            await accepted.wait()
            await stream.aclose()
            nursery.cancel_scope.cancel()
    retries = [e for e in logs if e["event"] == "peer.connect_retry"]
    assert retries and retries[0]["attempt"] == 1 and retries[0]["port"] == port
    assert all(e["retry_in_s"] <= 0.08 for e in retries)
    assert any(e["event"] == "peer.connect_ok" for e in logs)


async def test_connect_with_backoff_gives_up_and_is_cancellable(
    autojump_clock: trio.testing.MockClock,
) -> None:
    port = unused_port()
    with pytest.raises(PeerUnavailable, match=f"cannot connect to peer 127.0.0.1:{port} after 3 attempts"):
        await connect_with_backoff("127.0.0.1", port, initial=1, maximum=2, max_attempts=3)
    t0 = trio.current_time()
    with trio.move_on_after(30) as scope:
        await connect_with_backoff("127.0.0.1", port, initial=1, maximum=4, jitter=0)
    assert scope.cancelled_caught and trio.current_time() - t0 == pytest.approx(30)


async def _socket_pair() -> tuple[PeerConnection, PeerConnection]:
    a, b = trio.socket.socketpair()
    return PeerConnection(trio.SocketStream(a)), PeerConnection(trio.SocketStream(b))


async def test_send_nowait_queues_for_the_writer_in_order_with_send() -> None:
    """Frames queued without waiting go out in order, before a later awaited send; with no
    writer running nothing is queued (the caller sends awaited)."""
    ca, cb = await _socket_pair()
    assert not ca.send_nowait(Ping(payload=b"no writer"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ca.run_writer)
        await trio.testing.wait_all_tasks_blocked()
        assert all(ca.send_nowait(Ping(payload=bytes([i]))) for i in range(3))
        await ca.send(Ping(payload=b"awaited"))  # takes the queued three along, first
        assert ca.send_nowait(Ping(payload=b"after"))
        got = [(await cb.receive()) for _ in range(5)]
        nursery.cancel_scope.cancel()
    assert [m.payload for m in got] == [b"\x00", b"\x01", b"\x02", b"awaited", b"after"]  # type: ignore[attr-defined]
    await ca.aclose()
    await cb.aclose()


async def test_a_failed_write_closes_the_link_and_says_why() -> None:
    """The peer's end is gone: the writer's write fails, it records why and closes the stream,
    the receive side of the link ends, and nothing more is queued."""
    ca, cb = await _socket_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ca.run_writer)
        await trio.testing.wait_all_tasks_blocked()
        await cb.aclose()
        with pytest.raises(ConnectionClosed):  # the peer's goodbye, or the closed connection
            while True:
                await ca.receive()
        # keep queueing until a write fails (the first may still land in the kernel's buffer)
        while ca.send_nowait(Ping(payload=b"y" * 4096)):
            await trio.sleep(0)
    assert ca.write_error
    assert not ca.send_nowait(Ping(payload=b"late"))
    with pytest.raises(ConnectionClosed):
        await ca.receive()


async def test_a_frame_queued_while_a_send_waits_goes_after_it() -> None:
    """send() called first, send_nowait() while it waits for a write under way: the frames
    leave in call order (the transfer protocol relies on it, e.g. an offer before its path)."""
    ca, cb = await _socket_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ca.run_writer)
        await trio.testing.wait_all_tasks_blocked()
        await ca._send_lock.acquire()  # a write under way
        nursery.start_soon(ca.send, Ping(payload=b"first"))
        await trio.testing.wait_all_tasks_blocked()  # send() waits for the lock
        assert ca.send_nowait(Ping(payload=b"second"))
        ca._send_lock.release()
        got = [(await cb.receive()) for _ in range(2)]
        nursery.cancel_scope.cancel()
    assert [m.payload for m in got] == [b"first", b"second"]  # type: ignore[attr-defined]
    await ca.aclose()
    await cb.aclose()


async def test_frames_keep_call_order_when_the_writer_is_first_in_line_for_the_lock() -> None:
    """The writer waits for the lock with a frame to write (A), a send() waits behind it (B),
    then another frame is queued (C): they leave as A, B, C. (send() used to take A along
    before waiting; the writer, first in line, then wrote C before A and B: a transfer's
    data-done overtook its path message, and gen failed a request ctx had completed.)"""
    ca, cb = await _socket_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ca.run_writer)
        await trio.testing.wait_all_tasks_blocked()
        await ca._send_lock.acquire()  # a write under way
        assert ca.send_nowait(Ping(payload=b"A"))
        await trio.testing.wait_all_tasks_blocked()  # the writer waits for the lock, first
        nursery.start_soon(ca.send, Ping(payload=b"B"))
        await trio.testing.wait_all_tasks_blocked()  # send() waits behind it
        assert ca.send_nowait(Ping(payload=b"C"))
        ca._send_lock.release()
        got = [(await cb.receive()) for _ in range(3)]
        nursery.cancel_scope.cancel()
    assert [m.payload for m in got] == [b"A", b"B", b"C"]  # type: ignore[attr-defined]
    await ca.aclose()
    await cb.aclose()


async def test_a_send_cancelled_while_waiting_still_goes_out_in_order() -> None:
    """A send() cancelled while it waits for the lock leaves its frame queued, in its place:
    the writer sends it after what was queued before and before what comes later."""
    ca, cb = await _socket_pair()
    scope = trio.CancelScope()

    async def gives_up() -> None:
        with scope:
            await ca.send(Ping(payload=b"gives up"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ca.run_writer)
        await trio.testing.wait_all_tasks_blocked()
        await ca._send_lock.acquire()  # a write under way
        assert ca.send_nowait(Ping(payload=b"before"))
        nursery.start_soon(gives_up)
        await trio.testing.wait_all_tasks_blocked()  # it waits for the lock
        scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert scope.cancelled_caught
        assert ca.send_nowait(Ping(payload=b"after"))
        ca._send_lock.release()
        got = [(await cb.receive()) for _ in range(3)]
        nursery.cancel_scope.cancel()
    assert [m.payload for m in got] == [b"before", b"gives up", b"after"]  # type: ignore[attr-defined]
    await ca.aclose()
    await cb.aclose()


async def test_a_writer_cancelled_before_it_writes_leaves_its_frames_to_the_goodbye() -> None:
    """The writer woke for a queued frame and got the lock, but is cancelled before it runs
    again (a daemon stopping right after a transfer's last message): the frame stays queued
    and the goodbye that closes the link takes it along. It used to be taken and dropped, and
    the peer's side, its link lost, could not tell whether more writes were on their way."""
    ca, cb = await _socket_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ca.run_writer)
        await trio.testing.wait_all_tasks_blocked()
        await ca._send_lock.acquire()  # a write under way: the frame is queued
        assert ca.send_nowait(Ping(payload=b"last"))
        await trio.testing.wait_all_tasks_blocked()  # the writer woke and waits for the lock
        ca._send_lock.release()  # handed to the writer, which is cancelled before it runs again
        nursery.cancel_scope.cancel()
    await ca.aclose("bye")
    assert (await cb.receive()).payload == b"last"  # type: ignore[attr-defined]
    with pytest.raises(ConnectionClosed, match="bye"):
        await cb.receive()
    await cb.aclose()


async def test_flush_returns_once_the_queued_frames_are_written() -> None:
    """A frame queued behind a write under way is in the stream once flush returns: the
    writer cancelled right after cannot lose it (a stopping daemon flushes its links)."""
    ca, cb = await _socket_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ca.run_writer)
        await trio.testing.wait_all_tasks_blocked()
        await ca._send_lock.acquire()
        assert ca.send_nowait(Ping(payload=b"queued"))
        ca._send_lock.release()
        await ca.flush()
        nursery.cancel_scope.cancel()
    await trio.aclose_forcefully(ca.stream)  # no goodbye: what arrives was written by then
    assert (await cb.receive()).payload == b"queued"  # type: ignore[attr-defined]
    with pytest.raises(ConnectionClosed):
        await cb.receive()
    await cb.aclose()


    await cb.aclose()


def _takes_nowait(link: PeerConnection) -> bool:
    """``link.takes_nowait`` read through a call: asserted directly, mypy would keep the property
    narrowed across the awaits that change it and skip the rest of the test as unreachable."""
    return link.takes_nowait


async def test_takes_nowait_only_while_the_writer_runs() -> None:
    """A link that just came up has no writer yet: callers must send awaited then (a transfer
    whose first message met such a link failed with an internal error)."""
    ca, cb = await _socket_pair()
    assert not _takes_nowait(ca) and not ca.send_nowait(Ping(payload=b"x"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ca.run_writer)
        await trio.testing.wait_all_tasks_blocked()
        assert _takes_nowait(ca)
        nursery.cancel_scope.cancel()
    assert not _takes_nowait(ca)  # the writer is gone
    await ca.send(Ping(payload=b"awaited"))  # the awaited path still works
    got = await cb.receive()
    assert isinstance(got, Ping) and got.payload == b"awaited", got
    await ca.aclose()
    await cb.aclose()


async def test_a_peer_with_another_name_is_refused_with_the_name_to_set() -> None:
    """A [[peers]] entry naming "gne" reaches the daemon called "gen": the error says which name
    to write (and the listening side learns why it was dropped)."""
    refused: list[KvdError] = []

    async def handler(stream: trio.SocketStream) -> None:
        try:
            conn = await accept_peer(stream, node="gen", secret=SECRET, welcome=welcome("gen", b"gen"))
            await conn.receive()
        except KvdError as exc:
            refused.append(exc)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, handler)
            with pytest.raises(PeerUnavailable) as info:
                await connect_peer("127.0.0.1", port, node="ctx", secret=SECRET,
                                   welcome=_unnamed(welcome("ctx", b"ctx")), expect_node="gne")
            while not refused:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert info.value.message == (f"expected peer 'gne' at 127.0.0.1:{port}, found 'gen': if that daemon is the one "
                                  "meant, set this [[peers]] name to 'gen'; otherwise fix its host/port")
    assert "set this [[peers]] name to 'gen'" in refused[0].message


def test_missing_secret_hint_creates_an_owner_only_file(tmp_path: Path) -> None:
    """The command the missing-secret error suggests makes a file load_secret accepts, owner-only
    from its creation (under a umask that would leave it world-readable otherwise)."""
    path = tmp_path / "peer.secret"
    with pytest.raises(BadRequest) as info:
        load_secret(path)
    found = re.search(r"`(\(umask 077 && [^`]*\))`", info.value.message)
    assert found, info.value.message
    if shutil.which("openssl") is None:
        pytest.skip("the suggested command uses openssl, not installed here")
    subprocess.run(["sh", "-c", f"umask 022; {found.group(1)}"], check=True)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(load_secret(path)) == 64


# --- corked writes ------------------------------------------------------------------------------


async def test_cork_writes_what_a_step_sends_in_one_go() -> None:
    """Between cork() and uncork() send_nowait only queues; uncork writes the lot in one
    write, in order (the peer finds every frame there at once). Corks nest; without a cork
    each message is written as it is sent."""
    import socket

    a, b = socket.socketpair()
    b.setblocking(False)  # the peer's end, read here: what has arrived, without waiting
    conn = PeerConnection(trio.SocketStream(trio.socket.from_stdlib_socket(a)), remote_addr="pair")
    frames = FrameBuffer(1 << 20)

    def arrived() -> list[object]:
        try:
            data = b.recv(1 << 16)
        except BlockingIOError:
            return []
        return [decode_peer(p) for p in frames.feed(data)]

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.run_writer)
            await trio.testing.wait_all_tasks_blocked()
            assert conn.takes_nowait
            conn.cork()
            conn.cork()
            assert conn.send_nowait(Ping(payload=b"path", id=1)) and conn.send_nowait(Ping(payload=b"done", id=2))
            conn.uncork()  # the outer cork still holds
            assert arrived() == []
            conn.uncork()
            assert arrived() == [Ping(payload=b"path", id=1), Ping(payload=b"done", id=2)]
            assert conn.send_nowait(Ping(payload=b"alone", id=3))  # no cork: at once
            assert arrived() == [Ping(payload=b"alone", id=3)]
            # an awaited send while corked takes the held messages first, in order
            conn.cork()
            assert conn.send_nowait(Ping(payload=b"held", id=4))
            await conn.send(Ping(payload=b"awaited", id=5))
            conn.uncork()
            assert arrived() == [Ping(payload=b"held", id=4), Ping(payload=b"awaited", id=5)]
            nursery.cancel_scope.cancel()
    b.close()
    await conn.aclose()


async def test_send_soon_leaves_its_frame_to_the_writer_and_keeps_call_order() -> None:
    """A frame queued with send_soon is not written by the call nor by an uncork (nothing is in
    the socket until the writer runs); a frame sent now after it takes it along, first; with
    no writer running nothing is queued."""
    ca, cb = await _socket_pair()
    assert not ca.send_soon(Ping(payload=b"no writer"))
    fd = cb.stream.socket.fileno()  # type: ignore[attr-defined]

    def readable() -> bool:
        return bool(select.select([fd], [], [], 0)[0])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ca.run_writer)
        await trio.testing.wait_all_tasks_blocked()
        ca.cork()
        assert ca.send_soon(Ping(payload=b"later"))
        ca.uncork()
        assert not readable()  # not written by the call, nor by the uncork
        got = [await cb.receive()]  # the writer wrote it once this task let it run
        await trio.testing.wait_all_tasks_blocked()  # (the writer is done with its write)
        assert ca.send_soon(Ping(payload=b"soon"))
        assert not readable()
        assert ca.send_nowait(Ping(payload=b"now"))  # written now, the queued one first
        assert readable()
        got += [(await cb.receive()) for _ in range(2)]
        nursery.cancel_scope.cancel()
    assert [m.payload for m in got] == [b"later", b"soon", b"now"]  # type: ignore[attr-defined]
    await ca.aclose()
    await cb.aclose()
