"""A transfer starts its actor task only when something must wait.

A request handled entirely in its callers' steps (registrations, the peer's messages, a
failure reported at once) starts no task: it ends in the step that made its machine final.
An action that must await (a message the link's writer cannot take now) starts the actor, and
what comes meanwhile waits behind it, in order. Data-path tasks run in the engine's nursery;
the transfer ends only after the last of them. With no actor, the engine's timer watches the
deadline (:meth:`Transfer.deadline_passed`); once an actor runs, it watches it itself.

In process, with an ``Env`` whose ``spawn`` starts tasks in the test's nursery (as the
engine's does) and records them; ``tests/test_lazy_actor_daemons.py`` checks real daemons.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog.testing
import trio
import trio.testing

from kvd.config import TransferConfig
from kvd.transfer.requests import Side
from kvd.transfer.transfer import Env, Transfer
from protocol import messages as m
from protocol import transfer as x
from protocol import transfer_fsm as f
from protocol.layout import KVLayout
from tests.fake_link import FakeLink, FakeLinks

ONE = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, tokens_per_block=32, dtype="bfloat16")
TP2 = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, tokens_per_block=32, dtype="bfloat16", tp_size=2)


@dataclass
class _Rig:
    """A transfer's environment: the tasks it started (True: its actor), reports, ends, the
    deadlines it asked the engine's timer to watch."""

    nursery: trio.Nursery
    links: FakeLinks | None = None
    spawned: list[bool] = field(default_factory=list)
    reports: list[m.Completion] = field(default_factory=list)
    ended: list[Transfer] = field(default_factory=list)
    watched: list[float] = field(default_factory=list)

    def spawn(self, fn: Callable[[], Awaitable[None]], actor: bool) -> None:
        self.spawned.append(actor)
        self.nursery.start_soon(fn)

    def env(self) -> Env:
        return Env(node="here", cfg=TransferConfig(), nixl=lambda: None,
                   links=lambda: self.links,  # type: ignore[arg-type,return-value]
                   staging=lambda: None, on_report=lambda t, side, c: self.reports.append(c),
                   on_finished=self.ended.append, spawn=self.spawn,
                   watch=lambda t: self.watched.append(t.machine.deadline))


def _gen(rig: _Rig, peer: str = "", ranks: tuple[int, ...] = (0, 1)) -> Transfer:
    t = Transfer(rig.env(), "r-lazy", peer, {f.Role.GEN})
    t.sides[f.Role.GEN] = Side(request_id="r-lazy", role="gen", layout=TP2, ranks=ranks, peer=peer,
                               deadline=math.inf)
    return t


async def test_a_request_handled_in_its_callers_steps_starts_no_task() -> None:
    """A rank registers, its executor leaves: the side fails and reports in that step, and the
    transfer ends there too (no actor, no inbox opened, nothing scheduled)."""
    async with trio.open_nursery() as nursery:
        rig = _Rig(nursery)
        t = _gen(rig)
        t.feed(f.RankRegistered(f.Role.GEN))
        assert not t.finished.is_set()
        t.feed(f.Disconnect(f.Role.GEN, "executor session 1 ended"))
        # ended in the caller's step, before any checkpoint
        assert t.finished.is_set() and rig.ended == [t]
        assert [c.ok for c in rig.reports] == [False] and rig.reports[0].error_code == "transfer_cancelled"
        assert rig.spawned == [] and not t._inbox.opened
        assert not nursery.child_tasks


async def test_an_announce_the_link_takes_at_once_and_the_peers_answer_start_no_task() -> None:
    """gen names its peer: the announce goes into the link's writer in the registration's
    step; ctx's data-done ends the side in the link's step. No task from start to end."""
    async with trio.open_nursery() as nursery:
        link = FakeLink(nowait=True)
        rig = _Rig(nursery, FakeLinks({"ctx": link}))
        t = _gen(rig, peer="ctx", ranks=(0,))
        t.feed(f.SideComplete(f.Role.GEN, deadline=trio.current_time() + 60, deadline_s=60, peer_named=True))
        assert [type(msg) for msg in link.sent] == [x.XferAnnounce]
        t.post(x.XferPath(request_id="r-lazy", path="mapped", layout=ONE, blocks={0: []}))
        t.post(x.XferDone(request_id="r-lazy", writes=0, bytes=0, chunks=0))
        assert t.finished.is_set() and rig.ended == [t] and [c.ok for c in rig.reports] == [True]
        assert rig.spawned == [] and not t._inbox.opened
        assert len(rig.watched) == 1 and math.isfinite(rig.watched[0])  # the engine's timer watched it


async def test_an_action_that_must_await_starts_the_actor_and_what_comes_meanwhile_waits_behind_it() -> None:
    """The link's writer cannot take the announce now: the actor starts and awaits its send.
    A cancel fed meanwhile queues behind it: its failure notice goes after the announce, and
    the side reports only once ctx says its writes stopped (no write after failure)."""
    async with trio.open_nursery() as nursery:
        link = FakeLink(nowait=False)
        rig = _Rig(nursery, FakeLinks({"ctx": link}))
        t = _gen(rig, peer="ctx", ranks=(0,))
        t.feed(f.SideComplete(f.Role.GEN, deadline=trio.current_time() + 60, deadline_s=60, peer_named=True))
        assert rig.spawned == [True]  # the actor, once
        await link.sending.wait()
        t.feed(f.Cancel(f.Role.GEN, "cancelled by client"))
        assert t.machine.state(f.Role.GEN) is f.State.ABORTING
        await trio.testing.wait_all_tasks_blocked()
        assert link.sent == [] and rig.reports == []  # the fail waits behind the announce's send
        link.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert [type(msg) for msg in link.sent] == [x.XferAnnounce, x.XferFail]
        assert rig.reports == [] and not t.finished.is_set()  # ctx may still write
        t.post(x.XferFail(request_id="r-lazy", code="transfer_cancelled", message="gen cancelled",
                          writes_stopped=True, sender="ctx"))
        await trio.testing.wait_all_tasks_blocked()
        assert t.finished.is_set() and rig.ended == [t]
        assert [c.error_code for c in rig.reports] == ["transfer_cancelled"]
        assert rig.spawned == [True]  # still the one actor


async def test_a_deadline_with_no_actor_is_enforced_by_the_engines_timer(
        autojump_clock: trio.testing.MockClock) -> None:
    """With no actor the deadline goes to the engine's timer (each time it moves earlier); at
    the deadline the side fails, naming the rank that never registered, and the transfer ends
    in the timer's step. Told early (a stale entry) it does nothing."""
    async with trio.open_nursery() as nursery:
        rig = _Rig(nursery)
        t = _gen(rig)
        start = trio.current_time()
        t.feed(f.RankRegistered(f.Role.GEN, deadline=start + 100, deadline_s=100))
        t.feed(f.RankRegistered(f.Role.GEN, deadline=start + 5, deadline_s=5))  # earlier: watched again
        t.feed(f.RankRegistered(f.Role.GEN, deadline=start + 50, deadline_s=50))  # later: no change
        assert rig.watched == [start + 100, start + 5]
        t.deadline_passed()  # not due yet
        assert rig.reports == [] and not t.finished.is_set()
        await trio.sleep_until(start + 5)
        t.deadline_passed()
        assert rig.ended == [t] and len(rig.reports) == 1
        assert rig.reports[0].error_code == "transfer_timeout" and "never registered" in rig.reports[0].error_message
        assert rig.spawned == []
        t.deadline_passed()  # a stale entry of an ended transfer: nothing
        assert len(rig.reports) == 1


async def test_once_an_actor_runs_it_watches_the_deadline_and_the_timer_leaves_it_alone(
        autojump_clock: trio.testing.MockClock) -> None:
    """The deadline was handed to the engine's timer, then the actor started (an awaited
    announce): the timer's call is a no-op, the actor's own sleep expires the side, once; it
    reports only once ctx says its writes stopped."""
    async with trio.open_nursery() as nursery:
        link = FakeLink(nowait=False)
        rig = _Rig(nursery, FakeLinks({"ctx": link}))
        t = _gen(rig, peer="ctx", ranks=(0, 1))
        start = trio.current_time()
        t.feed(f.RankRegistered(f.Role.GEN, deadline=start + 5, deadline_s=5))
        assert rig.watched == [start + 5] and rig.spawned == []
        t.feed(f.SideComplete(f.Role.GEN, deadline=start + 60, deadline_s=60, peer_named=True))
        assert rig.spawned == [True]
        link.release.set()
        await trio.sleep_until(start + 5)
        t.deadline_passed()  # the engine's timer: the actor watches it now
        await trio.testing.wait_all_tasks_blocked()
        assert trio.current_time() == start + 5
        assert [type(msg) for msg in link.sent] == [x.XferAnnounce, x.XferFail]
        assert t.machine.gen.code == "transfer_timeout" and rig.reports == []  # ctx may still write
        t.post(x.XferFail(request_id="r-lazy", code="transfer_cancelled", message="gen timed out",
                          writes_stopped=True, sender="ctx"))
        await trio.testing.wait_all_tasks_blocked()
        assert t.finished.is_set() and rig.ended == [t]
        assert [c.error_code for c in rig.reports] == ["transfer_timeout"]
        assert rig.spawned == [True] and len(link.sent) == 2


async def test_a_data_task_with_no_actor_ends_the_transfer_when_it_ends() -> None:
    """The local path's copy runs as a task (in the engine's nursery; no actor). Cancelled
    before the task's first step, the request reports at once, the task starts cancelled and
    copies nothing, and the transfer ends only when the task has ended."""
    with structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            rig = _Rig(nursery)
            t = Transfer(rig.env(), "r-local", "here", {f.Role.CTX, f.Role.GEN})
            t.sides[f.Role.CTX] = Side(request_id="r-local", role="ctx", layout=ONE, ranks=(0,), peer="here",
                                       deadline=math.inf)
            t.sides[f.Role.GEN] = Side(request_id="r-local", role="gen", layout=TP2, ranks=(0, 1), peer="here",
                                       deadline=math.inf)
            t.feed(f.SideComplete(f.Role.GEN))
            t.feed(f.SideComplete(f.Role.CTX))  # both ready: the local copy's task is started
            assert rig.spawned == [False]
            t.feed(f.Cancel(f.Role.CTX, "cancelled by client"))
            assert t.machine.finished and [c.ok for c in rig.reports] == [False, False]
            assert not t.finished.is_set() and rig.ended == []  # its task has not ended yet
            await trio.testing.wait_all_tasks_blocked()
            assert t.finished.is_set() and rig.ended == [t]
    assert rig.spawned == [False]  # no actor
    assert t.sides[f.Role.GEN].bytes_done == 0 and t.sent is None  # nothing copied
    assert not [e for e in logs if e["event"] in ("transfer.task_failed_after_end", "transfer.internal_error")], logs


async def test_a_data_task_that_fails_with_no_actor_fails_the_request_once() -> None:
    """The local path's planner refuses the pair of layouts inside the task: both sides fail
    once, and the transfer ends with the task (no actor: nothing to tell a peer)."""
    async with trio.open_nursery() as nursery:
        rig = _Rig(nursery)
        wide = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, tokens_per_block=32, dtype="bfloat16")
        t = Transfer(rig.env(), "r-bad", "here", {f.Role.CTX, f.Role.GEN})
        t.sides[f.Role.CTX] = Side(request_id="r-bad", role="ctx", layout=ONE, ranks=(0,), peer="here",
                                   deadline=math.inf)
        t.sides[f.Role.GEN] = Side(request_id="r-bad", role="gen", layout=wide, ranks=(0,), peer="here",
                                   deadline=math.inf)
        t.feed(f.SideComplete(f.Role.GEN))
        t.feed(f.SideComplete(f.Role.CTX))
        assert rig.spawned == [False]
        await trio.testing.wait_all_tasks_blocked()
        assert t.finished.is_set() and rig.ended == [t]
        assert len(rig.reports) == 2 and not any(c.ok for c in rig.reports)
        assert rig.spawned == [False]
