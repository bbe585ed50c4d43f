"""The transfer actor's end: what arrives while it winds down is still handled.

A gen side that fails before its ctx peer spoke up owes ctx an answer when ctx's offer comes
(the machine's "tell" rule). If that offer lands in the transfer's inbox behind the actor's
last actions, the actor must feed it before it ends, or ctx waits for its whole deadline (seen
once in a loaded full-suite run of
``test_gen_rank_leaving_before_its_side_is_complete_fails_ctx_once``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import trio
import trio.testing

from kvd.config import TransferConfig
from kvd.transfer.requests import Side
from kvd.transfer.transfer import Env, Transfer
from protocol import messages as m
from protocol import transfer as x
from protocol import transfer_fsm as f
from protocol.layout import KVLayout

TP2 = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, tokens_per_block=32, dtype="bfloat16", tp_size=2)
ONE = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, tokens_per_block=32, dtype="bfloat16")


def _gen_transfer(reports: list[m.Completion], ended: list[Transfer]) -> Transfer:
    env = Env(node="gen", cfg=TransferConfig(), nixl=lambda: None, links=lambda: None, staging=lambda: None,
              on_report=lambda t, side, c: reports.append(c), on_finished=ended.append)
    t = Transfer(env, "r-late", "", {f.Role.GEN})
    t.sides[f.Role.GEN] = Side(request_id="r-late", role="gen", layout=TP2, ranks=(0, 1), peer="",
                               deadline=math.inf)
    return t


async def _fail_rank0(t: Transfer, then: Callable[[], None] = lambda: None) -> None:
    """Run ``t``'s actor; rank 0 of 2 registers and its executor leaves (the side fails,
    reported inline, and the machine is final); ``then()`` runs right after, before the actor
    is scheduled again. Returns once the actor ended."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(t.run)
        await trio.testing.wait_all_tasks_blocked()
        t.feed(f.RankRegistered(f.Role.GEN))
        t.feed(f.Disconnect(f.Role.GEN, "executor session 1 ended"))
        then()


async def test_an_offer_queued_behind_the_last_actions_is_answered_before_the_actor_ends() -> None:
    reports: list[m.Completion] = []
    ended: list[Transfer] = []
    t = _gen_transfer(reports, ended)

    def offer_arrives() -> None:
        # the actor was woken to end; before it runs, ctx's offer arrives behind that
        assert t.machine.finished and len(reports) == 1 and not reports[0].ok
        t.post(x.XferOffer(request_id="r-late", layout=ONE, blocks={0: [1, 2]}, deadline_s=60))
        assert not t.finished.is_set()

    await _fail_rank0(t, offer_arrives)
    assert ended == [t]
    # the offer was fed to the machine, which answered it with the gen side's failure
    assert t.machine.state(f.Role.CTX) is f.State.OFFERED
    assert t.machine.fail_sent
    assert t.machine.gen.code == "transfer_cancelled" and "session 1 ended" in t.machine.gen.message


async def test_an_offer_after_the_end_finds_the_transfer_finished() -> None:
    """Once ``finished`` is set the engine answers late offers itself (its tombstone rule):
    the actor ended with its inbox empty."""
    reports: list[m.Completion] = []
    ended: list[Transfer] = []
    t = _gen_transfer(reports, ended)
    await _fail_rank0(t)
    assert t.finished.is_set() and ended == [t]
    assert t.machine.state(f.Role.GEN) is f.State.FAILED and not t.machine.fail_sent
    assert t._inbox.rx.statistics().current_buffer_used == 0  # nothing left unhandled


async def test_a_deadline_moved_while_the_actor_sleeps_expires_the_side_then(
        autojump_clock: trio.testing.MockClock) -> None:
    """A registration that moves the deadline does not wake the actor (its sleep's deadline
    is moved); the side still fails at the earliest deadline, naming the missing rank. A later
    registration's later deadline does not postpone it."""
    reports: list[m.Completion] = []
    ended: list[Transfer] = []
    t = _gen_transfer(reports, ended)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(t.run)
        await trio.testing.wait_all_tasks_blocked()
        assert t._sleep is not None and t._sleep.deadline == math.inf  # asleep, no deadline yet
        start = trio.current_time()
        t.feed(f.RankRegistered(f.Role.GEN, deadline=start + 100))
        assert t._sleep is not None and t._sleep.deadline == start + 100
        assert t._inbox.rx.statistics().current_buffer_used == 0  # nothing queued: no wake-up
        t.feed(f.RankRegistered(f.Role.GEN, deadline=start + 5))  # earlier: moves it
        t.feed(f.RankRegistered(f.Role.GEN, deadline=start + 50))  # later: no change
        assert t._sleep is not None and t._sleep.deadline == start + 5
    assert ended == [t] and len(reports) == 1 and not reports[0].ok
    assert reports[0].error_code == "transfer_timeout" and "never registered" in reports[0].error_message
    assert trio.current_time() - start == 5


async def test_a_send_task_that_starts_after_its_side_was_cancelled_does_nothing() -> None:
    """ctx's data path starts as a task; its side is cancelled before the task's first step.
    The task must see that and end quietly: no path chosen, no write, no second outcome (it
    went on to the link and failed with 'task_failed_after_end' once the request was settled)."""
    import structlog.testing

    reports: list[m.Completion] = []
    ended: list[Transfer] = []
    env = Env(node="ctx", cfg=TransferConfig(), nixl=lambda: None, links=lambda: None, staging=lambda: None,
              on_report=lambda t, side, c: reports.append(c), on_finished=ended.append)
    t = Transfer(env, "r-cancel", "gen", {f.Role.CTX})
    t.sides[f.Role.CTX] = Side(request_id="r-cancel", role="ctx", layout=ONE, ranks=(0,), peer="gen",
                               deadline=math.inf)
    with structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(t.run)
            await trio.testing.wait_all_tasks_blocked()
            t.feed(f.DestinationReceived(f.Role.GEN, announced=True))
            t.feed(f.SideComplete(f.Role.CTX, peer_named=True))  # both ready: the data task is started
            assert t.machine.state(f.Role.CTX) is f.State.SENDING
            t.feed(f.Cancel(f.Role.CTX, "cancelled by its executor"))  # before the task ran
            assert t.machine.finished
    assert [c.ok for c in reports] == [False] and reports[0].error_code == "transfer_cancelled"
    assert t.machine.path is None  # no path was chosen
    assert ended == [t]
    assert not [e for e in logs if e["event"] in ("transfer.task_failed_after_end", "transfer.internal_error")], logs
