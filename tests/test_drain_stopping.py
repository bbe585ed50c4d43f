"""Which sides a stopping daemon fails (their other side never came) and when, and which it lets
finish, on the real state machine. Runs in milliseconds; the daemon-level behaviour is in
tests/test_drain.py."""

from __future__ import annotations

from kvd.transfer.stopping import QuietSides, live_roles, waiting_roles
from protocol.errors import DaemonStopping
from protocol.transfer_fsm import (
    DestinationReceived,
    LocalFailure,
    NotifSeen,
    OfferReceived,
    Path,
    PathChosen,
    PathReceived,
    RankRegistered,
    Report,
    Role,
    SideComplete,
    State,
    TransferMachine,
    WritePosted,
)

CTX, GEN = Role.CTX, Role.GEN
KEY = ("peer", "req")


def test_gen_sides_that_wait_for_ctx() -> None:
    g = TransferMachine(here={GEN})
    assert waiting_roles(g) == {GEN: True}  # a peer's offer made it: no executor may come now
    g.handle(RankRegistered(GEN))
    assert g.state(GEN) is State.REGISTERING and waiting_roles(g) == {GEN: True}  # ranks missing
    g.handle(SideComplete(GEN))
    assert g.state(GEN) is State.READY and waiting_roles(g) == {GEN: False}  # an offer may be on its way

    announced = TransferMachine(here={GEN})
    announced.handle(SideComplete(GEN, peer_named=True))
    assert announced.state(GEN) is State.DEST_OUT  # destination out, ctx silent since
    assert waiting_roles(announced) == {GEN: False}
    announced.handle(NotifSeen(GEN))  # ctx data arriving: it moves, let it finish
    assert waiting_roles(announced) == {}


def test_gen_sides_whose_ctx_spoke_up_are_left_alone() -> None:
    offered = TransferMachine(here={GEN})
    offered.handle(OfferReceived(CTX))
    offered.handle(SideComplete(GEN))
    assert offered.state(GEN) is State.DEST_OUT and offered.state(CTX) is State.OFFERED
    assert waiting_roles(offered) == {}  # ctx registered and has our destination

    announced = TransferMachine(here={GEN})
    announced.handle(SideComplete(GEN, peer_named=True))
    announced.handle(PathReceived(CTX, path=Path.BOUNCE))
    assert announced.state(GEN) is State.RECEIVING and waiting_roles(announced) == {}
    assert QuietSides(1.0).due(KEY, announced, 100.0) == []
    assert live_roles(announced) == [GEN]  # what the drain's deadline fails


def test_ctx_sides_that_wait_for_gen() -> None:
    c = TransferMachine(here={CTX})
    c.handle(RankRegistered(CTX))
    assert waiting_roles(c) == {CTX: True}
    c.handle(SideComplete(CTX))
    assert c.state(CTX) is State.OFFERED and waiting_roles(c) == {CTX: False}  # gen's accept may be coming
    c.handle(DestinationReceived(GEN))
    assert c.state(CTX) is State.SENDING and waiting_roles(c) == {}
    c.handle(PathChosen(CTX, path=Path.BOUNCE))
    c.handle(WritePosted(CTX))
    assert live_roles(c) == [CTX]
    c.handle(LocalFailure(CTX, DaemonStopping.code, "stopping"))
    assert c.state(CTX) is State.ABORTING  # its write is still in flight: nothing to stop twice
    assert live_roles(c) == [] and waiting_roles(c) == {}


def test_local_request_with_one_side_missing_is_doomed() -> None:
    both = TransferMachine(here={CTX, GEN})
    both.handle(SideComplete(CTX))
    assert waiting_roles(both) == {CTX: True, GEN: True}  # gen would have to register here
    assert QuietSides(1.0).due(KEY, both, 0.0) == [CTX, GEN]
    both.handle(SideComplete(GEN))
    assert both.state(CTX) is State.SENDING and waiting_roles(both) == {}


def test_a_side_waiting_for_the_peer_fails_once_it_stayed_quiet() -> None:
    quiet = QuietSides(1.0)
    c = TransferMachine(here={CTX})
    c.handle(SideComplete(CTX))  # offered
    assert quiet.due(KEY, c, 10.0) == []  # the accept may be on its way
    assert quiet.due(KEY, c, 10.5) == []
    assert quiet.due(KEY, c, 11.0) == [CTX]  # a second of silence: gen is not there

    answered = TransferMachine(here={CTX})
    answered.handle(SideComplete(CTX))
    assert quiet.due(("peer", "other"), answered, 10.0) == []
    answered.handle(DestinationReceived(GEN))  # the accept came: the data moves
    assert quiet.due(("peer", "other"), answered, 20.0) == []

    # a state change starts the wait again
    g = TransferMachine(here={GEN})
    g.handle(SideComplete(GEN))
    assert quiet.due(("peer", "g"), g, 0.0) == []
    g.handle(OfferReceived(CTX))  # ctx's offer: gen accepts it (dest_out, ctx known): not waiting
    assert quiet.due(("peer", "g"), g, 5.0) == []


def test_failing_a_waiting_side_reports_daemon_stopping() -> None:
    g = TransferMachine(here={GEN})
    g.handle(SideComplete(GEN))
    (role,) = QuietSides(0.0).due(KEY, g, 0.0)
    actions = g.handle(LocalFailure(role, DaemonStopping.code, "kvd is stopping"))
    reports = [a for a in actions if isinstance(a, Report)]
    assert reports == [Report(GEN, False, "daemon_stopping", "kvd is stopping")]
    assert g.finished and waiting_roles(g) == {} and live_roles(g) == []
