"""Blocking client: the async client's API for executors that run in plain threads.

Same methods, same arguments, same errors as :class:`clients.client.AsyncClient`, over a
plain ``socket``. One request is on the wire at a time (a lock serialises callers), so
share a client between threads only for quick calls; a thread that ``wait()``s for a long
transfer should have its own client (sessions are cheap).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

from clients._wire import (
    ANCILLARY_SIZE,
    SocketUnreachable,
    check_reply,
    completion_or_raise,
    connection_lost,
    count_arg,
    default_socket_path,
    encode_request,
    expect_request,
    fds_from_ancillary,
    id_list,
    pool_arg,
    publish_request,
    wait_request,
)
from protocol import messages as m
from protocol.codec import decode_reply
from protocol.errors import BadRequest, ConnectionClosed, KvdError, error_from_code
from protocol.framing import DEFAULT_MAX_FRAME_SIZE, FrameBuffer
from protocol.layout import KVLayout

if TYPE_CHECKING:  # clients.attach imports torch: only attach() needs it (kvctl starts fast)
    from clients._words import PageWatch
    from clients.attach import MappedPool

T = TypeVar("T", bound=m.Message)

#: The longest ``spin_s`` a Client takes: polling longer than this only burns a core.
MAX_SPIN_S = 1.0


class Client:
    """A blocking session with the local daemon; a context manager.

    ``path``: the daemon's ``socket_path`` (default ``$KVD_SOCKET``, else ``/run/kvd/kvd.sock``);
    a socket that cannot be reached raises :class:`~protocol.errors.ConnectionClosed` saying
    what to check. ``client`` names the session in ``kvctl sessions`` and the daemon's log.
    ``timeout``: seconds the daemon may take to answer a call (``None``: no limit); a
    :meth:`wait` may take its own ``timeout_s`` on top of it, so a long wait needs no large
    ``timeout``. ``spin_s``: seconds to poll the socket for a reply before sleeping in the kernel
    (default 0: sleep at once). A thread with a core to itself (a serving engine's executor
    waiting for its KV) then takes a reply that comes within ``spin_s`` without a scheduler
    wake-up, which on some hosts costs a few hundred microseconds (see docs/performance.md);
    a longer wait sleeps as before, having burnt ``spin_s`` of CPU. ``completion_page`` (needs
    ``spin_s`` > 0, else ``BadRequest``): map the daemon's completion page and, while spinning, take a request that
    the page says is done without waiting for its reply (``kvd.mapping.words``; off by default.
    On the mapped path with GPU pools the GPU stores such an executor's token right after the
    kernel, so it is done when the bytes are: docs/integration.md, "The completion page").
    :class:`~clients.polling.PollingClient` takes ``completion_page`` too, without spinning.
    """

    def __init__(self, path: str | None = None, *, client: str = "", timeout: float | None = None,
                 spin_s: float = 0.0, completion_page: bool = False) -> None:
        if isinstance(spin_s, bool) or not isinstance(spin_s, int | float) or not 0 <= spin_s <= MAX_SPIN_S:
            raise BadRequest(f"spin_s must be a number of seconds >= 0 and at most {MAX_SPIN_S:g}, got {spin_s!r}; "
                             "0 sleeps at once")
        self.path = path or default_socket_path()
        self._timeout = timeout
        self._spin_s = float(spin_s)
        if completion_page and not self._reads_page():
            # it used to map nothing, silently: the executor believed it read the page
            raise BadRequest("completion_page=True needs spin_s > 0 on a Client: only a spinning wait reads the "
                             "page; give spin_s (e.g. 0.001), or use PollingClient(completion_page=True), "
                             "whose get_finished reads it without spinning")
        self._closed = False  # close() was called: a later call says so, not "the daemon went away"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(self.path)
        except OSError as exc:
            self._sock.close()
            raise SocketUnreachable(self.path, exc.strerror or str(exc)) from None
        self._lock = threading.RLock()  # wait() holds it around _call, to set the socket timeout
        self._ids = itertools.count(1)
        self._frames = FrameBuffer(DEFAULT_MAX_FRAME_SIZE)
        self._ready: list[tuple[m.Message, list[int]]] = []
        self._page: PageWatch | None = None  # the daemon's completion page (completion_page=True)
        self._owed = b""  # waits for requests the page completed: they go with the next write
        try:
            self.welcome = self._call(
                m.Hello(id=self._id(), version=m.PROTOCOL_VERSION, client=client or f"pid{os.getpid()}", pid=os.getpid()),
                m.Welcome,
            )
            if completion_page and self._reads_page():
                self._page = self._attach_words()
        except BaseException:
            self._sock.close()
            raise

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """End the session (the daemon returns its leases)."""
        self._closed = True
        self._sock.close()
        if self._page is not None:
            self._page.close()
            self._page = None

    @property
    def page_completions(self) -> int:
        """Completions this client took from the daemon's completion page (a spinning wait, or
        :meth:`PollingClient.get_finished <clients.polling.PollingClient.get_finished>`),
        without waiting for the ``Completion`` reply."""
        return self._page.seen if self._page is not None else 0

    def _reads_page(self) -> bool:
        """Whether this client would read a completion page: a wait looks at it only while it
        spins (a subclass that looks at it otherwise says so here)."""
        return self._spin_s > 0

    def _attach_words(self) -> PageWatch | None:
        """Map the daemon's completion page (read-only); None when the daemon has none to
        give (an older kvd): waits then use the socket alone."""
        from clients._words import PageWatch

        try:
            reply, fds = self._call_with_fds(m.AttachWords(id=self._id()), m.WordsAttached)
        except KvdError:
            return None
        return PageWatch.open(reply, fds)

    @property
    def daemon_pid(self) -> int:
        """The process id of the daemon this client is connected to: the process that listens
        on the socket, from the kernel's peer credentials (``SO_PEERCRED``). 0 where the kernel
        does not say (not Linux, or a daemon in a PID namespace this process cannot see)."""
        option = getattr(socket, "SO_PEERCRED", None)
        if option is None:
            return 0
        try:
            cred = self._sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
        except OSError:  # closed, or a socket kind without peer credentials
            return 0
        pid: int = struct.unpack("3i", cred)[0]
        return max(pid, 0)

    # -- plumbing ---------------------------------------------------------------------------
    def _id(self) -> int:
        return next(self._ids)

    def _receive(self, seen: Callable[[], m.Completion | None] | None = None) -> tuple[m.Message, list[int]]:
        while not self._ready:
            try:
                data, anc = self._recvmsg(seen)
            except TimeoutError:
                # the connection is fine (the late reply is dropped when it comes): say which
                # limit ran out, not "the connection broke"
                raise ConnectionClosed(
                    f"the daemon did not answer within {self._sock.gettimeout()} s (this Client's timeout); "
                    "give Client a larger timeout, or None", by_peer=False) from None
            except OSError as exc:
                raise connection_lost(f"connection to the daemon broke: {exc}", closed=self._closed) from None
            fds = fds_from_ancillary(anc)
            if not data:
                for fd in fds:
                    os.close(fd)
                raise connection_lost("the daemon closed the connection")
            for i, payload in enumerate(self._frames.feed(data)):
                self._ready.append((decode_reply(payload), fds if i == 0 else []))
        return self._ready.pop(0)

    def _recvmsg(self, seen: Callable[[], m.Completion | None] | None = None,
                 ) -> tuple[bytes, list[tuple[int, int, bytes]]]:
        """Bytes and ancillary data from the socket: polled for up to ``spin_s`` first (the
        socket non-blocking meanwhile: a socket with a timeout would wait in ``poll`` before
        each read), then a blocking read under the socket's timeout. ``seen``: asked between
        polls; a completion it returns ends the read (:class:`_PageSaidDone`)."""
        if self._spin_s > 0:
            end = time.perf_counter() + self._spin_s
            timeout = self._sock.gettimeout()
            self._sock.settimeout(0.0)
            try:
                while True:
                    try:
                        data, anc, _flags, _addr = self._sock.recvmsg(65536, ANCILLARY_SIZE)
                        return data, anc
                    except BlockingIOError:
                        if seen is not None:
                            done = seen()
                            if done is not None:
                                raise _PageSaidDone(done) from None
                        if time.perf_counter() >= end:
                            break
            finally:
                self._sock.settimeout(timeout)
        data, anc, _flags, _addr = self._sock.recvmsg(65536, ANCILLARY_SIZE)
        return data, anc

    def _call_with_fds(self, msg: m.Message, expected: type[T]) -> tuple[T, list[int]]:
        with self._lock:
            self._send(encode_request(msg))
            reply, fds = self._receive_reply(msg.id)
        try:
            return check_reply(reply, expected), fds
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def _send(self, data: bytes) -> None:
        """Write ``data`` (whole frames) to the daemon, after the waits owed for requests the
        completion page answered (their replies are dropped); called with the lock held."""
        if self._owed:
            data, self._owed = self._owed + data, b""
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise connection_lost(f"cannot send to the daemon: {exc}", closed=self._closed) from None

    def _route(self, reply: m.Message) -> bool:
        """Take a reply that is not the one a call waits for; False (the default): it is dropped
        (a call that gave up). A subclass keeps replies of its own here."""
        return False

    def _receive_reply(self, request_id: int, seen: Callable[[], m.Completion | None] | None = None,
                       ) -> tuple[m.Message, list[int]]:
        """The reply to ``request_id``; other replies go to :meth:`_route`, and are dropped
        when it does not take them. ``seen``: see :meth:`_recvmsg`."""
        while True:
            reply, fds = self._receive(seen)
            if reply.id == request_id:
                return reply, fds
            if self._route(reply):
                continue
            if isinstance(reply, m.Error) and reply.id == 0:
                raise error_from_code(reply.code, reply.message)
            for fd in fds:
                os.close(fd)

    def _register_and_wait(self, msg: m.Expect | m.Publish, timeout_s: float | None) -> m.Completion:
        """Send the registration and its wait in one write, then read both replies: the
        daemon takes the wait as soon as the registration is done, with no client turn between."""
        wait = wait_request(self._id(), msg.request_id, timeout_s)
        with self._lock, self._patience(timeout_s):
            self._send(encode_request(msg) + encode_request(wait))
            registered, fds = self._receive_reply(msg.id)
            _close_all(fds)
            # a refused registration raises here; its wait's reply (an error) is dropped later
            self._noted(check_reply(registered, m.Registered), msg.peer)
            reply = self._wait_reply(wait)
        return completion_or_raise(reply)

    def _noted(self, reply: m.Registered, peer: str) -> None:
        if self._page is not None:
            self._page.note(reply, peer)

    def _wait_reply(self, wait: m.Wait) -> m.Completion:
        """The outcome of ``wait`` (sent already): its reply, or while spinning, the completion
        page's word when it comes first (the reply is then dropped when it comes). Called with
        the lock held."""
        page = self._page
        seen = None
        if page is not None and page.watching(wait.request_id):
            rid = wait.request_id

            def seen() -> m.Completion | None:
                return page.done(rid)

        try:
            reply, fds = self._receive_reply(wait.id, seen)
        except _PageSaidDone as done:
            return done.completion
        finally:
            if page is not None:
                page.forget(wait.request_id)
        _close_all(fds)
        return check_reply(reply, m.Completion)

    @contextlib.contextmanager
    def _patience(self, wait_s: float | None) -> Iterator[None]:
        """The socket's timeout while a wait's reply is due: the daemon answers a wait when the
        transfer ends or ``wait_s`` has passed, so ``timeout`` bounds only the time after that
        (with ``Client(timeout=10)``, ``wait(timeout_s=60)`` failed after 10 s as a broken
        connection). Called with the lock held: no other call uses the socket meanwhile."""
        if self._timeout is None:
            yield
            return
        self._sock.settimeout(None if wait_s is None else wait_s + self._timeout)
        try:
            yield
        finally:
            self._sock.settimeout(self._timeout)

    def _call(self, msg: m.Message, expected: type[T]) -> T:
        reply, fds = self._call_with_fds(msg, expected)
        for fd in fds:
            os.close(fd)
        return reply

    # -- API (mirrors AsyncClient) ----------------------------------------------------------
    def ping(self, payload: bytes = b"") -> bytes:
        """A round trip to the daemon; returns ``payload`` as it came back."""
        return self._call(m.Ping(id=self._id(), payload=payload), m.Pong).payload

    def stats(self) -> m.DaemonStats:
        """The daemon's state and counters (what ``kvctl stats`` shows)."""
        return self._call(m.Stats(id=self._id()), m.StatsReply).stats

    def pools(self) -> list[m.PoolInfo]:
        """Every pool of the daemon: kind, occupancy and, in ``layout`` and ``rank``, the layout its
        configuration gives it (the one to register with, ``num_blocks`` included)."""
        return self._call(m.ListPools(id=self._id()), m.PoolsReply).pools

    def sessions(self, offset: int = 0, limit: int = 0) -> list[m.SessionInfo]:
        """Sessions ``offset`` .. ``offset + limit`` (``limit`` 0: to the end, in one reply)."""
        return self.sessions_page(offset, limit).sessions

    def sessions_page(self, offset: int = 0, limit: int = 0) -> m.SessionsReply:
        """One page of sessions with ``total`` (how many there are): page on with ``offset``."""
        return self._call(m.ListSessions(id=self._id(), offset=offset, limit=limit), m.SessionsReply)

    def transfers(self, offset: int = 0, limit: int = 0) -> list[m.TransferInfo]:
        """Transfers ``offset`` .. ``offset + limit`` (``limit`` 0: to the end, in one reply)."""
        return self.transfers_page(offset, limit).transfers

    def transfers_page(self, offset: int = 0, limit: int = 0) -> m.TransfersReply:
        """One page of transfers with ``total`` (how many there are): page on with ``offset``."""
        return self._call(m.ListTransfers(id=self._id(), offset=offset, limit=limit), m.TransfersReply)

    def peers(self) -> list[m.PeerInfo]:
        """Peer daemons: live links and configured peers not connected."""
        return self._call(m.ListPeers(id=self._id()), m.PeersReply).peers

    def config(self) -> str:
        """The daemon's effective configuration as JSON."""
        return self._call(m.GetConfig(id=self._id()), m.ConfigReply).config_json

    def drain(self) -> None:
        """Stop the daemon gracefully: no new work, in-flight transfers finish, then it exits
        (operators only: root, the daemon's user, ``[access] operator_gids``; else ``PermissionDenied``)."""
        self._call(m.Drain(id=self._id()), m.Ok)

    def attach(self, pool: str) -> MappedPool:
        """Map ``pool`` into this process: ``.tensor`` is a torch view of kvd's memory in the pool's
        axis order, ``.info`` its :class:`~protocol.messages.PoolInfo`."""
        from clients.attach import map_pool  # before the call: a failed import leaks no fds

        reply, fds = self._call_with_fds(m.AttachPool(id=self._id(), pool=pool_arg(pool)), m.Attached)
        return map_pool(reply, fds)

    def alloc(self, pool: str, count: int) -> list[int]:
        """Lease ``count`` free blocks of ``pool`` to this session; returns their ids (not necessarily
        contiguous or sorted). They stay leased until :meth:`free` or the end of the session.
        ``OutOfBlocks`` when fewer are free; ``NotFound`` names the pools there are."""
        return self._call(m.Alloc(id=self._id(), pool=pool_arg(pool), count=count_arg(count)), m.Allocated).block_ids

    def free(self, pool: str, block_ids: list[int]) -> int:
        """Return leased blocks to ``pool``; returns how many. All or nothing: ``BlockNotLeased`` if an id
        is not leased to this session (never allocated, or freed already), ``BadRequest`` if one is
        listed twice, ``BlocksInUse`` while a request still uses them (wait for it or cancel it first)."""
        return self._call(m.Free(id=self._id(), pool=pool_arg(pool), block_ids=id_list(block_ids)), m.Freed).count

    def expect(
        self,
        request_id: str,
        pool: str,
        layout: KVLayout,
        rank: int,
        block_ids: list[int],
        *,
        ranks: list[int] | None = None,
        deadline_s: float | None = None,
        peer: str = "",
    ) -> None:
        """gen side: this rank will receive ``request_id`` into ``block_ids`` (token order; a list,
        or a numpy array / integer tensor of ids).

        ``peer`` names the ctx daemon's node when known: once every gen rank registered, the
        destination goes to it unasked and the ctx side's publish moves bytes at once. Returns
        once registered; :meth:`wait` gives the outcome. Refused at once as :meth:`publish` is.
        """
        msg = expect_request(self._id(), request_id, pool, layout, rank, block_ids, ranks, deadline_s, peer)
        self._noted(self._call(msg, m.Registered), peer)

    def publish(
        self,
        request_id: str,
        pool: str,
        layout: KVLayout,
        rank: int,
        block_ids: list[int],
        peer: str,
        *,
        ranks: list[int] | None = None,
        deadline_s: float | None = None,
    ) -> None:
        """ctx side: this rank's KV of ``request_id`` is in ``block_ids`` (token order); send it to
        ``peer``, the gen daemon's ``node`` name (this daemon's own node: between its own pools).

        Returns once registered; :meth:`wait` gives the outcome. Refused at once with
        ``UnknownPeer`` (a name neither configured nor connected), ``IncompatibleLayout`` (``layout``
        is not the pool's), ``BlockNotLeased`` (a block not leased to this session), ``BadRequest``
        (a block id listed twice) or ``DuplicateRequest``. ``deadline_s`` bounds the
        whole transfer (default ``[transfer] deadline_s``); a peer that is down fails it then,
        with ``PeerUnavailable``, and so does a peer whose link cannot authenticate (the two
        daemons read different secrets).
        """
        msg = publish_request(self._id(), request_id, pool, layout, rank, block_ids, peer, ranks, deadline_s)
        self._noted(self._call(msg, m.Registered), peer)

    def expect_and_wait(
        self,
        request_id: str,
        pool: str,
        layout: KVLayout,
        rank: int,
        block_ids: list[int],
        *,
        ranks: list[int] | None = None,
        deadline_s: float | None = None,
        peer: str = "",
        timeout_s: float | None = None,
    ) -> m.Completion:
        """:meth:`expect` and :meth:`wait` sent together (one write, no turn between them):
        returns the completion; a refused registration raises as :meth:`expect` does."""
        msg = expect_request(self._id(), request_id, pool, layout, rank, block_ids, ranks, deadline_s, peer)
        return self._register_and_wait(msg, timeout_s)

    def publish_and_wait(
        self,
        request_id: str,
        pool: str,
        layout: KVLayout,
        rank: int,
        block_ids: list[int],
        peer: str,
        *,
        ranks: list[int] | None = None,
        deadline_s: float | None = None,
        timeout_s: float | None = None,
    ) -> m.Completion:
        """:meth:`publish` and :meth:`wait` sent together (one write, no turn between them):
        returns the completion; a refused registration raises as :meth:`publish` does."""
        msg = publish_request(self._id(), request_id, pool, layout, rank, block_ids, peer, ranks, deadline_s)
        return self._register_and_wait(msg, timeout_s)

    def wait(self, request_id: str, timeout_s: float | None = None) -> m.Completion:
        """Wait for the transfer; returns its Completion, raises its error if it failed.

        ``timeout_s`` passing raises :class:`~protocol.errors.WaitTimeout`; the transfer goes on
        (its own bound is the registration's ``deadline_s``). The outcome is reported once: a later
        wait for the same request raises ``NotFound`` saying it ended.
        """
        msg = wait_request(self._id(), request_id, timeout_s)
        with self._lock, self._patience(timeout_s):
            page = self._page
            done = page.done(request_id) if page is not None else None
            if done is not None:  # done already: its wait goes with the next write, to collect it
                self._owed += encode_request(msg)
                return done
            self._send(encode_request(msg))
            reply = self._wait_reply(msg)
        return completion_or_raise(reply)

    def cancel(self, request_id: str, *, force: bool = False) -> None:
        """Cancel a request this session registered (``force``: an operator cancelling any)."""
        self._call(m.Cancel(id=self._id(), request_id=request_id, force=force), m.Ok)


class _PageSaidDone(Exception):
    """The completion page said the awaited request is done (ends a spinning read)."""

    def __init__(self, completion: m.Completion) -> None:
        super().__init__(completion.request_id)
        self.completion = completion


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
