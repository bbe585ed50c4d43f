"""Which sides a stopping daemon fails at once (their other side never came) and which it lets
finish, on the real state machine. Runs in milliseconds; the daemon-level behaviour is in
tests/test_drain.py."""

from __future__ import annotations

from kvd.transfer.stopping import roles_to_stop, waiting_roles
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


def test_gen_sides_that_wait_for_ctx() -> None:
    g = TransferMachine(here={GEN})
    assert waiting_roles(g) == [GEN]  # nothing registered yet (a peer's offer made it)
    g.handle(RankRegistered(GEN))
    assert g.state(GEN) is State.REGISTERING and waiting_roles(g) == [GEN]
    g.handle(SideComplete(GEN))
    assert g.state(GEN) is State.READY and waiting_roles(g) == [GEN]  # no offer came

    announced = TransferMachine(here={GEN})
    announced.handle(SideComplete(GEN, peer_named=True))
    assert announced.state(GEN) is State.DEST_OUT  # destination out, ctx silent since
    assert waiting_roles(announced) == [GEN]
    announced.handle(NotifSeen(GEN))  # ctx data arriving: it moves, let it finish
    assert waiting_roles(announced) == []


def test_gen_sides_whose_ctx_spoke_up_are_left_alone() -> None:
    offered = TransferMachine(here={GEN})
    offered.handle(OfferReceived(CTX))
    offered.handle(SideComplete(GEN))
    assert offered.state(GEN) is State.DEST_OUT and offered.state(CTX) is State.OFFERED
    assert waiting_roles(offered) == []  # ctx registered and has our destination

    announced = TransferMachine(here={GEN})
    announced.handle(SideComplete(GEN, peer_named=True))
    announced.handle(PathReceived(CTX, path=Path.BOUNCE))
    assert announced.state(GEN) is State.RECEIVING and waiting_roles(announced) == []
    assert roles_to_stop(announced, only_waiting=True) == []
    assert roles_to_stop(announced, only_waiting=False) == [GEN]  # the drain's deadline passed


def test_ctx_sides_that_wait_for_gen() -> None:
    c = TransferMachine(here={CTX})
    c.handle(RankRegistered(CTX))
    assert waiting_roles(c) == [CTX]
    c.handle(SideComplete(CTX))
    assert c.state(CTX) is State.OFFERED and waiting_roles(c) == [CTX]  # gen never answered
    c.handle(DestinationReceived(GEN))
    assert c.state(CTX) is State.SENDING and waiting_roles(c) == []
    c.handle(PathChosen(CTX, path=Path.BOUNCE))
    c.handle(WritePosted(CTX))
    assert roles_to_stop(c, only_waiting=False) == [CTX]
    c.handle(LocalFailure(CTX, DaemonStopping.code, "stopping"))
    assert c.state(CTX) is State.ABORTING  # its write is still in flight: nothing to stop twice
    assert roles_to_stop(c, only_waiting=False) == [] and waiting_roles(c) == []


def test_local_request_with_one_side_missing() -> None:
    both = TransferMachine(here={CTX, GEN})
    both.handle(SideComplete(CTX))
    assert waiting_roles(both) == [CTX, GEN]  # gen never registered: neither can finish
    both.handle(SideComplete(GEN))
    assert both.state(CTX) is State.SENDING and waiting_roles(both) == []


def test_failing_a_waiting_side_reports_daemon_stopping() -> None:
    g = TransferMachine(here={GEN})
    g.handle(SideComplete(GEN))
    (role,) = roles_to_stop(g, only_waiting=True)
    actions = g.handle(LocalFailure(role, DaemonStopping.code, "kvd is stopping"))
    reports = [a for a in actions if isinstance(a, Report)]
    assert reports == [Report(GEN, False, "daemon_stopping", "kvd is stopping")]
    assert g.finished and waiting_roles(g) == [] and roles_to_stop(g, only_waiting=False) == []
