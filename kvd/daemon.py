"""The daemon's shared state and request handling, driven by session actors.

``Daemon`` ties the actors together: the pools (one per configured device/rank), the
sessions, the transfer engine and the counters behind ``Stats``. All of it lives on the
trio thread; every mutation happens between two awaits, so each operation is atomic with
respect to every other session (the actor rule of DESIGN.md without a channel hop for the
sub-microsecond allocator operations). Slow work (pool creation, NIXL registration,
gather/scatter) goes through ``trio.to_thread``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

import structlog
import trio

from kvd.config import Config, LimitsConfig, config_to_json
from protocol import messages as m
from protocol.errors import BadRequest, Draining, LimitExceeded, NotFound

if TYPE_CHECKING:
    from kvd.executor.peercred import AccessPolicy
    from kvd.executor.session import Session
    from kvd.ops.metrics import Metrics
    from kvd.pool import Pool
    from kvd.transfer.engine import Engine

log = structlog.get_logger("kvd.daemon")


def kvd_version() -> str:
    """Installed kvd version (or "dev" from a source tree)."""
    try:
        return version("kvd")
    except PackageNotFoundError:  # pragma: no cover - running from an uninstalled tree
        return "dev"


#: Smallest ``max_frame_size`` accepted: below it an Expect/Publish of a few blocks cannot fit.
MIN_FRAME_SIZE = 4096


def check_limits(limits: LimitsConfig) -> None:
    """Refuse ``[limits]`` values that would break every session (raises :class:`BadRequest`)."""
    for name in ("max_sessions", "max_inflight_per_session", "max_blocks_per_session"):
        value = getattr(limits, name)
        if value < 1:
            raise BadRequest(f"invalid configuration: [limits] {name} must be at least 1, got {value}")
    if limits.max_frame_size < MIN_FRAME_SIZE:
        raise BadRequest(
            f"invalid configuration: [limits] max_frame_size must be at least {MIN_FRAME_SIZE}, "
            f"got {limits.max_frame_size}"
        )


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
        self.counters = Counters()
        self.started = time.monotonic()
        self.draining = False
        self.stop_requested = trio.Event()
        self.engine: Engine | None = None

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
        if isinstance(msg, m.Ping):
            return m.Pong(id=msg.id, payload=msg.payload), []
        if isinstance(msg, m.Stats):
            return m.StatsReply(id=msg.id, stats=self.stats()), []
        if isinstance(msg, m.ListPools):
            return m.PoolsReply(id=msg.id, pools=self.pool_infos()), []
        if isinstance(msg, m.ListSessions):
            infos = [s.info(self.blocks_leased_by(s.id)) for s in self.sessions.values()]
            return m.SessionsReply(id=msg.id, sessions=infos), []
        if isinstance(msg, m.ListTransfers):
            transfers = self.engine.transfer_infos() if self.engine is not None else []
            return m.TransfersReply(id=msg.id, transfers=transfers), []
        if isinstance(msg, m.GetConfig):
            return m.ConfigReply(id=msg.id, config_json=config_to_json(self.config)), []
        if isinstance(msg, m.Drain):
            self.request_stop("drain requested by client", session)
            return m.Ok(id=msg.id), []
        if isinstance(msg, m.AttachPool):
            attached, fds = self.pool(msg.pool).attach_reply(msg.id, sessions=self._pool_sessions(msg.pool))
            log.info("pool.attached", pool=msg.pool, kind=attached.handle_kind)
            return attached, fds
        if self.draining and isinstance(msg, m.Alloc | m.Expect | m.Publish):
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
        if isinstance(msg, m.Expect | m.Publish):
            if len(session.requests) >= self.config.limits.max_inflight_per_session:
                raise LimitExceeded(
                    f"max_inflight_per_session={self.config.limits.max_inflight_per_session} "
                    "registered requests reached"
                )
            engine = self._engine()
            await engine.register(session, msg)
            self.counters.requests_registered += 1
            return m.Registered(id=msg.id, request_id=msg.request_id), []
        if isinstance(msg, m.Cancel):
            await self._engine().cancel(session, msg)
            return m.Ok(id=msg.id), []
        raise BadRequest(f"unexpected message {type(msg).__name__}")

    async def wait(self, session: Session, msg: m.Wait) -> m.Message:
        """Wait for a request's completion (runs as a session task)."""
        return await self._engine().wait(session, msg)

    def _engine(self) -> Engine:
        if self.engine is None:
            raise NotFound("this daemon has no transfer engine running")
        return self.engine

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

    # -- stats ------------------------------------------------------------------------------
    def _pool_sessions(self, name: str) -> int:
        return self.pools[name].blocks.sessions

    def pool_infos(self) -> list[m.PoolInfo]:
        return [p.info(sessions=p.blocks.sessions) for p in self.pools.values()]

    def update_pool_metrics(self) -> None:
        for name, pool in self.pools.items():
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
        )

    # -- lifecycle --------------------------------------------------------------------------
    def request_stop(self, reason: str, session: Session | None = None) -> None:
        """Begin a graceful drain (SIGTERM, SIGINT or a client's Drain)."""
        if not self.draining:
            log.info("daemon.draining", reason=reason, by_session=session.id if session else None)
        self.draining = True
        self.stop_requested.set()


