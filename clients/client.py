"""Async (trio) client for executors and tools.

    async with open_client("/run/kvd/kvd.sock", client="ctx-rank0") as kvd:
        pool = await kvd.attach("gpu0")            # MappedPool: .tensor is the KV pool view
        blocks = await kvd.alloc("gpu0", 256)
        ...  # write KV into pool.tensor[blocks]
        await kvd.publish("req-1", "gpu0", layout, rank=0, block_ids=blocks, peer="gen-node")
        done = await kvd.wait("req-1")             # Completion (raises on failure)

Many requests may be in flight on one client: a reader task routes each reply to its
caller by request id. Errors from the daemon raise the same ``KvdError`` subclass.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, TypeVar

import trio

from clients._wire import (
    ANCILLARY_SIZE,
    SocketUnreachable,
    check_reply,
    client_closed,
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
from protocol.errors import KvdError, ProtocolError, error_from_code
from protocol.framing import DEFAULT_MAX_FRAME_SIZE, FrameBuffer
from protocol.layout import KVLayout

if TYPE_CHECKING:  # clients.attach imports torch: only attach() needs it (kvctl starts fast)
    from clients.attach import MappedPool

T = TypeVar("T", bound=m.Message)


class _Pending:
    __slots__ = ("event", "fds", "reply")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.reply: m.Message | None = None
        self.fds: list[int] = []


class AsyncClient:
    """One session with the local daemon. Create with :func:`open_client`."""

    def __init__(self, sock: trio.socket.SocketType, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self._sock = sock
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._send_lock = trio.Lock()
        self._frames = FrameBuffer(max_frame_size)
        self._closed: KvdError | None = None
        self.welcome: m.Welcome | None = None

    # -- plumbing ---------------------------------------------------------------------------
    async def _reader(self) -> None:
        try:
            while True:
                data, anc, _flags, _addr = await self._sock.recvmsg(65536, ANCILLARY_SIZE)
                fds = fds_from_ancillary(anc)
                if not data:
                    for fd in fds:
                        os.close(fd)
                    raise connection_lost("the daemon closed the connection")
                for payload in self._frames.feed(data):
                    reply = decode_reply(payload)
                    pending = self._pending.pop(reply.id, None)
                    if pending is None:
                        if isinstance(reply, m.Error) and reply.id == 0:
                            raise error_from_code(reply.code, reply.message)
                        for fd in fds:
                            os.close(fd)
                        continue
                    pending.reply, pending.fds = reply, fds
                    fds = []
                    pending.event.set()
        except KvdError as exc:
            self._fail_all(exc)
        except OSError as exc:
            self._fail_all(connection_lost(f"connection to the daemon broke: {exc}"))

    def _fail_all(self, exc: KvdError) -> None:
        self._closed = exc
        for pending in self._pending.values():
            pending.event.set()
        self._pending.clear()

    async def _call_with_fds(self, msg: m.Message, expected: type[T]) -> tuple[T, list[int]]:
        if self._closed is not None:
            raise self._closed
        data = encode_request(msg)  # before the pending entry: a value it refuses leaves none behind
        pending = _Pending()
        self._pending[msg.id] = pending
        try:
            async with self._send_lock:
                view = memoryview(data)
                while view:
                    view = view[await self._sock.send(view) :]
        except OSError as exc:
            self._pending.pop(msg.id, None)
            raise connection_lost(f"cannot send to the daemon: {exc}") from None
        await pending.event.wait()
        if pending.reply is None:
            assert self._closed is not None
            raise self._closed
        try:
            return check_reply(pending.reply, expected), pending.fds
        except BaseException:
            for fd in pending.fds:
                os.close(fd)
            raise

    async def _register_and_wait(self, msg: m.Expect | m.Publish, timeout_s: float | None) -> m.Completion:
        """Send the registration and its wait in one write, then await both replies: the
        daemon takes the wait as soon as the registration is done, with no client turn between."""
        if self._closed is not None:
            raise self._closed
        wait = wait_request(self._id(), msg.request_id, timeout_s)
        data = encode_request(msg) + encode_request(wait)
        registered, done = _Pending(), _Pending()
        self._pending[msg.id], self._pending[wait.id] = registered, done
        try:
            async with self._send_lock:
                view = memoryview(data)
                while view:
                    view = view[await self._sock.send(view) :]
        except OSError as exc:
            self._pending.pop(msg.id, None)
            self._pending.pop(wait.id, None)
            raise connection_lost(f"cannot send to the daemon: {exc}") from None
        for pending in (registered, done):
            await pending.event.wait()
            if pending.reply is None:
                assert self._closed is not None
                raise self._closed
            for fd in pending.fds:
                os.close(fd)
            if pending is registered:
                try:
                    check_reply(pending.reply, m.Registered)
                except BaseException:  # refused: its wait's reply (an error) is dropped on arrival
                    self._pending.pop(wait.id, None)
                    raise
        assert done.reply is not None
        return completion_or_raise(check_reply(done.reply, m.Completion))

    async def _call(self, msg: m.Message, expected: type[T]) -> T:
        reply, fds = await self._call_with_fds(msg, expected)
        for fd in fds:
            os.close(fd)
        return reply

    def _id(self) -> int:
        return next(self._ids)

    # -- API --------------------------------------------------------------------------------
    async def hello(self, client: str) -> m.Welcome:
        """Versioned handshake (done by :func:`open_client`)."""
        self.welcome = await self._call(
            m.Hello(id=self._id(), version=m.PROTOCOL_VERSION, client=client, pid=os.getpid()), m.Welcome
        )
        return self.welcome

    async def ping(self, payload: bytes = b"") -> bytes:
        """A round trip to the daemon; returns ``payload`` as it came back."""
        return (await self._call(m.Ping(id=self._id(), payload=payload), m.Pong)).payload

    async def stats(self) -> m.DaemonStats:
        """The daemon's state and counters (what ``kvctl stats`` shows)."""
        return (await self._call(m.Stats(id=self._id()), m.StatsReply)).stats

    async def pools(self) -> list[m.PoolInfo]:
        """Every pool of the daemon: kind, occupancy and, in ``layout`` and ``rank``, the layout its
        configuration gives it (the one to register with, ``num_blocks`` included)."""
        return (await self._call(m.ListPools(id=self._id()), m.PoolsReply)).pools

    async def sessions(self, offset: int = 0, limit: int = 0) -> list[m.SessionInfo]:
        """Sessions ``offset`` .. ``offset + limit`` (``limit`` 0: to the end, in one reply)."""
        return (await self.sessions_page(offset, limit)).sessions

    async def sessions_page(self, offset: int = 0, limit: int = 0) -> m.SessionsReply:
        """One page of sessions with ``total`` (how many there are): page on with ``offset``."""
        return await self._call(m.ListSessions(id=self._id(), offset=offset, limit=limit), m.SessionsReply)

    async def transfers(self, offset: int = 0, limit: int = 0) -> list[m.TransferInfo]:
        """Transfers ``offset`` .. ``offset + limit`` (``limit`` 0: to the end, in one reply)."""
        return (await self.transfers_page(offset, limit)).transfers

    async def transfers_page(self, offset: int = 0, limit: int = 0) -> m.TransfersReply:
        """One page of transfers with ``total`` (how many there are): page on with ``offset``."""
        return await self._call(m.ListTransfers(id=self._id(), offset=offset, limit=limit), m.TransfersReply)

    async def peers(self) -> list[m.PeerInfo]:
        """Peer daemons: live links and configured peers not connected."""
        return (await self._call(m.ListPeers(id=self._id()), m.PeersReply)).peers

    async def config(self) -> str:
        """The daemon's effective configuration as JSON."""
        return (await self._call(m.GetConfig(id=self._id()), m.ConfigReply)).config_json

    async def drain(self) -> None:
        """Stop the daemon gracefully: no new work, in-flight transfers finish, then it exits
        (operators only: root, the daemon's user, ``[access] operator_gids``; else ``PermissionDenied``)."""
        await self._call(m.Drain(id=self._id()), m.Ok)

    async def attach(self, pool: str) -> MappedPool:
        """Map ``pool`` into this process: ``.tensor`` is a torch view of kvd's memory in the pool's
        axis order, ``.info`` its :class:`~protocol.messages.PoolInfo`."""
        from clients.attach import map_pool  # before the call: a failed import leaks no fds

        reply, fds = await self._call_with_fds(m.AttachPool(id=self._id(), pool=pool_arg(pool)), m.Attached)
        return map_pool(reply, fds)

    async def alloc(self, pool: str, count: int) -> list[int]:
        """Lease ``count`` free blocks of ``pool`` to this session; returns their ids (not necessarily
        contiguous or sorted). They stay leased until :meth:`free` or the end of the session.
        ``OutOfBlocks`` when fewer are free; ``NotFound`` names the pools there are."""
        return (await self._call(m.Alloc(id=self._id(), pool=pool_arg(pool), count=count_arg(count)), m.Allocated)).block_ids

    async def free(self, pool: str, block_ids: list[int]) -> int:
        """Return leased blocks to ``pool``; returns how many. All or nothing: ``BlockNotLeased`` if an id
        is not leased to this session (never allocated, or freed already), ``BadRequest`` if one is
        listed twice, ``BlocksInUse`` while a request still uses them (wait for it or cancel it first)."""
        msg = m.Free(id=self._id(), pool=pool_arg(pool), block_ids=id_list(block_ids))
        return (await self._call(msg, m.Freed)).count

    async def expect(
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
        """gen side: this rank will receive ``request_id`` into ``block_ids`` (token order).

        ``peer`` names the ctx daemon's node when known: once every gen rank registered, the
        destination goes to it unasked and the ctx side's publish moves bytes at once. Returns
        once registered; :meth:`wait` gives the outcome. Refused at once as :meth:`publish` is.
        """
        msg = expect_request(self._id(), request_id, pool, layout, rank, block_ids, ranks, deadline_s, peer)
        await self._call(msg, m.Registered)

    async def publish(
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
        await self._call(msg, m.Registered)

    async def expect_and_wait(
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
        return await self._register_and_wait(msg, timeout_s)

    async def publish_and_wait(
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
        return await self._register_and_wait(msg, timeout_s)

    async def wait(self, request_id: str, timeout_s: float | None = None) -> m.Completion:
        """Wait for the transfer; returns its Completion, raises its error if it failed.

        ``timeout_s`` passing raises :class:`~protocol.errors.WaitTimeout`; the transfer goes on
        (its own bound is the registration's ``deadline_s``). The outcome is reported once: a later
        wait for the same request raises ``NotFound`` saying it ended.
        """
        reply = await self._call(wait_request(self._id(), request_id, timeout_s), m.Completion)
        return completion_or_raise(reply)

    async def cancel(self, request_id: str, *, force: bool = False) -> None:
        """Cancel a request this session registered (``force``: an operator cancelling any)."""
        await self._call(m.Cancel(id=self._id(), request_id=request_id, force=force), m.Ok)


@asynccontextmanager
async def open_client(path: str | None = None, *, client: str = "") -> AsyncIterator[AsyncClient]:
    """Connect, handshake, and yield an :class:`AsyncClient`; closes the session on exit.

    ``path``: the daemon's ``socket_path`` (default ``$KVD_SOCKET``, else ``/run/kvd/kvd.sock``);
    a socket that cannot be reached raises :class:`~protocol.errors.ConnectionClosed` saying
    what to check. ``client`` names the session in ``kvctl sessions`` and the daemon's log.
    """
    path = path or default_socket_path()
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    try:
        await sock.connect(path)
    except OSError as exc:
        sock.close()
        raise SocketUnreachable(path, exc.strerror or str(exc)) from None
    kvd = AsyncClient(sock)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(kvd._reader)
            try:
                await kvd.hello(client or f"pid{os.getpid()}")
                yield kvd
            finally:
                nursery.cancel_scope.cancel()
                if kvd._closed is None:  # a call after the block says so, not "the daemon went away"
                    kvd._closed = client_closed()
    except BaseExceptionGroup as group:  # unwrap the single error the reader or caller raised
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    finally:
        sock.close()


__all__ = ["AsyncClient", "ProtocolError", "open_client"]
