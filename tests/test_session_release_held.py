"""SessionConnection.release_held: a registration's reply held for its wait's (publish_and_wait)
leaves at once when released, the replies after it stay held until the one the cork waits
for, and the order of frames on the socket never changes."""

from __future__ import annotations

import socket

import trio

from kvd.config import Config
from kvd.daemon import Daemon
from kvd.executor.peercred import AccessPolicy
from kvd.executor.session import Session, SessionConnection
from kvd.ops.metrics import Metrics
from protocol import messages as m
from protocol.framing import FrameBuffer


def _conn(stream: trio.SocketStream) -> SessionConnection:
    daemon = Daemon(Config(), {}, AccessPolicy(), Metrics(process_metrics=False))
    return SessionConnection(daemon, stream, Session(id=1, pid=1, uid=0, gid=0))


def _pair() -> tuple[SessionConnection, socket.socket]:
    """A session connection on one end of a socket pair; the other end, as the executor's."""
    a, b = socket.socketpair()
    ours = trio.socket.fromfd(a.fileno(), a.family, a.type)  # (a dup: ``a`` closes here)
    a.close()
    return _conn(trio.SocketStream(ours)), b


async def _frames(sock: socket.socket, frames: FrameBuffer, want: int) -> list[m.Message]:
    """The next ``want`` replies from the other end (decoded); the daemon's writes are
    complete when they return (written without awaiting), so a blocking read finds them."""
    from protocol.codec import decode_reply

    out: list[m.Message] = []
    sock.settimeout(10)
    while len(out) < want:
        data = sock.recv(65536)
        assert data, "connection closed"
        out += [decode_reply(p) for p in frames.feed(data)]
    return out


def _pending(sock: socket.socket) -> bool:
    """Whether bytes are waiting to be read (without reading them)."""
    sock.setblocking(False)
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except BlockingIOError:
        return False
    finally:
        sock.settimeout(10)


async def test_released_registration_reply_goes_before_its_completion() -> None:
    conn, b = _pair()
    frames = FrameBuffer(1 << 20)
    ran: list[str] = []
    conn.cork(until=2)
    await conn.send(m.Registered(id=1, request_id="r", word=3, token=9), then=lambda: ran.append("data path"))
    assert not _pending(b) and ran == []  # held, and so is its data path
    conn.run_held()
    assert ran == ["data path"]
    conn.release_held()  # the data path is launched: the registration's reply may go
    (reg,) = await _frames(b, frames, 1)
    assert isinstance(reg, m.Registered) and reg.word == 3 and reg.token == 9
    assert conn.corked  # still holding for the wait's reply
    await conn.send(m.Pong(id=7, payload=b"x"))  # an unrelated reply meanwhile: held, in order
    assert not _pending(b)
    conn.release_held()
    conn.release_held()  # nothing held: nothing written twice
    await conn.send(m.Completion(id=2, request_id="r", ok=True, bytes=1))
    assert not conn.corked
    got = await _frames(b, frames, 2)
    assert [type(x).__name__ for x in got] == ["Pong", "Completion"]
    assert not _pending(b)
    conn.stream.socket.close()
    b.close()


async def test_release_without_cork_or_held_replies_writes_nothing() -> None:
    conn, b = _pair()
    conn.release_held()  # not corked
    conn.cork(until=5)
    conn.release_held()  # corked, nothing held
    assert not _pending(b) and conn.corked
    await conn.flush()
    assert not conn.corked and not _pending(b)
    conn.stream.socket.close()
    b.close()
