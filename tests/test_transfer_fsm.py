"""The transfer state machine, without a daemon: every state x every event, the joint rules,
duplicates, reordering, late messages after failure, deadlines, and a pair of machines wired
back to back (what two daemons do) under shuffled delivery. Runs in milliseconds."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable

import pytest

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.transfer_fsm import (
    FINAL,
    JOINT,
    LOCAL_EVENTS,
    OBSERVED_EVENTS,
    REMOTE_EVENTS,
    TRANSITIONS,
    AbortWrites,
    Action,
    Cancel,
    Clock,
    DataDoneReceived,
    DataOut,
    DestinationReceived,
    Disconnect,
    Event,
    FailReceived,
    LandedSeen,
    LocalFailure,
    NotifSeen,
    OfferReceived,
    Path,
    PathChosen,
    PathReceived,
    PeerFenced,
    PeerLost,
    RankRegistered,
    Report,
    Role,
    SendDataDone,
    SendDestination,
    SendFail,
    SendOffer,
    SendPath,
    SideComplete,
    StartData,
    StartReceive,
    State,
    TransferMachine,
    WriteEnded,
    WritePosted,
)

CTX, GEN = Role.CTX, Role.GEN
ALL_EVENTS: list[type[Event]] = sorted(LOCAL_EVENTS | set(REMOTE_EVENTS) | set(OBSERVED_EVENTS),
                                       key=lambda t: t.__name__)


def make(role: Role) -> Callable[[type[Event]], Event]:
    def build(etype: type[Event]) -> Event:
        return etype(role)

    return build


def reports(actions: list[Action]) -> list[Report]:
    return [a for a in actions if isinstance(a, Report)]


# --- every state x every event ---------------------------------------------------------------


def _cases() -> list[tuple[Role, bool, State, type[Event]]]:
    out = []
    for role in Role:
        for hosted in (True, False):
            for state in TRANSITIONS[role]:
                for etype in ALL_EVENTS:
                    out.append((role, hosted, state, etype))
    return out


def _legal(role: Role, hosted: bool, etype: type[Event]) -> type[Exception] | None:
    """Who broke the rules when ``etype`` about ``role`` arrives, before the table is asked."""
    if etype in OBSERVED_EVENTS:  # seen here of the peer's side: only the other side is hosted
        return None if not hosted and OBSERVED_EVENTS[etype] is role else LocalProtocolError
    if etype in LOCAL_EVENTS:
        if not hosted:
            return LocalProtocolError
        only = {PathChosen: CTX, DataOut: CTX, NotifSeen: GEN}.get(etype)
        return LocalProtocolError if only is not None and only is not role else None
    if role not in REMOTE_EVENTS[etype]:
        return LocalProtocolError
    return RemoteProtocolError if hosted else None


@pytest.mark.parametrize(("role", "hosted", "state", "etype"), _cases(),
                         ids=lambda v: getattr(v, "name", getattr(v, "__name__", str(v))))
def test_every_state_every_event(role: Role, hosted: bool, state: State, etype: type[Event]) -> None:
    """Each (side, state, event) either follows the table (then maybe a joint rule) or raises
    the named error of whoever broke the rules; never a silent ignore of an unknown pair."""
    m = TransferMachine(here={role} if hosted else {role.other})
    m.side(role).state = state
    m.dest_out = True  # a path message is only valid once gen handed its destination out
    if etype in (WriteEnded,):
        m.side(role).in_flight = 1
    if etype is DataDoneReceived or etype is PathReceived:
        m.talked = True
    if etype is LandedSeen:
        m.path = Path.MAPPED  # only the mapped path's kernel records a landed event
    pre = _legal(role, hosted, etype)
    table = TRANSITIONS[role][state].get(etype)
    if pre is None and table is None:
        pre = LocalProtocolError if hosted or etype in OBSERVED_EVENTS else RemoteProtocolError
    if etype is WritePosted and role is CTX and state is State.ABORTING:
        pre = LocalProtocolError  # no new write once ctx began aborting
    if etype is DataDoneReceived and role is CTX and state is State.DONE and pre is None:
        pre = RemoteProtocolError  # a second XferDone (only a landed event's confirmation is kept)
    if etype is PathReceived and role is CTX and state is State.DONE and pre is None:
        pre = RemoteProtocolError  # kept only after gen saw the request land (a completion token)
    if pre is not None:
        with pytest.raises(pre):
            m.handle(make(role)(etype))
        return
    assert table is not None
    m.handle(make(role)(etype))
    got = m.state(role)
    assert got == table or got in JOINT[role].get(table, frozenset()) or (
        table in JOINT[role] and any(got in JOINT[role].get(s, frozenset()) for s in JOINT[role][table])
    ), f"{role.name} {state.name} --{etype.__name__}--> {got.name}, table says {table.name}"


def test_table_covers_every_state_of_both_roles() -> None:
    for role in Role:
        assert set(TRANSITIONS[role]) >= {State.IDLE, State.REGISTERING, State.READY, State.DONE,
                                          State.ABORTING, State.FAILED}
        for state in FINAL:
            assert set(TRANSITIONS[role][state].values()) == {state}, "a final state is never left"


# --- the flows ------------------------------------------------------------------------------


def test_gen_done_from_the_completion_token_before_the_path_message() -> None:
    """ctx's GPU stored gen's completion token (mapped path) before ctx's path message came:
    gen is done; the path message, when it comes, changes nothing; another path is refused."""
    gen = TransferMachine(here={GEN})
    gen.handle(SideComplete(GEN, deadline=12.0, peer_named=True))
    out = gen.handle(LandedSeen(CTX, 4096))
    assert gen.state(GEN) is State.DONE and gen.state(CTX) is State.DONE and gen.path is Path.MAPPED
    assert [type(a).__name__ for a in out] == ["Report"] and out[0].ok  # type: ignore[attr-defined]
    assert gen.handle(PathReceived(CTX, Path.MAPPED)) == []
    assert gen.handle(DataDoneReceived(CTX, 0, 4096)) == []  # the confirmation that follows
    assert gen.state(GEN) is State.DONE
    other = TransferMachine(here={GEN})
    other.handle(SideComplete(GEN, deadline=12.0, peer_named=True))
    other.handle(LandedSeen(CTX, 4096))
    with pytest.raises(RemoteProtocolError, match="done already"):
        other.handle(PathReceived(CTX, Path.BOUNCE))
    early = TransferMachine(here={GEN})  # no destination handed out: no token could be stored
    early.handle(RankRegistered(GEN, deadline=12.0))
    with pytest.raises(LocalProtocolError, match="before gen handed out its destination"):
        early.handle(LandedSeen(CTX, 4096))


def test_gen_done_from_the_completion_token_after_an_offer_before_the_path_message() -> None:
    """ctx published first (offer/accept): the token can come before the path message too,
    with ctx still 'offered' here. gen is done (its executor may reuse the blocks at once)."""
    gen = TransferMachine(here={GEN})
    gen.handle(OfferReceived(CTX, deadline=12.0))
    assert gen.state(CTX) is State.OFFERED
    gen.handle(SideComplete(GEN, deadline=12.0))
    assert gen.state(GEN) is State.DEST_OUT
    out = gen.handle(LandedSeen(CTX, 4096))
    assert gen.state(GEN) is State.DONE and gen.state(CTX) is State.DONE and gen.path is Path.MAPPED
    assert reports(out) == [Report(GEN, True)] and gen.nbytes == 4096
    assert gen.handle(PathReceived(CTX, Path.MAPPED)) == []
    assert gen.handle(DataDoneReceived(CTX, 0, 4096)) == []
    offered = TransferMachine(here={GEN})  # offered, gen not complete: no destination handed out
    offered.handle(OfferReceived(CTX, deadline=12.0))
    offered.handle(RankRegistered(GEN, deadline=12.0))
    with pytest.raises(LocalProtocolError, match="before gen handed out its destination"):
        offered.handle(LandedSeen(CTX, 4096))


def test_gen_announces_and_publish_starts_with_zero_round_trips() -> None:
    gen = TransferMachine(here={GEN})
    assert gen.handle(RankRegistered(GEN, deadline=10.0)) == []
    assert gen.handle(SideComplete(GEN, deadline=12.0, peer_named=True)) == [SendDestination(announced=True)]
    assert gen.deadline == 10.0 and gen.state(GEN) is State.DEST_OUT

    ctx = TransferMachine(here={CTX})
    assert ctx.handle(DestinationReceived(GEN, deadline=9.0, announced=True)) == []
    assert ctx.handle(SideComplete(CTX, deadline=20.0)) == [StartData()]  # no offer: 0 round trips
    assert ctx.handle(PathChosen(CTX, Path.DIRECT)) == [SendPath(Path.DIRECT)]
    ctx.handle(WritePosted(CTX, 2))
    ctx.handle(WriteEnded(CTX, 2))
    assert ctx.handle(DataOut(CTX, writes=2, nbytes=100)) == [SendDataDone(2, 100), Report(CTX, True)]

    # gen: notifications may overtake the path message and the done message
    assert gen.handle(NotifSeen(GEN)) == []
    assert gen.handle(PathReceived(CTX, Path.DIRECT)) == [StartReceive(Path.DIRECT)]
    assert gen.state(GEN) is State.RECEIVING
    assert gen.handle(DataDoneReceived(CTX, writes=2, nbytes=100)) == []
    assert gen.handle(NotifSeen(GEN)) == [Report(GEN, True)]
    assert gen.finished and ctx.finished


@pytest.mark.parametrize("gen_first", [True, False])
def test_offer_accept_in_either_order(gen_first: bool) -> None:
    gen = TransferMachine(here={GEN})
    ctx = TransferMachine(here={CTX})
    assert ctx.handle(SideComplete(CTX, deadline=5.0)) == [SendOffer()]
    if gen_first:
        assert gen.handle(SideComplete(GEN)) == []  # no peer named: wait for the offer
        assert gen.handle(OfferReceived(CTX, deadline=5.0)) == [SendDestination(announced=False)]
    else:
        assert gen.handle(OfferReceived(CTX, deadline=5.0)) == []  # kept until gen registers
        assert gen.handle(RankRegistered(GEN)) == []
        assert gen.handle(SideComplete(GEN)) == [SendDestination(announced=False)]
    assert ctx.handle(DestinationReceived(GEN)) == [StartData()]
    assert ctx.state(CTX) is State.SENDING


def test_announce_crossing_an_offer_sends_one_destination() -> None:
    """ctx offered before the announce arrived: gen does not answer the offer a second time."""
    gen = TransferMachine(here={GEN})
    ctx = TransferMachine(here={CTX})
    assert gen.handle(SideComplete(GEN, peer_named=True)) == [SendDestination(announced=True)]
    assert ctx.handle(SideComplete(CTX)) == [SendOffer()]
    assert gen.handle(OfferReceived(CTX)) == []
    assert ctx.handle(DestinationReceived(GEN, announced=True)) == [StartData()]


def test_mapped_path_completes_gen_on_the_done_message_alone() -> None:
    gen = TransferMachine(here={GEN})
    gen.handle(SideComplete(GEN, peer_named=True))
    gen.handle(PathReceived(CTX, Path.MAPPED))
    assert gen.handle(DataDoneReceived(CTX, writes=0, nbytes=10)) == [Report(GEN, True)]


def _gen_mapped() -> TransferMachine:
    gen = TransferMachine(here={GEN})
    gen.handle(SideComplete(GEN, peer_named=True))
    gen.handle(PathReceived(CTX, Path.MAPPED))
    return gen


def test_mapped_path_completes_gen_on_the_landed_event_then_takes_the_done_message() -> None:
    """gen saw ctx's CUDA event complete: it reports at once; ctx's XferDone that follows is a
    confirmation (nothing happens), a second one or one naming NIXL writes is a protocol error."""
    gen = _gen_mapped()
    assert gen.handle(LandedSeen(CTX, nbytes=10)) == [Report(GEN, True)]
    assert gen.state(CTX) is State.DONE and gen.nbytes == 10
    assert gen.handle(DataDoneReceived(CTX, writes=0, nbytes=10)) == []
    assert gen.handle(LandedSeen(CTX, nbytes=10)) == []  # a second look: nothing new
    with pytest.raises(RemoteProtocolError):
        gen.handle(DataDoneReceived(CTX, writes=3, nbytes=10))
    plain = _gen_mapped()
    plain.handle(DataDoneReceived(CTX, writes=0, nbytes=10))
    with pytest.raises(RemoteProtocolError):  # no landed event: a duplicate
        plain.handle(DataDoneReceived(CTX, writes=0, nbytes=10))
    # the done message first, then the event: the event changes nothing
    first = _gen_mapped()
    assert first.handle(DataDoneReceived(CTX, writes=0, nbytes=10)) == [Report(GEN, True)]
    assert first.handle(LandedSeen(CTX, nbytes=10)) == []


def test_a_landed_event_is_only_gens_view_of_a_mapped_ctx_side() -> None:
    ctx = _ctx_sending()
    with pytest.raises(LocalProtocolError):  # a ctx daemon knows its own kernel: DataOut
        ctx.handle(LandedSeen(CTX))
    with pytest.raises(LocalProtocolError):
        _gen_mapped().handle(LandedSeen(GEN))
    bounce = _gen_receiving()  # the direct path: NIXL writes, no kernel event
    with pytest.raises(LocalProtocolError):
        bounce.handle(LandedSeen(CTX))
    # (before ctx's path message, a landed request is what gen's completion token says:
    # test_gen_done_from_the_completion_token_before_the_path_message)


def test_gen_cancelled_while_the_kernel_runs_reports_once_the_event_says_it_landed() -> None:
    """No write after failure: a cancelled gen side waits until ctx cannot write; the landed
    event says so (every byte of the one kernel is in), without waiting for ctx's word."""
    gen = _gen_mapped()
    assert reports(gen.handle(Cancel(GEN))) == []  # ctx's kernel may still be writing
    (report,) = reports(gen.handle(LandedSeen(CTX, nbytes=10)))
    assert report.role is GEN and not report.ok
    # ctx failed (its writes stopped) before the event was seen: gen failed; the event is late
    failed = _gen_mapped()
    (report,) = reports(failed.handle(FailReceived(CTX, "transfer_failed", "kernel", writes_stopped=True)))
    assert not report.ok
    assert failed.handle(LandedSeen(CTX, nbytes=10)) == []


def test_bounce_gen_waits_for_its_own_scatters() -> None:
    gen = TransferMachine(here={GEN})
    gen.handle(SideComplete(GEN, peer_named=True))
    gen.handle(PathReceived(CTX, Path.BOUNCE))
    gen.handle(NotifSeen(GEN))
    gen.handle(WritePosted(GEN))  # the scatter of that chunk
    assert gen.handle(DataDoneReceived(CTX, writes=1)) == []
    assert gen.handle(WriteEnded(GEN)) == [Report(GEN, True)]


def test_a_notification_that_starts_a_scatter_counts_it_in_flight() -> None:
    """``NotifSeen(scatter=True)`` is the notification and its scatter's WritePosted in one
    event: gen reports only once that scatter ended; on an aborting side neither counts."""
    gen = TransferMachine(here={GEN})
    gen.handle(SideComplete(GEN, peer_named=True))
    gen.handle(PathReceived(CTX, Path.BOUNCE))
    assert gen.handle(NotifSeen(GEN, scatter=True)) == []
    assert gen.side(GEN).in_flight == 1
    assert gen.handle(DataDoneReceived(CTX, writes=1)) == []  # its one write seen, its scatter not done
    assert gen.handle(WriteEnded(GEN)) == [Report(GEN, True)]
    aborting = TransferMachine(here={GEN})
    aborting.handle(SideComplete(GEN, peer_named=True))
    aborting.handle(PathReceived(CTX, Path.BOUNCE))
    aborting.handle(NotifSeen(GEN, scatter=True))
    aborting.handle(Cancel(GEN))  # the scatter in flight keeps it aborting
    assert aborting.state(GEN) is State.ABORTING
    assert aborting.handle(NotifSeen(GEN, scatter=True)) == []  # late: no new scatter counted
    assert aborting.side(GEN).in_flight == 1
    assert reports(aborting.handle(WriteEnded(GEN))) == []  # ctx may still be writing: its word first
    assert aborting.side(GEN).in_flight == 0
    (report,) = reports(aborting.handle(FailReceived(CTX, "transfer_cancelled", "stopped")))
    assert report.role is GEN and not report.ok


def test_local_path_and_a_failure_there_fail_both_sides_at_once() -> None:
    m = TransferMachine(here={GEN})
    m.handle(SideComplete(GEN))
    m.host(CTX)
    assert m.handle(SideComplete(CTX)) == [StartData(Path.LOCAL)]
    out = m.handle(LocalFailure(CTX, "incompatible_layout", "geometry differs"))
    assert reports(out) == [Report(CTX, False, "incompatible_layout", "geometry differs"),
                            Report(GEN, False, "incompatible_layout", "ctx side failed: geometry differs")]
    assert not [a for a in out if isinstance(a, SendFail)]  # nobody to tell: both sides are here


def test_local_path_success() -> None:
    m = TransferMachine(here={GEN, CTX})
    m.handle(SideComplete(CTX))
    assert m.handle(SideComplete(GEN)) == [StartData(Path.LOCAL)]
    m.handle(WritePosted(CTX))
    m.handle(WriteEnded(CTX))
    assert m.handle(DataOut(CTX, 0, 5)) == [Report(CTX, True), Report(GEN, True)]


def test_host_refuses_a_side_the_peer_already_plays() -> None:
    m = TransferMachine(here={GEN})
    m.handle(OfferReceived(CTX))
    with pytest.raises(LocalProtocolError):
        m.host(CTX)


# --- no write after failure -------------------------------------------------------------------


def _gen_receiving() -> TransferMachine:
    gen = TransferMachine(here={GEN})
    gen.handle(SideComplete(GEN, peer_named=True))
    gen.handle(PathReceived(CTX, Path.DIRECT))
    return gen


def _ctx_sending(writes: int = 3) -> TransferMachine:
    ctx = TransferMachine(here={CTX})
    ctx.handle(DestinationReceived(GEN))
    ctx.handle(SideComplete(CTX))
    ctx.handle(PathChosen(CTX, Path.DIRECT))
    ctx.handle(WritePosted(CTX, writes))
    return ctx


def test_gen_cancel_reports_only_after_ctx_says_its_writes_stopped() -> None:
    gen = _gen_receiving()
    out = gen.handle(Cancel(GEN, "cancelled by client"))
    assert out == [SendFail("transfer_cancelled", "cancelled by client", writes_stopped=True)]
    assert gen.state(GEN) is State.ABORTING and not reports(out)
    assert gen.handle(NotifSeen(GEN)) == []  # a write still landing: absorbed, still no report
    assert gen.handle(Clock(math.inf)) == []  # its deadline passing changes nothing either

    ctx = _ctx_sending(3)
    out = ctx.handle(FailReceived(GEN, "transfer_cancelled", "cancelled by client"))
    assert out == [AbortWrites(CTX)]
    assert ctx.handle(WriteEnded(CTX, 2)) == []
    out = ctx.handle(WriteEnded(CTX, 1))
    assert out == [Report(CTX, False, "transfer_cancelled", "gen side failed: cancelled by client"),
                   SendFail("transfer_cancelled", "gen side failed: cancelled by client", writes_stopped=True)]
    assert reports(gen.handle(FailReceived(CTX, "transfer_cancelled", "x"))) == [
        Report(GEN, False, "transfer_cancelled", "cancelled by client")]


def test_ctx_executor_disconnect_aborts_then_tells_gen() -> None:
    ctx = _ctx_sending(1)
    assert ctx.handle(Disconnect(CTX, "executor session 3 ended")) == [AbortWrites(CTX)]
    with pytest.raises(LocalProtocolError):
        ctx.handle(WritePosted(CTX))  # the path must not post after an abort
    out = ctx.handle(WriteEnded(CTX))
    assert [type(a) for a in out] == [Report, SendFail]


def test_peer_lost_keeps_gen_blocks_until_the_peer_is_fenced_or_confirms() -> None:
    for ending in (PeerFenced(), FailReceived(CTX, "peer_unavailable", "link lost", writes_stopped=True)):
        gen = _gen_receiving()
        out = gen.handle(PeerLost("heartbeat timeout"))
        assert not reports(out) and gen.state(GEN) is State.ABORTING
        assert [type(a) for a in out] == [SendFail]  # owed to the peer, sent once it is back
        assert reports(gen.handle(ending)) == [Report(GEN, False, "peer_unavailable", "peer link lost: heartbeat timeout")]


def test_ctx_failure_with_writes_not_yet_stopped_keeps_gen_waiting() -> None:
    gen = _gen_receiving()
    assert gen.handle(FailReceived(CTX, "nixl_error", "x", writes_stopped=False)) == []
    assert gen.state(GEN) is State.ABORTING
    assert reports(gen.handle(FailReceived(CTX, "nixl_error", "x", writes_stopped=True)))


def test_gen_fails_at_once_when_it_never_handed_out_its_destination() -> None:
    gen = TransferMachine(here={GEN})
    gen.handle(RankRegistered(GEN, deadline=1.0))
    out = gen.handle(Clock(1.0))
    assert out == [Report(GEN, False, "transfer_timeout",
                          "the request (gen side) missed its deadline while waiting for the other gen ranks to expect "
                          "it; check that every gen executor of the request expects it, or give the request a "
                          "longer deadline_s")]


def _expire(m: TransferMachine, role: Role) -> str:
    """The clock passes the deadline: ``role`` fails (reported at once, or once no write can land
    any more) as a timeout; its message."""
    m.handle(Clock(m.deadline))
    side = m.side(role)
    assert side.state in (State.ABORTING, State.FAILED) and side.code == "transfer_timeout"
    return side.message


def test_timeout_names_the_request_the_side_the_seconds_and_what_was_awaited() -> None:
    # gen expected, no ctx ever published: waiting for the ctx side
    gen = TransferMachine(here={GEN}, request_id="r-7")
    gen.handle(SideComplete(GEN, deadline=5.0, deadline_s=2.5))
    msg = _expire(gen, GEN)
    assert msg.startswith("request 'r-7' (gen side) missed its deadline of 2.5 s while waiting for the ctx side "
                          "to publish;"), msg
    assert "deadline_s" in msg and "their daemon is running" in msg
    # gen named its peer: the destination was announced, ctx never spoke
    named = TransferMachine(here={GEN}, request_id="r-8")
    named.handle(SideComplete(GEN, deadline=5.0, deadline_s=3.0, peer_named=True))
    assert "waiting for the ctx side to publish (gen's destination was announced to it)" in _expire(named, GEN)
    # ctx offered, gen never answered: waiting for gen's destination on the peer
    ctx = TransferMachine(here={CTX}, request_id="r-9")
    ctx.handle(SideComplete(CTX, deadline=5.0, deadline_s=1.0))
    msg = _expire(ctx, CTX)
    assert msg.startswith("request 'r-9' (ctx side) missed its deadline of 1 s while waiting for gen's destination "
                          "(the gen executors on the peer daemon have not all expected it)"), msg
    assert "the peer daemon is running" in msg
    # ctx and gen on one daemon, gen expected, ctx never published
    local = TransferMachine(here={CTX, GEN}, request_id="r-l")
    local.handle(SideComplete(GEN, deadline=4.0, deadline_s=4.0))
    assert "the ctx executors on this daemon have not all published it" in _expire(local, GEN)


def test_timeout_while_data_moves_says_so() -> None:
    ctx = TransferMachine(here={CTX}, request_id="r-m")
    ctx.handle(DestinationReceived(GEN, deadline=9.0, deadline_s=0.25))
    ctx.handle(SideComplete(CTX, deadline=10.0, deadline_s=1.0))
    ctx.handle(PathChosen(CTX, Path.DIRECT))
    ctx.handle(WritePosted(CTX, 3))
    msg = _expire(ctx, CTX)
    assert ctx.state(CTX) is State.ABORTING  # its writes are being aborted
    assert msg.startswith("request 'r-m' (ctx side) missed its deadline of 0.25 s while data was still moving "
                          "(3 writes in flight);"), msg
    gen = TransferMachine(here={GEN}, request_id="r-m")
    gen.handle(SideComplete(GEN, deadline=1.0, deadline_s=1.0, peer_named=True))
    gen.handle(PathReceived(CTX, Path.DIRECT))
    gen.handle(DataDoneReceived(CTX, 4, 100))
    assert "while data was still moving (0 of 4 ctx writes arrived)" in _expire(gen, GEN)


def test_ctx_data_out_then_gen_cancel_is_a_late_message() -> None:
    ctx = _ctx_sending(1)
    ctx.handle(WriteEnded(CTX))
    ctx.handle(DataOut(CTX, 1, 10))
    assert ctx.handle(FailReceived(GEN, "transfer_cancelled", "late")) == []
    assert ctx.state(CTX) is State.DONE


def test_gen_cancel_after_data_done_reports_without_waiting() -> None:
    gen = _gen_receiving()
    gen.handle(DataDoneReceived(CTX, writes=2))
    assert reports(gen.handle(Cancel(GEN))) == [Report(GEN, False, "transfer_cancelled", "cancelled")]


def test_unasked_offer_expires_and_tells_ctx() -> None:
    gen = TransferMachine(here={GEN})
    gen.handle(OfferReceived(CTX, deadline=3.0))
    assert gen.handle(Clock(2.9)) == []
    out = gen.handle(Clock(3.0))
    assert [type(a) for a in out] == [SendFail, Report]


@pytest.mark.parametrize("stop", [Cancel(CTX, "cancelled by client"), Disconnect(CTX, "executor session 2 ended"),
                                  LocalFailure(CTX, "transfer_timeout", "ranks [1] never registered")],
                         ids=["cancel", "disconnect", "deadline"])
def test_ctx_failing_before_anything_was_said_tells_gen_it_never_heard(stop: Event) -> None:
    """ctx rank 0 of 2 registered and the side failed (nothing went to gen: no offer yet): ctx
    still sends its one failure notice, marked unheard (gen may not know the request)."""
    ctx = TransferMachine(here={CTX})
    assert ctx.handle(RankRegistered(CTX, deadline=30.0)) == []
    out = ctx.handle(stop)
    side = ctx.side(CTX)
    assert out == [Report(CTX, False, side.code, side.message),
                   SendFail(side.code, side.message, writes_stopped=True, unheard=True)]
    assert ctx.handle(Cancel(CTX)) == []  # one notice, one report
    # an offer sent (maybe still waiting for the link) and no answer: still unheard
    offered = TransferMachine(here={CTX})
    assert offered.handle(SideComplete(CTX, deadline=30.0)) == [SendOffer()]
    assert offered.handle(stop)[-1] == SendFail(offered.ctx.code, offered.ctx.message, writes_stopped=True,
                                                 unheard=True)


def test_ctx_failing_after_gen_spoke_tells_gen_as_before() -> None:
    """gen's destination came: ctx's notice is not unheard (gen knows the request)."""
    ctx = TransferMachine(here={CTX})
    ctx.handle(DestinationReceived(GEN, announced=True))
    ctx.handle(RankRegistered(CTX))
    out = ctx.handle(Cancel(CTX, "cancelled by client"))
    assert out[-1] == SendFail("transfer_cancelled", "cancelled by client", writes_stopped=True, unheard=False)
    # an echo: ctx fails because gen did; its notice says gen spoke
    echo = _ctx_sending(0)
    out = echo.handle(FailReceived(GEN, "transfer_cancelled", "cancelled by client"))
    assert [a for a in out if isinstance(a, SendFail)] == [
        SendFail("transfer_cancelled", "gen side failed: cancelled by client", writes_stopped=True)]


def test_a_local_ctx_failure_sends_nothing() -> None:
    both = TransferMachine(here={CTX, GEN})
    both.handle(RankRegistered(CTX))
    out = both.handle(Cancel(CTX, "cancelled by client"))
    assert not [a for a in out if isinstance(a, SendFail)]


def test_gen_first_known_by_ctx_failure_fails_at_once_and_keeps_its_deadline() -> None:
    """gen knows nothing of the request and ctx's failure notice arrives (unheard, with what
    was left of its deadline): gen's side ends at once (no executor to tell: the engine keeps
    the end until that deadline); a gen rank waiting (registering or ready) fails at once with
    ctx's reason, reported once."""
    fresh = TransferMachine(here={GEN})
    out = fresh.handle(FailReceived(CTX, "transfer_cancelled", "cancelled by client", deadline=42.0,
                                    deadline_s=12.0))
    assert out == [Report(GEN, False, "transfer_cancelled", "ctx side failed: cancelled by client")]
    assert fresh.finished and fresh.deadline == 42.0 and fresh.deadline_s == 12.0 and not fresh.fail_sent
    for waiting in (RankRegistered(GEN, deadline=60.0), SideComplete(GEN, deadline=60.0)):
        gen = TransferMachine(here={GEN})
        gen.handle(waiting)
        out = gen.handle(FailReceived(CTX, "transfer_cancelled", "cancelled by client", deadline=42.0))
        assert out == [Report(GEN, False, "transfer_cancelled", "ctx side failed: cancelled by client")]
        assert gen.deadline == 42.0  # the earlier of the two
        assert gen.handle(FailReceived(CTX, "transfer_cancelled", "again")) == []  # absorbed
    # a notice without a deadline (an older daemon, or ctx had heard) changes no deadline
    old = TransferMachine(here={GEN})
    old.handle(RankRegistered(GEN, deadline=60.0))
    old.handle(FailReceived(CTX, "transfer_cancelled", "x"))
    assert old.deadline == 60.0


# --- duplicates, reordering, late messages -----------------------------------------------------


def test_duplicate_messages_are_remote_protocol_errors() -> None:
    gen = TransferMachine(here={GEN})
    gen.handle(OfferReceived(CTX))
    with pytest.raises(RemoteProtocolError):
        gen.handle(OfferReceived(CTX))
    ctx = TransferMachine(here={CTX})
    ctx.handle(DestinationReceived(GEN))
    with pytest.raises(RemoteProtocolError):
        ctx.handle(DestinationReceived(GEN))
    g2 = _gen_receiving()
    g2.handle(DataDoneReceived(CTX, writes=1))
    with pytest.raises(RemoteProtocolError):
        g2.handle(DataDoneReceived(CTX, writes=1))


def test_path_before_destination_is_a_remote_protocol_error() -> None:
    gen = TransferMachine(here={GEN})
    gen.handle(SideComplete(GEN))  # no peer named, no offer: nothing handed out
    with pytest.raises(RemoteProtocolError):
        gen.handle(PathReceived(CTX, Path.DIRECT))


def test_peer_may_not_speak_for_our_side() -> None:
    ctx = TransferMachine(here={CTX})
    with pytest.raises(RemoteProtocolError):
        ctx.handle(OfferReceived(CTX))
    with pytest.raises(LocalProtocolError):
        ctx.handle(SideComplete(GEN))


def test_extra_notification_after_done_is_absorbed_only_after_failure() -> None:
    gen = _gen_receiving()
    gen.handle(DataDoneReceived(CTX, writes=0))
    assert gen.state(GEN) is State.DONE
    with pytest.raises(LocalProtocolError):
        gen.handle(NotifSeen(GEN))  # more writes than ctx said: a bug, named
    failed = _gen_receiving()
    failed.handle(Cancel(GEN))
    failed.handle(FailReceived(CTX, "transfer_cancelled", ""))
    assert failed.handle(NotifSeen(GEN)) == []


# --- two machines back to back, deliveries shuffled ---------------------------------------------


class _Pair:
    """Two daemons' machines; messages queue on a link, notifications on NIXL (unordered)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.ctx = TransferMachine(here={CTX})
        self.gen = TransferMachine(here={GEN})
        self.to_gen: list[Event] = []
        self.to_ctx: list[Event] = []
        self.notifs = 0
        self.writes_pending = 0
        self.reports: dict[Role, list[Report]] = {CTX: [], GEN: []}
        self.landed_after_gen_report = 0
        self.gen_reported = False

    def run(self, machine: TransferMachine, ev: Event | Clock | PeerLost | PeerFenced) -> None:
        try:
            actions = machine.handle(ev)
        except (LocalProtocolError, RemoteProtocolError):
            return
        for a in actions:
            self.act(machine, a)

    def act(self, machine: TransferMachine, a: Action) -> None:
        if isinstance(a, Report):
            self.reports[a.role].append(a)
            if a.role is GEN:
                self.gen_reported = True
        elif isinstance(a, SendOffer):
            self.to_gen.append(OfferReceived(CTX))
        elif isinstance(a, SendDestination):
            self.to_ctx.append(DestinationReceived(GEN, announced=a.announced))
        elif isinstance(a, SendPath):
            self.to_gen.append(PathReceived(CTX, a.path))
        elif isinstance(a, SendDataDone):
            self.to_gen.append(DataDoneReceived(CTX, a.writes, a.nbytes))
        elif isinstance(a, SendFail):
            q = self.to_gen if machine is self.ctx else self.to_ctx
            q.append(FailReceived(CTX if machine is self.ctx else GEN, a.code, a.message, a.writes_stopped))
        elif isinstance(a, StartData):
            self.run(self.ctx, PathChosen(CTX, Path.DIRECT))
            self.writes_pending = 3
            self.run(self.ctx, WritePosted(CTX, 3))
        elif isinstance(a, AbortWrites):
            pass  # the writes end (aborted) in later steps

    def step(self) -> bool:
        choices: list[Callable[[], None]] = []
        if self.to_gen:
            choices.append(lambda: self.run(self.gen, self.to_gen.pop(0)))
        if self.to_ctx:
            choices.append(lambda: self.run(self.ctx, self.to_ctx.pop(0)))
        if self.notifs:
            def notif() -> None:
                self.notifs -= 1
                self.run(self.gen, NotifSeen(GEN))
            choices.append(notif)
        if self.writes_pending:
            def land() -> None:
                self.writes_pending -= 1
                if self.gen_reported:
                    self.landed_after_gen_report += 1
                self.notifs += 1
                self.run(self.ctx, WriteEnded(CTX))
                if self.writes_pending == 0 and self.ctx.state(CTX) is State.SENDING:
                    self.run(self.ctx, DataOut(CTX, 3, 30))
            choices.append(land)
        if not choices:
            return False
        self.rng.choice(choices)()
        return True


FAULTS: list[tuple[str, Callable[[_Pair], None]]] = [
    ("none", lambda p: None),
    ("gen cancel", lambda p: p.run(p.gen, Cancel(GEN))),
    ("gen disconnect", lambda p: p.run(p.gen, Disconnect(GEN))),
    ("ctx cancel", lambda p: p.run(p.ctx, Cancel(CTX))),
    ("ctx nixl error", lambda p: p.run(p.ctx, LocalFailure(CTX, "nixl_error", "boom"))),
    ("gen deadline", lambda p: p.run(p.gen, Clock(100.0))),
    ("ctx deadline", lambda p: p.run(p.ctx, Clock(100.0))),
]


@pytest.mark.parametrize(("name", "fault"), FAULTS, ids=[f[0] for f in FAULTS])
@pytest.mark.parametrize("peer_named", [True, False])
def test_pair_under_shuffled_delivery(name: str, fault: Callable[[_Pair], None], peer_named: bool) -> None:
    """Whatever the interleaving and wherever the fault strikes: one report per side, both agree
    on success, and gen never reports while a ctx write can still land."""
    for seed in range(150):
        rng = random.Random(seed)
        p = _Pair(rng)
        registrations: list[tuple[TransferMachine, Event]] = [
            (p.gen, SideComplete(GEN, deadline=50.0, peer_named=peer_named)),
            (p.ctx, SideComplete(CTX, deadline=50.0)),
        ]
        rng.shuffle(registrations)
        at = rng.randrange(12)
        ticked = False
        for step in itertools.count():
            if step == at:
                fault(p)
            if registrations:
                p.run(*registrations.pop())
                continue
            if not p.step():
                if step < at:
                    continue
                if not ticked:  # nothing left to deliver: let the deadlines pass once
                    ticked = True
                    p.run(p.ctx, Clock(60.0))
                    p.run(p.gen, Clock(60.0))
                    continue
                break
        for role in Role:
            assert len(p.reports[role]) == 1, (name, seed, role, p.reports[role])
        assert p.landed_after_gen_report == 0, (name, seed)
        ok = {r: p.reports[r][0].ok for r in Role}
        if name == "none":
            assert ok == {CTX: True, GEN: True}, (seed, p.reports)
        elif not ok[GEN]:
            assert p.writes_pending == 0


def test_pair_peer_loss_then_fence() -> None:
    p = _Pair(random.Random(1))
    p.run(p.gen, SideComplete(GEN, peer_named=True))
    p.run(p.ctx, DestinationReceived(GEN, announced=True))
    p.to_ctx.clear()
    p.run(p.ctx, SideComplete(CTX))
    p.run(p.gen, PeerLost("heartbeat timeout"))
    assert p.reports[GEN] == []
    p.run(p.gen, PeerFenced())
    assert [r.ok for r in p.reports[GEN]] == [False]
