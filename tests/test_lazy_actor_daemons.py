"""Real daemons: a request handled in its callers' steps starts no task on either daemon, a
request whose data path needs a task still gets it, and a deadline is enforced for a request
that never had an actor (the engine's timer). Tasks are counted through ``Stats``
(``transfer_actors``, ``transfer_tasks``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from clients import open_client
from kvd.demo.launch import DaemonProcess
from protocol.errors import TransferTimeout
from protocol.layout import KVLayout
from protocol.messages import DaemonStats
from tests.layout_fields import Geometry
from tests.transfer_harness import assert_exact, run_transfer, start_pair, wait_for_peer

Factory = Callable[..., DaemonProcess]
GEO: Geometry = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 32, "dtype": "bfloat16"}
ONE = KVLayout(**GEO)
TP2 = KVLayout(**GEO, tp_size=2)


async def _stats(d: DaemonProcess) -> DaemonStats:
    """``d``'s stats once no transfer is active (a request's end is counted after its replies)."""
    async with open_client(d.socket_path) as c:
        with trio.fail_after(20):
            while (st := await c.stats()).transfers_active:
                await trio.sleep(0.01)
    return st


@pytest.mark.parametrize("gen_first", [True, False])
async def test_a_small_mapped_request_starts_no_task_on_either_daemon(
        daemon_factory: Factory, short_tmp: Path, gen_first: bool) -> None:
    """gen announcing (gen first, peer named) or ctx offering (ctx first): the messages go
    into the links' writers, the publish's step plans, copies and reports, gen ends on the
    data-done: no actor, no data-path task, on either daemon, for several requests."""
    pair = start_pair(daemon_factory, short_tmp, ONE, TP2, mapped=True)
    for i in range(3):
        out = await run_transfer(pair, ONE, TP2, request_id=f"r-lazy-{i}", blocks=4,
                                 gen_peer="ctx" if gen_first else "")
        assert_exact(out, TP2)
    for d in (pair.ctx, pair.gen):
        st = await _stats(d)
        assert st.transfers_done == 3 and st.transfers_failed == 0
        assert (st.transfer_actors, st.transfer_tasks) == (0, 0), (d.socket_path, st)


async def test_a_request_whose_data_path_needs_a_task_still_runs_it(
        daemon_factory: Factory, short_tmp: Path) -> None:
    """Across nodes (NIXL, the direct path) ctx's data path is a task: started, it moves the
    bytes, and the request ends once it has ended."""
    pair = start_pair(daemon_factory, short_tmp, ONE, ONE)
    out = await run_transfer(pair, ONE, ONE, request_id="r-task", blocks=4, gen_peer="ctx")
    assert_exact(out, ONE)
    ctx = await _stats(pair.ctx)
    assert ctx.transfers_done == 1 and ctx.transfer_tasks >= 1
    assert (await _stats(pair.gen)).transfers_done == 1


async def test_a_deadline_is_enforced_for_a_request_with_no_actor(daemon_factory: Factory, short_tmp: Path) -> None:
    """One of two gen ranks registers with a short deadline, the other never does: the side
    fails at its deadline naming the missing rank (the engine's timer, as no actor ran), once,
    and its blocks go back."""
    pair = start_pair(daemon_factory, short_tmp, ONE, TP2, mapped=True)
    async with open_client(pair.gen.socket_path) as g:
        await wait_for_peer(g)
        ids = await g.alloc("gen0", 2)
        await g.expect("r-late", "gen0", TP2, 0, ids, ranks=[0, 1], deadline_s=0.3)
        with trio.fail_after(20), pytest.raises(TransferTimeout, match=r"ranks \[1\] never registered"):
            await g.wait("r-late")
        assert await g.free("gen0", ids) == 2  # no longer held by the request
    st = await _stats(pair.gen)
    assert st.transfers_failed == 1 and (st.transfer_actors, st.transfer_tasks) == (0, 0)
    (failed,) = pair.gen.logged("transfer.failed", request_id="r-late")
    assert failed["code"] == TransferTimeout.code
