"""The daemon ↔ daemon link over TCP: framing, authenticated handshake, heartbeats, reconnect.

- :class:`PeerConnection` wraps a ``trio.abc.Stream`` with length-prefixed msgpack frames of
  :mod:`protocol.peer` messages. Its :meth:`~PeerConnection.receive` answers the peer's
  heartbeats and records acks itself, so a link needs one task that keeps receiving.
- :func:`handshake_client` / :func:`handshake_server`: version check, mutual HMAC
  challenge-response on the shared secret (:mod:`kvd.peer.auth`), then both sides exchange
  :class:`~protocol.peer.PeerWelcome` (NIXL metadata, bounce regions, pools). Pass a
  :class:`PeerConnection` (not a bare stream) when the link is used afterwards: frames the
  peer sends right after the handshake may already sit in its buffer.
- :func:`run_heartbeats`: sends ``Heartbeat`` every ``interval``; raises
  :class:`~protocol.errors.PeerUnavailable` when nothing arrived for ``timeout``.
- :func:`connect_with_backoff`: TCP connect, retried with capped exponential backoff + jitter.

Failures are the :mod:`protocol.errors` classes: ``AuthFailed`` (both sides, logged as the
``peer.auth_failed`` warning with the remote address), ``VersionMismatch`` (both sides),
``PeerUnavailable`` (handshake timeout, heartbeat loss, connect gave up), ``ConnectionClosed``
(``by_peer`` tells "the peer closed or broke it" from "we closed it"), ``ProtocolError``.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import structlog
import trio

from kvd.peer.auth import check_nonce, handshake_mac, new_nonce, verify_mac
from protocol.errors import (
    AuthFailed,
    BadRequest,
    ConnectionClosed,
    KvdError,
    PeerUnavailable,
    ProtocolError,
    VersionMismatch,
    error_from_code,
)
from protocol.framing import DEFAULT_MAX_FRAME_SIZE, FrameBuffer
from protocol.peer import (
    PEER_PROTOCOL_VERSION,
    PRE_AUTH_MAX_FRAME_SIZE,
    Heartbeat,
    HeartbeatAck,
    PeerAuth,
    PeerBye,
    PeerChallenge,
    PeerError,
    PeerHello,
    PeerWelcome,
    decode_peer,
    encode_peer,
)

__all__ = [
    "DEFAULT_HANDSHAKE_TIMEOUT",
    "NodeNameMismatch",
    "PeerConnection",
    "PeerVersionMismatch",
    "accept_peer",
    "connect_peer",
    "connect_with_backoff",
    "handshake_client",
    "handshake_server",
    "open_peer",
    "run_heartbeats",
]

log = structlog.get_logger("kvd.peer")

DEFAULT_HANDSHAKE_TIMEOUT = 10.0
_M = TypeVar("_M", bound=msgspec.Struct)


class PeerVersionMismatch(VersionMismatch):
    """A ``VersionMismatch`` met while dialling a peer, with the versions for the operator's
    advice: ``ours`` (this daemon's peer protocol), ``theirs`` (the peer's: None when the peer
    refused ours without us learning its own; its refusal's text may say). Same wire code."""

    def __init__(self, message: str, *, ours: int, theirs: int | None) -> None:
        super().__init__(message)
        self.ours = ours
        self.theirs = theirs


class NodeNameMismatch(PeerUnavailable):
    """The daemon at a ``[[peers]]`` entry's address announced another node name (``found``)
    than the entry's (``expected``). Same wire code as ``PeerUnavailable``."""

    def __init__(self, message: str, *, expected: str, found: str) -> None:
        super().__init__(message)
        self.expected = expected
        self.found = found


class OwnNodeName(BadRequest):
    """The daemon at the other end announced this daemon's own node name (``node``): two
    daemons configured alike. Same wire code as ``BadRequest``."""

    def __init__(self, message: str, *, node: str) -> None:
        super().__init__(message)
        self.node = node


class HandshakeTimeout(PeerUnavailable):
    """The other end accepted the connection but did not complete the peer handshake within
    ``timeout_s``: not a kvd peer port, or a daemon that is stalled. Same wire code as
    ``PeerUnavailable``."""

    def __init__(self, message: str, *, timeout_s: float) -> None:
        super().__init__(message)
        self.timeout_s = timeout_s


def _peer_address(stream: trio.abc.Stream) -> str:
    sock = getattr(stream, "socket", None)
    if sock is None:
        return ""
    try:
        addr = sock.getpeername()
    except OSError:
        return ""
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = addr[0]
        return f"[{host}]:{addr[1]}" if ":" in str(host) else f"{host}:{addr[1]}"
    return str(addr)


def _now() -> float:
    try:
        return trio.current_time()
    except RuntimeError:  # outside trio.run
        return 0.0


class PeerConnection:
    """A framed peer-link connection over any ``trio.abc.Stream``.

    ``send`` may be called from several tasks (a lock keeps frames whole); ``receive`` from
    one task at a time. A send cancelled halfway leaves a partial frame on the wire: treat
    the link as broken after that.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        remote_addr: str | None = None,
        receive_size: int = 64 * 1024,
    ) -> None:
        self.stream = stream
        self._buf = FrameBuffer(max_frame_size)
        self._max_frame_size = max_frame_size
        self._frames: deque[bytes] = deque()
        self._send_lock = trio.Lock()
        # frames queued by send_nowait, written by run_writer (and first by any send)
        self._outbox: list[bytes] = []
        self._outbox_ready = trio.Event()
        self._writer_running = False
        self._corked = 0  # cork() depth: send_nowait only queues, uncork() writes the lot
        self._soon_only = False  # every queued frame came from send_soon: left to the writer
        #: Why the writer stopped, if a write failed (the link is closed then).
        self.write_error = ""
        self._receiving = False
        self._receive_size = receive_size
        self._closed_by_us = False
        self.remote_addr = _peer_address(stream) if remote_addr is None else remote_addr
        #: Set by the handshake.
        self.remote_node = ""
        self.welcome: PeerWelcome | None = None
        #: trio time of the last frame received (any message proves the peer alive).
        self.last_received = _now()
        self.last_ack_seq = 0

    @property
    def max_frame_size(self) -> int:
        return self._max_frame_size

    @max_frame_size.setter
    def max_frame_size(self, value: int) -> None:
        if value < 1:
            raise ValueError("max_frame_size must be positive")
        self._max_frame_size = value
        self._buf.max_frame_size = value

    @property
    def closed(self) -> bool:
        """True once we closed the link (``aclose``)."""
        return self._closed_by_us

    def describe(self) -> str:
        who = f"peer {self.remote_node!r}" if self.remote_node else "peer"
        return f"{who} at {self.remote_addr}" if self.remote_addr else who

    async def send(self, msg: msgspec.Struct) -> None:
        """Frame and send one message, in call order with :meth:`send_nowait` and other sends;
        returns once it is written (by this call or by the writer).

        The frame joins the queue at once and the queue is written under the lock by
        whichever task holds it next. (Taking the queue along before waiting for the lock
        broke the order: the writer, ahead in the lock's line, wrote frames queued later
        first; a transfer's data-done overtook its path message.)"""
        data = encode_peer(msg, self._max_frame_size)
        if self._closed_by_us:
            raise ConnectionClosed(f"link to {self.describe()} was closed by us", by_peer=False)
        self._outbox.append(data)
        self._outbox_ready.set()  # cancelled while waiting, the writer still sends it, in order
        await self.flush()

    async def flush(self) -> None:
        """Return once every frame queued before the call (by :meth:`send_nowait` or a
        :meth:`send`) is written to the stream, by this call or by the writer (a write under way
        included). A daemon that stops next, cancelling the writer, loses none of them: a writer
        cancelled between taking the queued frames and writing them would drop them. Raises
        ``ConnectionClosed`` when the link is gone."""
        async with self._send_lock:
            if self.write_error:  # the writer took our frames (or ones before them) and failed
                raise ConnectionClosed(f"link to {self.describe()} broke: {self.write_error}", by_peer=True)
            if not self._outbox:
                return  # the writer wrote them, in order, before we got the lock
            # cancelled now (a stopping daemon): the frames stay queued for the goodbye, in order
            await trio.lowlevel.checkpoint_if_cancelled()
            data = b"".join(self._outbox)
            self._outbox.clear()
            self._soon_only = False
            await self._write(data)

    async def _write(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except trio.BrokenResourceError as exc:
            raise ConnectionClosed(f"link to {self.describe()} broke: {exc}", by_peer=True) from None
        except trio.ClosedResourceError:
            raise ConnectionClosed(f"link to {self.describe()} was closed by us", by_peer=False) from None

    @property
    def takes_nowait(self) -> bool:
        """Whether :meth:`send_nowait` would take a message now (its writer runs; the link is
        neither closed nor broken): until the writer task started, and once the link ends, not."""
        return self._writer_running and not self._closed_by_us and not self.write_error

    def send_nowait(self, msg: msgspec.Struct) -> bool:
        """Queue one message for :meth:`run_writer`, without waiting; False (nothing queued)
        when no writer runs or the link is closed. Frames keep their order with :meth:`send`.
        A write that fails later closes the link (:attr:`write_error` says why): callers learn
        of it as of any broken link."""
        if not self.takes_nowait:
            return False
        data = encode_peer(msg, self._max_frame_size)
        if self._corked:  # written with what follows it in this step (uncork)
            self._outbox.append(data)
            self._soon_only = False
            return True
        if (not self._outbox or self._soon_only) and not self._send_lock.locked():
            # nothing queued (or only what send_soon left for later: it goes first, in order)
            # and no write under way: straight into the socket (what it does not take now is
            # queued, first in line, for the writer)
            if self._outbox:
                data = b"".join([*self._outbox, data])
                self._outbox.clear()
                self._soon_only = False
            data = data[self._write_now(data):]
            if not data:
                return True
        self._outbox.append(data)
        self._outbox_ready.set()
        return True

    def send_soon(self, msg: msgspec.Struct) -> bool:
        """Queue one message behind what is queued, for the writer task: written once this step
        yields (or with the next message sent now), never by this call nor by :meth:`uncork`.
        For a message nobody waits for at once (the data-done confirmation that follows a
        landed event), so that its write, tens of microseconds on some hosts, stays off the
        step's critical path. False as :meth:`send_nowait`."""
        if not self.takes_nowait:
            return False
        data = encode_peer(msg, self._max_frame_size)
        if not self._outbox:
            self._soon_only = True
        self._outbox.append(data)
        self._outbox_ready.set()
        return True

    def cork(self) -> None:
        """Hold what :meth:`send_nowait` takes until the matching :meth:`uncork`, which writes
        it in one go: messages a step sends one after the other (a transfer's path message and
        its data-done) cost one write and one wake-up of the peer instead of one each. Call
        both in one step (no checkpoint between them)."""
        self._corked += 1

    def uncork(self) -> None:
        """End a :meth:`cork`: what it held goes into the socket now (what the socket does not
        take, and everything while another write is under way, is left to the writer)."""
        self._corked -= 1
        if self._corked or not self._outbox:
            return
        if self._soon_only:  # (send_soon's: the writer's, after this step)
            self._outbox_ready.set()
            return
        if not self._send_lock.locked():
            data = b"".join(self._outbox)
            self._outbox.clear()
            data = data[self._write_now(data):]
            if not data:
                return
            self._outbox.append(data)
        self._outbox_ready.set()

    def _write_now(self, data: bytes) -> int:
        """Bytes of ``data`` the stream's socket took without blocking (0 when it has none,
        or would block; an error is left to the writer, which then sees it)."""
        sock = getattr(self.stream, "socket", None)
        if sock is None:
            return 0
        try:
            return os.write(sock.fileno(), data)
        except OSError:
            return 0

    async def run_writer(self) -> None:
        """Write what :meth:`send_nowait` queues, in order, batching what piled up into one
        write, until cancelled or a write fails (then the stream is closed, so the receiving
        side of the link ends too). Run one per connection, beside its receive loop."""
        self._writer_running = True
        try:
            while True:
                await self._outbox_ready.wait()
                self._outbox_ready = trio.Event()
                async with self._send_lock:
                    if not self._outbox:
                        continue  # a send() took them along
                    # cancelled (the daemon stopping) before the write: leave the frames queued
                    # for the goodbye (aclose) rather than take them and drop them in send_all
                    await trio.lowlevel.checkpoint_if_cancelled()
                    data = b"".join(self._outbox)
                    self._outbox.clear()
                    self._soon_only = False
                    await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.write_error = str(exc) or type(exc).__name__
            await trio.aclose_forcefully(self.stream)
        finally:
            self._writer_running = False

    async def _next_payload(self) -> bytes:
        while not self._frames:
            try:
                data = await self.stream.receive_some(self._receive_size)
            except trio.BrokenResourceError as exc:
                raise ConnectionClosed(f"link to {self.describe()} broke: {exc}", by_peer=True) from None
            except trio.ClosedResourceError:
                raise ConnectionClosed(f"link to {self.describe()} was closed by us", by_peer=False) from None
            if not data:
                if self._buf.pending:
                    raise ConnectionClosed(
                        f"{self.describe()} closed the connection in the middle of a frame", by_peer=True
                    )
                raise ConnectionClosed(f"{self.describe()} closed the connection", by_peer=True)
            self._frames.extend(self._buf.feed(bytes(data)))
        return self._frames.popleft()

    async def receive_any(self) -> msgspec.Struct:
        """The next message, whatever it is (the handshake uses this)."""
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this peer link")
        self._receiving = True
        try:
            payload = await self._next_payload()
        finally:
            self._receiving = False
        msg = decode_peer(payload)
        self.last_received = _now()
        return msg

    async def receive(self) -> msgspec.Struct:
        """The next application message.

        Heartbeats are answered and acks recorded here (never returned); ``PeerBye`` raises
        ``ConnectionClosed(by_peer=True)`` with the peer's reason.
        """
        while True:
            msg = await self.receive_any()
            if isinstance(msg, Heartbeat):
                await self.send(HeartbeatAck(seq=msg.seq))
                continue
            if isinstance(msg, HeartbeatAck):
                self.last_ack_seq = max(self.last_ack_seq, msg.seq)
                continue
            if isinstance(msg, PeerBye):
                reason = f": {msg.reason}" if msg.reason else ""
                raise ConnectionClosed(f"{self.describe()} closed the link{reason}", by_peer=True)
            return msg

    async def aclose(self, reason: str = "") -> None:
        """Say goodbye (best effort, bounded) and close the stream. Idempotent."""
        if self._closed_by_us:
            return
        with trio.CancelScope(shield=True):
            with trio.move_on_after(1.0):
                with contextlib.suppress(ConnectionClosed, trio.BusyResourceError):
                    await self.send(PeerBye(reason=reason))
            self._closed_by_us = True
            await trio.aclose_forcefully(self.stream)

    async def __aenter__(self) -> PeerConnection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


# --- handshake ---------------------------------------------------------------------------


async def _expect(conn: PeerConnection, cls: type[_M]) -> _M:
    msg = await conn.receive_any()
    if isinstance(msg, cls):
        return msg
    if isinstance(msg, PeerError):
        raise error_from_code(msg.code, f"{conn.describe()}: {msg.message}")
    raise ProtocolError(
        f"{conn.describe()} sent {type(msg).__name__} during the handshake where {cls.__name__} was expected"
    )


async def _refuse(conn: PeerConnection, err: KvdError) -> None:
    """Tell the peer why (best effort, bounded), then the caller raises ``err``."""
    with trio.move_on_after(1.0):
        with contextlib.suppress(ConnectionClosed, trio.BusyResourceError):
            await conn.send(PeerError(code=err.code, message=err.message))


#: Why a handshake MAC failed, and what to do: the operator reading ``kvctl peers`` or the log on
#: either side cannot tell which daemon has the "wrong" secret, only that the two differ.
_MAC_MISMATCH = (
    "its MAC does not match our secret (the two daemons read different secrets: give every daemon "
    "of the deployment the same peer_secret_file content)"
)


#: Where a warning goes: ``log.warning`` or a rate limiter's ``warning`` (same signature).
Warn = Callable[..., object]


def _auth_failed(
    conn: PeerConnection, side: str, reason: str, node: str = "", warn: Warn | None = None
) -> AuthFailed:
    fields = dict(remote=conn.remote_addr, node=node or conn.remote_node, side=side, reason=reason)
    if warn is None:
        log.warning("peer.auth_failed", **fields)
    else:
        warn("peer.auth_failed", **fields)
    who = f"peer {node!r}" if node else "peer"
    where = f" at {conn.remote_addr}" if conn.remote_addr else ""
    return AuthFailed(f"{who}{where} failed the shared-secret handshake: {reason}")


async def _expect_logged(conn: PeerConnection, cls: type[_M], side: str, node: str, warn: Warn) -> _M:
    """:func:`_expect`, where the peer's own refusal (a ``PeerError`` naming ``auth_failed`` or
    ``version_mismatch``) is logged as ours are: the listener takes those two errors for ones
    the handshake logged, and anyone who reaches the port can send them."""
    try:
        return await _expect(conn, cls)
    except AuthFailed as exc:
        raise _auth_failed(conn, side, f"the peer refused us: {exc.message}", node, warn) from None
    except VersionMismatch as exc:
        warn("peer.version_mismatch", remote=conn.remote_addr, side=side, error=exc.message)
        raise


def _check_node_name(conn: PeerConnection, theirs: str, ours: str) -> BadRequest | None:
    """Why the node name the peer gave cannot be a peer's (None: it can). ``""`` is this
    daemon's "no peer" (the key of gen sides that named none): a link under it would reach them."""
    if not theirs:
        return BadRequest(f"the peer at {conn.remote_addr} gave an empty node name; every daemon needs a node name")
    if theirs == ours:
        return OwnNodeName(f"the peer at {conn.remote_addr} has our own node name {ours!r}", node=ours)
    return None


def _as_conn(stream: trio.abc.Stream | PeerConnection, max_frame_size: int) -> PeerConnection:
    if isinstance(stream, PeerConnection):
        return stream
    return PeerConnection(stream, max_frame_size=max_frame_size)


async def handshake_client(
    stream: trio.abc.Stream | PeerConnection,
    *,
    node: str,
    secret: bytes,
    local_welcome_payload: PeerWelcome,
    timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    expect_node: str | None = None,
    version: int = PEER_PROTOCOL_VERSION,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    warn: Warn | None = None,
) -> tuple[str, PeerWelcome]:
    """Authenticate to a listening daemon; returns its node name and welcome.

    ``local_welcome_payload`` is sent once both sides are authenticated (its ``node`` is set
    to ``node``). ``expect_node``: refuse a peer announcing another name. Raises
    ``AuthFailed``, ``VersionMismatch``, ``PeerUnavailable`` (no handshake within
    ``timeout``), ``ConnectionClosed`` or ``ProtocolError``. ``warn`` takes the
    ``peer.auth_failed`` and ``peer.version_mismatch`` warnings (default ``log.warning``): a
    daemon retrying a peer that refuses it passes a rate limiter.
    """
    warn_ = warn or log.warning
    conn = _as_conn(stream, max_frame_size)
    full = conn.max_frame_size
    try:
        with trio.fail_after(timeout):
            conn.max_frame_size = min(full, PRE_AUTH_MAX_FRAME_SIZE)
            nonce_c = new_nonce()
            await conn.send(PeerHello(version=version, node=node, nonce=nonce_c))
            try:
                ch = await _expect(conn, PeerChallenge)
            except AuthFailed as exc:
                raise _auth_failed(conn, "client", f"the peer refused us: {exc.message}", "", warn_) from None
            except VersionMismatch as exc:
                warn_("peer.version_mismatch", remote=conn.remote_addr, side="client", error=exc.message)
                raise PeerVersionMismatch(exc.message, ours=version, theirs=None) from None
            except BadRequest as exc:
                # the listener checks names first: it refused ours as its own. It speaks our
                # protocol version (it checked that before), so it words it as _check_node_name
                if exc.message.endswith(f"has our own node name {node!r}"):
                    raise OwnNodeName(f"{exc.message} (the same as this daemon's)", node=node) from None
                raise
            if ch.version != version:
                err = PeerVersionMismatch(
                    f"peer {ch.node!r} speaks peer protocol {ch.version}, we speak {version}",
                    ours=version, theirs=ch.version,
                )
                warn_("peer.version_mismatch", remote=conn.remote_addr, side="client", error=err.message)
                await _refuse(conn, err)
                raise err
            try:
                check_nonce(ch.nonce, other=nonce_c)
            except AuthFailed as exc:
                fail = _auth_failed(conn, "client", exc.message, ch.node, warn_)
                await _refuse(conn, fail)
                raise fail from None
            expected = handshake_mac(
                secret,
                "server",
                version=version,
                client_node=node,
                server_node=ch.node,
                client_nonce=nonce_c,
                server_nonce=ch.nonce,
            )
            if not verify_mac(expected, ch.mac):
                fail = _auth_failed(conn, "client", _MAC_MISMATCH, ch.node, warn_)
                await _refuse(conn, fail)
                raise fail
            err_b = _check_node_name(conn, ch.node, node)
            if err_b is not None:
                await _refuse(conn, err_b)
                raise err_b
            mac_c = handshake_mac(
                secret,
                "client",
                version=version,
                client_node=node,
                server_node=ch.node,
                client_nonce=nonce_c,
                server_nonce=ch.nonce,
            )
            await conn.send(PeerAuth(mac=mac_c))
            conn.remote_node = ch.node
            conn.max_frame_size = full
            try:
                welcome = await _expect(conn, PeerWelcome)
            except AuthFailed as exc:
                raise _auth_failed(conn, "client", f"the peer refused us: {exc.message}", ch.node, warn_) from None
            if welcome.node != ch.node:
                raise ProtocolError(f"peer {ch.node!r} welcomed us as {welcome.node!r}")
            if expect_node is not None and ch.node != expect_node:
                err_n = NodeNameMismatch(
                    f"expected peer {expect_node!r} at {conn.remote_addr}, found {ch.node!r}: if that daemon "
                    f"is the one meant, set this [[peers]] name to {ch.node!r}; otherwise fix its host/port",
                    expected=expect_node, found=ch.node,
                )
                await _refuse(conn, err_n)
                raise err_n
            await conn.send(msgspec.structs.replace(local_welcome_payload, node=node))
    except trio.TooSlowError:
        raise HandshakeTimeout(
            f"{conn.describe()} did not complete the handshake within {timeout} s", timeout_s=timeout
        ) from None
    finally:
        conn.max_frame_size = full
    conn.welcome = welcome
    log.info("peer.connected", remote=conn.remote_addr, node=ch.node, side="client")
    return ch.node, welcome


async def handshake_server(
    stream: trio.abc.Stream | PeerConnection,
    *,
    node: str,
    secret: bytes,
    local_welcome_payload: PeerWelcome | Callable[[], PeerWelcome],
    timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    version: int = PEER_PROTOCOL_VERSION,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    warn: Warn | None = None,
) -> tuple[str, PeerWelcome]:
    """Authenticate a connecting daemon; returns its node name and welcome.

    Same errors as :func:`handshake_client`. Before the peer has proved the secret, frames
    are limited to :data:`~protocol.peer.PRE_AUTH_MAX_FRAME_SIZE`. ``local_welcome_payload``
    may be a callable: it is then only called once the peer has authenticated (building a
    welcome asks NIXL for its metadata; a stranger must not make us do that). ``warn`` takes
    the ``peer.auth_failed`` and ``peer.version_mismatch`` warnings (default ``log.warning``):
    anyone who reaches the port can cause them at will, so a daemon passes a rate limiter.
    """
    warn_ = warn or log.warning
    conn = _as_conn(stream, max_frame_size)
    full = conn.max_frame_size
    try:
        with trio.fail_after(timeout):
            conn.max_frame_size = min(full, PRE_AUTH_MAX_FRAME_SIZE)
            hello = await _expect_logged(conn, PeerHello, "server", "", warn_)
            if hello.version != version:
                err = VersionMismatch(
                    f"peer {hello.node!r} speaks peer protocol {hello.version}, we speak {version}"
                )
                warn_(
                    "peer.version_mismatch", remote=conn.remote_addr, side="server", error=err.message
                )
                await _refuse(conn, err)
                raise err
            try:
                check_nonce(hello.nonce)
            except AuthFailed as exc:
                fail = _auth_failed(conn, "server", exc.message, hello.node, warn_)
                await _refuse(conn, fail)
                raise fail from None
            err_b = _check_node_name(conn, hello.node, node)
            if err_b is not None:
                await _refuse(conn, err_b)
                raise err_b
            nonce_s = new_nonce()
            args: dict[str, Any] = dict(
                version=version,
                client_node=hello.node,
                server_node=node,
                client_nonce=hello.nonce,
                server_nonce=nonce_s,
            )
            mac_s = handshake_mac(secret, "server", **args)
            await conn.send(PeerChallenge(version=version, node=node, nonce=nonce_s, mac=mac_s))
            auth = await _expect_logged(conn, PeerAuth, "server", hello.node, warn_)
            if not verify_mac(handshake_mac(secret, "client", **args), auth.mac):
                fail = _auth_failed(conn, "server", _MAC_MISMATCH, hello.node, warn_)
                await _refuse(conn, fail)
                raise fail
            conn.remote_node = hello.node
            conn.max_frame_size = full
            ours = local_welcome_payload() if callable(local_welcome_payload) else local_welcome_payload
            await conn.send(msgspec.structs.replace(ours, node=node))
            welcome = await _expect_logged(conn, PeerWelcome, "server", hello.node, warn_)
            if welcome.node != hello.node:
                raise ProtocolError(f"peer {hello.node!r} sent a welcome for {welcome.node!r}")
    except trio.TooSlowError:
        raise HandshakeTimeout(
            f"{conn.describe()} did not complete the handshake within {timeout} s", timeout_s=timeout
        ) from None
    finally:
        conn.max_frame_size = full
    conn.welcome = welcome
    log.info("peer.accepted", remote=conn.remote_addr, node=hello.node, side="server")
    return hello.node, welcome


# --- liveness ----------------------------------------------------------------------------


async def run_heartbeats(conn: PeerConnection, interval: float = 5.0, timeout: float = 15.0) -> None:
    """Send ``Heartbeat`` every ``interval`` s; raise ``PeerUnavailable`` after ``timeout`` s of silence.

    Any frame from the peer counts as a sign of life (its ``HeartbeatAck`` or anything else),
    so a task must keep calling :meth:`PeerConnection.receive` meanwhile. Runs until
    cancelled or until the peer falls silent.
    """
    if interval <= 0 or timeout <= 0:
        raise ValueError("heartbeat interval and timeout must be positive")
    seq = 0
    next_beat = trio.current_time()
    conn.last_received = max(conn.last_received, trio.current_time())
    while True:
        now = trio.current_time()
        deadline = conn.last_received + timeout
        if now >= deadline:
            silent = now - conn.last_received
            log.warning(
                "peer.heartbeat_lost",
                remote=conn.remote_addr,
                node=conn.remote_node,
                silent_s=round(silent, 3),
            )
            raise PeerUnavailable(
                f"{conn.describe()} sent nothing for {silent:.1f} s (heartbeat timeout {timeout} s)"
            )
        if now >= next_beat:
            seq += 1
            with trio.move_on_after(timeout) as scope:
                await conn.send(Heartbeat(seq=seq))
            if scope.cancelled_caught:
                raise PeerUnavailable(f"sending a heartbeat to {conn.describe()} blocked for {timeout} s")
            next_beat = now + interval
        await trio.sleep_until(min(next_beat, conn.last_received + timeout))


# --- connecting --------------------------------------------------------------------------


def _connect_error(exc: OSError) -> str:
    """trio's "all attempts to connect to H:P failed", with why (e.g. "Connection refused")."""
    cause = exc.__cause__
    inner = cause.exceptions[0] if isinstance(cause, BaseExceptionGroup) and cause.exceptions else cause
    detail = inner.strerror if isinstance(inner, OSError) else ""
    return f"{exc}: {detail}" if detail and detail not in str(exc) else str(exc)


async def connect_with_backoff(
    host: str,
    port: int,
    *,
    initial: float = 0.1,
    maximum: float = 10.0,
    multiplier: float = 2.0,
    jitter: float = 0.5,
    connect_timeout: float = 5.0,
    max_attempts: int | None = None,
    rng: random.Random | None = None,
    on_retry: Callable[[str], None] | None = None,
) -> trio.SocketStream:
    """Open a TCP stream, retrying with exponential backoff (capped at ``maximum``) and jitter.

    Each wait is ``delay * (1 - jitter * U[0,1))``, with ``delay`` doubling from ``initial``.
    Cancellable at any point (the caller's deadline applies); raises ``PeerUnavailable``
    after ``max_attempts`` failed attempts (``None`` = retry forever). ``on_retry(reason)`` is
    called after each failed attempt (``kvctl peers`` shows the latest reason).
    """
    if initial <= 0 or maximum < initial or multiplier < 1 or not 0 <= jitter <= 1:
        raise ValueError("need 0 < initial <= maximum, multiplier >= 1 and 0 <= jitter <= 1")
    rand = rng or random.Random()
    delay = initial
    attempt = 0
    while True:
        attempt += 1
        try:
            with trio.fail_after(connect_timeout):
                stream = await trio.open_tcp_stream(host, port)
        except (OSError, trio.TooSlowError) as exc:
            reason = (
                f"timed out after {connect_timeout} s" if isinstance(exc, trio.TooSlowError) else _connect_error(exc)
            )
            if max_attempts is not None and attempt >= max_attempts:
                raise PeerUnavailable(
                    f"cannot connect to peer {host}:{port} after {attempt} attempts: {reason}"
                ) from None
            if on_retry is not None:
                on_retry(reason)
            wait = delay * (1 - jitter * rand.random())
            level = log.info if attempt == 1 or attempt % 10 == 0 else log.debug
            level(
                "peer.connect_retry",
                host=host,
                port=port,
                attempt=attempt,
                retry_in_s=round(wait, 3),
                error=reason,
            )
            await trio.sleep(wait)
            delay = min(maximum, delay * multiplier)
        else:
            if attempt > 1:
                log.info("peer.connect_ok", host=host, port=port, attempts=attempt)
            return stream


async def connect_peer(
    host: str,
    port: int,
    *,
    node: str,
    secret: bytes,
    welcome: PeerWelcome,
    expect_node: str | None = None,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    warn: Warn | None = None,
    **backoff: Any,
) -> PeerConnection:
    """Connect (with backoff) and authenticate; returns the ready link (closed on failure).

    ``warn``: as for :func:`handshake_client`."""
    stream = await connect_with_backoff(host, port, **backoff)
    return await open_peer(stream, node=node, secret=secret, welcome=welcome, expect_node=expect_node,
                           handshake_timeout=handshake_timeout, max_frame_size=max_frame_size, warn=warn)


async def open_peer(
    stream: trio.abc.Stream,
    *,
    node: str,
    secret: bytes,
    welcome: PeerWelcome,
    expect_node: str | None = None,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    warn: Warn | None = None,
) -> PeerConnection:
    """Authenticate a stream we connected (the client side); returns the ready link (the
    stream is closed on failure). ``warn``: as for :func:`handshake_client`."""
    conn = PeerConnection(stream, max_frame_size=max_frame_size)
    try:
        await handshake_client(
            conn,
            node=node,
            secret=secret,
            local_welcome_payload=welcome,
            timeout=handshake_timeout,
            expect_node=expect_node,
            warn=warn,
        )
    except BaseException:
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(stream)
        raise
    return conn


async def accept_peer(
    stream: trio.abc.Stream,
    *,
    node: str,
    secret: bytes,
    welcome: PeerWelcome | Callable[[], PeerWelcome],
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    warn: Warn | None = None,
) -> PeerConnection:
    """Authenticate an accepted stream (a ``trio.serve_tcp`` handler's); closed on failure.

    ``welcome`` may be a callable, called only after the peer authenticated; ``warn`` as for
    :func:`handshake_server`.
    """
    conn = PeerConnection(stream, max_frame_size=max_frame_size)
    try:
        await handshake_server(
            conn, node=node, secret=secret, local_welcome_payload=welcome, timeout=handshake_timeout, warn=warn
        )
    except BaseException:
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(stream)
        raise
    return conn
