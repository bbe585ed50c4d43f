"""Which sides of a request a stopping daemon fails, and which it lets finish.

A drain (SIGTERM, ``kvctl drain``) lets transfers whose data is moving run to completion, up
to ``drain_timeout_s``. A request whose other side never came cannot complete: while draining
no executor here may register (``draining``), and waiting for the peer's side would only hold
the stop until the deadline, then drop the executor's ``wait`` with a closed connection. Such
sides fail at once with :class:`~protocol.errors.DaemonStopping`, through the state machine's
normal failure path (so no write can land after the failure is reported).

Pure functions of a :class:`~protocol.transfer_fsm.TransferMachine`: no I/O, no clock.
"""

from __future__ import annotations

from protocol import transfer_fsm as f

__all__ = ["roles_to_stop", "waiting_roles"]

#: A hosted side in one of these has not started moving data on either side's behalf.
_NOT_STARTED = frozenset({f.State.IDLE, f.State.REGISTERING, f.State.READY})


def _waits_for_peer(machine: f.TransferMachine, role: f.Role) -> bool:
    side = machine.side(role)
    if side.state in _NOT_STARTED:
        # not every rank registered (none can while draining), or complete with no other side yet
        return True
    if role is f.Role.CTX and side.state is f.State.OFFERED:
        return True  # the offer is out and gen has not answered: gen never registered
    if role is f.Role.GEN and side.state is f.State.DEST_OUT and not machine.local:
        # gen handed out its destination; ctx has not said a word since (no path, no data)
        return machine.state(f.Role.CTX) is f.State.IDLE and machine.notifs == 0 and side.in_flight == 0
    return False


def waiting_roles(machine: f.TransferMachine) -> list[f.Role]:
    """The sides hosted here that wait for the other side of the request and move no data.

    On the local path (both sides here) the request waits when either side does; failing that
    side takes the other down with it (the machine spreads a failure).
    """
    if machine.finished:
        return []
    return [r for r in sorted(machine.here, key=lambda r: r.value) if _waits_for_peer(machine, r)]


def roles_to_stop(machine: f.TransferMachine, *, only_waiting: bool) -> list[f.Role]:
    """Hosted sides to fail now: the waiting ones, or (``only_waiting=False``, the drain's
    deadline passed) every side that has not ended or begun aborting."""
    live = [r for r in sorted(machine.here, key=lambda r: r.value)
            if machine.state(r) not in f.FINAL and machine.state(r) is not f.State.ABORTING]
    if only_waiting:
        waiting = set(waiting_roles(machine))
        return [r for r in live if r in waiting]
    return live
