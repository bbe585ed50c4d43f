"""One executor connection = one session.

The session actor reads frames, decodes requests, dispatches them to the daemon's actors
and writes replies. Everything the session leases (blocks, registered requests) is tied to
it and returned when it ends, *however* it ends: clean close, protocol error, executor
crash (EOF/ECONNRESET), daemon shutdown. A ``Wait`` for a request still running never holds
up the rest of its traffic: it is answered in the step that reports the request
(:mod:`kvd.executor.waits`).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog
import trio

from kvd.executor.fdpass import send_rest, send_with_fds
from kvd.executor.waits import Waits
from kvd.ops.steptrace import mark
from kvd.ops.throttle import Throttle
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
    ReplyTooLarge,
    VersionMismatch,
)
from protocol.framing import DEFAULT_MAX_FRAME_SIZE, FrameBuffer
from protocol.limits import MAX_HELLO_FRAME, MAX_NAME_LEN, clip_text

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
#: Replies may always be this large, whatever ``max_frame_size`` (stats, pool lists).
REPLY_FLOOR = 1 << 20
#: An ``Allocated`` reply's frame besides its ids: header, tag, id, pool name (at most
#: ``MAX_NAME_LEN`` characters of up to 4 UTF-8 bytes each), array header; and the most bytes
#: one block id (at most ``MAX_BLOCK_ID``, below 2**32) takes in msgpack.
_ALLOCATED_OVERHEAD = 64 + 4 * MAX_NAME_LEN
_MAX_BLOCK_ID_BYTES = 5
#: Request ids a session's record of its latest registrations keeps (ok or refused): what a
#: wait on a request the engine does not hold for the session is told (see
#: :meth:`Session.note_registration`). As many as the engine keeps ended requests uncollected.
RECENT_REGISTRATIONS = 1024
#: How much of a refusal's message that record keeps.
REFUSAL_TEXT_LEN = 300
#: The registrations, which a wait may follow in the same read (a tuple: ``A | B`` in an
#: ``isinstance`` builds a union object on every call).
_REGISTRATIONS = (m.Publish, m.Expect)


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
    #: Root, the daemon's uid or a member of ``[access] operator_gids`` (see :func:`is_operator`).
    operator: bool = False
    #: The executor mapped the completion page (``AttachWords``): a registration's reply held
    #: back for its wait's may go as soon as the data path is launched (see
    #: :meth:`SessionConnection.release_held`), so it can watch its slot while the GPU works.
    reads_page: bool = False
    #: The request ids of this session's latest registrations, oldest first (at most
    #: RECENT_REGISTRATIONS): ``""`` registered, else why the registration was refused (it
    #: registered nothing). A wait on a request the engine does not hold for this session is
    #: told which: waited twice, refused, or never registered here.
    registrations: dict[str, str] = field(default_factory=dict)

    def note_registration(self, request_id: str, refused: KvdError | None = None) -> None:
        """Record that this session registered ``request_id`` (``refused``: tried, and was told
        that). A refusal after a registration that went through changes nothing: the request
        was this session's (a second registration of it, refused, does not undo that)."""
        seen = self.registrations
        if refused is None:
            seen.pop(request_id, None)  # moved to the end: the oldest go first
            seen[request_id] = ""
        elif seen.get(request_id) != "":
            seen.pop(request_id, None)
            seen[request_id] = clip_text(f"[{refused.code}] {refused.message}", REFUSAL_TEXT_LEN)
        else:
            return
        if len(seen) > RECENT_REGISTRATIONS:
            del seen[next(iter(seen))]

    def describe(self) -> str:
        """How messages name this session: ``session 14 ('gen-1', pid 4242)``, with its client
        name when it gave one (``kvctl sessions`` lists each session's id, client and pid)."""
        who = f"{self.client!r}, " if self.client else ""
        return f"session {self.id} ({who}pid {self.pid})"

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
        # a semaphore, not a trio.Lock: a wait's early reply (write_nowait) may take it in the
        # step of whoever reported the request and leave the rest to a task (kvd.executor.waits)
        self._send_lock = trio.Semaphore(1)
        # the first frame (the Hello) may be at most MAX_HELLO_FRAME: a connection not through
        # its handshake never makes the daemon buffer up to max_frame_size
        self._frames = FrameBuffer(daemon.config.limits.max_frame_size, first_frame_size=MAX_HELLO_FRAME)
        self._reply_limit = min(max(daemon.config.limits.max_frame_size, REPLY_FLOOR), DEFAULT_MAX_FRAME_SIZE)
        # replies held by cork() until the reply it waits for (or flush()): a registration
        # sent with its wait gets both replies in one write (one syscall here, one wake-up of
        # the executor); what their sends would have run after the registration's reply waits
        # for run_held() (the data path starts once the wait is registered)
        self._cork: list[bytes] | None = None
        self._cork_until = 0
        self._held_then: list[Callable[[], None]] = []

    @property
    def reply_limit(self) -> int:
        """Largest reply frame: ``max_frame_size`` (at least 1 MiB), at most what clients read
        (the daemon's configuration does not change while it runs: worked out once)."""
        return self._reply_limit

    @property
    def alloc_fits(self) -> int:
        """Block ids an ``Allocated`` reply holds for sure (each at most 5 bytes of msgpack)."""
        return (self._reply_limit - _ALLOCATED_OVERHEAD) // _MAX_BLOCK_ID_BYTES

    def fits(self, reply: m.Allocated) -> bool:
        """Whether ``reply`` fits one reply frame (encoded only when the count leaves a doubt)."""
        n = len(reply.block_ids)
        if n <= self.alloc_fits:
            return True
        if n > self._reply_limit:  # every id takes a byte at least: no need to encode them
            return False
        try:
            encode(reply, self._reply_limit)
        except FrameTooLarge:
            return False
        return True

    def _encode(self, msg: m.Message) -> tuple[bytes, bool]:
        """The reply's frame, and whether it is the frame of ``msg`` itself: a reply too large
        for one frame becomes a ``reply_too_large`` error (the session goes on)."""
        try:
            return encode(msg, self._reply_limit), True
        except FrameTooLarge as exc:
            err = ReplyTooLarge(
                f"the {type(msg).__name__} reply does not fit in one frame ({exc.message}); "
                "ask for less (offset/limit)"
            )
            _throttle.warning("session.reply_too_large", reply=type(msg).__name__, reason=err.message)
            return encode(m.Error(id=msg.id, code=err.code, message=err.message)), False

    def write_nowait(self, msg: m.Message) -> bytes | None:
        """Start writing one reply without awaiting, if no other reply is under way: returns
        what the socket did not take (``b""``: all of it went), to be passed to
        :meth:`finish_write`, which must follow (the send lock is held until then when some
        is left); None when another reply is being written (nothing done: use :meth:`send`)."""
        if self._send_lock.value == 0:
            return None
        data, _ = self._encode(msg)
        if self._cork is not None:  # goes out with the replies before it
            self._cork.append(data)
            if msg.id != self._cork_until:
                return b""
            data, self._cork = b"".join(self._cork), None  # the last one held for: all go now
        sent = self._write_now(data)
        if sent == len(data):
            return b""
        self._send_lock.acquire_nowait()  # no checkpoint since the check: no reply came between
        return data[sent:]

    async def finish_write(self, rest: bytes) -> None:
        """Write what :meth:`write_nowait` left, then let other replies go."""
        if not rest:
            return
        try:
            await send_rest(self.stream.socket, rest)
        finally:
            self._send_lock.release()

    async def send(self, msg: m.Message, fds: list[int] | None = None,
                   then: Callable[[], None] | None = None) -> None:
        """Write one reply (with optional fds) atomically with respect to other replies.

        ``then`` runs once the reply is written, or before awaiting the socket when it cannot
        be written at once (never after a checkpoint); while replies are held (:meth:`cork`),
        :meth:`run_held` runs it. A reply too large for one frame fails
        its request with ``reply_too_large`` (the session goes on) instead of breaking the
        connection.
        """
        try:
            data, whole = self._encode(msg)
        except BaseException:
            if then is not None:
                then()
            raise
        if not whole:
            fds = None
        if self._cork is not None:
            if then is not None:
                self._held_then.append(then)  # run_held() runs it
                then = None
            if not fds and self._send_lock.value:
                self._cork.append(data)  # written in order with the held ones
                if msg.id != self._cork_until:
                    return
                data, self._cork = b"".join(self._cork), None  # the last one held for: all go now
            else:
                await self.flush()  # fds ride on their own frame's first byte: the held ones go first
        if not fds and self._send_lock.value:
            # no other reply under way: straight into the socket, without the two scheduler
            # passes (lock, send) an awaited write costs (~30-100 us each on a busy host); what
            # the socket does not take now is written under the lock, taken at once (no
            # checkpoint in between, so no other reply can start between the two parts)
            sent = self._write_now(data)
            if then is not None:
                then()
            if sent == len(data):
                return
            self._send_lock.acquire_nowait()
            try:
                await send_rest(self.stream.socket, data[sent:])
            finally:
                self._send_lock.release()
            return
        if then is not None:
            then()
        async with self._send_lock:
            await send_with_fds(self.stream.socket, data, fds or [])

    @property
    def corked(self) -> bool:
        """Replies are being held (:meth:`cork`)."""
        return self._cork is not None

    def cork(self, until: int) -> None:
        """Hold the replies from now on until the reply to request ``until`` comes (then all of
        them are written in one go, in the step that answers it) or :meth:`flush`. The ``then``
        of a reply sent meanwhile waits for :meth:`run_held`."""
        if self._cork is None:
            self._cork = []
        self._cork_until = until

    def release_held(self) -> None:
        """Write the replies held so far now, without awaiting, and go on holding the ones
        that follow until the reply :meth:`cork` waits for: a registration's ``Registered``
        leaves while its data path runs, not with the completion. What the socket does not
        take now stays held, first in line. Nothing happens while another reply is being
        written (it then goes with the rest, as before)."""
        held = self._cork
        if not held or not self._send_lock.value:
            return
        data = b"".join(held)
        sent = self._write_now(data)
        self._cork = [data[sent:]] if sent < len(data) else []
        mark("session.released", sent)

    def run_held(self) -> None:
        """Run what the replies sent while corked would have run once written (see
        :meth:`send`'s ``then``), in order; call it before :meth:`flush`, and when the session
        ends (a registration's data path must not be left behind)."""
        while self._held_then:
            self._held_then.pop(0)()

    async def flush(self) -> None:
        """Write the replies :meth:`cork` held, in order (straight into the socket when no
        other reply is under way, else after it, under the send lock), and stop holding."""
        held, self._cork = self._cork, None
        if not held:
            return
        data = b"".join(held)
        if self._send_lock.value:
            sent = self._write_now(data)
            if sent == len(data):
                return
            data = data[sent:]
            self._send_lock.acquire_nowait()  # no checkpoint since the check
            try:
                await send_rest(self.stream.socket, data)
            finally:
                self._send_lock.release()
            return
        async with self._send_lock:
            await send_rest(self.stream.socket, data)

    def _write_now(self, data: bytes) -> int:
        """Bytes of ``data`` the socket took without blocking (0 when it would block; an error
        is left to the awaited write, which raises it)."""
        try:
            return os.write(self.stream.socket.fileno(), data)
        except OSError:
            return 0

    async def send_error(self, request_id: int, exc: KvdError) -> None:
        """Reply with the wire form of ``exc`` (its message clipped to ``MAX_TEXT_LEN``)."""
        await self.send(m.Error(id=request_id, code=exc.code, message=clip_text(exc.message)))

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


def is_operator(session: Session) -> bool:
    """True when the session's peer is an operator (root, the daemon's uid, ``operator_gids``).

    Decided once from SO_PEERCRED when the connection is accepted; use it to guard every verb
    that changes the daemon rather than the caller's own requests.
    """
    return session.operator


#: Warnings a client can trigger at will are rate-limited (one line, then a count).
_throttle = Throttle(log)
#: Access refusals are each worth a line (who was refused), up to a burst.
_rejections = Throttle(log, burst=20)


async def handle_connection(daemon: Daemon, stream: trio.SocketStream) -> None:
    """Serve one client connection until it closes; never raises for client faults.

    A connection is *pending* (counted against ``max_pending_connections``) until its Hello
    arrives, which must happen within ``handshake_timeout_s``; only then does it become a
    session (counted against ``max_sessions``). Operators may use ``operator_reserve`` more
    of each, so a flood of other clients cannot lock them out.
    """
    from kvd.executor.peercred import peer_credentials

    try:
        creds = peer_credentials(stream.socket)
    except OSError as exc:  # pragma: no cover - SO_PEERCRED always works on AF_UNIX/Linux
        log.warning("session.no_credentials", error=str(exc))
        await stream.aclose()
        return
    session = Session(id=next(_session_ids), pid=creds.pid, uid=creds.uid, gid=creds.gid)
    conn = SessionConnection(daemon, stream, session)
    limits = daemon.config.limits
    bound = structlog.contextvars.bound_contextvars(session=session.id, pid=creds.pid, uid=creds.uid)
    with bound:
        try:
            try:
                daemon.access.check(creds)
            except PermissionDenied as exc:
                _rejections.warning("session.rejected", gid=creds.gid, reason=exc.message)
                daemon.counters.rejected_sessions += 1
                await conn.refuse(0, exc)
                return
            session.operator = daemon.access.operator_reason(creds) is not None
            reserve = limits.operator_reserve if session.operator else 0
            if daemon.pending_connections >= limits.max_pending_connections + reserve:
                exc_p = LimitExceeded(
                    f"max_pending_connections={limits.max_pending_connections} connections are waiting "
                    "for their handshake; try again later"
                )
                _throttle.warning("session.pending_limit", reason=exc_p.message)
                await conn.refuse(0, exc_p)
                return
            daemon.pending_connections += 1
            try:
                first = await _handshake(daemon, conn)
            finally:
                daemon.pending_connections -= 1
            if first is None:
                return
            hello, rest = first
            if len(daemon.sessions) >= limits.max_sessions + reserve:
                exc2 = LimitExceeded(f"max_sessions={limits.max_sessions} reached; try again later")
                _throttle.warning("session.limit", reason=exc2.message)
                await conn.refuse(hello.id, exc2)
                return
            daemon.add_session(session)
            try:
                log.info("session.opened", client=hello.client, client_pid=hello.pid, operator=session.operator)
                await conn.send(
                    m.Welcome(
                        id=hello.id,
                        version=m.PROTOCOL_VERSION,
                        server=f"kvd {daemon.version}",
                        node=daemon.config.node,
                        session_id=session.id,
                        max_frame_size=limits.max_frame_size,
                    )
                )
                await _serve_session(daemon, conn, rest)
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


async def _handshake(daemon: Daemon, conn: SessionConnection) -> tuple[m.Hello, list[bytes]] | None:
    """Read the Hello (within ``handshake_timeout_s``); returns it and the frames after it.

    ``None``: the connection was refused (and told why) or closed before a valid Hello.
    """
    timeout = daemon.config.limits.handshake_timeout_s
    frames: list[bytes] | None = None
    with trio.move_on_after(timeout):
        try:
            frames = await conn.receive_frames()
        except FrameTooLarge as exc:
            _throttle.warning("session.frame_too_large", reason=exc.message)
            await conn.refuse(0, exc)
            return None
        except (trio.BrokenResourceError, ConnectionError):
            return None
        if frames is None:
            return None
    if frames is None:
        exc_t = HandshakeRequired(f"no Hello within handshake_timeout_s={timeout:g} s")
        _throttle.warning("session.handshake_timeout", reason=exc_t.message)
        await conn.refuse(0, exc_t)
        return None
    payload, rest = frames[0], frames[1:]
    try:
        msg = decode_request(payload)
    except KvdError as exc:
        _throttle.warning("session.bad_frame", reason=clip_text(exc.message), handshaken=False)
        await conn.refuse(request_id_of(payload), exc)
        return None
    if not isinstance(msg, m.Hello):
        exc_h = HandshakeRequired("the first message must be Hello")
        _throttle.warning("session.bad_frame", reason=exc_h.message, handshaken=False)
        await conn.refuse(msg.id, exc_h)
        return None
    if msg.version != m.PROTOCOL_VERSION:
        exc_v = VersionMismatch(
            f"client speaks protocol version {msg.version}, this daemon speaks {m.PROTOCOL_VERSION}"
        )
        _throttle.warning("session.version_mismatch", reason=exc_v.message)
        await conn.refuse(msg.id, exc_v)
        return None
    conn.session.client = msg.client
    return msg, rest


async def _serve_session(daemon: Daemon, conn: SessionConnection, first: list[bytes]) -> None:
    pending: list[bytes] | None = first
    async with trio.open_nursery() as nursery:
        waits = Waits(daemon, conn, nursery)
        try:
            while True:
                if pending is None:
                    try:
                        pending = await conn.receive_frames()
                    except FrameTooLarge as exc:
                        _throttle.warning("session.frame_too_large", reason=exc.message)
                        await conn.refuse(0, exc)
                        return  # the byte stream is no longer aligned: disconnect
                    except (trio.BrokenResourceError, ConnectionError):
                        return
                    if pending is None:
                        return
                frames, pending = pending, None
                ahead: m.Message | None = None  # the next frame, decoded already
                for i, payload in enumerate(frames):
                    msg, ahead = ahead, None
                    if msg is None:
                        try:
                            msg = decode_request(payload)
                        except KvdError as exc:
                            # one rate-limited line: a client can send malformed frames at will
                            _throttle.warning("session.bad_frame", reason=clip_text(exc.message), handshaken=True)
                            await conn.send_error(request_id_of(payload), exc)
                            continue
                    if isinstance(msg, m.Hello):
                        await conn.send_error(msg.id, ProtocolError("Hello sent twice"))
                        continue
                    mark("session.request", type(msg).__name__)
                    if isinstance(msg, _REGISTRATIONS) and i + 1 < len(frames):
                        ahead = _wait_for(msg.request_id, frames[i + 1])
                        if ahead is not None:
                            # registration and wait sent together (publish_and_wait): the wait
                            # is registered before the registration's data path starts, and
                            # both replies go out together when it is answered, in the step
                            # that reports the request (or when the wait is left pending)
                            conn.cork(until=ahead.id)
                    await _dispatch(daemon, conn, waits, msg)
                    if ahead is None:
                        # the registration's data path, once its wait is registered; an
                        # executor that reads the completion page gets its Registered reply
                        # (its slot) as soon as the GPU has the work (Daemon.release_replies)
                        daemon.release_replies = conn.release_held if conn.session.reads_page else None
                        try:
                            conn.run_held()
                        finally:
                            daemon.release_replies = None
                        if conn.corked:
                            await conn.flush()
        finally:
            conn.run_held()  # a registration's data path runs even if its session ends now
            waits.close()
            nursery.cancel_scope.cancel()


def _wait_for(request_id: str, payload: bytes) -> m.Wait | None:
    """``payload`` decoded when it is a wait for ``request_id`` (else None: it is decoded, and
    a bad frame answered, in its turn)."""
    try:
        msg = decode_request(payload)
    except KvdError:
        return None
    return msg if isinstance(msg, m.Wait) and msg.request_id == request_id else None


async def _dispatch(daemon: Daemon, conn: SessionConnection, waits: Waits, msg: m.Message) -> None:
    """Run one request: answered here, or (a wait for a request still running) when it ends."""
    session = conn.session
    if isinstance(msg, m.Drain):
        if not is_operator(session):
            refused = PermissionDenied(
                f"drain changes the daemon and needs an operator: {daemon.access.operator_rule()}; "
                f"this session (uid {session.uid}, gid {session.gid}) is not one"
            )
            _rejections.warning("session.operator_refused", verb="drain", gid=session.gid, reason=refused.message)
            await conn.send_error(msg.id, refused)
            return
        # reply first: the stop that follows must not race the Ok
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
        try:
            ready = daemon.completion_now(session, msg)
            if ready is None:
                waits.add(msg)  # answered in the step that reports the request
                return
        except KvdError as exc:
            await conn.send_error(msg.id, exc)
            return
        await conn.send(ready)  # ended already: reply now
        mark("session.replied", "Completion")
        return
    try:
        reply, fds = await daemon.handle(session, msg)
    except KvdError as exc:
        daemon.after_reply()
        await conn.send_error(msg.id, exc)
        return
    except Exception as exc:  # a bug: report it, keep serving
        daemon.after_reply()
        log.exception("session.internal_error", request=type(msg).__name__)
        await conn.send_error(msg.id, InternalError(f"{type(exc).__name__}: {exc}"))
        return
    if isinstance(reply, m.Allocated) and not conn.fits(reply):
        # all or nothing: blocks whose ids the executor cannot be told go back at once (no
        # checkpoint since the alloc: nobody saw them), else they stay leased, unusable and
        # unfreeable, until the session ends
        daemon.pool(reply.pool).blocks.free(session.id, reply.block_ids)
        daemon.update_pool_metrics([reply.pool])
        daemon.after_reply()
        n = len(reply.block_ids)
        err = ReplyTooLarge(f"alloc of {n} blocks: their ids do not fit in one reply frame of at most "
                            f"{conn.reply_limit} bytes; nothing was allocated: ask for fewer blocks "
                            f"(at most {conn.alloc_fits} per alloc), in several allocs")
        _throttle.warning("session.reply_too_large", reply="Allocated", reason=err.message)
        await conn.send_error(msg.id, err)
        return
    # a registration's data path, when it runs in this step, starts once the reply is out
    await conn.send(reply, fds, then=daemon.after_reply)
    mark("session.replied", type(reply).__name__)
