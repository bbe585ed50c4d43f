"""Every bounce staging slot is free again after requests fail mid-bounce, and the next bounce
transfer gets them.

gen's grant loop (:meth:`kvd.transfer.paths.bounce.Receiver._grants`) hands receive slots to
ctx as credits. A side's slots are all taken back when it reports (``SlotPool.release_owner``),
and its tasks are cancelled then or at the actor's next turn. The loop used to go on after
that whenever it was already runnable: taking a free slot is no checkpoint, so a cancelled loop
only stopped once no slot was left, and it never asked whether its side still received. Two
orderings did it:

- the loop waited for a free slot, another request's slot was handed to it (the loop woken,
  not yet run), and its own request reported before it ran: a restarted ctx daemon fences
  every request of the old one in one step, in registration order. The woken loop granted a
  slot it no longer held and took every free one (two real daemons below);
- a credit was on its way (the loop awaited its send) when the side reported: the loop
  resumed and took the free slots for the next credit (in one process below).

Those slots were never given back: ``bounce_chunks_in_use`` stayed at the pool's size, and
every later bounce request found no receive slot and fell back to per-fragment writes after
``bounce_wait_s`` (or failed at its deadline, if shorter). ctx's send staging slots cannot be
kept so (each one taken is refused by ``Progress.check`` or released on the task's own path),
but a waiter woken with a slot its owner's end took back got it anyway: ``SlotPool.acquire``
now raises ``SlotsReclaimed`` there, which the tests here pin too.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from clients import open_client
from kvd.demo.launch import DaemonProcess
from kvd.pool import Pool
from kvd.transfer.paths import bounce
from kvd.transport.setup import _staging
from kvd.transport.slots import SlotPool, SlotsReclaimed
from protocol import transfer as x
from protocol.errors import KvdError
from protocol.layout import KVLayout
from tests.bounce_harness import OWNER, RID, Counts, make_pools, plan_of
from tests.transfer_harness import (
    Pair,
    assert_exact,
    gen_progress,
    logged,
    pools_for,
    run_transfer,
    start_pair,
    wait_for_peer,
)

Factory = Callable[..., DaemonProcess]
GEO = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 64, "dtype": "bfloat16"}
#: twice the tokens per block on gen: a regroup, so the bytes go through the bounce slots
CTX = KVLayout(**GEO, tokens_per_block=16)  # type: ignore[arg-type]
GEN = KVLayout(**GEO, tokens_per_block=32)  # type: ignore[arg-type]
BLOCKS = 64  # ctx blocks of 128 KiB: 8 MiB, 8 chunks of 1 MiB
GEN_BLOCKS = BLOCKS * CTX.tokens_per_block // GEN.tokens_per_block
#: 4 receive (and send) slots of 1 MiB on each daemon; ctx waits long for a first credit
TRANSFER = {"bounce_size_mb": 4, "chunk_mb": 1, "deadline_s": 60.0, "mapped": False, "bounce_wait_s": 60.0}
SLOTS = 4
HOLDERS = ("r-hold-a", "r-hold-b")  # gen requests ctx never publishes: 2 receive slots each


# -- two daemons -----------------------------------------------------------------------------------


async def slots_in_use(d: DaemonProcess) -> int:
    """``bounce_chunks_in_use`` (receive and send slots held) once ``d`` runs no transfer and
    leases no block: every request has ended, its tasks included, and been collected."""
    async with open_client(d.socket_path, client="checker") as c:
        with trio.fail_after(20):
            while True:
                st = await c.stats()
                if st.transfers_active == 0 and st.blocks_leased == 0:
                    assert st.bounce_chunks_total == 2 * SLOTS, st
                    return st.bounce_chunks_in_use
                await trio.sleep(0.02)  # polling the daemon's reply; the condition is the sync point


async def until_in_use(d: DaemonProcess, n: int) -> None:
    async with open_client(d.socket_path, client="checker") as c:
        with trio.fail_after(20):
            while (await c.stats()).bounce_chunks_in_use != n:
                await trio.sleep(0.02)


async def until_receiving(d: DaemonProcess, rid: str) -> None:
    """Until gen's side of ``rid`` heard ctx's path message (its receive task starts with it)."""
    async with open_client(d.socket_path, client="watcher") as c:
        with trio.fail_after(20):
            while (state := (await gen_progress(c, rid))[0]) != "receiving":
                assert state not in ("done", "failed"), state
                await trio.sleep(0.02)


async def cancel(d: DaemonProcess, rid: str) -> None:
    """Cancel ``rid`` on ``d`` as an operator (this test's uid is the daemon's)."""
    async with open_client(d.socket_path, client="operator") as c:
        await c.cancel(rid, force=True)


class Requests:
    """Executors of the requests of a test; each one's outcome lands in :attr:`outcomes`."""

    def __init__(self, pair: Pair) -> None:
        self.pair = pair
        self.outcomes: dict[tuple[str, str], object] = {}

    async def gen(self, rid: str, blocks: int, task_status: trio.TaskStatus[None]) -> None:
        async with open_client(self.pair.gen.socket_path, client=f"gen-{rid}") as c:
            await wait_for_peer(c)
            ids = await c.alloc("gen0", blocks)
            await c.expect(rid, "gen0", GEN, 0, ids, peer="ctx", deadline_s=60)
            task_status.started()
            try:
                self.outcomes["gen", rid] = await c.wait(rid)
            except KvdError as exc:
                self.outcomes["gen", rid] = exc

    async def ctx(self, rid: str) -> None:
        async with open_client(self.pair.ctx.socket_path, client=f"ctx-{rid}") as c:
            ids = await c.alloc("ctx0", BLOCKS)
            await c.publish(rid, "ctx0", CTX, 0, ids, peer="gen", deadline_s=60)
            try:
                self.outcomes["ctx", rid] = await c.wait(rid)
            except (KvdError, OSError) as exc:  # (OSError: its daemon was killed)
                self.outcomes["ctx", rid] = exc

    async def one_waiting_for_a_slot(self, nursery: trio.Nursery, rid: str) -> None:
        """Two requests ctx never publishes hold the 4 receive slots (2 granted with each
        destination); ``rid``, published, finds none: gen's grant loop waits for a free receive
        slot, ctx for its first credit."""
        for holder in HOLDERS:
            await nursery.start(self.gen, holder, 2)
        await until_in_use(self.pair.gen, SLOTS)
        await nursery.start(self.gen, rid, GEN_BLOCKS)
        nursery.start_soon(self.ctx, rid)
        await until_receiving(self.pair.gen, rid)

    def failed(self, *keys: tuple[str, str]) -> None:
        for key in keys:
            assert isinstance(self.outcomes[key], KvdError), (key, self.outcomes[key])


async def next_bounce_is_exact(pair: Pair) -> None:
    """Both daemons hold no slot; a bounce request gets them (no fallback) and lands byte-exact."""
    for d in (pair.gen, pair.ctx):
        held = await slots_in_use(d)
        assert held == 0, (
            f"{held} bounce slots still held on {d.config_path} after every request ended:\n"
            + "\n".join(line for line in d.log().splitlines() if '"warning"' in line or "credit" in line)
        )
    out = await run_transfer(pair, CTX, GEN, request_id="r-next", blocks=32, gen_peer="ctx")
    assert_exact(out, GEN)
    for c in [*out.ctx.values(), *out.gen.values()]:
        assert c.path == "bounce" and not c.fallback, c
    for d in (pair.gen, pair.ctx):
        assert await slots_in_use(d) == 0


async def test_receive_slots_come_back_when_a_fence_ends_a_request_whose_grant_loop_was_handed_one(
    daemon_factory: Factory, short_tmp: Path
) -> None:
    pair = start_pair(daemon_factory, short_tmp, CTX, GEN, num_blocks=BLOCKS, transfer=TRANSFER)
    reqs = Requests(pair)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await reqs.one_waiting_for_a_slot(nursery, "r-waits")
            # ctx dies: every gen side aborts and waits for ctx's word (its writes may land)
            os.kill(pair.ctx.pid, signal.SIGKILL)
            await logged(pair.gen, "peer.disconnected", 1, node="ctx")
            # a new ctx daemon (a new NIXL agent) fences the old one: in one step gen reports
            # the three requests in registration order; r-hold-a's slots go back first, one
            # of them to r-waits' grant loop, and r-waits ends before that loop runs
            pair.ctx = daemon_factory(
                {
                    "node": "ctx",
                    "pools": pools_for("ctx", CTX, BLOCKS),
                    "peer_secret_file": str(short_tmp / "peer.secret"),
                    "transfer": TRANSFER,
                    "peers": [{"name": "gen", "host": "127.0.0.1", "port": pair.gen.peer_port}],
                },
                name="ctx2",
            )
            await logged(pair.gen, "transfer.failed", 3, role="gen")
    reqs.failed(*(("gen", rid) for rid in (*HOLDERS, "r-waits")))
    await next_bounce_is_exact(pair)


@pytest.mark.parametrize("side", ["gen", "ctx"])
async def test_slots_come_back_when_a_request_is_cancelled_while_its_grant_loop_waits(
    side: str, daemon_factory: Factory, short_tmp: Path
) -> None:
    """Safe before the fix too (pinned): the side ends while its grant loop waits for a slot.
    The loop's wait is dropped with the side's slots (``release_owner`` drops its waiters), so
    nothing wakes it but its cancellation."""
    pair = start_pair(daemon_factory, short_tmp, CTX, GEN, num_blocks=BLOCKS, transfer=TRANSFER)
    reqs = Requests(pair)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await reqs.one_waiting_for_a_slot(nursery, "r-waits")
            await cancel(pair.gen if side == "gen" else pair.ctx, "r-waits")
            await logged(pair.gen, "transfer.failed", 1, role="gen", request_id="r-waits")
            await logged(pair.ctx, "transfer.failed", 1, role="ctx", request_id="r-waits")
            for holder in HOLDERS:  # their slots go back, to nobody waiting
                await cancel(pair.gen, holder)
    reqs.failed(*(("gen", rid) for rid in (*HOLDERS, "r-waits")), ("ctx", "r-waits"))
    await next_bounce_is_exact(pair)


# -- in one process ----------------------------------------------------------------------------------


@pytest.fixture
def gen_pools() -> Iterator[dict[int, Pool]]:
    pools = make_pools("gen", GEN, GEN_BLOCKS)
    yield pools
    for pool in pools.values():
        pool.close()


async def test_a_grant_loop_resuming_after_its_side_reported_takes_no_slot(
    gen_pools: dict[int, Pool],
) -> None:
    """A credit is on its way (the loop awaits its send) when the side fails and reports: its
    slots go back (``release_owner``), and the send returns before the cancellation reaches the
    loop. The loop must take no slot for the next credit (it took all 4 free ones)."""
    p = plan_of(CTX, GEN, BLOCKS)
    chunks = bounce.chunks(p, 1 << 20)
    assert len(chunks) == 8
    slots, counts, credits = SlotPool(SLOTS), Counts(), list[list[int]]()

    async def grant(batch: list[int]) -> None:
        credits.append(batch)
        if len(credits) == 1:  # while this credit is sent, the side fails and reports
            counts.stop = True  # (Progress.check refuses writes now)
            assert slots.release_owner(OWNER) == SLOTS
        await trio.lowlevel.checkpoint()

    receiver = bounce.Receiver(
        RID, OWNER, p, chunks, gen_pools, _staging(1 << 20, SLOTS, -1), slots, counts, grant
    )
    notifs_tx, notifs_rx = trio.open_memory_channel[x.Notif](0)
    with trio.fail_after(10), notifs_tx:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receiver.run, notifs_rx)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()  # the transfer's end
    assert credits == [[0, 1, 2, 3]]
    assert slots.in_use == 0, f"the ended side holds receive slots {slots.owned_by(OWNER)}"


async def test_a_waiter_whose_slot_was_taken_back_before_it_ran_gets_none() -> None:
    """A slot handed to a waiting ``acquire`` (woken, not yet run), then taken back with its
    owner's slots in the same step: ``acquire`` raises, it does not return a slot the owner no
    longer holds (cancelled meanwhile or not: a woken task runs on)."""
    pool = SlotPool(1)
    held = pool.try_acquire("other")
    assert held is not None
    got: list[object] = []

    async def waiter() -> None:
        try:
            got.append(await pool.acquire("mine"))
        except SlotsReclaimed as exc:
            got.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        pool.release("other", held)  # handed to "mine": woken
        assert pool.owned_by("mine") == {held}
        nursery.cancel_scope.cancel()  # too late: the waiter runs on with what it was handed
        assert pool.release_owner("mine") == 1  # its transfer ended in the same step
    assert len(got) == 1 and isinstance(got[0], SlotsReclaimed), got
    assert pool.in_use == 0


async def test_a_cancelled_waiter_whose_slot_was_taken_back_only_sees_its_cancellation() -> None:
    pool = SlotPool(1)
    held = pool.try_acquire("other")
    assert held is not None
    outcome: list[BaseException] = []

    async def waiter(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            try:
                await pool.acquire("mine")
            except BaseException as exc:
                outcome.append(exc)
                raise

    async with trio.open_nursery() as nursery:
        scope = await nursery.start(waiter)
        await trio.testing.wait_all_tasks_blocked()
        scope.cancel()  # delivered: the waiter will raise Cancelled, still queued for a slot
        pool.release("other", held)  # handed to it all the same
        assert pool.release_owner("mine") == 1  # and taken back
    assert len(outcome) == 1 and isinstance(outcome[0], trio.Cancelled), outcome
    assert pool.in_use == 0 and pool.owned_by("mine") == set()
