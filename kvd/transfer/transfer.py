"""One :class:`Transfer` per request: its state machine, its deadline, its leases, its tasks.

The transfer is an actor. Everything that happens to the request — executor registrations,
cancels and disconnects (fed by the engine), the peer's transfer-control messages (from the
peer link), NIXL notifications (from the poller) and what its own data-path tasks report — is
fed to the sans-IO :class:`~protocol.transfer_fsm.TransferMachine`, in order, and the actions it
returns are carried out in order: send a message, start the data path, abort writes, report to
the executors. When the actor has nothing pending this happens in the caller's step, as far
as the actions need no waiting; the rest (and everything that comes meanwhile) goes through
the actor's inbox (a trio memory channel). It never decides on its own when a side has failed
or may give its blocks back: the machine does.

The actor's task is started only when something must wait: an event or action queued behind
pending work, or an action that must await (a message the link's writer cannot take now). A
request handled entirely in its callers' steps (a small mapped request: registration, plan,
copy and report in the publish's step) never has one: its data-path tasks, if any, run in the
engine's nursery (:attr:`Env.spawn`), its deadline is watched by the engine's one timer task
(:attr:`Env.watch`, :meth:`Transfer.deadline_passed`) until an actor runs, and it ends
(``finished``, :attr:`Env.on_finished`) in the step that sees its machine final with no task
left. A task per request cost ~80 us (profiled) to create and ~45 us of scheduler work.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
import trio

from kvd.mapping.words import SLOT_BYTES
from kvd.ops.logctx import bind_request_id, unbind_request_id
from kvd.ops.steptrace import mark
from kvd.regroup import landed
from kvd.regroup.landed import LandedMark
from kvd.regroup.plan import CheckedBlocks, Plan, check_blocks, plan
from kvd.transfer.lazychannel import LazyChannel
from kvd.transfer.movers import gpu_tokens, wait_polling
from kvd.transfer.paths import bounce, direct, fragment, local, mapped
from kvd.transfer.paths.base import Job, Sent
from kvd.transfer.requests import Side
from kvd.transfer.words import CompletionPage
from protocol import messages as m
from protocol import transfer as x
from protocol import transfer_fsm as f
from protocol.errors import (
    InternalError,
    KvdError,
    LocalProtocolError,
    PeerUnavailable,
    RemoteProtocolError,
    TransferCancelled,
    TransferTimeout,
)
from protocol.layout import KVLayout
from protocol.limits import MAX_DEADLINE_S

if TYPE_CHECKING:
    from kvd.config import TransferConfig
    from kvd.peer.links import PeerLink, PeerLinks
    from kvd.transport import NixlAgent
    from kvd.transport.setup import Staging

log = structlog.get_logger("kvd.transfer")

#: Up to this many request blocks (over all ranks) the planner runs on the event loop: it only
#: validates and computes boxes there (fragments are lazy), less than a worker-thread hop.
INLINE_PLAN_BLOCKS = 4096

#: Receive slots a gen side grants with its announce (the bounce path then starts at once).
PREGRANT_SLOTS = 2

_PATHS = {p.value: p for p in f.Path}
#: Paths whose bytes (or credits) travel over NIXL: notifications to poll, UCX to drive.
NIXL_PATHS = frozenset({f.Path.DIRECT, f.Path.FRAGMENT, f.Path.BOUNCE})
_PATHS["fragment-fallback"] = f.Path.FRAGMENT  # older daemons' name


async def make_plan(ctx: KVLayout, gen: KVLayout, cb: dict[int, list[int]], gb: dict[int, list[int]]) -> Plan:
    """Plan a request: on the event loop when small, in a worker thread when large."""
    if sum(map(len, cb.values())) + sum(map(len, gb.values())) <= INLINE_PLAN_BLOCKS:
        return plan(ctx, gen, cb, gb)
    return await trio.to_thread.run_sync(partial(plan, ctx, gen, cb, gb))


def _map_into(job: Job, maps: dict[int, Any]) -> None:
    """The job writes into the peer's pools as mapped here (gen rank -> mapping)."""
    job.dst = {r: v.tensor for r, v in maps.items()}
    job.mapped = dict(maps)


def _first_kvd_error(exc: BaseException) -> KvdError | None:
    """The KvdError inside ``exc`` (which may be a nursery's exception group), if any."""
    if isinstance(exc, KvdError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _first_kvd_error(inner)
            if found is not None:
                return found
    return None


def _only_cancelled(exc: BaseException) -> bool:
    """Whether ``exc`` is a group of nothing but :class:`TransferCancelled` (however nested)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_cancelled(inner) for inner in exc.exceptions)
    return isinstance(exc, TransferCancelled)


@dataclass
class Env:
    """What a transfer needs from its daemon, handed in (a transfer never reaches for more)."""

    node: str
    cfg: TransferConfig
    nixl: Callable[[], NixlAgent | None]
    links: Callable[[], PeerLinks | None]
    staging: Callable[[], Staging | None]
    #: called once per side when the machine reports it, before its executors' replies: only
    #: what a reply must not precede (a failure's ``transfer.failed`` line: the executor that
    #: was told finds why); the rest waits for :attr:`after_report`
    on_report: Callable[[Transfer, Side, m.Completion], None]
    #: called once when the transfer has nothing left running
    on_finished: Callable[[Transfer], None]
    #: called once when the transfer's path turns out to move bytes over NIXL (direct,
    #: fragment, bounce): the notification poller spins only while such a transfer runs
    on_nixl: Callable[[Transfer], None] = field(default=lambda t: None)
    #: called after :attr:`on_report` and the replies, in the same step (leases and slots
    #: returned, the ``transfer.done`` line, counters, metrics, history: no client request is
    #: read before the step ends, so none finds them held or missing)
    after_report: Callable[[Transfer, Side, m.Completion], None] = field(default=lambda t, s, c: None)
    #: takes work to run right after the executor's reply to the registration being handled
    #: now (True), or refuses it (False: no registration is being handled; run it now)
    after_reply: Callable[[Callable[[], None]], bool] = field(default=lambda fn: False)
    #: starts a task of the transfer in the engine's nursery (True: its actor; False: a
    #: data-path task or the backlog's sender).
    #: None: the owner runs :meth:`Transfer.run` itself, before feeding anything, and the
    #: tasks run in the actor's own nursery (the in-process actor tests)
    spawn: Callable[[Callable[[], Awaitable[None]], bool], None] | None = None
    #: the machine's deadline moved while no actor watches it: the engine's timer calls
    #: :meth:`Transfer.deadline_passed` once it is due
    watch: Callable[[Transfer], None] = field(default=lambda t: None)
    #: the daemon's completion page (:mod:`kvd.transfer.words`), None in unit tests
    words: CompletionPage | None = None
    #: the GPU will store ctx's completion token (the kernel is launched): the replies the
    #: registering session holds may go now, so its executor watches its slot meanwhile
    replies_now: Callable[[], None] = field(default=lambda: None)


#: Events that may fail a side: a side whose completion token is in is settled first.
_MAY_FAIL = (f.Cancel, f.Disconnect, f.LocalFailure, f.Clock, f.PeerLost, f.FailReceived)
_RECEIVING_STATES = frozenset({f.State.DEST_OUT, f.State.RECEIVING})
#: ctx states, seen from gen, in which ctx's GPU may have stored gen's token (offered: ctx published
#: first, and its kernel ran before its path message was read here)
_UNLANDED = frozenset({f.State.IDLE, f.State.OFFERED, f.State.SENDING})
#: Numbers the requests of this daemon (``Transfer.ref``): each side's first message names its
#: number, and the peer names it back in this request's notices and NIXL notifications. From a
#: random start: a restarted daemon (or another peer) does not repeat the numbers a peer may
#: still remember (a retry with a repeated number would be taken for the request it retries)
_refs = itertools.count(secrets.randbits(62) + 1)


def _draw_refs() -> None:
    """A process forked after import draws its own start (no per-request check of the pid)."""
    global _refs
    _refs = itertools.count(secrets.randbits(62) + 1)


os.register_at_fork(after_in_child=_draw_refs)


@dataclass
class _Do:
    actions: list[f.Action]


@dataclass
class _Remote:
    """What the peer told us about its side."""

    layout: KVLayout | None = None
    blocks: dict[int, list[int]] = field(default_factory=dict)
    pools: dict[int, x.RemoteRegion] = field(default_factory=dict)
    pool_names: dict[int, str] = field(default_factory=dict)
    chunking: str = ""  # gen's bounce chunk layout (x.CHUNKING_RANGES; "" = an older daemon)
    chunk_bytes: int = 0  # ctx's bounce chunk size (0 = an older daemon)
    credits: str = ""  # how ctx takes bounce credits (x.CREDITS_NOTIF; "" = XferGrant messages)
    landed: x.LandedEvent | None = None  # ctx's landed event (mapped path), from its path message
    word: int = -1  # gen's completion slot and token (mapped path: our GPU stores the token)
    token: int = 0
    # the peer's number for this request (its Transfer.ref: x.XferOffer.ref), named in the NIXL
    # notifications we send it for this request; 0: not known yet, or an older daemon
    ref: int = 0
    # ``blocks`` validated against ``layout`` when the destination arrived (before the request
    # completed here): the planner then skips that work. None: not checked (the planner does).
    checked: CheckedBlocks | None = None

    def set_side(self, layout: KVLayout, blocks: dict[int, list[int]], *, check: bool = False) -> None:
        """The peer's layout and blocks; ``check``: validate them now, off the critical path
        (a bad destination is left for the planner, which refuses it where it always has)."""
        self.layout, self.blocks, self.checked = layout, blocks, None
        if check:
            with contextlib.suppress(KvdError):
                self.checked = check_blocks("gen", layout, blocks)


class _Progress:
    """A path's reports, fed to the machine for ``role``."""

    def __init__(self, t: Transfer, role: f.Role, side: Side | None) -> None:
        self.t, self.role, self.side = t, role, side

    def posted(self, n: int = 1) -> None:
        self.check()
        self.t.feed(f.WritePosted(self.role, n))

    def planned(self, chunks: int) -> None:
        if self.side is not None:
            self.side.chunks_total = chunks

    def check(self) -> None:
        """Refuse a new write once the side failed (aborting, or failed already: a data task
        can still run a step after its side reported, until its cancellation is delivered)."""
        state = self.t.machine.state(self.role)
        if state is f.State.ABORTING or state is f.State.FAILED:
            raise TransferCancelled(f"request {self.t.request_id!r}: {state.value}, no new write")
        if state is f.State.DONE:  # a path that wrote on after it said all its data was out: a bug
            raise InternalError(f"request {self.t.request_id!r}: a write after the side was done")

    def ended(self, n: int = 1) -> None:
        self.t.feed(f.WriteEnded(self.role, n))

    def moved(self, nbytes: int, chunks: int = 1) -> None:
        if self.side is not None:
            self.side.bytes_done += nbytes
            self.side.chunks_done += chunks

    def mark(self, stage: str) -> None:
        if self.side is not None:
            self.side.mark(stage)


class _ScatterProgress(_Progress):
    """gen's scatters: posted when their notification arrives, so only their end is reported."""

    def __init__(self, t: Transfer, side: Side) -> None:
        super().__init__(t, f.Role.GEN, side)

    def posted(self, n: int = 1) -> None:
        raise InternalError("gen scatters are posted when their notification arrives")

    def ended(self, n: int = 1) -> None:
        self.t.scatters_ended(n)


class Transfer:
    """One request on this daemon (see the module docstring)."""

    def __init__(self, env: Env, request_id: str, peer: str, here: set[f.Role]) -> None:
        self.env = env
        self.request_id = request_id
        self.peer = peer  # the other daemon's node ("" while a gen side waits for any offer)
        self.machine = f.TransferMachine(here=set(here), request_id=request_id)
        self.sides: dict[f.Role, Side] = {}
        self.remote = _Remote()
        self.peer_instance = ""  # the peer's NIXL agent when we first talked: a new one = fenced
        self.created = time.monotonic()
        self.finished = trio.Event()
        self.forgetting = False  # the engine drops it soon
        #: this request among every one of this daemon, ids reused included: the peer names
        #: it in its notices, answers and NIXL notifications, so that one about an earlier
        #: request of the same id is not taken for this one's (see Engine.deliver, _on_notif)
        self.ref = next(_refs)
        # the actor's inbox, the bounce path's notified chunks and the receive slots gen
        # granted (in order), each opened when first read (see LazyChannel): a request
        # handled in its callers' steps never queues, and the mapped, direct and local paths
        # never read the other two (gen grants two slots with every announce all the same)
        self._inbox: LazyChannel[Any] = LazyChannel()
        self._notifs: LazyChannel[x.Notif] = LazyChannel()
        self._grants: LazyChannel[int] = LazyChannel()
        self._scopes: dict[f.Role, trio.CancelScope] = {}
        self._pending_scatters = 0
        self._nursery: trio.Nursery | None = None
        self._plan: Plan | None = None
        self.sent: Sent | None = None  # what our sending path did (ctx)
        self.done_msg: x.XferDone | None = None  # what the peer's did (gen)
        self.landed_msg: x.LandedEvent | None = None  # ctx's landed event, seen complete (gen)
        self.round_trips = 0  # peer round trips ctx waited for before data moved
        self.pregranted = 0  # receive slots granted with the announce (gen)
        self.bounce_chunk = 0  # the bounce chunk size ctx chose, named in its path message
        # Actions run in the step of whoever fed the event when nothing of the actor's is
        # pending (see feed): each hop through the actor's inbox cost a scheduler pass
        # (~50-100 us on the H200 host), and a 1-block transfer made about ten of them.
        self._queued = 0  # items in the inbox
        self._sleep: trio.CancelScope | None = None  # the actor's wait on its inbox, while it waits
        self._acting = False  # the actor is carrying out actions (it may be awaiting a send)
        self._inline = False  # actions are running in a caller's step
        self._deferred: list[f.Action] = []  # actions of events fed meanwhile: they go after
        self._backlog: list[x.XferMessage] | None = None  # messages waiting for the link, in order
        self._unsent_told = False  # gen's destination never left: the side failed for it (once)
        self.uses_nixl = False  # its path moves bytes over NIXL (told to the engine once)
        self._corked: PeerLink | None = None  # the link held while the data path starts inline
        self._landed: LandedMark | None = None  # ctx: the landed event its path message names
        self._ctx_run: local.KernelRun | None = None  # ctx: the kernel launched in the publish step
        # The actor's task starts only when something must wait (see the module docstring).
        self._actor = False  # the actor's task was started (it ends only with the transfer)
        self._expired = False  # the deadline did its work: a side still aborting waits for quiet
        self._tasks = 0  # data-path tasks (and the backlog's sender) started and not ended
        self._task_scopes: set[trio.CancelScope] = set()  # theirs: cancelled once the machine is final
        self._ending = False  # they were cancelled: one started now starts cancelled
        self._tasks_done: trio.Event | None = None  # the actor waits on it for the last task's end

    def _grant(self, slots: list[int]) -> None:
        """Receive slots gen granted, for the bounce sender, in order."""
        for slot in slots:
            self._grants.send_nowait(slot)

    @property
    def key(self) -> tuple[str, str]:
        return (self.peer, self.request_id)

    @property
    def slot_owner(self) -> str:
        return f"{self.peer}/{self.request_id}"

    # -- input --------------------------------------------------------------------------------
    def feed(self, event: f.Event | f.Clock | f.PeerLost | f.PeerFenced) -> None:
        """Apply one event now; its actions run in order: right here when the actor has
        nothing pending and they need no waiting (reports, starting or aborting a data task,
        a message the link's writer takes), else on the actor. Raises protocol errors."""
        if isinstance(event, _MAY_FAIL):
            self._settle_tokens()
        before = self.machine.deadline
        actions = self.machine.handle(event)
        mark("feed", type(event).__name__, actions)
        if not self.uses_nixl and self.machine.path in NIXL_PATHS:
            self.uses_nixl = True
            self.env.on_nixl(self)
        if self._inline:  # fed by an action running now: after the rest of its list
            self._deferred.extend(actions)
            return
        if actions and self._idle():
            actions = self._run_inline(actions)
            if not actions:
                if self.machine.finished:
                    if self._actor:
                        self._queue(_Do([]))  # the actor sees the end
                    else:
                        self._maybe_end()  # no actor: the transfer ends here, once no task is left
                elif self.machine.deadline != before:
                    self._deadline_moved()
                return
        if actions:
            self._queue(_Do(actions))
        elif self.machine.deadline < before:
            self._deadline_moved()

    def _deadline_moved(self) -> None:
        """The machine's deadline moved: an actor asleep in its inbox gets its sleep's deadline
        moved (trio re-reads it, no wake-up: a scheduler pass saved per request); any other
        reads the deadline when it next sleeps (one not started yet, when it first does). With
        no actor, the engine's timer watches it."""
        if self._sleep is not None:
            self._sleep.deadline = self.machine.deadline
        elif not self._actor and not self._expired:
            self.env.watch(self)

    def deadline_passed(self) -> None:
        """The engine's timer: the deadline :attr:`Env.watch` was told of is due. With no actor
        (nothing pending: it runs in order now) the machine hears the time, as the actor's sleep
        would have told it; an actor that started meanwhile watches the deadline itself."""
        if self._actor or self._expired or self.finished.is_set():
            return
        now = trio.current_time()
        if now < self.machine.deadline:
            return  # (cannot happen: a deadline only moves earlier) not due yet
        self._expired = True
        token = bind_request_id(self.request_id)  # lines logged name the request, as on the actor
        try:
            try:
                self._explain_expiry()
            except Exception as exc:
                self._on_step_error(exc)
            self._handle(f.Clock(now))
        finally:
            unbind_request_id(token)

    def post(self, item: x.XferMessage | x.Notif | x.Credit | f.PeerLost | f.PeerFenced) -> None:
        """Deliver a peer message, a notification or a link event (never blocks): handled
        right here when the actor has nothing pending, else queued behind what it has."""
        if self._idle():
            token = bind_request_id(self.request_id)  # lines logged name the request, as on the actor
            try:
                self._handle(item)
            finally:
                unbind_request_id(token)
        else:
            self._queue(item)

    def _queue(self, item: Any) -> None:
        """Put ``item`` in the actor's inbox, behind what is there; start the actor if it has
        not been (never once the transfer ended: what comes then stays unread, as it always did)."""
        self._queued += 1
        self._inbox.send_nowait(item)
        if not self._actor and self.env.spawn is not None and not self.finished.is_set():
            self._actor = True
            self.env.spawn(self.run, True)

    def _idle(self) -> bool:
        """Nothing of the actor's is pending or running: what comes now may run in order. (With
        no engine to start tasks in, not before the actor's nursery is open.)"""
        return not (self._queued or self._acting or self._inline) and (
            self._nursery is not None or self.env.spawn is not None)

    def _run_inline(self, actions: list[f.Action]) -> list[f.Action]:
        """Carry out the leading actions that need no waiting; return the rest (for the actor),
        followed by the actions of events those fed meanwhile. Logged lines name the request,
        as the actor's do."""
        self._inline = True
        token = bind_request_id(self.request_id)
        try:
            return self._act_in_order(actions)
        finally:
            unbind_request_id(token)
            self._inline = False

    def _act_in_order(self, actions: list[f.Action]) -> list[f.Action]:
        while True:
            for i, a in enumerate(actions):
                try:
                    done = self._act_now(a)
                except Exception as exc:  # as on the actor: this request fails, the caller goes on
                    self._on_step_error(exc)
                    done = True
                if not done:
                    return actions[i:] + self._take_deferred()
            if not self._deferred:
                return []
            actions = self._take_deferred()

    def _take_deferred(self) -> list[f.Action]:
        out, self._deferred = self._deferred, []
        return out

    def _act_now(self, a: f.Action) -> bool:
        """Carry out ``a`` now if it needs no waiting; False (nothing done) otherwise."""
        mark("now", type(a).__name__)
        if self._act_local(a):
            return True
        if isinstance(a, f.SendFail) or self._backlog is not None:
            return False  # sent awaited (owed to the next link if this one is gone), or in order
        links = self.env.links()
        link = links.links.get(self.peer) if links is not None else None
        if link is None or not link.takes_nowait:
            return False  # the actor sends it, awaited (a link that just came up has no writer yet)
        if not self.peer_instance:
            self.peer_instance = link.agent
        # _message may take receive slots (an announce's grants): only once it will go
        if self._landed is not None and isinstance(a, f.SendDataDone):
            # gen has the landed event: this is its confirmation, written after this step
            return link.send_soon(self._message(a)) or self._unsent(a)
        return link.send_nowait(self._message(a)) or self._unsent(a)

    def _unsent(self, a: f.Action) -> bool:
        raise InternalError(f"the link's writer refused {type(a).__name__} after accepting the link")

    # -- the actor ------------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve the request until the machine says every side here has ended and no task of
        it is left (started by the engine when something must wait: see the module docstring)."""
        self._actor = True
        bound = structlog.contextvars.bound_contextvars(request_id=self.request_id)
        try:
            with bound:
                if self.env.spawn is None:  # no engine: the tasks run in the actor's own nursery
                    async with trio.open_nursery() as nursery:
                        self._nursery = nursery
                        await self._serve()
                else:
                    await self._serve()
                # the tasks' ends were checkpoints: a peer's offer may have come meanwhile, and
                # a gen side that failed before ctx spoke owes it an answer (SendFail)
                await self._drain()
        finally:
            # no checkpoint since the last drain found the inbox empty: from here on the engine
            # sees ``finished`` and answers late messages itself
            self._finish()

    async def _serve(self) -> None:
        """The actor's loop: the inbox, in order, and the deadline; then the tasks' end."""
        while not self.machine.finished:
            item: Any = None
            try:  # queued already (e.g. what made the engine start the actor): taken
                item = self._inbox.rx.receive_nowait()  # without receive()'s scheduler pass
                self._queued -= 1
            except trio.WouldBlock:
                # once expired, the deadline has done its work: a side still aborting
                # waits for its writes (or the peer's word), however long that takes
                with trio.move_on_at(math.inf if self._expired else self.machine.deadline) as sleep:
                    self._sleep = None if self._expired else sleep  # feed may move its deadline
                    item = await self._inbox.rx.receive()
                    self._queued -= 1
                self._sleep = None
            if item is None:
                self._expired = True
                self._explain_expiry()
                item = f.Clock(trio.current_time())
            await self._step(item)
        # the machine is final: nothing it waits for is left in the tasks
        await self._drain()
        self._end_tasks()
        while self._tasks:
            self._tasks_done = trio.Event()
            await self._tasks_done.wait()
        self._tasks_done = None

    def _end_tasks(self) -> None:
        """The machine is final: cancel the tasks still running (an idle bounce receiver, the
        backlog's sender); one started from now on starts cancelled."""
        self._ending = True
        for scope in list(self._task_scopes):
            scope.cancel()

    def _maybe_end(self) -> None:
        """With no actor: end the transfer if its machine is final and no task is left; cancel
        the tasks left (the last one's end comes back here)."""
        if self._actor or self.finished.is_set() or not self.machine.finished:
            return
        if self._tasks:
            if not self._ending:
                self._end_tasks()
            return
        self._finish()

    def _finish(self) -> None:
        self.finished.set()
        self.env.on_finished(self)

    async def _drain(self) -> None:
        """Carry out everything queued (the last reports, a Fail owed to the peer) and feed
        the messages that came meanwhile, until the inbox is empty."""
        while True:
            try:
                item = self._inbox.rx.receive_nowait()
            except trio.WouldBlock:
                return
            self._queued -= 1
            await self._step(item)

    async def _step(self, item: Any) -> None:
        if isinstance(item, _Do):
            self._acting = True
            try:
                await self._do(item.actions)
            except Exception as exc:
                self._on_step_error(exc)
            finally:
                self._acting = False
        else:
            self._handle(item)

    def _handle(self, item: Any) -> None:
        """A message, notification or link event, fed to the machine now."""
        try:
            if isinstance(item, x.Notif):
                self._on_notif(item)
            elif isinstance(item, x.Credit):
                self._on_credit(item.slots, "credits_notif")
            elif isinstance(item, x.XferMessage):
                self._on_message(item)
            else:
                self.feed(item)
        except Exception as exc:
            self._on_step_error(exc)

    def _on_step_error(self, exc: Exception) -> None:
        if isinstance(exc, RemoteProtocolError):
            log.warning("transfer.peer_protocol_error", peer=self.peer, error=exc.message)
            self._fail_here(exc)
        elif isinstance(exc, LocalProtocolError):
            log.error("transfer.local_protocol_error", error=exc.message)
            self._fail_here(exc)
        else:  # a bug: this request fails, the daemon serves on
            log.exception("transfer.internal_error", exc_info=exc)
            self._fail_here(InternalError(f"internal error: {type(exc).__name__}: {exc}"))

    def _explain_expiry(self) -> None:
        """At the deadline, fail with the most useful reason the machine cannot know (which
        ranks are missing, ctx's link to its peer that is down); the machine words the other
        cases itself."""
        limit = f" of {self.machine.deadline_s:.3g} s" if self.machine.deadline_s > 0 else ""
        more = "or give the request a longer deadline_s"
        for role, side in self.sides.items():
            st = self.machine.state(role)
            name = f"request {self.request_id!r} ({side.role} side) missed its deadline{limit}"
            if st is f.State.REGISTERING:
                missing = sorted(set(side.ranks) - set(side.parts))
                verb = "publish" if role is f.Role.CTX else "expect"
                self.feed(f.LocalFailure(role, TransferTimeout.code,
                                         f"{name}: ranks {missing} never registered ({len(side.parts)} of "
                                         f"{len(side.ranks)} did); check that the {side.role} executors of those "
                                         f"ranks are running and {verb} this request id, {more}"))
                continue
            links = self.env.links()
            if role is f.Role.GEN and links is not None and self._destination_waits(links):
                # its destination still waits for a link that never came up: the peer never
                # heard of it. The backlog's sender, woken by the same deadline, says the same
                # when it runs first; whichever runs first, the outcome is this one
                self._destination_unsent(links)
                continue
            if role is f.Role.CTX and st in (f.State.READY, f.State.OFFERED):
                if self.peer == self.env.node:
                    # the local path: the gen side lives here and never registered (or only some
                    # of its ranks did: name the others)
                    gen = self.sides.get(f.Role.GEN)
                    who = ("no gen executor expected it" if gen is None else
                           f"gen ranks {sorted(set(gen.ranks) - set(gen.parts))} never expected it")
                    self.feed(f.LocalFailure(role, TransferTimeout.code,
                                             f"{name}: {who} on this daemon (peer {self.peer!r} is this daemon: "
                                             "the local path); check that the gen executors are running and "
                                             f"expect this request id here, {more}"))
                elif links is not None and self.peer not in links.links:
                    self.feed(f.LocalFailure(role, PeerUnavailable.code,
                                             f"{name}: {links.describe_missing(self.peer)}; "
                                             f"{links.down_hint(self.peer)}"))
                elif st is f.State.OFFERED:
                    # the offer went out and the peer never gave a destination: its gen side
                    # (which knows which ranks are missing) never became complete
                    self.feed(f.LocalFailure(role, TransferTimeout.code,
                                             f"{name}: peer {self.peer!r} never accepted the offer: not every gen "
                                             "rank registered (expect) there; its log names the missing ranks, "
                                             f"{more}"))

    def _fail_here(self, exc: KvdError) -> None:
        for role in list(self.machine.here):
            st = self.machine.state(role)
            if st not in f.FINAL and st is not f.State.ABORTING:
                self.feed(f.LocalFailure(role, exc.code, exc.message))

    # -- peer messages --------------------------------------------------------------------------
    def _deadline(self, seconds: float) -> float:
        return trio.current_time() + seconds if seconds > 0 else math.inf

    def _on_message(self, msg: x.XferMessage) -> None:
        r = self.remote
        if isinstance(msg, x.XferOffer):
            r.set_side(msg.layout, dict(msg.blocks))
            r.ref = msg.ref
            self.feed(f.OfferReceived(f.Role.CTX, deadline=self._deadline(msg.deadline_s), deadline_s=msg.deadline_s))
        elif isinstance(msg, x.XferAccept | x.XferAnnounce):
            announced = isinstance(msg, x.XferAnnounce)
            r.set_side(msg.layout, dict(msg.blocks), check=announced)
            r.pools, r.pool_names = dict(msg.pools), dict(msg.pool_names)
            r.chunking = msg.chunking
            r.word, r.token, r.ref = msg.word, msg.token, msg.ref
            if not announced:
                self.round_trips += 1
            deadline_s = msg.deadline_s if isinstance(msg, x.XferAnnounce) else 0.0
            deadline = self._deadline(deadline_s) if isinstance(msg, x.XferAnnounce) else math.inf
            self.feed(f.DestinationReceived(f.Role.GEN, deadline=deadline, deadline_s=deadline_s, announced=announced))
            self._grant(msg.slots)
        elif isinstance(msg, x.XferPath):
            path = _PATHS.get(msg.path)
            if path is None:
                raise RemoteProtocolError(f"unknown path {msg.path!r}")
            if msg.layout is not None:
                r.set_side(msg.layout, dict(msg.blocks))
            r.chunk_bytes, r.credits = msg.chunk_bytes, msg.credits
            r.ref = msg.ref or r.ref
            r.landed = msg.landed if path is f.Path.MAPPED else None
            self.feed(f.PathReceived(f.Role.CTX, path))
        elif isinstance(msg, x.XferGrant):
            self._on_credit([msg.slot], "credits_link")
        elif isinstance(msg, x.XferDone):
            self.done_msg = msg
            gen = self.sides.get(f.Role.GEN)
            if gen is not None and gen.started:
                gen.mark("done_received")
            self.feed(f.DataDoneReceived(f.Role.CTX, msg.writes, msg.bytes))
        elif isinstance(msg, x.XferFail):
            role = f.Role(msg.sender) if msg.sender in ("ctx", "gen") else self._remote_role()
            if role is None:
                return
            r.ref = r.ref or msg.ref  # the peer's number, when this notice is the first word of it
            self.feed(f.FailReceived(role, msg.code, msg.message, msg.writes_stopped,
                                     deadline=self._deadline(msg.deadline_s), deadline_s=msg.deadline_s))
        # XferComplete: older daemons confirm a transfer; the data-done message already did

    def _on_credit(self, slots: list[int], kind: str) -> None:
        """Receive slots gen granted (a Credit notification or an XferGrant): the bounce sender's."""
        if self.machine.state(f.Role.CTX) is not f.State.SENDING:
            return  # late: the bounce path ended (its grant channel is read no more)
        self._grant(slots)
        side = self.sides.get(f.Role.CTX)
        if side is not None:
            side.stages[kind] = side.stages.get(kind, 0) + len(slots)

    def _remote_role(self) -> f.Role | None:
        others = [r for r in f.Role if r not in self.machine.here]
        return others[0] if others else None

    def _on_notif(self, n: x.Notif) -> None:
        """A write of the peer landed here: count it; a bounce chunk is scattered next."""
        st = self.machine.state(f.Role.GEN)
        if f.Role.GEN not in self.machine.here or st in f.FINAL:
            return  # late: the side ended (its slots and blocks stay ours until ctx stopped)
        side = self.sides.get(f.Role.GEN)
        if side is not None and n.slot < 0:
            side.chunks_done += 1  # a direct/fragment write landed (bounce counts its scatters)
        if n.slot >= 0 and st is not f.State.ABORTING:
            # the scatter is counted in flight by the same event, before it is queued
            self._pending_scatters += 1
            self.feed(f.NotifSeen(f.Role.GEN, scatter=True))
            self._notifs.send_nowait(n)
            return
        self.feed(f.NotifSeen(f.Role.GEN))

    # -- actions ----------------------------------------------------------------------------------
    async def _do(self, actions: list[f.Action]) -> None:
        for a in actions:
            mark("do", type(a).__name__)
            if not self._act_local(a):
                await self._send(self._message(a))

    def _act_local(self, a: f.Action) -> bool:
        """Carry out ``a`` if it involves no peer message (reports, starting or aborting a data
        task); False for a message to send."""
        if isinstance(a, f.Report):
            self._uncork()  # the peer has what this step sent it before the report's work
            self._report(a)
        elif isinstance(a, f.StartData):
            if a.path is None:
                self._start_send()
            else:
                self._start(self._local_task)
        elif isinstance(a, f.StartReceive):
            self._start_receive(a.path)
        elif isinstance(a, f.AbortWrites):
            self._abort(a.role)
        else:
            return False
        return True

    def _start(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Start a task of the transfer: in the engine's nursery (the actor's own, with no engine)."""
        self._tasks += 1
        if self._nursery is not None:
            self._nursery.start_soon(self._task, fn)
        else:
            spawn = self.env.spawn
            if spawn is None:
                raise InternalError("a transfer with no engine starts tasks only once its actor runs")
            spawn(partial(self._task, fn), False)

    async def _task(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Run ``fn`` under a scope the transfer's end cancels; the last task's end may end it."""
        scope = trio.CancelScope()
        if self._ending:
            scope.cancel()  # as a task started in a cancelled nursery: it stops at its first checkpoint
        self._task_scopes.add(scope)
        try:
            with scope:
                await fn()
        finally:
            self._task_scopes.discard(scope)
            self._tasks -= 1
            if not self._tasks:
                if self._tasks_done is not None:
                    self._tasks_done.set()  # the actor waits for it
                else:
                    self._maybe_end()

    def _abort(self, role: f.Role) -> None:
        scope = self._scopes.get(role)
        if scope is not None:
            scope.cancel()  # each write ends (WriteEnded) once aborted and confirmed
        elif role is f.Role.GEN and self._pending_scatters:
            n, self._pending_scatters = self._pending_scatters, 0
            self.feed(f.WriteEnded(f.Role.GEN, n))  # their scatters will never run

    def _prime_word(self, side: Side) -> tuple[int, int]:
        """gen: the completion slot and token for ctx's GPU to store after its kernel (mapped
        path, GPU pools, an executor that reads the page), its outcome written now; (-1, 0)
        where no GPU will store it."""
        words = self.env.words
        if words is None or side.word < 0 or not words.device_ptr:
            return -1, 0
        if not all(p.pool.device >= 0 for p in side.parts.values()) or not side.read_by_page():
            return -1, 0
        nbytes = sum(len(p.block_ids) * side.layout.block_bytes(r) for r, p in side.parts.items())
        words.prime(side.word, nbytes, "mapped")
        return side.word, side.token

    def _message(self, a: f.Action) -> x.XferMessage:
        rid = self.request_id
        if isinstance(a, f.SendOffer):
            side = self.sides[f.Role.CTX]
            self.round_trips += 0  # counted when the accept arrives
            return x.XferOffer(request_id=rid, layout=side.layout, blocks=side.blocks_by_rank(),
                               deadline_s=max(0.0, self.machine.deadline - trio.current_time()), ref=self.ref)
        if isinstance(a, f.SendDestination):
            side = self.sides[f.Role.GEN]
            regions = {r: x.RemoteRegion(addr=p.pool.ptr, nbytes=p.pool.nbytes, device=p.pool.device)
                       for r, p in side.parts.items()}
            names = {r: p.pool.name for r, p in side.parts.items()}
            word, token = self._prime_word(side)
            if a.announced:
                return x.XferAnnounce(request_id=rid, layout=side.layout, blocks=side.blocks_by_rank(),
                                      pools=regions, pool_names=names, slots=self._pregrant(),
                                      deadline_s=max(0.0, self.machine.deadline - trio.current_time()),
                                      chunking=x.CHUNKING_RANGES, word=word, token=token, ref=self.ref)
            return x.XferAccept(request_id=rid, layout=side.layout, blocks=side.blocks_by_rank(),
                                pools=regions, pool_names=names, slots=self._pregrant(), chunking=x.CHUNKING_RANGES,
                                word=word, token=token, ref=self.ref)
        if isinstance(a, f.SendPath):
            side = self.sides[f.Role.CTX]
            bounced = a.path is f.Path.BOUNCE
            return x.XferPath(request_id=rid, path=a.path.value, layout=side.layout, blocks=side.blocks_by_rank(),
                              chunk_bytes=self.bounce_chunk if bounced else 0,
                              credits=x.CREDITS_NOTIF if bounced and self.env.cfg.credit_notifs else "",
                              landed=self._landed_event() if a.path is f.Path.MAPPED else None, ref=self.ref)
        if isinstance(a, f.SendDataDone):
            chunks = self.sent.chunks if self.sent is not None else a.writes
            return x.XferDone(request_id=rid, writes=a.writes, bytes=a.nbytes, chunks=chunks)
        if isinstance(a, f.SendFail):
            sender = next(iter(self.machine.here)).value
            # unheard: the peer may not know the request; what is left of the deadline tells it
            # how long to keep the failure for its ranks (at least a moment: 0 means "known")
            left = min(max(self.machine.deadline - trio.current_time(), 1e-3), MAX_DEADLINE_S) if a.unheard else 0.0
            return x.XferFail(request_id=rid, code=a.code, message=a.message,
                              writes_stopped=a.writes_stopped, sender=sender, deadline_s=left,
                              ref=self.ref, peer_ref=self.remote.ref)
        raise InternalError(f"unexpected action {a!r}")

    def _landed_event(self) -> x.LandedEvent | None:
        """The path message's landed event (ctx), when the kernel recorded one."""
        mark_ = self._landed
        if mark_ is None or self._plan is None:
            return None
        return x.LandedEvent(device=mark_.device, slot=mark_.slot, handle=mark_.handle,
                             nbytes=self._plan.total_bytes(), chunks=len(self._plan.src_ranks()))

    def _pregrant(self) -> list[int]:
        """Receive slots granted with the announce, so a bounce transfer needs no round trip
        either (free ones only, at most ``PREGRANT_SLOTS``: they sit idle until ``publish``)."""
        staging = self.env.staging()
        if staging is None or not self.env.cfg.grant_credits:
            return []
        slots: list[int] = []
        while len(slots) < PREGRANT_SLOTS:
            slot = staging.recv_slots.try_acquire(self.slot_owner)
            if slot is None:
                break
            slots.append(slot)
        self.pregranted = len(slots)
        return slots

    async def _send(self, msg: x.XferMessage) -> None:
        """Send to the peer, after any message still waiting for the link; a failure notice
        that cannot go now is owed to its next link."""
        if self._backlog is not None:  # earlier messages wait for the link: this one goes after
            self._backlog.append(msg)
            return
        links = self.env.links()
        link = links.links.get(self.peer) if links is not None else None
        if link is None and links is not None and not isinstance(msg, x.XferFail):
            # ctx offering before the link is up (the daemons start in any order): wait aside,
            # the actor keeps serving (a cancel must not wait for the link)
            if not self.machine.finished:
                self._backlog = [msg]
                self._start(partial(self._send_when_linked, links))
            return
        if link is not None:
            if not self.peer_instance:
                self.peer_instance = link.agent
            try:
                await link.send(msg)
                return
            except PeerUnavailable:
                pass
        if isinstance(msg, x.XferFail) and links is not None:
            links.owe(self.peer, msg)

    async def _send_when_linked(self, links: PeerLinks) -> None:
        """Send the backlog, in order, once the link is up; what is left at the deadline (or
        when the transfer ends first) is dropped, but for failure notices: owed to the link."""
        try:
            with trio.move_on_at(self.machine.deadline), contextlib.suppress(PeerUnavailable):
                link = await links.wait_for(self.peer)
                if not self.peer_instance:
                    self.peer_instance = link.agent
                while self._backlog:
                    msg = self._backlog[0]
                    ended = self.machine.finished or all(self.machine.state(r) in f.FINAL for r in self.machine.here)
                    if not ended or isinstance(msg, x.XferFail):
                        await link.send(msg)
                    self._backlog.pop(0)
        finally:
            left, self._backlog = self._backlog or [], None
            for msg in left:
                if isinstance(msg, x.XferFail):
                    links.owe(self.peer, msg)
            if not self.machine.finished and any(isinstance(msg, x.XferAnnounce | x.XferAccept) for msg in left):
                self._destination_unsent(links)

    def _destination_waits(self, links: PeerLinks) -> bool:
        """gen's destination (announce or accept) still waits in the backlog for a link to the
        peer that is not up: it never left."""
        return (self.peer not in links.links and self._backlog is not None
                and any(isinstance(msg, x.XferAnnounce | x.XferAccept) for msg in self._backlog))

    def _destination_unsent(self, links: PeerLinks) -> None:
        """gen's destination never left (no link to the peer before the deadline): the peer
        cannot write into these blocks, so the gen side may report (it fails here, unless it
        failed already, e.g. at the same deadline) instead of waiting for a peer that never
        heard of the request."""
        if self._unsent_told:
            return  # the deadline's handler and the backlog's sender both come here: once
        self._unsent_told = True
        st = self.machine.state(f.Role.GEN)
        if st not in f.FINAL and st is not f.State.ABORTING:
            self.feed(f.LocalFailure(f.Role.GEN, PeerUnavailable.code,
                                     f"request {self.request_id!r} (gen side): its destination never reached "
                                     f"the peer: {links.describe_missing(self.peer)}; {links.down_hint(self.peer)}"))
        self.post(f.PeerFenced())  # none of the peer's writes can land: it never had the destination

    # -- reports ----------------------------------------------------------------------------------
    def _report(self, a: f.Report) -> None:
        side = self.sides.get(a.role)
        scope = self._scopes.get(a.role)
        if scope is not None:
            scope.cancel()  # e.g. the bounce receiver, idle now
        if side is None:
            log.info("transfer.dropped", request_id=self.request_id, peer=self.peer, role=a.role.value, code=a.code,
                     reason=a.message)
            return
        path = self.machine.path.value if self.machine.path is not None else ""
        duration = time.monotonic() - (side.started or side.created)
        if a.ok:
            sent, done, seen = self.sent, self.done_msg, self.landed_msg
            nbytes = (sent.nbytes if sent is not None else done.bytes if done is not None
                      else seen.nbytes if seen is not None else side.bytes_total)
            chunks = (sent.chunks if sent is not None else done.chunks if done is not None
                      else seen.chunks if seen is not None else side.chunks_done)
            fallback = sent.fallback if sent is not None else "fragment" if path == "fragment" else ""
            completion = m.Completion(request_id=self.request_id, ok=True, bytes=nbytes, duration_s=duration,
                                      path=path, chunks=chunks, fallback=fallback, peer=self.peer)
            side.bytes_total = side.bytes_done = nbytes
        else:
            completion = m.Completion(request_id=self.request_id, ok=False, bytes=side.bytes_done,
                                      duration_s=duration, path=path, chunks=side.chunks_done, peer=self.peer,
                                      error_code=a.code, error_message=a.message)
        side.path = path
        if side.started:
            side.mark("reported")
        side.finish(completion)
        # the machine made the outcome final and no write can land any more (it reports only
        # then): the replies may go first. What is left (leases returned, the transfer.done
        # line, counters) happens in this same step, before any client request is read
        self.env.on_report(self, side, completion)
        side.reported()  # waiting executors' replies
        self.env.after_report(self, side, completion)
        mark("reported")

    # -- data path: ctx -----------------------------------------------------------------------------
    async def _get_plan(self) -> Plan:
        if self._plan is None:
            ctx, gen = self.sides.get(f.Role.CTX), self.sides.get(f.Role.GEN)
            r = self.remote
            if r.layout is None and (ctx is None or gen is None):
                raise RemoteProtocolError("no layout of the other side to plan with")
            cl, cb = (ctx.layout, ctx.blocks_by_rank()) if ctx is not None else (r.layout, r.blocks)
            gl, gb = (gen.layout, gen.blocks_by_rank()) if gen is not None else (r.layout, r.blocks)
            assert cl is not None and gl is not None
            self._plan = await make_plan(cl, gl, cb, gb)
            for side in self.sides.values():
                side.bytes_total = self._plan.total_bytes()
        return self._plan

    async def _guarded(self, role: f.Role, body: Callable[[], Any]) -> None:
        """Run a data-path task of ``role`` under its cancel scope; failures go to the machine."""
        scope = self._scopes[role] = trio.CancelScope()
        try:
            with scope:
                await body()
        except BaseExceptionGroup as group:
            # An abort cancels the scope while a write may fail at the same moment (e.g. the
            # peer's NIXL agent was just removed): the group then holds Cancelled *and* the
            # error, which ``except Exception`` would let escape and take the daemon down.
            # The same when the transfer's end cancels its tasks once its machine is final.
            failures, cancelled = group.split(Exception)
            if failures is not None:
                self._fail_task(role, failures)
            if cancelled is not None and not scope.cancel_called:
                raise cancelled from None  # a cancellation from outside goes on, without the error
        except Exception as exc:
            self._fail_task(role, exc)
        finally:
            self._scopes.pop(role, None)

    def _fail_task(self, role: f.Role, exc: BaseException) -> None:
        """A data-path task of ``role`` raised ``exc``: the machine hears of it (once)."""
        if self.machine.finished:  # nothing left to fail: say it happened, the request is settled
            if _only_cancelled(exc):
                return  # a data task stopped by _Progress.check after its side ended: as intended
            log.warning("transfer.task_failed_after_end", role=role.value, error=f"{type(exc).__name__}: {exc}")
            return
        kvd_exc = _first_kvd_error(exc)
        if kvd_exc is not None:
            if self.machine.state(role) is not f.State.ABORTING:
                self.feed(f.LocalFailure(role, kvd_exc.code, kvd_exc.message))
            return
        log.error("transfer.internal_error", exc_info=exc)
        if self.machine.state(role) is not f.State.ABORTING:
            self.feed(f.LocalFailure(role, InternalError.code, f"internal error: {type(exc).__name__}: {exc}"))

    def _job(self, p: Plan, side: Side) -> Job:
        cfg = self.env.cfg
        return Job(request_id=self.request_id, owner=self.slot_owner, plan=p, src={r: part.pool for r, part in side.parts.items()},
                   progress=_Progress(self, f.Role.CTX, side), chunk_bytes=cfg.chunk_mb << 20,
                   descs_per_write=cfg.descs_per_write,
                   gpu_chunk_bytes=cfg.gpu_chunk_mb << 20, stages=side.stages, peer_ref=self.remote.ref)

    async def _local_task(self) -> None:
        async def body() -> None:
            # cancelled or failed before this task's first step: a host copy has no checkpoint
            # before its bytes land, so it must not start (nothing written, nothing will be)
            if self.machine.state(f.Role.CTX) is not f.State.SENDING:
                return
            ctx, gen = self.sides[f.Role.CTX], self.sides[f.Role.GEN]
            ctx.started = gen.started = time.monotonic()
            ctx.state = gen.state = "copying"
            p = await self._get_plan()
            ctx.mark("planned")
            job = self._job(p, ctx)
            job.dst = {r: part.pool.tensor() for r, part in gen.parts.items()}
            self.sent = await local.send(job)
            ctx.mark("data_out")
            gen.bytes_done = self.sent.nbytes
            self.feed(f.DataOut(f.Role.CTX, 0, self.sent.nbytes))

        await self._guarded(f.Role.CTX, body)

    def _start_send(self) -> None:
        """Start ctx's data path: right here when the whole of it needs no waiting (a small
        request into mapped host pools: plan, copy, report and the data-done message all in the
        step that completed the request, usually the executor's publish, once its reply went
        out), else as a task."""
        if self.env.after_reply(self._start_send_now):
            return
        self._start_send_now()

    def _start_send_now(self) -> None:
        if self.machine.state(f.Role.CTX) is not f.State.SENDING:
            return  # failed or cancelled before it started: nothing was written, nothing will be
        link = self._link()
        if link is not None:
            # the path message and, when the data is out in this step, the data-done message
            # go to the peer in one write: one wake-up of the peer, not two (written before
            # the side reports: see _act_local)
            link.cork()
            self._corked = link
            try:
                if self._send_now(link):
                    return
            except Exception as exc:  # as in a task: the machine hears of it (once), the caller goes on
                with structlog.contextvars.bound_contextvars(request_id=self.request_id):
                    self._fail_task(f.Role.CTX, exc)
                return
            finally:
                self._uncork()
        self._start(self._send_task)

    def _flush_corked(self) -> None:
        """Write what the corked link holds now; the link stays corked for what follows."""
        link = self._corked
        if link is not None:
            link.uncork()
            link.cork()

    def _uncork(self) -> None:
        """Write the messages held since :meth:`_start_send_now` corked the link."""
        link, self._corked = self._corked, None
        if link is not None:
            link.uncork()

    def _link(self) -> PeerLink | None:
        """The link to the peer, if it is up."""
        links = self.env.links()
        return links.links.get(self.peer) if links is not None else None

    def _send_started(self, link: PeerLink | None = None) -> tuple[Side, PeerLink]:
        """The ctx side's data path starts (over ``link``, when the caller found it up already)."""
        side = self.sides[f.Role.CTX]
        side.started = started = time.monotonic()
        if side.complete_at:  # from the last registration to the data path's start
            side.stages["queued"] = round(started - side.complete_at, 6)
        side.state = "planning"
        if link is None:
            link = self._link()
            if link is None:
                raise PeerUnavailable(f"request {self.request_id!r}: link to peer {self.peer} is down")
        return side, link

    def _send_job(self, side: Side, link: PeerLink, p: Plan) -> Job:
        side.mark("planned")
        mark("planned")
        job = self._job(p, side)
        job.nixl, job.remote_agent, job.remote_pools = self.env.nixl(), link.agent, self.remote.pools
        side.state = "sending"
        return job

    def _sent(self, side: Side, sent: Sent) -> None:
        self.sent = sent
        side.mark("data_out")
        self.feed(f.DataOut(f.Role.CTX, sent.writes, sent.nbytes))

    def _send_now(self, link: PeerLink) -> bool:
        """The ctx data path in this step if it takes no waiting; False (nothing done) if not."""
        side = self.sides.get(f.Role.CTX)
        if side is None or self._plan is not None:
            return False
        maps = self._mapped_dst(link)
        if maps is None:
            return False
        blocks = sum(map(len, self.remote.blocks.values()))
        for part in side.parts.values():
            blocks += len(part.block_ids)
        if blocks > INLINE_PLAN_BLOCKS:
            return False
        side, link = self._send_started(link)
        gen_blocks = self.remote.checked or self.remote.blocks  # checked when announced
        self._plan = p = plan(side.layout, self._remote_layout(), side.blocks_by_rank(), gen_blocks)
        total = p.total_bytes()
        for s in self.sides.values():
            s.bytes_total = total
        job = self._send_job(side, link, p)
        if not maps.keys() >= set(p.dst_ranks()):
            return self._send_rest_as_task(job, link, p)  # the path is chosen there, as always
        if any(part.pool.device >= 0 for part in side.parts.values()):
            return self._launch_now(job, link, p, maps)
        if not local.fits_inline(job):
            return self._send_rest_as_task(job, link, p)
        _map_into(job, maps)
        self.feed(f.PathChosen(f.Role.CTX, f.Path.MAPPED))
        sent = mapped.send_now(job)
        if sent is None:  # cannot happen after fits_inline; the task does the same work awaited
            raise InternalError("mapped.send_now refused a request that fits inline")
        self._sent(side, sent)
        return True

    def _launch_now(self, job: Job, link: PeerLink, p: Plan, maps: dict[int, Any]) -> bool:
        """GPU pools: the regroup kernel is launched in this step (the bytes start moving before
        the event loop turns again). A small request's kernel is usually done by the time the
        path message is out: then this step reports it too (data-done to gen, the executors'
        replies), else a task waits for its completion. When the kernel cannot be launched so
        (not loaded yet, copy engines, pools it cannot reach), the data task does everything,
        as for any other request."""
        _map_into(job, maps)
        job.stores = self._token_stores(link, p)
        run = mapped.launch_now(job)
        if run is None:
            job.dst, job.mapped = {}, {}
            return self._send_rest_as_task(job, link, p)
        job.stages["gpu_launch_inline"] = 1  # (the transfer.done line says how it started)
        if self._stores_own_token(job.stores):
            self.env.replies_now()
        self._ctx_run = run
        self._landed = run.launched.landed
        self.feed(f.PathChosen(f.Role.CTX, f.Path.MAPPED))
        if self._landed is not None:
            # the path message names the landed event: it leaves now, and gen watches the
            # event while the kernel runs instead of waiting for the data-done message
            job.stages["landed_event"] = 1
            self._flush_corked()
        sent = run.finish_now()
        if sent is not None:
            job.stages["gpu_done_inline"] = 1
            self._sent(self.sides[f.Role.CTX], sent)
            return True

        async def body() -> None:
            sent = await run.finish()
            if self.sent is None:  # (else reported already: its token was seen, _settle_tokens)
                self._sent(self.sides[f.Role.CTX], sent)

        self._start(partial(self._guarded, f.Role.CTX, body))
        return True

    def _token_stores(self, link: PeerLink, p: Plan) -> list[tuple[int, int]]:
        """The completion tokens ctx's GPU stores after the kernel (mapped path): gen's, into
        the peer's page mapped here (when gen named a slot: an executor there reads the page),
        and ours, when an executor here reads it; each slot's outcome is written before (gen
        primed its own when it announced). Empty with ``KVD_GPU_TOKENS=0``."""
        stores: list[tuple[int, int]] = []
        if not gpu_tokens():
            return stores
        r, peer_words = self.remote, link.words
        if r.word >= 0 and r.token and peer_words is not None and peer_words.device_ptr and r.word < peer_words.slots:
            stores.append((peer_words.device_ptr + r.word * SLOT_BYTES, r.token))
        words, side = self.env.words, self.sides[f.Role.CTX]
        if words is not None and words.device_ptr and side.word >= 0 and side.read_by_page():
            words.prime(side.word, p.total_bytes(), "mapped", len(p.src_ranks()))
            stores.append((words.device_ptr + side.word * SLOT_BYTES, side.token))
        return stores

    def _stores_own_token(self, stores: list[tuple[int, int]]) -> bool:
        """Whether the GPU stores our ctx side's token (then its executor may watch its slot)."""
        side = self.sides.get(f.Role.CTX)
        return side is not None and side.token != 0 and any(v == side.token for _, v in stores)

    def settle_tokens(self) -> None:
        """A side whose completion token a GPU stored is done now (see :meth:`_settle_tokens`):
        asked when its blocks are wanted again (its executors may have seen the token)."""
        if not self.machine.finished:
            self._settle_tokens()

    def _settle_tokens(self) -> None:
        """Before an event that may fail a side: a side whose completion token was stored
        (the mapped path's GPU did, after every byte landed) is done first, as its spinning
        executors may have seen already. ctx: its kernel is over (the token follows the
        kernel's event on the stream); gen: ctx's kernel landed, as a landed event says."""
        words = self.env.words
        if words is None:
            return
        ctx = self.sides.get(f.Role.CTX)
        if ctx is not None and self._ctx_run is not None and self.sent is None and words.holds(ctx.word, ctx.token):
            sent = self._ctx_run.finish_now()
            if sent is not None:
                self._sent(ctx, sent)
        gen = self.sides.get(f.Role.GEN)
        mc = self.machine
        if (gen is not None and f.Role.CTX not in mc.here and mc.gen.state in _RECEIVING_STATES
                and mc.ctx.state in _UNLANDED and mc.path in (None, f.Path.MAPPED) and words.holds(gen.word, gen.token)):
            self.feed(f.LandedSeen(f.Role.CTX, words.primed_bytes(gen.word)))

    def _send_rest_as_task(self, job: Job, link: PeerLink, p: Plan) -> bool:
        """Planned here, too large to copy in this step: the rest runs as the data task."""
        async def body() -> None:
            self._sent(self.sides[f.Role.CTX], await self._choose_and_send(job, link, p))

        self._start(partial(self._guarded, f.Role.CTX, body))
        return True

    def _remote_layout(self) -> KVLayout:
        if self.remote.layout is None:
            raise RemoteProtocolError("no layout of the other side to plan with")
        return self.remote.layout

    def _mapped_dst(self, link: PeerLink) -> dict[int, Any] | None:
        """gen rank -> the peer's pool as mapped here, when every announced pool is; else None."""
        mapped = link.mapped
        if not mapped:
            return None  # not on this node (or not mapped): the usual case off the mapped path
        maps: dict[int, Any] = {}
        for r, name in self.remote.pool_names.items():
            view = mapped.get(name)
            if view is None:
                return None
            maps[r] = view
        return maps or None

    async def _send_task(self) -> None:
        async def body() -> None:
            # the side can fail or be cancelled before this task's first step, and while a
            # worker thread plans (a thread is not cancelled): nothing written, nothing will be
            if self.machine.state(f.Role.CTX) is not f.State.SENDING:
                return
            side, link = self._send_started()
            p = await self._get_plan()
            if self.machine.state(f.Role.CTX) is not f.State.SENDING:
                return
            job = self._send_job(side, link, p)
            self._sent(side, await self._choose_and_send(job, link, p))

        await self._guarded(f.Role.CTX, body)

    async def _choose_and_send(self, job: Job, link: PeerLink, p: Plan) -> Sent:
        maps = self._mapped_dst(link)
        if maps is not None and set(p.dst_ranks()) <= set(maps):
            self.feed(f.PathChosen(f.Role.CTX, f.Path.MAPPED))
            _map_into(job, maps)
            return await mapped.send(job)
        if p.direct:
            self.feed(f.PathChosen(f.Role.CTX, f.Path.DIRECT))
            return await direct.send(job)
        staging = self.env.staging()
        if staging is None:
            raise PeerUnavailable("this daemon has no staging for the bounce path")
        if self.remote.chunking != x.CHUNKING_RANGES or link.slot_bytes < 1:
            # an older gen daemon scatters another chunk layout: per-fragment writes are right for any
            reason = f"{self.peer} does not scatter bounce chunks as this daemon cuts them (an older kvd)"
            log.warning("transfer.bounce_fallback", peer=self.peer, reason=reason, fragments=p.num_fragments())
            self.feed(f.PathChosen(f.Role.CTX, f.Path.FRAGMENT))
            return await fragment.send(job)
        gpu = staging.send.device >= 0  # a pipeline of chunks pays off on GPUs, not on a few cores
        self.bounce_chunk = bounce.chunk_size(p, min(staging.send.slot_bytes, link.slot_bytes),
                                              bounce.PIPELINE_CHUNKS if gpu else 1)
        chunks = bounce.chunks(p, self.bounce_chunk)
        self.feed(f.PathChosen(f.Role.CTX, f.Path.BOUNCE))  # its path message names bounce_chunk
        self.sides[f.Role.CTX].chunks_total = len(chunks)
        first: int | None = None
        if self._grants.rx.statistics().current_buffer_used == 0:
            self.round_trips += 1  # path out, first grant back (none came with the destination)
        with trio.move_on_after(self.env.cfg.bounce_wait_s):
            first = await self._grants.rx.receive()
        if first is None:
            reason = f"no receive credit from {self.peer} within bounce_wait_s={self.env.cfg.bounce_wait_s}"
            log.warning("transfer.bounce_fallback", peer=self.peer, reason=reason, fragments=p.num_fragments())
            self.feed(f.PathChosen(f.Role.CTX, f.Path.FRAGMENT))
            return await fragment.send(job)
        job.grants = self._grants.rx.receive
        job.staging, job.slot_pool = staging.send, staging.send_slots
        job.remote_region, job.remote_slot_bytes = link.bounce, link.slot_bytes
        return await bounce.send(job, chunks, self.bounce_chunk, first)

    # -- data path: gen -------------------------------------------------------------------------------
    def _start_receive(self, path: f.Path) -> None:
        side = self.sides.get(f.Role.GEN)
        if side is not None:
            side.state = "receiving"
            side.started = side.started or time.monotonic()
        scope = self._scopes.get(f.Role.GEN)
        if path is f.Path.MAPPED and self.remote.landed is not None:
            self._watch_landed(self.remote.landed)
        if path is not f.Path.BOUNCE:
            if scope is not None:  # ctx switched to per-fragment writes: no slot will be used
                scope.cancel()
            staging = self.env.staging()
            if self.pregranted and staging is not None and not self._pending_scatters:
                staging.recv_slots.release_owner(self.slot_owner)  # ctx writes into the blocks
                self.pregranted = 0
            return
        if scope is None:
            self._start(self._receive_task)

    def _watch_landed(self, ev: x.LandedEvent) -> None:
        """gen, mapped path: watch ctx's landed event (:mod:`kvd.regroup.landed`): asked once
        here (a small request's kernel is usually done by now), else by a task until it
        completes or the ctx side ends otherwise. A handle not opened yet is opened in a worker
        thread for the next requests; this one completes on ctx's data-done message."""
        side = self.sides.get(f.Role.GEN)
        devices = [part.pool.device for part in side.parts.values()] if side is not None else []
        link = self._link()
        if not devices or min(devices) < 0 or link is None:
            return  # (host pools: ctx cannot have recorded a CUDA event for them)
        # the handle is the peer process's: keyed by its instance (see kvd.regroup.landed)
        known, event = landed.opened(link.instance, ev.handle)
        if not known:
            self._start(partial(self._open_landed, link.instance, ev.handle, devices[0]))
            return
        if event is None:
            return  # the driver refused this handle before: the data-done message completes it
        done = landed.query(event)
        if done:
            self._landed_seen(ev)
        elif done is not None:
            self._start(partial(self._landed_task, event, ev))

    async def _open_landed(self, instance: str, handle: bytes, device: int) -> None:
        await trio.to_thread.run_sync(landed.open_event, instance, handle, device)

    async def _landed_task(self, event: Any, ev: x.LandedEvent) -> None:
        def ready() -> bool | None:
            if self.machine.state(f.Role.CTX) is not f.State.SENDING:
                return None  # ctx's word came first: stop asking
            return landed.query(event)  # (None: the query failed, logged: the data-done message decides)

        # polled as the ctx side waits for its own kernel (kvd.transfer.movers.until_done)
        if await wait_polling(ready, ev.nbytes):
            self._landed_seen(ev)

    def _landed_seen(self, ev: x.LandedEvent) -> None:
        if self.machine.state(f.Role.CTX) is not f.State.SENDING:
            return  # ctx's word came first
        gen = self.sides.get(f.Role.GEN)
        if gen is not None:
            gen.stages["landed_event"] = 1
            if gen.started:
                gen.mark("landed")
        self.landed_msg = ev
        self.feed(f.LandedSeen(f.Role.CTX, ev.nbytes))

    async def _receive_task(self) -> None:
        async def body() -> None:
            # the side can fail or be cancelled between ctx's path message and this task's
            # first step: the abort then counted the chunks notified meanwhile as never to be
            # scattered (no task to cancel yet), so none of them may be scattered now
            if self.machine.state(f.Role.GEN) is not f.State.RECEIVING:
                return
            side = self.sides[f.Role.GEN]
            p = await self._get_plan()
            staging = self.env.staging()
            links = self.env.links()
            if staging is None or links is None or self.peer not in links.links:
                raise PeerUnavailable("no receive staging or no link for the bounce path")
            link = links.links[self.peer]
            chunk = self.remote.chunk_bytes
            if chunk < 1:
                raise RemoteProtocolError(f"peer {self.peer} names no bounce chunk size (an older kvd, which "
                                          "lays bounce chunks out otherwise): upgrade it")
            if chunk > staging.recv.slot_bytes:
                raise RemoteProtocolError(f"peer {self.peer} cuts {chunk}-byte bounce chunks; this daemon's "
                                          f"receive slots hold {staging.recv.slot_bytes} bytes")
            chunks = bounce.chunks(p, chunk)
            side.chunks_total = len(chunks)
            rid = self.request_id
            credits = bounce.Credits(rid, self.env.nixl(), link.agent, link.send,
                                     by_notif=self.remote.credits == x.CREDITS_NOTIF, stages=side.stages,
                                     ref=self.remote.ref)
            progress = _ScatterProgress(self, side)
            receiver = bounce.Receiver(rid, self.slot_owner, p, chunks, {r: part.pool for r, part in side.parts.items()},
                                       staging.recv, staging.recv_slots, progress, credits, granted=self.pregranted,
                                       withhold=not self.env.cfg.grant_credits)
            if receiver.withhold:
                log.warning("transfer.credits_withheld", reason="transfer.grant_credits = false")
            try:
                await receiver.run(self._notifs.rx)
            finally:
                # chunks notified but never scattered (aborted): their scatters will not run
                if self._pending_scatters:
                    n, self._pending_scatters = self._pending_scatters, 0
                    self.feed(f.WriteEnded(f.Role.GEN, n))

        await self._guarded(f.Role.GEN, body)

    def scatters_ended(self, n: int) -> None:
        self._pending_scatters -= n
        self.feed(f.WriteEnded(f.Role.GEN, n))

    # -- inspection ------------------------------------------------------------------------------------
    def info(self) -> list[m.TransferInfo]:
        return [msgspec.structs.replace(s.info(), state=s.state if s.completion else self._state_of(r),
                                        peer=s.peer or self.peer)
                for r, s in self.sides.items()]

    def _state_of(self, role: f.Role) -> str:
        return self.machine.state(role).value
