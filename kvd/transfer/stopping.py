"""Which sides of a request a stopping daemon fails, and which it lets finish.

A drain (SIGTERM, ``kvctl drain``) lets transfers whose data is moving run to completion, up
to ``drain_timeout_s``. A request whose other side never came cannot complete: while draining
no executor here may register (``draining``), and waiting for the peer's side would only hold
the stop until the deadline, then drop the executor's ``wait`` with a closed connection. Such
sides fail with :class:`~protocol.errors.DaemonStopping`, through the state machine's normal
failure path (so no write can land after the failure is reported).

Some of them are *doomed*: no message can complete them any more (a rank still missing here,
or a local request's other side), and they fail at once. The others wait for the peer daemon,
whose answer may already be on its way (an accept for our offer, an offer for our ready gen
side, a path for our announced destination): they fail only once they stayed so for
``quiet_s``, so a request the peer is matching right now is not cut.

Pure: no I/O, the time is an input.
"""

from __future__ import annotations

from protocol import transfer_fsm as f

__all__ = ["QuietSides", "live_roles", "waiting_roles"]

#: A hosted side in one of these has not started moving data on either side's behalf.
_NOT_STARTED = frozenset({f.State.IDLE, f.State.REGISTERING, f.State.READY})


def _waits_for_peer(machine: f.TransferMachine, role: f.Role) -> bool:
    side = machine.side(role)
    if side.state in _NOT_STARTED:
        return True
    if role is f.Role.CTX and side.state is f.State.OFFERED:
        return True  # the offer is out and gen has not answered
    if role is f.Role.GEN and side.state is f.State.DEST_OUT and not machine.local:
        # gen handed out its destination; ctx has not said a word since (no path, no data)
        return machine.state(f.Role.CTX) is f.State.IDLE and machine.notifs == 0 and side.in_flight == 0
    return False


def waiting_roles(machine: f.TransferMachine) -> dict[f.Role, bool]:
    """The sides hosted here that wait for the other side of the request and move no data,
    each with whether it is doomed (no message can complete it any more, during a drain).

    On the local path (both sides here) every waiting side is doomed: the missing one would
    have to register here. On a peer's request, a side still missing ranks (or one a peer's
    message created, with no executor of ours) is doomed; one that is complete waits for the
    peer, whose next message may be on its way.
    """
    if machine.finished:
        return {}
    out: dict[f.Role, bool] = {}
    for role in sorted(machine.here, key=lambda r: r.value):
        if _waits_for_peer(machine, role):
            out[role] = machine.local or machine.state(role) in (f.State.IDLE, f.State.REGISTERING)
    return out


def live_roles(machine: f.TransferMachine) -> list[f.Role]:
    """Hosted sides that have not ended nor begun aborting (what the drain's deadline fails)."""
    return [r for r in sorted(machine.here, key=lambda r: r.value)
            if machine.state(r) not in f.FINAL and machine.state(r) is not f.State.ABORTING]


class QuietSides:
    """Picks the waiting sides to fail: the doomed ones at once, the others once they have
    waited in the same state for ``quiet_s`` (the caller's clock, e.g. trio's)."""

    def __init__(self, quiet_s: float) -> None:
        self.quiet_s = quiet_s
        self._since: dict[tuple[tuple[str, str], f.Role], tuple[f.State, float]] = {}

    def due(self, key: tuple[str, str], machine: f.TransferMachine, now: float) -> list[f.Role]:
        """The sides of the request ``key`` to fail now."""
        out = []
        live = set(live_roles(machine))
        for role, doomed in waiting_roles(machine).items():
            if role not in live:
                continue
            state = machine.state(role)
            seen = self._since.get((key, role))
            if seen is None or seen[0] is not state:
                self._since[(key, role)] = seen = (state, now)
            if doomed or now - seen[1] >= self.quiet_s:
                out.append(role)
        return out
