"""One executor connection = one session.

The session actor reads frames, decodes requests, dispatches them to the daemon's actors
and writes replies. Everything the session leases (blocks, registered requests) is tied to
it and returned when it ends, *however* it ends: clean close, protocol error, executor
crash (EOF/ECONNRESET), daemon shutdown. Slow requests (``Wait``) run as tasks of the
session's own nursery so they never hold up the rest of its traffic.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog
import trio

from kvd.executor.fdpass import send_with_fds
from protocol import messages as m
from protocol.codec import decode_request, encode, request_id_of
from protocol.errors import (
    FrameTooLarge,
    HandshakeRequired,
    InternalError,
    KvdError,
    LimitExceeded,
    PermissionDenied,
    ProtocolError,
    VersionMismatch,
)
from protocol.framing import FrameBuffer

if TYPE_CHECKING:
    from kvd.daemon import Daemon

log = structlog.get_logger("kvd.executor.session")

_session_ids = itertools.count(1)

#: Requests answered inline (fast, no awaiting on other actors beyond a lock).
RECEIVE_SIZE = 65536
#: After refusing a connection (access, limits, oversized frame, bad handshake): how long and
#: how much of what the client still sends we read and discard before closing.
REFUSE_LINGER_S = 1.0
REFUSE_LINGER_BYTES = 4 << 20


@dataclass(eq=False)
class Session:
    """State the daemon keeps per connected executor."""

    id: int
    pid: int
    uid: int
    gid: int
    client: str = ""
    connected_at: float = field(default_factory=time.monotonic)
    inflight: int = 0
    requests: set[str] = field(default_factory=set)

    def info(self, blocks_leased: int) -> m.SessionInfo:
        """Wire description for ``kvctl sessions``."""
        return m.SessionInfo(
            session_id=self.id,
            client=self.client,
            pid=self.pid,
            uid=self.uid,
            blocks_leased=blocks_leased,
            requests=len(self.requests),
            connected_s=time.monotonic() - self.connected_at,
        )


class SessionConnection:
    """Reads and writes one client socket; owns the send lock."""

    def __init__(self, daemon: Daemon, stream: trio.SocketStream, session: Session) -> None:
        self.daemon = daemon
        self.stream = stream
        self.session = session
        self._send_lock = trio.Lock()
        self._frames = FrameBuffer(daemon.config.limits.max_frame_size)

    async def send(self, msg: m.Message, fds: list[int] | None = None) -> None:
        """Write one reply (with optional fds) atomically with respect to other replies."""
        data = encode(msg, max(self.daemon.config.limits.max_frame_size, 1 << 20))
        async with self._send_lock:
            await send_with_fds(self.stream.socket, data, fds or [])

    async def send_error(self, request_id: int, exc: KvdError) -> None:
        """Reply with the wire form of ``exc``."""
        await self.send(m.Error(id=request_id, code=exc.code, message=exc.message))

    async def refuse(self, request_id: int, exc: KvdError) -> None:
        """Send ``exc``, then give the client a moment to read it before we hang up.

        Closing a Unix socket whose receive queue still holds the client's bytes (its Hello,
        the rest of an oversized frame) makes the client's next send fail (EPIPE/ECONNRESET)
        before it has read our error; so half-close (the client sees EOF right after the
        error) and drain what it still sends, bounded by ``REFUSE_LINGER_S`` and
        ``REFUSE_LINGER_BYTES``.
        """
        await self.send_error(request_id, exc)
        async with self._send_lock:
            await self.stream.send_eof()
        with trio.move_on_after(REFUSE_LINGER_S):
            drained = 0
            while drained < REFUSE_LINGER_BYTES:
                data = await self.stream.receive_some(RECEIVE_SIZE)
                if not data:
                    return
                drained += len(data)

    async def receive_frames(self) -> list[bytes] | None:
        """Next batch of whole frames; ``None`` at EOF. Raises FrameTooLarge."""
        while True:
            data = await self.stream.receive_some(RECEIVE_SIZE)
            if not data:
                return None
            frames = self._frames.feed(data)
            if frames:
                return frames


async def handle_connection(daemon: Daemon, stream: trio.SocketStream) -> None:
    """Serve one client connection until it closes; never raises for client faults."""
    from kvd.executor.peercred import peer_credentials

    try:
        creds = peer_credentials(stream.socket)
    except OSError as exc:  # pragma: no cover - SO_PEERCRED always works on AF_UNIX/Linux
        log.warning("session.no_credentials", error=str(exc))
        await stream.aclose()
        return
    session = Session(id=next(_session_ids), pid=creds.pid, uid=creds.uid, gid=creds.gid)
    conn = SessionConnection(daemon, stream, session)
    bound = structlog.contextvars.bound_contextvars(session=session.id, pid=creds.pid, uid=creds.uid)
    with bound:
        try:
            try:
                daemon.access.check(creds)
            except PermissionDenied as exc:
                log.warning("session.rejected", gid=creds.gid, reason=exc.message)
                daemon.counters.rejected_sessions += 1
                await conn.refuse(0, exc)
                return
            if len(daemon.sessions) >= daemon.config.limits.max_sessions:
                exc2 = LimitExceeded(
                    f"max_sessions={daemon.config.limits.max_sessions} reached; try again later"
                )
                log.warning("session.limit", reason=exc2.message)
                await conn.refuse(0, exc2)
                return
            daemon.add_session(session)
            try:
                await _serve_session(daemon, conn)
            finally:
                with trio.CancelScope(shield=True):
                    returned = await daemon.end_session(session)
                    log.info("session.closed", blocks_returned=returned, client=session.client)
        # except*: a reply to a client that is already gone fails inside the session's
        # nursery, which wraps it in an ExceptionGroup; nothing a client does may take the
        # daemon (the listener's nursery) down with it.
        except* (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
            pass  # broken by the client; its leases were returned above
        except* Exception:
            log.exception("session.crashed")  # a bug: this session ends, the daemon serves on
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()


async def _serve_session(daemon: Daemon, conn: SessionConnection) -> None:
    session = conn.session
    handshaken = False
    async with trio.open_nursery() as nursery:
        try:
            while True:
                try:
                    frames = await conn.receive_frames()
                except FrameTooLarge as exc:
                    log.warning("session.frame_too_large", reason=exc.message)
                    await conn.refuse(0, exc)
                    return  # the byte stream is no longer aligned: disconnect
                except (trio.BrokenResourceError, ConnectionError):
                    return
                if frames is None:
                    return
                for payload in frames:
                    try:
                        msg = decode_request(payload)
                    except KvdError as exc:
                        if not handshaken:
                            await conn.refuse(request_id_of(payload), exc)
                            return
                        await conn.send_error(request_id_of(payload), exc)
                        continue
                    if not handshaken:
                        if not isinstance(msg, m.Hello):
                            await conn.refuse(msg.id, HandshakeRequired("the first message must be Hello"))
                            return
                        if msg.version != m.PROTOCOL_VERSION:
                            await conn.refuse(
                                msg.id,
                                VersionMismatch(
                                    f"client speaks protocol version {msg.version}, "
                                    f"this daemon speaks {m.PROTOCOL_VERSION}"
                                ),
                            )
                            return
                        session.client = msg.client
                        handshaken = True
                        log.info("session.opened", client=msg.client, client_pid=msg.pid)
                        await conn.send(
                            m.Welcome(
                                id=msg.id,
                                version=m.PROTOCOL_VERSION,
                                server=f"kvd {daemon.version}",
                                node=daemon.config.node,
                                session_id=session.id,
                                max_frame_size=daemon.config.limits.max_frame_size,
                            )
                        )
                        continue
                    if isinstance(msg, m.Hello):
                        await conn.send_error(msg.id, ProtocolError("Hello sent twice"))
                        continue
                    await _dispatch(daemon, conn, nursery, msg)
        finally:
            nursery.cancel_scope.cancel()


async def _dispatch(
    daemon: Daemon, conn: SessionConnection, nursery: trio.Nursery, msg: m.Message
) -> None:
    """Run one request: inline when quick, as a session task when it may wait."""
    session = conn.session
    if isinstance(msg, m.Drain):
        # reply first: once the stop is requested the root nursery may cancel this session
        try:
            await conn.send(m.Ok(id=msg.id))
        finally:
            daemon.request_stop("drain requested by client", session)
        return
    if isinstance(msg, m.Wait):
        if session.inflight >= daemon.config.limits.max_inflight_per_session:
            await conn.send_error(
                msg.id,
                LimitExceeded(
                    f"max_inflight_per_session={daemon.config.limits.max_inflight_per_session} reached"
                ),
            )
            return
        session.inflight += 1
        nursery.start_soon(_run_slow, conn, msg.id, lambda: daemon.wait(session, msg))
        return
    try:
        reply, fds = await daemon.handle(session, msg)
    except KvdError as exc:
        await conn.send_error(msg.id, exc)
        return
    except Exception as exc:  # a bug: report it, keep serving
        log.exception("session.internal_error", request=type(msg).__name__)
        await conn.send_error(msg.id, InternalError(f"{type(exc).__name__}: {exc}"))
        return
    await conn.send(reply, fds)


async def _run_slow(
    conn: SessionConnection, request_id: int, fn: Callable[[], Awaitable[m.Message]]
) -> None:
    try:
        try:
            reply = await fn()
        except KvdError as exc:
            await conn.send_error(request_id, exc)
            return
        await conn.send(reply)
    except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
        pass
    finally:
        conn.session.inflight -= 1
