"""The transfer protocol as a sans-IO state machine (h11 style): no I/O, no clocks.

One :class:`TransferMachine` per request holds the state of BOTH sides, ctx (the sender) and
gen (the receiver). A daemon feeds it events for the sides it hosts (``here``: executors
registered, writes posted and ended, notifications seen, cancel, disconnect, local failures)
and the peer's transfer-control messages for the other side; time is an input
(:class:`Clock`). Each :meth:`TransferMachine.handle` returns the actions the daemon must
carry out (send a message, start or abort the data path, report to the executors). Both
daemons run the same machine, so they agree on what happened; with ctx and gen on one daemon
both sides are ``here`` and nothing is sent.

Per side, the states move along :data:`TRANSITIONS` (``{role: {state: {event type: new
state}}}``; a pair not in the table is a protocol error naming who broke the rules:
:class:`~protocol.errors.LocalProtocolError` for our own events,
:class:`~protocol.errors.RemoteProtocolError` for the peer's messages). The few transitions
that depend on both sides are the joint rules under the table, applied to a fixed point after
every event:

- **destination**: gen is ready and either named its ctx peer (``expect(peer=...)``) or has
  an offer → send the destination (layout, blocks, pools, receive slots) — unasked in the
  first case (an *announce*), as the accept in the second;
- **offer**: ctx is ready and knows no destination → send an offer (today's flow);
- **start**: ctx is ready and knows the destination → start the data path (zero peer round
  trips when the destination was announced before ``publish``);
- **complete**: ctx's data is out (``DataOut`` here, ``XferDone`` from the peer, or
  :class:`LandedSeen`: gen saw the CUDA event ctx recorded after its one kernel complete) and
  gen has seen every write notification and finished its own scatters → gen is done;
- **spread**: one side aborting or failed → the other aborts too;
- **report**: a side that is aborting reports failure (and gives its blocks and slots back)
  only once no write can land any more: ctx when its own writes are over; gen when its own
  scatters are over and ctx cannot write (it never got the destination, or said its writes
  stopped, or its data was out, or the peer was fenced — it reconnected as a new instance).
  A ctx side hosted alone then sends its one failure notice, also when nothing was said yet
  (``publish`` named its gen peer): gen learns of it instead of waiting for its deadline.

A late message (a notification or a failure after the side ended) is absorbed by the table
(``FAILED`` keeps ``FAILED``); only a message that could never be valid raises.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol.errors import (
    LocalProtocolError,
    PeerUnavailable,
    RemoteProtocolError,
    TransferCancelled,
    TransferTimeout,
)

__all__ = [
    "FINAL",
    "JOINT",
    "LOCAL_EVENTS",
    "OBSERVED_EVENTS",
    "REMOTE_EVENTS",
    "TRANSITIONS",
    "AbortWrites",
    "Action",
    "Cancel",
    "Clock",
    "DataDoneReceived",
    "DataOut",
    "DestinationReceived",
    "Disconnect",
    "Event",
    "FailReceived",
    "LandedSeen",
    "LocalFailure",
    "NotifSeen",
    "OfferReceived",
    "Path",
    "PathChosen",
    "PathReceived",
    "PeerFenced",
    "PeerLost",
    "RankRegistered",
    "Report",
    "Role",
    "SendDataDone",
    "SendDestination",
    "SendFail",
    "SendOffer",
    "SendPath",
    "SideComplete",
    "SideState",
    "StartData",
    "StartReceive",
    "State",
    "TransferMachine",
    "WriteEnded",
    "WritePosted",
]


class Role(enum.Enum):
    """The two sides of a transfer."""

    CTX = "ctx"  # sender: the prefill (context) executors' KV
    GEN = "gen"  # receiver: the decode (generation) executors' blocks

    # members are singletons compared by identity: hash them so, in C. Enum's own __hash__ is
    # Python code (hash of the name), and every event hashes roles and states a dozen times
    # (``here``, the table, ``FINAL``): ~2.5 us of each event's ~6
    __hash__ = object.__hash__

    @property
    def other(self) -> Role:
        return Role.GEN if self is Role.CTX else Role.CTX


class State(enum.Enum):
    """A side's state. ctx and gen use different subsets (see :data:`TRANSITIONS`)."""

    IDLE = "idle"  # nothing known yet
    REGISTERING = "registering"  # some ranks registered, not all
    READY = "ready"  # every rank registered
    OFFERED = "offered"  # ctx: offer sent (or, seen from gen, received)
    DEST_OUT = "dest_out"  # gen: destination handed to ctx (announce or accept): writes may land
    SENDING = "sending"  # ctx: the data path runs
    RECEIVING = "receiving"  # gen: ctx said which path it takes
    DONE = "done"  # final: success
    ABORTING = "aborting"  # failed; writes may still be in flight
    FAILED = "failed"  # final: failure reported, no write can land any more

    __hash__ = object.__hash__  # as Role's


#: States a side never leaves.
FINAL = frozenset({State.DONE, State.FAILED})


class Path(enum.Enum):
    """How the bytes move."""

    LOCAL = "local"  # ctx and gen pools on one daemon
    MAPPED = "mapped"  # the peer's pools are mapped here (same node / NVLink domain)
    DIRECT = "direct"  # equal layouts: whole blocks written straight into the peer's pools
    BOUNCE = "bounce"  # gather into staging, NIXL write into receive slots, scatter
    FRAGMENT = "fragment"  # no receive slot in time: one NIXL descriptor per fragment

    __hash__ = object.__hash__  # as Role's


# --- events ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """Base of the events; ``role`` is the side the event is about."""

    role: Role


# events of a side hosted here (from its executors and the engine)
@dataclass(frozen=True)
class RankRegistered(Event):
    """A rank registered; more are to come. ``deadline`` on the caller's clock; ``deadline_s``:
    the same deadline as the executor gave it, in seconds (only quoted in error messages)."""

    deadline: float = math.inf
    deadline_s: float = 0.0


@dataclass(frozen=True)
class SideComplete(Event):
    """The last rank registered. ``peer_named``: gen's ``expect`` named its ctx peer."""

    deadline: float = math.inf
    deadline_s: float = 0.0  # as RankRegistered's
    peer_named: bool = False


@dataclass(frozen=True)
class PathChosen(Event):
    """ctx planned and picked its path (after :class:`StartData`)."""

    path: Path = Path.DIRECT


@dataclass(frozen=True)
class WritePosted(Event):
    """``n`` writes into gen memory started: ctx NIXL writes/copies, or gen scatters."""

    n: int = 1


@dataclass(frozen=True)
class WriteEnded(Event):
    """``n`` writes reached a final state (completed, or aborted and confirmed)."""

    n: int = 1


@dataclass(frozen=True)
class DataOut(Event):
    """ctx: every write is complete; ``writes`` notifications are on their way to gen."""

    writes: int = 0
    nbytes: int = 0


@dataclass(frozen=True)
class NotifSeen(Event):
    """gen: a NIXL notification of one ctx write arrived. ``scatter``: and gen starts a write
    of its own into its blocks because of it (a bounce chunk's scatter), counted in flight as
    :class:`WritePosted` counts one (one event per notification instead of two)."""

    scatter: bool = False


@dataclass(frozen=True)
class Cancel(Event):
    """An executor (or an operator) cancelled the request."""

    reason: str = "cancelled"


@dataclass(frozen=True)
class Disconnect(Event):
    """An executor of the side disconnected before the side ended."""

    reason: str = "executor disconnected"


@dataclass(frozen=True)
class LocalFailure(Event):
    """The data path (planning, NIXL, copy) failed here; ``code`` is a protocol.errors code."""

    code: str = "transfer_failed"
    message: str = ""


# what the gen daemon observes of the peer's ctx side itself (no message)
@dataclass(frozen=True)
class LandedSeen(Event):
    """gen: the CUDA event ctx's path message named (recorded right after the request's one
    kernel launch) completed: every byte ctx writes is in gen's blocks and none can land any
    more, as ``XferDone`` would say (which still comes, as a confirmation). ``nbytes``: what
    the path message said the request moves."""

    nbytes: int = 0


# messages of the peer, about ITS side (role = the sender's side)
@dataclass(frozen=True)
class OfferReceived(Event):
    """``XferOffer``: ctx is ready and asks for a destination."""

    deadline: float = math.inf
    deadline_s: float = 0.0  # as RankRegistered's: what was left of ctx's deadline


@dataclass(frozen=True)
class DestinationReceived(Event):
    """``XferAnnounce`` (unasked) or ``XferAccept`` (answer to an offer)."""

    deadline: float = math.inf
    deadline_s: float = 0.0  # as RankRegistered's: what was left of gen's deadline
    announced: bool = False


@dataclass(frozen=True)
class PathReceived(Event):
    """``XferPath``: ctx started writing along ``path``."""

    path: Path = Path.DIRECT


@dataclass(frozen=True)
class DataDoneReceived(Event):
    """``XferDone``: ctx's data is out; ``writes`` notifications belong to it."""

    writes: int = 0
    nbytes: int = 0


@dataclass(frozen=True)
class FailReceived(Event):
    """``XferFail``: the peer's side failed; ``writes_stopped``: none of its writes can land.
    ``deadline`` (on the caller's clock; ``deadline_s`` as sent): a ctx side that failed before
    it heard from gen gives what was left of its deadline, so that a gen side first known by
    this failure keeps the request's deadline (the engine remembers the end until then)."""

    code: str = "transfer_failed"
    message: str = ""
    writes_stopped: bool = True
    deadline: float = math.inf
    deadline_s: float = 0.0


# events without a side
@dataclass(frozen=True)
class Clock:
    """The time now (same clock as the deadlines); expires sides past their deadline."""

    now: float


@dataclass(frozen=True)
class PeerLost:
    """The link to the peer broke (heartbeat timeout, EOF). Its writes may still land."""

    reason: str = ""


@dataclass(frozen=True)
class PeerFenced:
    """The peer proved that none of its writes can land any more (it came back as a new
    instance: the old process is gone)."""


# --- actions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """Base of the actions the daemon carries out."""


@dataclass(frozen=True)
class SendOffer(Action):
    pass


@dataclass(frozen=True)
class SendDestination(Action):
    """Send gen's destination; ``announced``: unasked (gen named its peer)."""

    announced: bool


@dataclass(frozen=True)
class SendPath(Action):
    path: Path


@dataclass(frozen=True)
class SendDataDone(Action):
    writes: int
    nbytes: int


@dataclass(frozen=True)
class SendFail(Action):
    """Send the side's one failure notice. ``unheard``: the peer never said anything about this
    request, so it may not know it at all (ctx failed before its offer, or before its offer
    reached gen): the notice carries the deadline, and gen keeps the failure for its ranks."""

    code: str
    message: str
    writes_stopped: bool
    unheard: bool = False


@dataclass(frozen=True)
class StartData(Action):
    """Plan and run the data path (``path`` is set for the local path, else ctx chooses)."""

    path: Path | None = None


@dataclass(frozen=True)
class StartReceive(Action):
    """gen: ctx took ``path``; set up what receiving needs (bounce: grant slots, scatter)."""

    path: Path


@dataclass(frozen=True)
class AbortWrites(Action):
    """Abort the side's in-flight writes; each one reports :class:`WriteEnded` when final."""

    role: Role


@dataclass(frozen=True)
class Report(Action):
    """Tell the side's executors the outcome and give its leases (blocks, slots) back."""

    role: Role
    ok: bool
    code: str = ""
    message: str = ""


# --- the table ---------------------------------------------------------------------------
# (the joint rules that move a side further without an event of its own are in JOINT below)

_S = State
_FAILURES: dict[type[Event], State] = {Cancel: _S.ABORTING, Disconnect: _S.ABORTING, LocalFailure: _S.ABORTING}


def _keep(state: State, *events: type[Event]) -> dict[type[Event], State]:
    return dict.fromkeys(events, state)


#: ``{role: {state: {event type: new state}}}``. Events of a side hosted here (registration,
#: writes, cancel...) and the peer's messages about its side share one table: which of them
#: may occur depends on whether the side is hosted here (checked before the lookup).
TRANSITIONS: dict[Role, dict[State, dict[type[Event], State]]] = {
    Role.CTX: {
        _S.IDLE: {
            RankRegistered: _S.REGISTERING, SideComplete: _S.READY,
            OfferReceived: _S.OFFERED, PathReceived: _S.SENDING,
            # gen saw ctx's GPU store its completion token before ctx's path message came
            LandedSeen: _S.DONE,
            FailReceived: _S.FAILED, **_FAILURES,
        },
        _S.REGISTERING: {
            RankRegistered: _S.REGISTERING, SideComplete: _S.READY, **_FAILURES,
        },
        _S.READY: {**_FAILURES},
        # LandedSeen: as in IDLE, the token came before the path message (offer/accept order)
        _S.OFFERED: {PathReceived: _S.SENDING, LandedSeen: _S.DONE, FailReceived: _S.FAILED, **_FAILURES},
        _S.SENDING: {
            # PathReceived: the peer's ctx switched bounce → fragment
            PathChosen: _S.SENDING, PathReceived: _S.SENDING, **_keep(_S.SENDING, WritePosted, WriteEnded),
            DataOut: _S.DONE, DataDoneReceived: _S.DONE, LandedSeen: _S.DONE, FailReceived: _S.FAILED,
            **_FAILURES,
        },
        # DataDoneReceived in DONE: the confirmation after LandedSeen (a duplicate otherwise:
        # refused by its effects)
        # PathReceived in DONE: the path message after gen saw the completion token
        _S.DONE: {FailReceived: _S.DONE, **_keep(_S.DONE, Cancel, Disconnect, LandedSeen, DataDoneReceived,
                                                  PathReceived)},
        _S.ABORTING: {
            **_keep(_S.ABORTING, WriteEnded, PathChosen, Cancel, Disconnect, LocalFailure, LandedSeen),
            FailReceived: _S.FAILED,
        },
        _S.FAILED: {**_keep(_S.FAILED, FailReceived, Cancel, Disconnect, LocalFailure, DataDoneReceived,
                                PathReceived, LandedSeen)},
    },
    Role.GEN: {
        _S.IDLE: {
            RankRegistered: _S.REGISTERING, SideComplete: _S.READY,
            DestinationReceived: _S.DEST_OUT, FailReceived: _S.FAILED, **_FAILURES,
        },
        _S.REGISTERING: {
            RankRegistered: _S.REGISTERING, SideComplete: _S.READY, **_FAILURES,
        },
        _S.READY: {**_FAILURES},
        _S.DEST_OUT: {
            NotifSeen: _S.DEST_OUT, **_keep(_S.DEST_OUT, WritePosted, WriteEnded),
            FailReceived: _S.FAILED, **_FAILURES,
        },
        _S.RECEIVING: {
            PathReceived: _S.RECEIVING,  # bounce → fragment: no receive slot came in time
            NotifSeen: _S.RECEIVING, **_keep(_S.RECEIVING, WritePosted, WriteEnded),
            FailReceived: _S.FAILED, **_FAILURES,
        },
        _S.DONE: {**_keep(_S.DONE, FailReceived, Cancel, Disconnect)},
        _S.ABORTING: {
            **_keep(_S.ABORTING, NotifSeen, WritePosted, WriteEnded, Cancel, Disconnect, LocalFailure),
            FailReceived: _S.FAILED,
        },
        _S.FAILED: {**_keep(_S.FAILED, NotifSeen, FailReceived, Cancel, Disconnect, LocalFailure)},
    },
}

#: Where the joint rules (code under the table) may move a side on their own; with
#: :data:`TRANSITIONS` this is the whole state graph (docs/design.md draws it).
JOINT: dict[Role, dict[State, frozenset[State]]] = {
    Role.CTX: {
        _S.READY: frozenset({_S.OFFERED, _S.SENDING, _S.ABORTING}),
        _S.OFFERED: frozenset({_S.SENDING, _S.ABORTING}),
        _S.IDLE: frozenset({_S.ABORTING}),
        _S.REGISTERING: frozenset({_S.ABORTING}),
        _S.SENDING: frozenset({_S.ABORTING}),
        _S.ABORTING: frozenset({_S.FAILED}),
    },
    Role.GEN: {
        _S.READY: frozenset({_S.DEST_OUT, _S.RECEIVING, _S.ABORTING}),
        _S.IDLE: frozenset({_S.ABORTING}),
        _S.REGISTERING: frozenset({_S.ABORTING}),
        _S.DEST_OUT: frozenset({_S.RECEIVING, _S.DONE, _S.ABORTING}),  # receiving: ctx's path message
        _S.RECEIVING: frozenset({_S.DONE, _S.ABORTING}),
        _S.ABORTING: frozenset({_S.FAILED}),
    },
}

#: Event types a side hosted here produces (the rest are the peer's messages about its side).
LOCAL_EVENTS: frozenset[type[Event]] = frozenset({
    RankRegistered, SideComplete, PathChosen, WritePosted, WriteEnded, DataOut, NotifSeen,
    Cancel, Disconnect, LocalFailure,
})
#: What a daemon observes of the peer's side by itself (no message), and of which side: only
#: where that side is the peer's and the other one is hosted here.
OBSERVED_EVENTS: dict[type[Event], Role] = {LandedSeen: Role.CTX}
#: Peer messages and the side that sends them.
REMOTE_EVENTS: dict[type[Event], frozenset[Role]] = {
    OfferReceived: frozenset({Role.CTX}),
    PathReceived: frozenset({Role.CTX}),
    DataDoneReceived: frozenset({Role.CTX}),
    DestinationReceived: frozenset({Role.GEN}),
    FailReceived: frozenset({Role.CTX, Role.GEN}),
}
#: The roles in the order the machine visits them (by value: ctx, then gen), so that both
#: daemons act alike; a constant, not ``sorted(here)`` per event.
_ORDER: tuple[Role, Role] = (Role.CTX, Role.GEN)
# The roles, the states and the other role as module constants for the machine's code
# below: an enum member fetched from its class (``State.ABORTING``) is a Python-level
# attribute lookup (~50 ns) and ``Role.other`` a property (~150 ns); the joint rules test a
# score of them per pass, a few passes per event.
_CTX, _GEN = Role.CTX, Role.GEN
(_ABORTING, _DEST_OUT, _DONE, _FAILED, _IDLE, _OFFERED, _READY, _RECEIVING, _SENDING) = (
    State.ABORTING, State.DEST_OUT, State.DONE, State.FAILED, State.IDLE, State.OFFERED, State.READY,
    State.RECEIVING, State.SENDING)
_OTHER: dict[Role, Role] = {_CTX: _GEN, _GEN: _CTX}
#: The states in which the joint failure rules (spread, report, tell) may apply to a pair.
_TROUBLE = frozenset({_ABORTING, _FAILED})
#: Local events that only one side produces.
_LOCAL_ONLY: dict[type[Event], Role] = {PathChosen: Role.CTX, DataOut: Role.CTX, NotifSeen: Role.GEN}


@dataclass
class SideState:
    """One side's state as this daemon knows it."""

    state: State = State.IDLE
    in_flight: int = 0  # writes (ctx) or scatters (gen) started here and not final yet
    code: str = ""  # why it failed
    message: str = ""
    reported: bool = False


@dataclass
class TransferMachine:
    """The protocol state of one request, both sides; see the module docstring."""

    here: set[Role]
    request_id: str = ""  # only quoted in error messages
    deadline: float = math.inf
    deadline_s: float = 0.0  # the event that set ``deadline`` gave it as this many seconds
    path: Path | None = None
    peer_named: bool = False  # gen named its ctx peer: announce its destination unasked
    dest_out: bool = False  # gen's destination was handed to ctx: ctx writes may land
    notifs: int = 0  # write notifications gen saw
    writes_expected: int = -1  # from ctx's DataOut / XferDone; -1 = not known yet
    nbytes: int = 0
    fenced: bool = False  # the peer can no longer write
    landed: bool = False  # gen saw ctx's landed event: ctx's XferDone is a confirmation
    fail_sent: bool = False  # our one XferFail went out
    talked: bool = False  # a message went to or came from the peer
    heard: bool = False  # a message came from the peer
    ctx: SideState = field(default_factory=SideState)
    gen: SideState = field(default_factory=SideState)

    # -- inspection ---------------------------------------------------------------------
    def side(self, role: Role) -> SideState:
        return self.ctx if role is Role.CTX else self.gen

    def state(self, role: Role) -> State:
        return self.side(role).state

    @property
    def finished(self) -> bool:
        """Every side hosted here is final and reported."""
        # a loop, not all() over a generator: asked after nearly every event
        for r in self.here:
            s = self.ctx if r is _CTX else self.gen
            if not (s.state in FINAL and s.reported):
                return False
        return True

    @property
    def local(self) -> bool:
        """ctx and gen both on this daemon (the local path)."""
        return len(self.here) == 2

    def host(self, role: Role) -> None:
        """``role`` registers on this daemon too (a gen side without a named peer, then a ctx
        publishing to this very daemon). Only before the peer said anything about it."""
        if role in self.here:
            return
        if self.side(role).state is not State.IDLE or self.talked:
            raise LocalProtocolError(f"{role.value} side is already played by the peer")
        self.here.add(role)

    # -- feeding ------------------------------------------------------------------------
    def handle(self, event: Event | Clock | PeerLost | PeerFenced) -> list[Action]:
        """Apply one event; return the actions to carry out, in order."""
        out: list[Action] = []
        if isinstance(event, Event):  # first: what nearly every call brings
            self._apply(event, out)
        elif isinstance(event, Clock):
            if event.now >= self.deadline:
                for role in self._hosted():
                    if self.side(role).state not in FINAL and self.side(role).state is not _ABORTING:
                        self._fail(role, TransferTimeout.code, self.timeout_message(role), out)
        elif isinstance(event, PeerLost):
            for role in self._hosted():
                if self.side(role).state not in FINAL and self.side(role).state is not _ABORTING:
                    self._fail(role, PeerUnavailable.code, f"peer link lost: {event.reason}", out)
        elif isinstance(event, PeerFenced):
            self.fenced = True
            remote = self._remote()
            if remote is not None and self.side(remote).state not in FINAL:
                s = self.side(remote)
                s.state, s.code, s.message = _FAILED, PeerUnavailable.code, "peer fenced"
        else:
            self._apply(event, out)
        self._joint(out)
        return out

    def timeout_message(self, role: Role) -> str:
        """Why the side ``role`` hosted here missed its deadline, in words: which request,
        which side, what it was waiting for, the deadline in seconds and what to check."""
        waiting, check = self._waiting_for(role)
        name = f"request {self.request_id!r}" if self.request_id else "the request"
        limit = f" of {self.deadline_s:.3g} s" if self.deadline_s > 0 else ""
        return f"{name} ({role.value} side) missed its deadline{limit} while {waiting}; {check}"

    def _waiting_for(self, role: Role) -> tuple[str, str]:
        """(what the side was waiting for, what to check), from the states alone."""
        me, c = self.side(role).state, self.ctx.state
        more = "or give the request a longer deadline_s"
        if me in (_IDLE, State.REGISTERING):
            verb, verbs = ("publish", "publishes") if role is _CTX else ("expect", "expects")
            which = "other" if me is State.REGISTERING else "first"
            return (f"waiting for the {which} {role.value} ranks to {verb} it",
                    f"check that every {role.value} executor of the request {verbs} it, {more}")
        moving = ("check the peer daemon (is it running? its log) and the link between the two daemons, "
                  f"{more} if this much data needs it")
        if role is _CTX:
            if me is _SENDING:
                return f"data was still moving ({self.ctx.in_flight} writes in flight)", moving
            where = "on this daemon" if self.local else "on the peer daemon"
            return (f"waiting for gen's destination (the gen executors {where} have not all expected it)",
                    f"check that every gen executor expects this request id {where}"
                    + ("" if self.local else " and that the peer daemon is running") + f", {more}")
        # gen
        if c in (_SENDING, _DONE) or me is _RECEIVING:
            seen = f"{self.notifs} of {self.writes_expected}" if self.writes_expected >= 0 else f"{self.notifs}"
            return f"data was still moving ({seen} ctx writes arrived)", moving
        if c is _OFFERED:
            return ("waiting for the ctx side to start sending (gen's destination went out)",
                    f"check the peer daemon (is it running? its log), {more}")
        if self.local:
            return ("waiting for the ctx side to publish (the ctx executors on this daemon have not all published it)",
                    f"check that every ctx executor publishes this request id with this daemon as its peer, {more}")
        told = " (gen's destination was announced to it)" if me is _DEST_OUT else ""
        return (f"waiting for the ctx side to publish{told}",
                "check that the ctx executors publish this request id with this daemon as their peer and that "
                f"their daemon is running and linked to this one, {more}")

    def _hosted(self) -> list[Role]:
        """The roles hosted here, in :data:`_ORDER`."""
        return [r for r in _ORDER if r in self.here]

    def _remote(self) -> Role | None:
        for r in _ORDER:
            if r not in self.here:
                return r
        return None

    def _apply(self, event: Event, out: list[Action]) -> None:
        etype = type(event)
        role = event.role
        hosted = role in self.here
        if etype in OBSERVED_EVENTS:
            if hosted or OBSERVED_EVENTS[etype] is not role or _OTHER[role] not in self.here:
                raise LocalProtocolError(f"{etype.__name__} is what a daemon hosting only the other side of "
                                         f"{OBSERVED_EVENTS[etype].value} sees; got it for {role.value}")
        elif etype in LOCAL_EVENTS:
            if not hosted:
                raise LocalProtocolError(f"{etype.__name__} for the {role.value} side, which the peer plays")
            only = _LOCAL_ONLY.get(etype)
            if only is not None and only is not role:
                raise LocalProtocolError(f"{etype.__name__} is a {only.value}-side event, got it for {role.value}")
        else:
            senders = REMOTE_EVENTS.get(etype)
            if senders is None or role not in senders:
                raise LocalProtocolError(f"unknown event {etype.__name__} for {role.value}")
            if hosted:
                raise RemoteProtocolError(
                    f"peer sent {etype.__name__} about the {role.value} side, which this daemon plays"
                )
            self.talked = self.heard = True
        side = self.ctx if role is _CTX else self.gen
        new = TRANSITIONS[role][side.state].get(etype)
        if new is None:
            err = LocalProtocolError if hosted or etype in OBSERVED_EVENTS else RemoteProtocolError
            raise err(f"{etype.__name__} not allowed while the {role.value} side is {side.state.value}")
        _EFFECTS[etype](self, event, side, new, out)

    def _effects(self, event: Event, side: SideState, new: State, out: list[Action]) -> None:
        """The bookkeeping of one table transition (counters, deadlines, failures), by the
        event's type (one of :data:`LOCAL_EVENTS` or :data:`REMOTE_EVENTS`: ``_apply``
        refused any other): one dict lookup instead of a chain of ``isinstance`` tests."""
        _EFFECTS[type(event)](self, event, side, new, out)

    def _deadline_from(self, event: RankRegistered | SideComplete | OfferReceived | DestinationReceived
                       | FailReceived) -> None:
        if event.deadline < self.deadline:
            self.deadline, self.deadline_s = event.deadline, event.deadline_s

    def _on_registered(self, event: RankRegistered | OfferReceived, side: SideState, new: State,
                       out: list[Action]) -> None:
        self._deadline_from(event)
        self._set(side, new)

    def _on_side_complete(self, event: SideComplete, side: SideState, new: State, out: list[Action]) -> None:
        self._deadline_from(event)
        self.peer_named = self.peer_named or event.peer_named
        self._set(side, new)

    def _on_destination(self, event: DestinationReceived, side: SideState, new: State, out: list[Action]) -> None:
        self._deadline_from(event)
        self.dest_out = True
        self._set(side, new)

    def _on_path_received(self, event: PathReceived, side: SideState, new: State, out: list[Action]) -> None:
        if not self.dest_out:
            raise RemoteProtocolError("ctx announced a path before gen handed out its destination")
        if side.state is _DONE:
            if event.path is not Path.MAPPED or not self.landed:
                raise RemoteProtocolError(f"XferPath ({event.path.value}) for a ctx side that is done already")
            return  # the path message of a request gen saw land (the completion token) first
        self.path = event.path
        if self.gen.state in (_DEST_OUT, _RECEIVING):
            self.gen.state = _RECEIVING
            out.append(StartReceive(event.path))
        self._set(side, new)

    def _on_path_chosen(self, event: PathChosen, side: SideState, new: State, out: list[Action]) -> None:
        self.path = event.path
        if side.state is _SENDING and _GEN not in self.here:
            out.append(SendPath(event.path))
        self._set(side, new)

    def _on_write_posted(self, event: WritePosted, side: SideState, new: State, out: list[Action]) -> None:
        if side.state is _ABORTING and event.role is _CTX:
            raise LocalProtocolError("write posted after the ctx side began aborting")
        side.in_flight += event.n
        self._set(side, new)

    def _on_write_ended(self, event: WriteEnded, side: SideState, new: State, out: list[Action]) -> None:
        if side.in_flight < event.n:
            raise LocalProtocolError(f"{event.n} writes ended but only {side.in_flight} were in flight")
        side.in_flight -= event.n
        self._set(side, new)

    def _on_notif_seen(self, event: NotifSeen, side: SideState, new: State, out: list[Action]) -> None:
        if side.state not in FINAL and side.state is not _ABORTING:
            self.notifs += 1
            if event.scatter:
                side.in_flight += 1
        self._set(side, new)

    def _on_data_out(self, event: DataOut, side: SideState, new: State, out: list[Action]) -> None:
        if side.in_flight:
            raise LocalProtocolError(f"data out with {side.in_flight} writes still in flight")
        self.writes_expected, self.nbytes = event.writes, event.nbytes
        side.state = _DONE
        if not self.local:
            out.append(SendDataDone(event.writes, event.nbytes))
            self.talked = True
        self._report(_CTX, out)

    def _on_data_done_received(self, event: DataDoneReceived, side: SideState, new: State,
                               out: list[Action]) -> None:
        if side.state is _DONE:
            if not self.landed or event.writes:
                raise RemoteProtocolError("XferDone for a ctx side that is done already")
            return  # the confirmation of what the landed event said
        if side.state is _SENDING:
            self.writes_expected, self.nbytes = event.writes, event.nbytes
        self._set(side, new)

    def _on_landed_seen(self, event: LandedSeen, side: SideState, new: State, out: list[Action]) -> None:
        early = side.state is _IDLE or side.state is _OFFERED  # before ctx's path message
        if early:
            # only the mapped path's kernel stores gen's completion token, and only into a
            # destination gen handed out
            if not self.dest_out or self.path not in (None, Path.MAPPED):
                raise LocalProtocolError("a landed request before gen handed out its destination")
            self.path = Path.MAPPED
        if side.state is _SENDING or early:
            if self.path is not Path.MAPPED:
                raise LocalProtocolError(f"a landed event on the {self.path.value if self.path else 'unknown'} "
                                         "path (only the mapped path's kernel records one)")
            self.landed = True
            self.writes_expected, self.nbytes = 0, event.nbytes
        self._set(side, new)

    def _on_fail_received(self, event: FailReceived, side: SideState, new: State, out: list[Action]) -> None:
        self._deadline_from(event)
        if side.state not in FINAL:
            side.code, side.message = event.code, event.message
            if not event.writes_stopped:
                new = _ABORTING
        self._set(side, new)

    def _on_stop(self, event: Cancel | Disconnect | LocalFailure, side: SideState, new: State,
                 out: list[Action]) -> None:
        if side.state in FINAL or side.state is _ABORTING:
            return  # late: the side already ended or is ending
        if isinstance(event, LocalFailure):
            self._fail(event.role, event.code, event.message, out)
        else:
            self._fail(event.role, TransferCancelled.code, event.reason, out)

    @staticmethod
    def _set(side: SideState, new: State) -> None:
        if side.state not in FINAL:
            side.state = new

    def _fail(self, role: Role, code: str, message: str, out: list[Action]) -> None:
        """A hosted side starts aborting: stop its writes; gen tells ctx at once."""
        side = self.side(role)
        side.state, side.code, side.message = _ABORTING, code, message
        if side.in_flight:
            out.append(AbortWrites(role))
        if role is _GEN and not self.local and self.talked and not self.fail_sent \
                and self.ctx.state not in (_DONE, _FAILED, _ABORTING):
            # gen never writes into ctx memory: its writes have "stopped" from the start
            out.append(SendFail(code, message, writes_stopped=True))
            self.fail_sent = True

    def _report(self, role: Role, out: list[Action]) -> None:
        side = self.side(role)
        if side.reported:
            return
        side.reported = True
        ok = side.state is _DONE
        out.append(Report(role, ok, "" if ok else side.code, "" if ok else side.message))

    def _ctx_quiet(self) -> bool:
        """No ctx write can land in gen's memory any more."""
        c = self.ctx
        if c.state in FINAL or self.fenced:
            return True
        if _CTX in self.here:
            return c.state is not _SENDING and not (c.state is _ABORTING and c.in_flight)
        return not self.dest_out

    # -- joint rules ----------------------------------------------------------------------
    def _joint(self, out: list[Action]) -> None:
        changed = True
        while changed:
            changed = self._step(out)

    def _failure_step(self, out: list[Action], gen_here: bool) -> bool:
        """The joint rules about failures (one applied per call): spread, report, tell."""
        # spread: a side aborting or failed takes the other one down
        for role in self.here:
            me, other = self.side(role), self.side(_OTHER[role])
            if me.state not in FINAL and me.state is not _ABORTING and other.state in (_ABORTING, _FAILED):
                self._fail(role, other.code or "transfer_failed",
                           f"{_OTHER[role].value} side failed: {other.message}", out)
                return True
        # report failure once no write can land
        for role in self._hosted():
            me = self.side(role)
            if me.state is _ABORTING and me.in_flight == 0 and (role is _CTX or self._ctx_quiet()):
                me.state = _FAILED
                self._report(role, out)
                if role is _CTX and not gen_here and not self.fail_sent:
                    # ctx always knows its gen peer (publish names it): tell it even before any
                    # message went either way (a rank left before the others published, the
                    # offer still waits for the link), or gen's ranks wait for their deadline
                    out.append(SendFail(me.code, me.message, writes_stopped=True, unheard=not self.heard))
                    self.fail_sent = True
                return True
        # tell: a side that failed before the peer spoke up answers it (no waiting for deadlines)
        remote = self._remote()
        if remote is not None and not self.fail_sent and self.side(remote).state in (
                _OFFERED, _DEST_OUT, _SENDING, _RECEIVING):
            me = self.side(_OTHER[remote])
            if me.state is _FAILED:
                out.append(SendFail(me.code, me.message, writes_stopped=True))
                self.fail_sent = True
                return True
        return False

    def _step(self, out: list[Action]) -> bool:
        c, g = self.ctx, self.gen
        ctx_here, gen_here = _CTX in self.here, _GEN in self.here
        # the failure rules below only apply once a side is aborting or failed: the usual pass
        # (nothing failed) skips them (each event runs one to three passes)
        if (c.state in _TROUBLE or g.state in _TROUBLE) and self._failure_step(out, gen_here):
            return True
        if ctx_here and gen_here:
            # local path: both ready → copy pool to pool
            if c.state is _READY and g.state is _READY:
                c.state, g.state = _SENDING, _RECEIVING
                self.path = Path.LOCAL
                self.dest_out = True
                out.append(StartData(Path.LOCAL))
                return True
        elif gen_here:
            if g.state is _READY and (self.peer_named or c.state is _OFFERED):
                g.state = _DEST_OUT
                self.dest_out = True
                self.talked = True
                out.append(SendDestination(announced=c.state is not _OFFERED))
                return True
        elif ctx_here:
            if c.state in (_READY, _OFFERED) and g.state is _DEST_OUT:
                c.state = _SENDING
                out.append(StartData())
                return True
            if c.state is _READY and g.state is _IDLE:
                c.state = _OFFERED
                self.talked = True
                out.append(SendOffer())
                return True
        # gen complete: ctx's data out, every notification seen, own scatters over
        if (gen_here and g.state in (_DEST_OUT, _RECEIVING) and c.state is _DONE
                and self.notifs >= max(self.writes_expected, 0) and g.in_flight == 0):
            g.state = _DONE
            self._report(_GEN, out)
            return True
        return False


#: What each event does besides its table transition (:meth:`TransferMachine._effects`).
_EFFECTS: dict[type[Event], Callable[[TransferMachine, Any, SideState, State, list[Action]], None]] = {
    RankRegistered: TransferMachine._on_registered,
    OfferReceived: TransferMachine._on_registered,
    SideComplete: TransferMachine._on_side_complete,
    DestinationReceived: TransferMachine._on_destination,
    PathReceived: TransferMachine._on_path_received,
    PathChosen: TransferMachine._on_path_chosen,
    WritePosted: TransferMachine._on_write_posted,
    WriteEnded: TransferMachine._on_write_ended,
    NotifSeen: TransferMachine._on_notif_seen,
    DataOut: TransferMachine._on_data_out,
    DataDoneReceived: TransferMachine._on_data_done_received,
    LandedSeen: TransferMachine._on_landed_seen,
    FailReceived: TransferMachine._on_fail_received,
    Cancel: TransferMachine._on_stop,
    Disconnect: TransferMachine._on_stop,
    LocalFailure: TransferMachine._on_stop,
}
assert set(_EFFECTS) == LOCAL_EVENTS | set(REMOTE_EVENTS) | set(OBSERVED_EVENTS), "every event needs its effects"

def mermaid(role: Role) -> str:
    """The state graph of ``role`` as a mermaid ``stateDiagram-v2``, drawn from :data:`TRANSITIONS`
    (events; ``peer:`` marks the peer's messages) and :data:`JOINT` (``joint`` rules). Events
    that keep the state (write counters, late messages) are left out."""
    lines = ["stateDiagram-v2", "    [*] --> idle"]
    edges: dict[tuple[State, State], list[str]] = {}
    for state, row in TRANSITIONS[role].items():
        for etype, new in row.items():
            if new is not state:
                label = f"peer: {etype.__name__}" if etype in REMOTE_EVENTS else etype.__name__
                edges.setdefault((state, new), []).append(label)
    for state, targets in JOINT[role].items():
        for new in sorted(targets, key=lambda s: s.value):
            edges.setdefault((state, new), []).append("joint")
    for (a, b), labels in sorted(edges.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value)):
        lines.append(f"    {a.value} --> {b.value} : {', '.join(sorted(set(labels)))}")
    lines += ["    done --> [*]", "    failed --> [*]"]
    return "\n".join(lines) + "\n"
