"""The daemon's shared state and request handling, driven by session actors.

``Daemon`` ties the actors together: the pools (one per configured device/rank), the
sessions, the transfer engine and the counters behind ``Stats``. All of it lives on the
trio thread; every mutation happens between two awaits, so each operation is atomic with
respect to every other session (actors that own their state, without a channel hop for the
sub-microsecond allocator operations). Slow work (pool creation, NIXL registration,
gather/scatter) goes through ``trio.to_thread``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, TypeVar

import structlog
import trio

from kvd.config import Config, LimitsConfig, config_to_json
from kvd.mapping.words import SLOT_WORDS
from kvd.ops.history import TransferHistory
from kvd.ops.peers import peer_infos
from protocol import messages as m
from protocol.errors import BadRequest, Draining, KvdError, LimitExceeded, NotFound, PermissionDenied
from protocol.limits import MAX_DEADLINE_S

if TYPE_CHECKING:
    from kvd.executor.peercred import AccessPolicy
    from kvd.executor.session import Session
    from kvd.ops.metrics import Metrics
    from kvd.pool import Pool
    from kvd.transfer.engine import Engine
    from kvd.transfer.requests import Side

log = structlog.get_logger("kvd.daemon")
_T = TypeVar("_T")


def kvd_version() -> str:
    """Installed kvd version (or "dev" from a source tree)."""
    try:
        return version("kvd")
    except PackageNotFoundError:  # pragma: no cover - running from an uninstalled tree
        return "dev"


#: The registration messages (a tuple: ``A | B`` would build a union object per request).
_REGISTRATIONS = (m.Expect, m.Publish)

#: Smallest ``max_frame_size`` accepted: below it an Expect/Publish of a few blocks cannot fit.
MIN_FRAME_SIZE = 4096


def check_limits(limits: LimitsConfig) -> None:
    """Refuse ``[limits]`` values that would break every session (raises :class:`BadRequest`)."""
    for name in (
        "max_sessions",
        "max_inflight_per_session",
        "max_blocks_per_session",
        "max_pending_connections",
        "max_pending_peers",
        "max_ranks_per_request",
        "max_ended_requests",
        "max_unclaimed_per_peer",
    ):
        value = getattr(limits, name)
        if value < 1:
            raise BadRequest(f"invalid configuration: [limits] {name} must be at least 1, got {value}")
    if limits.operator_reserve < 0:
        raise BadRequest(
            f"invalid configuration: [limits] operator_reserve must be >= 0, got {limits.operator_reserve}"
        )
    if limits.max_frame_size < MIN_FRAME_SIZE:
        raise BadRequest(
            f"invalid configuration: [limits] max_frame_size must be at least {MIN_FRAME_SIZE}, "
            f"got {limits.max_frame_size}"
        )
    _check_seconds("[limits] handshake_timeout_s", limits.handshake_timeout_s, positive=True)


def _check_seconds(name: str, value: float, *, positive: bool) -> None:
    ok = math.isfinite(value) and (value > 0 if positive else value >= 0) and value <= MAX_DEADLINE_S
    if not ok:
        bound = "> 0" if positive else ">= 0"
        raise BadRequest(
            f"invalid configuration: {name} must be finite, {bound} and at most {MAX_DEADLINE_S:g} s, got {value}"
        )


def check_config(config: Config) -> None:
    """Refuse a configuration whose limits or durations cannot work (raises :class:`BadRequest`)."""
    check_limits(config.limits)
    _check_seconds("drain_timeout_s", config.drain_timeout_s, positive=False)
    t = config.transfer
    _check_seconds("[transfer] deadline_s", t.deadline_s, positive=True)
    _check_seconds("[transfer] bounce_wait_s", t.bounce_wait_s, positive=False)
    _check_seconds("[transfer] heartbeat_interval_s", t.heartbeat_interval_s, positive=True)
    _check_seconds("[transfer] heartbeat_timeout_s", t.heartbeat_timeout_s, positive=True)
    _check_seconds("[transfer] reconnect_initial_s", t.reconnect_initial_s, positive=True)
    _check_seconds("[transfer] reconnect_max_s", t.reconnect_max_s, positive=True)
    _check_seconds("[transfer] remember_ended_s", t.remember_ended_s, positive=False)
    if t.reconnect_max_s < t.reconnect_initial_s:
        raise BadRequest(
            f"invalid configuration: [transfer] reconnect_max_s ({t.reconnect_max_s:g}) is below "
            f"reconnect_initial_s ({t.reconnect_initial_s:g})"
        )


def _page(items: list[_T], offset: int, limit: int) -> list[_T]:
    """``items[offset : offset + limit]``; ``limit`` 0 = to the end."""
    return items[offset : offset + limit] if limit else items[offset:]


@dataclass
class Counters:
    """Monotonic counters exposed through ``Stats`` and metrics."""

    requests_registered: int = 0
    transfers_done: int = 0
    transfers_failed: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    rejected_sessions: int = 0


class Daemon:
    """Everything one kvd process owns."""

    def __init__(
        self,
        config: Config,
        pools: dict[str, Pool],
        access: AccessPolicy,
        metrics: Metrics,
    ) -> None:
        self.config = config
        self.version = kvd_version()
        self.pools = pools
        self.access = access
        self.metrics = metrics
        self.sessions: dict[int, Session] = {}
        #: Executor connections accepted but not yet through Hello (not sessions yet).
        self.pending_connections = 0
        self.counters = Counters()
        self.started = time.monotonic()
        self.draining = False
        self.stop_reason = ""  # why the drain began (the first request_stop's reason)
        self.stop_requested = trio.Event()
        self.engine: Engine | None = None
        self.history = TransferHistory()
        #: while a session runs a registration's data path (its replies held for its wait's):
        #: what writes them at once, for an executor that reads the completion page
        self.release_replies: Callable[[], None] | None = None

    # -- sessions ---------------------------------------------------------------------------
    def add_session(self, session: Session) -> None:
        self.sessions[session.id] = session
        self.metrics.set_sessions(len(self.sessions))

    async def end_session(self, session: Session) -> int:
        """Cancel the session's requests, then return every block it leased."""
        if self.engine is not None:
            await self.engine.session_ended(session)
        returned = sum(pool.blocks.release_session(session.id) for pool in self.pools.values())
        self.sessions.pop(session.id, None)
        self.metrics.set_sessions(len(self.sessions))
        self.update_pool_metrics()
        return returned

    def blocks_leased_by(self, session_id: int) -> int:
        return sum(len(p.blocks.leased_by(session_id)) for p in self.pools.values())

    # -- requests ----------------------------------------------------------------------------
    def pool(self, name: str) -> Pool:
        try:
            return self.pools[name]
        except KeyError:
            raise NotFound(f"no pool named {name!r}; pools: {sorted(self.pools)}") from None

    async def handle(self, session: Session, msg: m.Message) -> tuple[m.Message, list[int]]:
        """Answer one quick request; returns the reply and fds to pass with it."""
        if isinstance(msg, _REGISTRATIONS):  # first: what every request sends (4-5 per request)
            try:
                if self.draining:
                    raise Draining("kvd is draining and takes no new work")
                reply = await self._register(session, msg)
            except KvdError as exc:  # a later wait on it is told it was refused, not "waited twice"
                session.note_registration(msg.request_id, exc)
                raise
            session.note_registration(msg.request_id)
            return reply, []
        if isinstance(msg, m.Ping):
            return m.Pong(id=msg.id, payload=msg.payload), []
        if isinstance(msg, m.Stats):
            return m.StatsReply(id=msg.id, stats=self.stats()), []
        if isinstance(msg, m.ListPools):
            return m.PoolsReply(id=msg.id, pools=self.pool_infos()), []
        if isinstance(msg, m.ListSessions):
            sessions = _page(list(self.sessions.values()), msg.offset, msg.limit)
            infos = [s.info(self.blocks_leased_by(s.id)) for s in sessions]
            return m.SessionsReply(id=msg.id, sessions=infos, total=len(self.sessions)), []
        if isinstance(msg, m.ListTransfers):
            live = self.engine.transfer_infos() if self.engine is not None else []
            transfers = self.history.merged(live)
            page = _page(transfers, msg.offset, msg.limit)
            return m.TransfersReply(id=msg.id, transfers=page, total=len(transfers)), []
        if isinstance(msg, m.ListPeers):
            return m.PeersReply(id=msg.id, peers=peer_infos(self.config, self.engine)), []
        if isinstance(msg, m.GetConfig):
            return m.ConfigReply(id=msg.id, config_json=config_to_json(self.config)), []
        if isinstance(msg, m.Drain):
            # sessions answer Drain themselves (kvd.executor.session); this path keeps the same rule
            if not session.operator:
                raise PermissionDenied(f"drain needs an operator: {self.access.operator_rule()}")
            self.request_stop("drain requested by client", session)
            return m.Ok(id=msg.id), []
        if isinstance(msg, m.AttachWords):
            words = self._engine().words
            if msg.writable and not session.operator:
                raise PermissionDenied("a writable completion page is for same-node peer daemons: "
                                       f"{self.access.operator_rule()}")
            fd = words.fd if msg.writable else words.read_only_fd
            session.reads_page = True
            return m.WordsAttached(id=msg.id, slots=words.slots, slot_words=SLOT_WORDS), [fd]
        if isinstance(msg, m.AttachPool):
            attached, fds = self.pool(msg.pool).attach_reply(msg.id, sessions=self._pool_sessions(msg.pool))
            log.info("pool.attached", pool=msg.pool, kind=attached.handle_kind)
            return attached, fds
        if self.draining and isinstance(msg, m.Alloc):
            raise Draining("kvd is draining and takes no new work")
        if isinstance(msg, m.Alloc):
            return self._alloc(session, msg), []
        if isinstance(msg, m.Free):
            pool = self.pool(msg.pool)
            if self.engine is not None:
                self.engine.check_not_in_flight(session, msg.pool, msg.block_ids)
            pool.blocks.free(session.id, msg.block_ids)
            self.update_pool_metrics()
            return m.Freed(id=msg.id, pool=msg.pool, count=len(msg.block_ids)), []
        if isinstance(msg, m.Cancel):
            await self._engine().cancel(session, msg)
            return m.Ok(id=msg.id), []
        raise BadRequest(f"unexpected message {type(msg).__name__}")

    async def _register(self, session: Session, msg: m.Expect | m.Publish) -> m.Registered:
        if len(session.requests) >= self.config.limits.max_inflight_per_session:
            raise LimitExceeded(
                f"max_inflight_per_session={self.config.limits.max_inflight_per_session} "
                "registered requests reached"
            )
        self._check_geometry(msg)
        engine = self._engine()
        word, token = await engine.register(session, msg)
        self.counters.requests_registered += 1
        return m.Registered(id=msg.id, request_id=msg.request_id, word=word, token=token)

    def replies_now(self) -> None:
        """A data path started in the registration's step has its work launched: the replies
        its session holds may go now (see :attr:`release_replies`)."""
        if self.release_replies is not None:
            self.release_replies()

    def after_reply(self) -> None:
        """Work the request just handled left for after its reply (see
        :meth:`kvd.transfer.engine.Engine.run_after_reply`); the session calls it every time."""
        if self.engine is not None:
            self.engine.run_after_reply()

    def watch(self, session: Session, msg: m.Wait, answer: Callable[[m.Completion], object]) -> Callable[[], None]:
        """Have ``answer`` called with the request's completion in the step that reports it;
        returns what ends the watch (see :meth:`kvd.transfer.engine.Engine.watch`)."""
        return self._engine().watch(session, msg, answer)

    def completion_now(self, session: Session, msg: m.Wait) -> m.Message | None:
        """The reply to a wait whose request has ended already, else None (then :meth:`wait`).

        A request this session does not hold (any more) is ``NotFound``, with what the executor
        most likely did (:attr:`Session.registrations` tells): waited twice (the outcome is
        reported once, then the request is forgotten), waited on a request whose registration
        was refused (it registered nothing), or on a session other than the one that registered it."""
        engine = self._engine()
        try:
            return engine.completion_now(session, msg)
        except NotFound as exc:
            rid = msg.request_id
            ended = self.history.outcome(rid)
            refused = session.registrations.get(rid)
            if refused == "":  # registered here, and its outcome reported to a wait already
                if ended is None:
                    raise NotFound(f"{exc.message} any more: this session registered it, and its outcome was "
                                   "reported already; each session that registered a request is told the outcome "
                                   "by one wait, and then no more") from None
                raise NotFound(f"{exc.message}: a request {rid!r} ended here ({ended}); each session "
                               "that registered it is told the outcome by one wait, and then no more (kvctl "
                               "transfers shows how it ended)") from None
            elsewhere = (f" (a request {rid!r} that another session registered ended here ({ended}): kvctl "
                         "transfers shows how)" if ended is not None else "")
            if refused is not None:
                raise NotFound(f"no request {rid!r} is registered by this session: its registration was refused "
                               f"({refused}), and a refused registration registers nothing; register it again, "
                               f"corrected{elsewhere}") from None
            raise NotFound(f"no request {rid!r} is registered by this session: wait on the session (Client) "
                           f"that registered it with expect or publish{elsewhere}") from None

    def _engine(self) -> Engine:
        if self.engine is None:
            raise NotFound("this daemon has no transfer engine running")
        return self.engine

    def _check_geometry(self, msg: m.Expect | m.Publish) -> None:
        """Bound a registration by what this daemon can really hold, before anything is sized.

        The protocol already bounds a layout (at most ``MAX_WORLD_SIZE`` ranks); here the
        participants (every one must register on this daemon) are bounded by
        ``[limits] max_ranks_per_request`` and the blocks by the pool's size.
        """
        limit = self.config.limits.max_ranks_per_request
        world = msg.layout.world_size
        participants = len(msg.ranks) if msg.ranks is not None else world
        if participants > limit:
            raise LimitExceeded(
                f"request {msg.request_id!r}: {participants} participating ranks (layout tp_size="
                f"{msg.layout.tp_size}, pp_size={msg.layout.pp_size}) exceed [limits] max_ranks_per_request={limit}"
            )
        if not 0 <= msg.rank < world:
            raise BadRequest(f"rank {msg.rank} is outside the layout's world size {world}")
        pool = self.pool(msg.pool)
        if len(msg.block_ids) > pool.layout.num_blocks:
            raise BadRequest(
                f"request {msg.request_id!r}: {len(msg.block_ids)} block ids, pool {msg.pool!r} has "
                f"{pool.layout.num_blocks} blocks"
            )

    def _alloc(self, session: Session, msg: m.Alloc) -> m.Allocated:
        pool = self.pool(msg.pool)
        limit = self.config.limits.max_blocks_per_session
        held = self.blocks_leased_by(session.id)
        if msg.count > 0 and held + msg.count > limit:
            raise LimitExceeded(
                f"max_blocks_per_session={limit}: session holds {held}, asked for {msg.count} more"
            )
        ids = pool.blocks.alloc(session.id, msg.count)
        self.update_pool_metrics()
        return m.Allocated(id=msg.id, pool=msg.pool, block_ids=ids)

    def transfer_finished(self, side: Side) -> None:
        """The engine finished a transfer side (done or failed): keep it for ``kvctl transfers``."""
        if side.completion is not None:
            self.history.record(side.info(), side.completion)

    # -- stats ------------------------------------------------------------------------------
    def _pool_sessions(self, name: str) -> int:
        return self.pools[name].blocks.sessions

    def pool_infos(self) -> list[m.PoolInfo]:
        return [p.info(sessions=p.blocks.sessions) for p in self.pools.values()]

    def update_pool_metrics(self, names: Iterable[str] | None = None) -> None:
        """Set the pool gauges (of ``names``, or of every pool)."""
        for name in self.pools if names is None else names:
            pool = self.pools[name]
            self.metrics.set_pool(name, pool.blocks.used, pool.blocks.free_count)

    def stats(self) -> m.DaemonStats:
        engine = self.engine
        return m.DaemonStats(
            version=self.version,
            node=self.config.node,
            uptime_s=time.monotonic() - self.started,
            draining=self.draining,
            sessions=len(self.sessions),
            requests_registered=self.counters.requests_registered,
            transfers_active=engine.active_count() if engine else 0,
            transfers_done=self.counters.transfers_done,
            transfers_failed=self.counters.transfers_failed,
            bytes_sent=self.counters.bytes_sent,
            bytes_received=self.counters.bytes_received,
            blocks_leased=sum(p.blocks.used for p in self.pools.values()),
            bounce_chunks_total=engine.bounce_chunks_total() if engine else 0,
            bounce_chunks_in_use=engine.bounce_chunks_in_use() if engine else 0,
            peers_connected=engine.peers_connected() if engine else 0,
            pools=self.pool_infos(),
            busy_poll=engine.busy_poll if engine else False,
            busy_poll_passes=engine.busy_passes if engine else 0,
            transfer_actors=engine.actors_started if engine else 0,
            transfer_tasks=engine.tasks_started if engine else 0,
        )

    # -- lifecycle --------------------------------------------------------------------------
    def request_stop(self, reason: str, session: Session | None = None) -> None:
        """Begin a graceful drain (SIGTERM, SIGINT or a client's Drain)."""
        if not self.draining:
            log.info("daemon.draining", reason=reason, by_session=session.id if session else None)
            self.stop_reason = reason
        self.draining = True
        self.stop_requested.set()


