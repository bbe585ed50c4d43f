"""The transfer engine: registers requests, dispatches events to their transfers, reports.

Each request is one :class:`~kvd.transfer.transfer.Transfer` (an actor running the sans-IO
state machine of :mod:`protocol.transfer_fsm`); the engine only finds the transfer an event
belongs to — by (peer node, request id): ids are per peer pair, unique while live — and turns
the machine's reports into completions, logs, counters and lease returns.

Rules a caller can rely on:

- an unknown peer is refused at registration (:class:`~protocol.errors.UnknownPeer`);
- blocks registered to an unfinished request cannot be registered to another, nor freed;
- only the registering session cancels a request (or an operator with ``force``);
- a wait that expires (``timeout_s``, :mod:`kvd.executor.waits`) leaves the transfer going on;
- one ``transfer.done`` or one ``transfer.failed`` per request and side, never both;
- a side reports failure, and its blocks and slots go back, only once no write can land in
  them: an executor that disconnects leaves its blocks with the transfer until then;
- finished requests do not count against the session's limits, waited for or not;
- an ended request someone may still ask about (a side that ended before all its ranks
  registered, gen failed before ctx spoke, a gen side known only by ctx's failure notice) is
  remembered until its deadline, at least ``remember_ended_s`` after it ended, at most
  ``max_ended_requests`` of them: a late rank or message learns how it ended.
"""

from __future__ import annotations

import contextlib
import math
import time
from functools import partial
from typing import TYPE_CHECKING

import msgspec
import structlog
import trio

from kvd.config import usable_cpus
from kvd.ops.collector import IdleCollector
from kvd.ops.throttle import Throttle
from kvd.transfer.requests import Side, add_registration, rank_registered
from kvd.transfer.timers import DueHeap
from kvd.transfer.transfer import Env, Transfer
from kvd.transfer.words import CompletionPage
from protocol import messages as m
from protocol import transfer as x
from protocol import transfer_fsm as f
from protocol.errors import (
    BadRequest,
    BlocksInUse,
    DuplicateRequest,
    KvdError,
    LimitExceeded,
    LocalProtocolError,
    NotFound,
    PeerUnavailable,
    PermissionDenied,
    UnknownPeer,
    error_from_code,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from kvd.daemon import Daemon
    from kvd.executor.session import Session
    from kvd.peer.links import PeerLink, PeerLinks
    from kvd.transport import NixlAgent
    from kvd.transport.setup import Staging, Transport

log = structlog.get_logger("kvd.transfer")
#: A peer at its unclaimed limit may send requests at will: one line, then a count.
_throttle = Throttle(log)

_ROLE = {f.Role.CTX: "ctx", f.Role.GEN: "gen"}
# the roles and states registration tests, as module constants (an enum member fetched through
# the module and its class is two Python-level attribute lookups per use)
_CTX, _GEN = f.Role.CTX, f.Role.GEN
_IDLE, _REGISTERING = f.State.IDLE, f.State.REGISTERING
#: Ended requests a session may leave uncollected (never waited for) before the oldest are dropped.
MAX_UNCOLLECTED = 1024


class Engine:
    """Owns NIXL, the peer links, the bounce staging and every transfer of this daemon."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.cfg = daemon.config.transfer
        self.node = daemon.config.node
        self.transfers: dict[tuple[str, str], Transfer] = {}
        self._by_session: dict[int, dict[str, Transfer]] = {}
        self._busy: dict[str, dict[int, Transfer]] = {}  # pool -> block -> unfinished request
        self.transport: Transport | None = None
        #: the completion page: executors (and same-node peers' GPUs) see sides done there
        self.words = CompletionPage()
        self.links: PeerLinks | None = None
        self.peer_port = 0
        self._nursery: trio.Nursery | None = None
        self._running = 0
        self._live: set[Transfer] = set()
        self._idle: trio.Event | None = None  # what wait_idle waits on, made when it first waits
        self._busy_ev = trio.Event()  # set while a request is unfinished: the busy poll spins
        self.busy_poll = self.cfg.busy_poll_on()
        self.busy_passes = 0  # scheduler passes the busy poll spun (Stats.busy_poll_passes)
        self.collector = IdleCollector()
        self._wake = trio.Event()  # set when a transfer takes a NIXL path: the idle poller wakes up
        # transfers whose path moves bytes over NIXL: the poller spins while one runs. Mapped
        # and local transfers need no notification, and a spinning poller is a task step in
        # every scheduler pass (and a core busy) for the whole life of every request
        self._nixl_live: set[Transfer] = set()
        # per peer node: transfers its messages started that no local executor registered yet
        # (bounded by [limits] max_unclaimed_per_peer; a local registration or the end claims one)
        self._unclaimed: dict[Transfer, str] = {}  # transfer -> the node it counts against
        self._unclaimed_count: dict[str, int] = {}
        # work a registration started that runs once the executor has its reply (run_after_reply)
        self._after_reply: list[Callable[[], None]] | None = None
        self._deferred: list[Callable[[], None]] = []
        # (session, request) pairs answered by a side's report, collected after its replies
        self._collects: list[tuple[int, Transfer]] = []
        # ended requests remembered for late ranks and messages, by when they are forgotten
        # (one task for all: _expire_ended)
        self._ended: DueHeap[Transfer] = DueHeap()
        # the deadlines of transfers with no actor task (most never start one), served by one
        # task (_watch_deadlines). Entries are not removed when a transfer ends or its actor
        # starts (it is skipped when due); the heap is compacted when it doubles, so ended
        # transfers are not held until their deadlines
        self._deadlines: DueHeap[Transfer] = DueHeap()
        self._deadlines_limit = 64
        self.actors_started = 0  # transfers' actor tasks started (Stats.transfer_actors)
        self.tasks_started = 0  # transfers' data-path tasks started (Stats.transfer_tasks)
        self._env = Env(node=self.node, cfg=self.cfg, nixl=self._nixl, links=lambda: self.links,
                        staging=self._staging, on_report=self._on_report, after_report=self._after_report,
                        on_finished=self._on_finished,
                        on_nixl=self._on_nixl, after_reply=self._defer, spawn=self._spawn,
                        watch=self._watch_deadline, words=self.words, replies_now=self.daemon.replies_now)

    # -- lifecycle --------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Bring up NIXL and the peer links; then serve transfers until cancelled."""
        from kvd.peer.links import PeerLinks
        from kvd.transport import poll_notifications
        from kvd.transport.setup import setup_transport

        chunk = self.cfg.chunk_mb << 20
        slots = max(1, (self.cfg.bounce_size_mb << 20) // chunk)
        transport = await trio.to_thread.run_sync(partial(setup_transport, self.daemon, chunk, slots))
        self.transport = transport
        await self._register_words()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.links = PeerLinks(self.daemon.config, transport, self.daemon.pools, self.daemon.version,
                                       deliver=self.deliver, link_up=self.link_up, link_lost=self.link_lost)
                self.peer_port = await nursery.start(self.links.run)
                # one poller for the agent's life: without NIXL's progress thread it also drives
                # UCX; it spins while transfers run over NIXL and backs off otherwise. Where the
                # loop may not spin (busy_poll off: few cores) it spins politely, yielding the
                # CPU every round to the worker threads that copy host chunks and post writes
                nursery.start_soon(partial(poll_notifications, transport.agent, self._on_notif,
                                           hot=lambda: bool(self._nixl_live), polite=not self.busy_poll,
                                           idle_max=0.05, wakeup=lambda: self._wake))
                if self.busy_poll:
                    nursery.start_soon(self._busy_poll)
                nursery.start_soon(self._expire_ended)
                nursery.start_soon(self._watch_deadlines)
                await nursery.start(self.collector.run)
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(transport.close)

    async def _register_words(self) -> None:
        """With GPU pools: the completion page registered with CUDA, so the mapped path's
        kernel stream can store our ctx executors' tokens (speed only: logged if refused)."""
        devices = sorted({p.device for p in self.daemon.pools.values() if p.device >= 0})
        if not devices:
            return
        from kvd.regroup import signal

        view = self.words.view
        try:
            self.words.device_ptr = await trio.to_thread.run_sync(signal.register_host, view.address, view.nbytes,
                                                                  devices[0])
        except Exception as exc:
            log.warning("transfer.completion_page_not_registered", error=str(exc),
                        fallback="ctx executors wait for their replies")

    async def _busy_poll(self) -> None:
        """While a request is unfinished, keep the event loop from sleeping in the kernel: each
        ``trio.sleep(0)`` is a scheduler pass that polls the sockets without blocking, so the
        next frame (a publish, the peer's data-done, an executor's wait) is handled when it
        arrives instead of after a wake-up. Measured on the H200 host (a sandboxed kernel): the
        1-block request's end-to-end p50 1.6 -> 1.15 ms, the publish reply 0.42 -> 0.16 ms.
        Sleeps (no cost) while nothing is pending."""
        log.info("transfer.busy_poll", cpus=usable_cpus())
        while True:
            if not self._running:
                await self._busy_ev.wait()
            self.busy_passes += 1
            await trio.sleep(0)

    def inflight(self) -> list[str]:
        """Request ids of the transfers still running (a side not ended yet, or a write not
        confirmed yet), sorted: what a drain waits for."""
        return sorted({t.request_id for t in self._live})

    def stop_requests(self, exc: KvdError,
                      pick: Callable[[tuple[str, str], f.TransferMachine], list[f.Role]]) -> list[str]:
        """A stopping daemon fails, with ``exc``, the sides ``pick`` names of every unfinished
        request (:mod:`kvd.transfer.stopping`); returns their request ids. Through the machine:
        a side reports once no write can land."""
        stopped: set[str] = set()
        for t in list(self.transfers.values()):
            if t.finished.is_set():
                continue
            for role in pick(t.key, t.machine):
                t.feed(f.LocalFailure(role, exc.code, exc.message))
                stopped.add(t.request_id)
        return sorted(stopped)

    async def wait_idle(self) -> None:
        """Return once no transfer is running."""
        while self._running:
            if self._idle is None:
                self._idle = trio.Event()
            await self._idle.wait()

    async def flush_links(self) -> None:
        """Write out the transfer messages still queued on the peer links (a stopping daemon
        calls it before the links close)."""
        if self.links is not None:
            await self.links.flush()

    async def drained(self) -> None:
        """Alias of :meth:`wait_idle` (the daemon's drain)."""
        await self.wait_idle()

    def _nixl(self) -> NixlAgent | None:
        return self.transport.agent if self.transport is not None else None

    def _staging(self) -> Staging | None:
        return self.transport.staging if self.transport is not None else None

    # -- stats ------------------------------------------------------------------------------
    def active_count(self) -> int:
        return self._running

    def bounce_chunks_total(self) -> int:
        st = self._staging()
        return st.recv_slots.count + st.send_slots.count if st is not None else 0

    def bounce_chunks_in_use(self) -> int:
        st = self._staging()
        return st.recv_slots.in_use + st.send_slots.in_use if st is not None else 0

    def peers_connected(self) -> int:
        return len(self.links.links) if self.links is not None else 0

    def transfer_infos(self) -> list[m.TransferInfo]:
        return [info for t in self.transfers.values() if not t.forgetting for info in t.info()]

    # -- executor requests ------------------------------------------------------------------
    def _check_peer(self, peer: str) -> None:
        if not peer or peer == self.node or (self.links is not None and peer in self.links.links):
            return  # connected: the usual case, without building the set the refusal names
        known = {p.name for p in self.daemon.config.peers}
        if self.links is not None:
            known.update(self.links.links)
            known.update(self.links.seen)
        if peer not in known:
            raise UnknownPeer(f"peer {peer!r} is neither configured nor connected "
                              f"(known peers: {sorted(known) or 'none'}; this node: {self.node!r}): check the "
                              "name; a peer that dials this daemon (this node in its [[peers]]) is known once "
                              "its link is up, which after this daemon (re)started takes its first redial: "
                              "retry when 'kvctl peers' lists it, or list it in this daemon's [[peers]] too")

    def _find(self, role: f.Role, rid: str, peer: str) -> tuple[str, Transfer | None]:
        """The key a registration belongs to, and its transfer if one exists."""
        local = peer == self.node
        if role is f.Role.CTX or peer:
            key_peer = self.node if local else peer
            t = self.transfers.get((key_peer, rid))
            if t is None and local:
                # gen registered here without naming a peer: ctx publishing to us joins it
                t = self.transfers.get(("", rid))
            return key_peer, t
        # gen without a peer: an offer that came first, or a local ctx side
        ended: tuple[str, Transfer] | None = None
        for (p, r), t in self.transfers.items():
            if r != rid or not p or f.Role.GEN not in t.machine.here:
                continue
            if not t.finished.is_set():
                return p, t  # an offer that came first (or the gen side it already has)
            if t.machine.state(f.Role.GEN) in f.FINAL:
                # a late rank of a side that already ended learns how; so does the first rank
                # when ctx's offer and then its failure came before any rank (a ctx abort)
                ended = (p, t)
        local_ctx = self.transfers.get((self.node, rid))
        if local_ctx is not None and not local_ctx.finished.is_set():
            return self.node, local_ctx
        unmatched = self.transfers.get(("", rid))
        if unmatched is None and ended is not None:
            return ended
        return "", unmatched

    def _pair(self, t: Transfer) -> str:
        """The pair of daemons among whose live requests ``t``'s id is unique (for messages)."""
        if t.peer == self.node:
            return f"this daemon {self.node!r} alone: ctx and gen both on it, the local path"
        if not t.peer:
            return "this daemon and the ctx daemon that will offer it (gen named no peer)"
        return f"this daemon and peer {t.peer!r}"

    async def register(self, session: Session, msg: m.Expect | m.Publish) -> tuple[int, int]:
        """Add one rank's registration; raises (changing nothing) when it is refused. Returns
        the side's completion slot and token (:mod:`kvd.transfer.words`; -1, 0: none)."""
        role = _GEN if isinstance(msg, m.Expect) else _CTX
        rid = msg.request_id
        pool = self.daemon.pool(msg.pool)
        deadline_s = msg.deadline_s if msg.deadline_s is not None else self.cfg.deadline_s
        if not deadline_s > 0 or not math.isfinite(deadline_s):
            raise BadRequest(f"request {rid!r}: deadline_s must be positive and finite, got {deadline_s}")
        if role is _CTX and not msg.peer:
            raise BadRequest(f"request {rid!r}: publish needs the gen peer's node name")
        try:
            pool.blocks.check_leased(session.id, msg.block_ids)  # the caller's own mistakes first
        except BadRequest as exc:  # a block id listed twice: which registration named it
            raise BadRequest(f"request {rid!r} ({_ROLE[role]} rank {msg.rank}): {exc.message}") from None
        self._check_peer(msg.peer)
        key_peer, t = self._find(role, rid, msg.peer)
        mine = self._by_session.get(session.id)
        earlier = mine.get(rid) if mine is not None else None
        if earlier is not None and earlier is not t:
            raise DuplicateRequest(f"request {rid!r}: this session registered it already, with another peer "
                                   f"({earlier.peer or 'none yet'}); its wait and cancel name one request")
        if t is not None:
            machine = t.machine
            side_state = machine.ctx if role is _CTX else machine.gen
            st = side_state.state
            if st is f.State.FAILED:
                raise error_from_code(side_state.code, f"request {rid!r} already failed: {side_state.message}")
            side = t.sides.get(role)
            part = side.parts.get(msg.rank) if side is not None else None
            if part is not None:  # this rank registered it already: by whom, and what to do
                ended = st.value if t.finished.is_set() or st in f.FINAL else ""
                raise rank_registered(rid, _ROLE[role], part, session, pair=self._pair(t), ended=ended)
            if t.finished.is_set() or (st is not _IDLE and st is not _REGISTERING):
                raise DuplicateRequest(f"request {rid!r} ({_ROLE[role]}) is already registered or ran; "
                                       "use a new request id")
            if role not in machine.here and (machine.talked or st is not _IDLE):
                raise DuplicateRequest(f"request {rid!r}: the {_ROLE[role]} side is played by peer {t.peer}")
        busy = self._busy.get(pool.name)
        if busy is None:
            busy = self._busy[pool.name] = {}
        if not busy.keys().isdisjoint(msg.block_ids):
            self._settle_holders(busy, msg.block_ids)
            for b in msg.block_ids:
                holder = busy.get(b)
                if holder is not None and holder is not t:
                    raise BlocksInUse(f"block {b} of pool {pool.name!r} belongs to unfinished request "
                                      f"{holder.request_id!r}; it cannot be registered to {rid!r}")
        deadline = trio.current_time() + deadline_s
        side = add_registration(t.sides.get(role) if t is not None else None, session, msg, pool,
                                _ROLE[role], deadline)  # type: ignore[arg-type]
        if t is None:
            # ctx and gen on this daemon: one machine plays both sides (the local path)
            t = self._start(rid, key_peer, {_CTX, _GEN} if key_peer == self.node else {role})
        elif role not in t.machine.here:
            try:
                t.machine.host(role)
            except LocalProtocolError as exc:
                raise DuplicateRequest(f"request {rid!r}: {exc.message}") from None
            if t.peer == "":  # an unmatched gen side joined by a local ctx
                self.transfers.pop(t.key, None)
                t.peer = self.node
                self.transfers[t.key] = t
        if side.word < 0:
            side.word, side.token = self.words.take()
        t.sides[role] = side
        self._claim(t)
        complete = side.complete
        if complete:
            side.complete_at = time.monotonic()
        event: f.Event = (f.SideComplete(role, deadline=deadline, deadline_s=deadline_s, peer_named=role is _GEN
                                         and bool(msg.peer) and msg.peer != self.node)
                          if complete else f.RankRegistered(role, deadline=deadline, deadline_s=deadline_s))
        busy.update(dict.fromkeys(msg.block_ids, t))
        session.requests.add(rid)
        if mine is None:
            mine = self._by_session[session.id] = {}
        mine[rid] = t
        if len(mine) > MAX_UNCOLLECTED:  # a session that never waits: forget its oldest ended ones
            for old in list(mine.values())[: len(mine) - MAX_UNCOLLECTED]:
                if old.finished.is_set():
                    self._collect(session.id, old)
        # last: the transfer may act on it at once (start the data path, or report an outcome,
        # which releases what was just recorded); a data path that runs in the caller's step
        # waits for run_after_reply, so the executor has its reply first
        self._after_reply = self._deferred
        try:
            t.feed(event)
        finally:
            self._after_reply = None
        return side.word, side.token

    def _defer(self, fn: Callable[[], None]) -> bool:
        if self._after_reply is None:
            return False
        self._after_reply.append(fn)
        return True

    def run_after_reply(self) -> None:
        """Run what the registration just handled left for after its reply (the session calls
        this once the reply is written, or before it awaits the socket, with no checkpoint
        between the registration and here: nothing else can happen to the request meanwhile)."""
        work, self._deferred = self._deferred, []
        for fn in work:
            try:
                fn()
            except Exception:  # a bug: that request fails at its deadline, the session serves on
                log.exception("transfer.internal_error")

    def _start(self, rid: str, peer: str, here: set[f.Role]) -> Transfer:
        assert self._nursery is not None
        t = Transfer(self._env, rid, peer, here)
        self.transfers[t.key] = t
        self._live.add(t)
        self._running += 1
        if self.busy_poll:
            self._busy_ev.set()
        # no task yet: the transfer starts its actor if something must wait (_spawn)
        return t

    def _spawn(self, fn: Callable[[], Awaitable[None]], actor: bool) -> None:
        """Start a transfer's task (its ``actor``, or a data-path task) in the engine's nursery."""
        assert self._nursery is not None
        if actor:
            self.actors_started += 1
        else:
            self.tasks_started += 1
        self._nursery.start_soon(fn)

    def _watch_deadline(self, t: Transfer) -> None:
        """``t``'s deadline moved while no actor watches it: the timer task tells it when due."""
        due = t.machine.deadline
        if not math.isfinite(due):
            return
        heap = self._deadlines
        if len(heap) >= self._deadlines_limit:
            heap.keep(lambda other: not other.finished.is_set())
            self._deadlines_limit = max(64, 2 * len(heap))
        heap.push(due, t)

    async def _watch_deadlines(self) -> None:
        """Tell each transfer with no actor when its deadline is due (one task for all of them)."""

        def due(t: Transfer) -> None:
            try:
                t.deadline_passed()
            except Exception:  # a bug: that request is not expired, the engine serves on
                log.exception("transfer.internal_error", request_id=t.request_id)

        await self._deadlines.serve(due)

    def _on_nixl(self, t: Transfer) -> None:
        """``t`` moves bytes over NIXL: the poller spins (woken at once if it sleeps) until it ends."""
        if not t.finished.is_set():
            self._nixl_live.add(t)
            self._wake.set()
            self._wake = trio.Event()

    def _of_session(self, session: Session, rid: str) -> Transfer:
        t = self._by_session.get(session.id, {}).get(rid)
        if t is None:
            raise NotFound(f"request {rid!r} is not registered by this session")
        return t

    def completion_now(self, session: Session, msg: m.Wait) -> m.Completion | None:
        """The reply to ``msg`` if the request has ended already (None: :meth:`wait` it).
        Raises as :meth:`wait` does for a request this session did not register."""
        t = self._of_session(session, msg.request_id)
        sides = [s for s in t.sides.values() if session.id in s.sessions()]
        if not sides or any(s.completion is None for s in sides):
            return None
        completion = sides[0].completion
        assert completion is not None
        self._collect(session.id, t)
        return msgspec.structs.replace(completion, id=msg.id)

    def watch(self, session: Session, msg: m.Wait, answer: Callable[[m.Completion], object]) -> Callable[[], None]:
        """Call ``answer`` with the completion of the session's side(s) of the request in the step
        that reports the last of them (the executor's reply goes out there, with no task to wake
        up); the request is then collected for the session. Returns what ends the watch (no call
        after it: the wait expired, or its session ended). Raises as :meth:`completion_now` does
        for a request this session did not register; call that first (a request that has ended
        already is never reported again)."""
        t = self._of_session(session, msg.request_id)
        sides = [s for s in t.sides.values() if session.id in s.sessions()]
        watching = [True]

        def reported() -> None:
            if watching[0] and all(s.completion is not None for s in sides):
                watching[0] = False
                first = sides[0].completion
                assert first is not None
                try:
                    answer(msgspec.structs.replace(first, id=msg.id))
                finally:
                    # collected once every waiter of the side has its reply (_after_report)
                    self._collects.append((session.id, t))

        def stop() -> None:
            watching[0] = False

        for s in sides:
            if s.completion is None:
                s.on_reported.append(reported)
        return stop

    async def cancel(self, session: Session, msg: m.Cancel) -> None:
        """Cancel the request: the registering session's sides, or every side with ``force``."""
        rid = msg.request_id
        t = self._by_session.get(session.id, {}).get(rid)
        if t is not None and not (msg.force and session.operator and t.finished.is_set()):
            targets = [(t, [r for r, s in t.sides.items() if session.id in s.sessions()])]
        else:
            # (an operator's forced cancel looks past its own request of the id that ended)
            found = [t2 for (_p, r), t2 in self.transfers.items() if r == rid]
            if not found:
                raise NotFound(f"no request {rid!r}")
            if t is None and any(p.session is session for t2 in found for side in t2.sides.values()
                                 for p in side.parts.values()):
                return  # this session's request, already ended and collected: nothing to cancel
            if not msg.force:
                raise PermissionDenied(f"request {rid!r} is not registered by this session (another session "
                                       "registered it; a registration that was refused registers nothing): only "
                                       "the registering session, or an operator with force, may cancel it")
            if not session.operator:  # root, the daemon's uid, or [access] operator_gids
                raise PermissionDenied(f"uid {session.uid} is not an operator")
            # the live requests of the id (one per peer pair at most), not one that ended and is
            # only held until its executors collect it: a cancel changes nothing there
            targets = [(t2, list(t2.sides)) for t2 in found if not t2.finished.is_set()]
        reason = f"request {rid!r} cancelled by " + ("an operator" if msg.force else "client")
        for target, roles in targets:
            for role in roles:
                target.feed(f.Cancel(role, reason))

    def _settle_holders(self, held: dict[int, Transfer], block_ids: list[int]) -> None:
        """The unfinished requests holding some of ``block_ids`` that are done in truth (their
        completion token was stored by a GPU: the executor may have seen it and reuse its
        blocks) report now, handing their blocks back, before a registration or free is refused."""
        holders = {t for b in block_ids if (t := held.get(b)) is not None}
        for t in holders:
            t.settle_tokens()

    def check_not_in_flight(self, session: Session, pool: str, block_ids: list[int]) -> None:
        """Refuse to free blocks that a registered, unfinished request still reads or writes."""
        held = self._busy.get(pool, {})
        if not held.keys().isdisjoint(block_ids):
            self._settle_holders(held, block_ids)
        for b in block_ids:
            t = held.get(b)
            if t is not None:
                busy = sorted(i for i in block_ids if i in held)
                raise BlocksInUse(f"blocks {busy[:8]} of pool {pool!r} belong to request {t.request_id!r} "
                                  f"({t.machine.state(f.Role.GEN if f.Role.GEN in t.sides else f.Role.CTX).value}); "
                                  "wait for it or cancel it first")

    async def session_ended(self, session: Session) -> None:
        """The executor is gone: its unfinished sides fail; blocks still writable stay with them."""
        mine = self._by_session.pop(session.id, {})
        for t in mine.values():
            for role, side in t.sides.items():
                parts = [p for p in side.parts.values() if p.session is session]
                if not parts:
                    continue
                if side.completion is None:
                    # the transfer holds these blocks until it reported: no write lands in a reused block
                    for p in parts:
                        p.pool.blocks.hand_over(session.id, self._quarantine(t, role), p.block_ids)
                    # name who left: every rank of the side hears it, the survivors included
                    who = f"{session.client!r}, " if session.client else ""
                    t.feed(f.Disconnect(role, f"request {t.request_id!r}: executor session {session.id} "
                                              f"({who}pid {session.pid}, rank {', '.join(str(p.rank) for p in parts)}) "
                                              "ended before the request did"))
                for p in parts:
                    p.session_gone = True
            self._maybe_forget(t)

    @staticmethod
    def _quarantine(t: Transfer, role: f.Role) -> tuple[str, str, str]:
        return ("transfer", t.slot_owner, role.value)

    def _collect(self, session_id: int, t: Transfer) -> None:
        self._by_session.get(session_id, {}).pop(t.request_id, None)
        for side in t.sides.values():
            for p in side.parts.values():
                if p.session.id == session_id:
                    p.session_gone = True
        self._maybe_forget(t)

    def _maybe_forget(self, t: Transfer) -> None:
        """Drop a finished transfer once no session can still wait for it."""
        if not t.finished.is_set():
            return
        gone = all(p.session_gone for s in t.sides.values() for p in s.parts.values())
        if not gone or self.transfers.get(t.key) is not t or t.forgetting:
            return
        t.forgetting = True
        if not self._late_ranks_may_come(t) and not self._ctx_may_ask(t):
            del self.transfers[t.key]  # every rank here registered and heard the outcome
            return
        # a side ended before all its ranks registered: a late rank still learns how it ended;
        # gen failed before ctx spoke up: ctx's offer, when it comes, is answered with the failure
        self._remember(t)

    @staticmethod
    def _partly_registered(t: Transfer) -> bool:
        """Some ranks of a side here registered, not all."""
        return any(r in t.sides and not t.sides[r].complete for r in t.machine.here)

    @staticmethod
    def _late_ranks_may_come(t: Transfer) -> bool:
        """A side here ended before all its ranks registered: the missing ones may still come."""
        return not all(r in t.sides and t.sides[r].complete for r in t.machine.here)

    @staticmethod
    def _ctx_may_ask(t: Transfer) -> bool:
        """gen's side here failed while the peer's ctx side was never heard from: its offer may
        still come, and must get the failure rather than wait for its deadline."""
        m_ = t.machine
        return (f.Role.GEN in m_.here and not m_.local and m_.state(f.Role.GEN) is f.State.FAILED
                and m_.state(f.Role.CTX) is f.State.IDLE and not t.remote.ref)

    def _remember(self, t: Transfer) -> None:
        """Keep the ended ``t`` until its deadline, and at least ``remember_ended_s`` from now;
        at most ``max_ended_requests`` of them: beyond, the one due first is forgotten now."""
        now = trio.current_time()
        until = remember_until(t.machine.deadline, now, self.cfg.remember_ended_s)
        self._ended.push(until, t)
        limit = self.daemon.config.limits.max_ended_requests
        if len(self._ended) > limit:  # first the entries of requests forgotten before their time
            self._ended.keep(lambda other: self.transfers.get(other.key) is other)
        while len(self._ended) > limit:
            due, old = self._ended.pop_first()
            if self._forget(old):
                log.warning("transfer.forgotten_early", request_id=old.request_id, peer=old.peer,
                            due_in_s=round(due - now, 3), limit=limit)

    def _forget(self, t: Transfer) -> bool:
        """Drop the remembered ``t`` (False: another request holds its key already)."""
        if self.transfers.get(t.key) is t:
            del self.transfers[t.key]
            return True
        return False

    async def _expire_ended(self) -> None:
        """Forget each remembered request when it is due (one task for all of them)."""

        def due(t: Transfer) -> None:
            if self._forget(t):
                log.debug("transfer.forgotten", request_id=t.request_id, peer=t.peer)

        await self._ended.serve(due)

    # -- reports (called by transfers) ------------------------------------------------------
    def _on_report(self, t: Transfer, side: Side, c: m.Completion) -> None:
        """A side reported, before its executors' replies: a failure is logged first (an
        executor told of it, or a test reading the log then, finds why). Everything else
        waits for :meth:`_after_report`: the replies are what the executors wait for."""
        if c.ok:  # a spinning executor sees it here, before the reply is written
            self.words.done(side.word, side.token, c.bytes, c.path, c.chunks, c.duration_s)
        else:
            log.warning("transfer.failed", request_id=t.request_id, role=side.role, peer=t.peer,
                        code=c.error_code, error=c.error_message, bytes=side.bytes_done, chunks=side.chunks_done)

    def _after_report(self, t: Transfer, side: Side, c: m.Completion) -> None:
        """The rest of a reported side, once its executors' replies are out, in the same step
        (no client request is read before it ends, so none finds a block still held, a request
        still counted or a figure missing): its blocks and slots go back, the ``transfer.done``
        line, the answered waits collected, counters, metrics, history."""
        role = f.Role.CTX if side.role == "ctx" else f.Role.GEN
        for part in side.parts.values():
            busy = self._busy.get(part.pool.name, {})
            for b in part.block_ids:
                if busy.get(b) is t:
                    del busy[b]
            part.session.requests.discard(t.request_id)
            part.pool.blocks.release_session(self._quarantine(t, role))
        staging = self._staging()
        if staging is not None:
            (staging.send_slots if role is f.Role.CTX else staging.recv_slots).release_owner(t.slot_owner)
        if c.ok:
            log.info("transfer.done", request_id=t.request_id, role=side.role, peer=t.peer, bytes=c.bytes,
                     duration_s=round(c.duration_s, 6),
                     gbps=round(c.bytes / c.duration_s / 1e9, 3) if c.duration_s > 0 else 0.0,
                     path=c.path, chunks=c.chunks, fallback=c.fallback or None,
                     round_trips=t.round_trips if role is f.Role.CTX else None, stages=side.stages or None)
        collects, self._collects = self._collects, []
        for session_id, answered in collects:
            self._collect(session_id, answered)
        d = self.daemon
        d.transfer_finished(side)  # kept for `kvctl transfers` after executors collect it
        if c.ok:
            d.counters.transfers_done += 1
            if side.role == "ctx":
                d.counters.bytes_sent += c.bytes
            else:
                d.counters.bytes_received += c.bytes
            d.metrics.transfer_done(side.role, c.path, c.bytes, c.duration_s)
        else:
            d.counters.transfers_failed += 1
            d.metrics.transfer_failed(c.error_code)
        d.update_pool_metrics({p.pool.name for p in side.parts.values()})

    def _on_finished(self, t: Transfer) -> None:
        for side in t.sides.values():  # no write of their tokens can come any more
            self.words.give_back(side.word)
            side.word = -1
        self._claim(t)
        self._live.discard(t)
        self._nixl_live.discard(t)
        self._running -= 1
        if self._running == 0:
            self.collector.idle()  # garbage collections now, between requests, not inside them
            if self._idle is not None:  # someone waits (a drain)
                self._idle.set()
                self._idle = None
            if self.busy_poll:
                self._busy_ev = trio.Event()
        self._maybe_forget(t)

    # -- peer links (called by PeerLinks) ---------------------------------------------------
    async def deliver(self, link: PeerLink, msg: x.XferMessage) -> None:
        """Route one transfer-control message from ``link`` into its transfer's inbox."""
        rid = msg.request_id
        t = self.transfers.get((link.node, rid))
        if isinstance(msg, x.XferFail) and (t is None or _about_another(t, msg)):
            if msg.sender == "gen":
                # gen's notice about no request here, or another than t (another of gen's than
                # the one t heard, or an earlier one of ours of this id, which ended here with its
                # writes): gen waits for our word that no write can land, so it is answered below,
                # as for a request we no longer know. (Dropped, it left gen aborting for good: a
                # link cut lost the first notice, and ctx's executor registered the id again
                # before the notice came on the next link)
                t = None
            elif t is not None or msg.peer_ref:
                # ctx's failure notice, or its answer to ours, about an earlier request of this
                # id, which ended here (e.g. gen's cancel crossed ctx's data-done message, and an
                # executor registered the id again before the answer was read)
                log.debug("transfer.stale_answer", peer=link.node, request_id=rid, code=msg.code)
                return
        ctx_unheard = isinstance(msg, x.XferFail) and msg.sender == "ctx" and msg.deadline_s > 0
        if t is None and (ctx_unheard or isinstance(msg, x.XferOffer | x.XferPath)):
            # a gen side that ended here without naming its peer (remembered until its deadline)
            unmatched = self.transfers.get(("", rid))
            if unmatched is not None and unmatched.finished.is_set():
                t = unmatched
        if t is not None and isinstance(msg, x.XferFail) and msg.sender == "gen" and f.Role.CTX in t.machine.here:
            mine = t.machine.side(f.Role.CTX)
            if mine.state in f.FINAL:
                # gen waits for our word that no write of ours can land. We said so when our
                # side ended, but that may have been lost with a link (gen's notice comes on
                # the next one): say it again, else gen waits for its deadline
                if mine.state is f.State.FAILED:
                    code, message = mine.code, mine.message
                else:
                    code, message = PeerUnavailable.code, "the ctx side had already finished sending"
                await self._tell(link, x.XferFail(request_id=rid, code=code, message=message, writes_stopped=True,
                                                  sender="ctx", peer_ref=msg.ref))
        if t is not None and t.finished.is_set() and isinstance(msg, x.XferOffer | x.XferAnnounce) \
                and _from_another(t, msg) and not self._partly_registered(t):
            # the peer started a new request of this id (its number differs from the one this
            # ended request heard): the peer's side of the old one ended, so no late message of
            # it needs an answer from here. Without this, the new request got the old one's
            # failure (a retry after a deadline failed with that deadline's message). Not when
            # some ranks of the ended one registered here and others may still come: they are
            # refused with how it ended, and the peer's retry is answered with it too. (With no
            # rank here, a late one and one of the retry cannot be told apart: the retry wins)
            log.debug("transfer.replaced", peer=link.node, request_id=rid, type=type(msg).__name__)
            self._forget(t)
            t = None
        if t is not None and t.finished.is_set() and isinstance(msg, x.XferOffer | x.XferAnnounce | x.XferPath):
            sender = "ctx" if isinstance(msg, x.XferAnnounce) else "gen"
            mine = t.machine.side(f.Role(sender))
            if f.Role(sender) in t.machine.here and mine.state is f.State.FAILED:
                # our side failed before the peer's got going: tell it why, not "ran already"
                await self._tell(link, x.XferFail(request_id=rid, code=mine.code, message=mine.message,
                                                  writes_stopped=True, sender=sender, peer_ref=msg.ref))
                if not isinstance(msg, x.XferPath):
                    # the peer's request now has a number here: a later one of this id is
                    # told apart (transfer.replaced), and gen no longer waits for ctx's offer
                    t.remote.ref = t.remote.ref or msg.ref
                    if t.forgetting and not self._late_ranks_may_come(t):
                        self._forget(t)  # remembered only for that offer, which got its answer
                return
            if isinstance(msg, x.XferPath):
                log.debug("transfer.late_message", peer=link.node, request_id=rid, type="XferPath")
                return
            await self._refuse(link, rid, sender,
                               DuplicateRequest(f"request {rid!r} already ran here; use a new request id"))
            return
        if t is None:
            if isinstance(msg, x.XferOffer) or ctx_unheard:
                # ctx's offer, or its failure before it heard from us (it had not offered, or
                # its offer never came): gen ranks waiting for any offer take it; else a new
                # gen side starts, so that the ranks that expect it later learn how it went
                t = self._find(f.Role.GEN, rid, "")[1]
                if t is not None and (t.peer == "" or t.peer == link.node) and f.Role.CTX not in t.machine.here \
                        and not t.finished.is_set():
                    self.transfers.pop(t.key, None)
                    t.peer = link.node
                    self.transfers[t.key] = t
                else:
                    t = await self._start_unclaimed(link, rid, f.Role.GEN)
            elif isinstance(msg, x.XferAnnounce):
                t = await self._start_unclaimed(link, rid, f.Role.CTX)
            elif isinstance(msg, x.XferFail) and msg.sender == "gen":
                # gen waits for our word that no write of ours can land: none ever will
                await self._refuse(link, rid, "ctx", NotFound(f"no request {rid!r} here"), peer_ref=msg.ref)
                return
            else:
                log.debug("transfer.unknown_request", peer=link.node, request_id=rid, type=type(msg).__name__)
                return
            if t is None:
                return  # refused: the peer has too many requests here that nobody registered
        if not t.peer_instance:
            t.peer_instance = link.agent
        t.post(msg)

    async def _start_unclaimed(self, link: PeerLink, rid: str, role: f.Role) -> Transfer | None:
        """A transfer the peer's message starts before any local rank registered it (the
        ``role`` side is ours); None, and the peer told ``limit_exceeded``, when that peer has
        ``max_unclaimed_per_peer`` such transfers already."""
        count = self._unclaimed_count.get(link.node, 0)
        limit = self.daemon.config.limits.max_unclaimed_per_peer
        if count >= limit:
            _throttle.warning("transfer.unclaimed_limit", peer=link.node, request_id=rid, limit=limit)
            sender = "gen" if role is f.Role.GEN else "ctx"
            await self._refuse(link, rid, sender, LimitExceeded(
                f"request {rid!r}: {link.node} has {limit} requests here that no local rank has registered "
                "([limits] max_unclaimed_per_peer)"))
            return None
        t = self._start(rid, link.node, {role})
        self._unclaimed[t] = link.node
        self._unclaimed_count[link.node] = count + 1
        return t

    def _claim(self, t: Transfer) -> None:
        """``t`` no longer counts against its peer's unclaimed limit (registered here, or ended)."""
        node = self._unclaimed.pop(t, None)
        if node is None:
            return
        left = self._unclaimed_count[node] - 1
        if left:
            self._unclaimed_count[node] = left
        else:
            del self._unclaimed_count[node]

    async def _refuse(self, link: PeerLink, rid: str, sender: str, exc: KvdError, peer_ref: int = 0) -> None:
        await self._tell(link, x.XferFail(request_id=rid, code=exc.code, message=exc.message,
                                          writes_stopped=True, sender=sender, peer_ref=peer_ref))

    @staticmethod
    async def _tell(link: PeerLink, msg: x.XferFail) -> None:
        with contextlib.suppress(KvdError):
            await link.send(msg)

    def link_up(self, link: PeerLink) -> None:
        """A link to ``link.node`` is up: a new peer instance proves the old one writes no more."""
        for t in list(self.transfers.values()):
            if t.peer == link.node and t.peer_instance and t.peer_instance != link.agent \
                    and not t.finished.is_set():
                t.post(f.PeerFenced())

    def link_lost(self, node: str, reason: str) -> None:
        """The link to ``node`` broke: every live transfer with it fails (and waits for quiet)."""
        for t in list(self.transfers.values()):
            if t.peer == node and not t.finished.is_set():
                t.post(f.PeerLost(reason))

    # -- NIXL notifications -----------------------------------------------------------------
    def _on_notif(self, remote: str, raw: bytes) -> None:
        """Route one NIXL notification to the transfer receiving it (never blocks)."""
        n = x.decode_notif(raw)
        if n is None or self.links is None:
            return
        node = self.links.node_of_agent(remote)
        t = self.transfers.get((node, n.request_id)) if node else None
        if t is not None and not t.finished.is_set():
            if n.ref and n.ref != t.ref:
                # a late notification of an earlier request of this id (a write's, or a credit,
                # still queued in NIXL when that request ended here): not this one's
                log.debug("transfer.stale_notification", peer=node, request_id=n.request_id, ref=n.ref)
                return
            t.post(n)


def _from_another(t: Transfer, msg: x.XferFail | x.XferOffer | x.XferAnnounce) -> bool:
    """Whether ``msg`` comes from another request of the peer's than the one ``t`` heard from
    (both numbers known, and they differ)."""
    return bool(msg.ref and t.remote.ref and msg.ref != t.remote.ref)


def _about_another(t: Transfer, msg: x.XferFail) -> bool:
    """Whether the peer's failure notice ``msg`` is about another request of its id than ``t``:
    it names another number of ours (``peer_ref``), or comes from another of the peer's
    requests than the one ``t`` heard. A notice naming no number is matched by its id alone."""
    return bool(msg.peer_ref and msg.peer_ref != t.ref) or _from_another(t, msg)


def remember_until(deadline: float, now: float, at_least_s: float) -> float:
    """When an ended request with ``deadline`` (``inf``: none known) is forgotten: at its
    deadline, and no sooner than ``at_least_s`` after ``now`` (its end)."""
    floor = now + at_least_s
    return deadline if math.isfinite(deadline) and deadline > floor else floor
