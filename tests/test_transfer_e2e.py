"""End-to-end regrouped transfers: two real daemon processes, real NIXL (UCX, loopback)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from kvd.demo.launch import DaemonProcess
from protocol.layout import VLLM_AXIS_ORDER, KVLayout
from tests.transfer_harness import Outcome, Pair, assert_exact, run_transfer, start_pair

GEO = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 16, "dtype": "bfloat16"}
Factory = Callable[..., DaemonProcess]


def L(**kw: object) -> KVLayout:
    return KVLayout(**{**GEO, **kw})  # type: ignore[arg-type]


CASES = {
    "tp1_to_tp4": (L(), L(tp_size=4), "bounce"),
    "tp4_to_tp1": (L(tp_size=4), L(), "bounce"),
    "pp2_to_pp1": (L(pp_size=2), L(), "bounce"),
    "equal_tp2": (L(tp_size=2), L(tp_size=2), "direct"),
    "tp1_to_vllm_tp2": (L(), L(tp_size=2, axis_order=VLLM_AXIS_ORDER), "bounce"),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_regrouped_transfer_is_byte_exact(case: str, daemon_factory: Factory, short_tmp: Path) -> None:
    ctx, gen, path = CASES[case]
    pair = start_pair(daemon_factory, short_tmp, ctx, gen)
    out = await run_transfer(pair, ctx, gen, request_id=f"req-{case}", blocks=8)
    assert_exact(out, gen)
    for c in [*out.ctx.values(), *out.gen.values()]:
        assert c.ok and c.path == path, c
        assert c.bytes > 0 and c.peer in ("gen", "ctx")


async def test_tp2_to_tp8_with_4_kv_heads_replicates(daemon_factory: Factory, short_tmp: Path) -> None:
    ctx = KVLayout(4, 4, 64, 16, "bfloat16", tp_size=2)
    gen = KVLayout(4, 4, 64, 16, "bfloat16", tp_size=8)
    pair = start_pair(daemon_factory, short_tmp, ctx, gen)
    out = await run_transfer(pair, ctx, gen, request_id="req-repl", blocks=4)
    assert_exact(out, gen)
    # every gen replica received its head: 8 ranks x (4 layers x 2 x 1 head x 16 x 64 x 2 B) x 4 blocks
    assert out.gen[0].bytes == 8 * 4 * 2 * 1 * 16 * 64 * 2 * 4


async def test_attention_dp_gen_rank(daemon_factory: Factory, short_tmp: Path) -> None:
    ctx = L(tp_size=2)
    gen = L(tp_size=2, attention_dp=True)
    pair = start_pair(daemon_factory, short_tmp, ctx, gen)
    out = await run_transfer(pair, ctx, gen, request_id="req-adp", blocks=4, gen_ranks=[1])
    assert_exact(out, gen)
    assert set(out.gen) == {1}


async def test_request_three_times_the_bounce_region_streams(daemon_factory: Factory, short_tmp: Path) -> None:
    # bounce region 4 MiB, request 12 MiB: each 1 MiB receive slot is reused about 3 times
    geo = {**GEO, "num_layers": 24}
    ctx, gen = KVLayout(**geo), KVLayout(**{**geo, "tp_size": 4})  # type: ignore[arg-type]
    pair = start_pair(daemon_factory, short_tmp, ctx, gen, num_blocks=32)
    out = await run_transfer(pair, ctx, gen, request_id="req-big", blocks=16)
    assert_exact(out, gen)
    c = out.gen[0]
    # 12 MiB through 4 slots of 1 MiB: every slot is reused at least 3 times
    assert c.bytes == 3 * 4 * 2**20 and c.chunks >= 12 and c.path == "bounce"


async def _concurrently(pair: Pair, ctx: KVLayout, gen: KVLayout, prefix: str, *, requests: int,
                        blocks: int) -> list[Outcome]:
    """``requests`` transfers of ``blocks`` blocks at once; each checked byte for byte."""
    outs: list[Outcome] = []

    async def one(i: int) -> None:
        outs.append(await run_transfer(pair, ctx, gen, request_id=f"{prefix}{i}", blocks=blocks, seed=i))

    async with trio.open_nursery() as nursery:
        for i in range(requests):
            nursery.start_soon(one, i)
    assert len(outs) == requests
    for out in outs:
        assert_exact(out, gen, whole_pool=False)
    return outs


async def test_concurrent_requests_each_larger_than_the_bounce_regions_all_finish(
    daemon_factory: Factory, short_tmp: Path
) -> None:
    """Four requests of 6 MiB at once through 4 MiB regions (4 slots of 1 MiB each way, 6
    chunks a request): chunks gather ahead of their grants while they can, the requests
    compete for both regions, and every one completes, byte for byte (that no circular wait
    can form is SlotPool's rule, tested in tests/test_slots.py)."""
    geo = {**GEO, "num_layers": 24}
    ctx, gen = KVLayout(**geo), KVLayout(**{**geo, "tp_size": 2})  # type: ignore[arg-type]
    pair = start_pair(daemon_factory, short_tmp, ctx, gen, num_blocks=32)
    outs = await _concurrently(pair, ctx, gen, "req-big", requests=4, blocks=8)
    for out in outs:
        c = out.gen[0]
        assert c.ok and c.path == "bounce" and c.chunks >= 6, c


async def test_sixteen_concurrent_requests(daemon_factory: Factory, short_tmp: Path) -> None:
    ctx, gen = L(), L(tp_size=2)
    pair = start_pair(daemon_factory, short_tmp, ctx, gen, num_blocks=64)
    for out in await _concurrently(pair, ctx, gen, "req-c", requests=16, blocks=4):
        assert all(c.ok for c in out.gen.values())


@pytest.mark.parametrize("case", ["tp1_to_tp4", "equal_tp2", "tp4_to_tp1"])
async def test_same_node_mapped_path(case: str, daemon_factory: Factory, short_tmp: Path) -> None:
    """Same node: the ctx daemon attaches the gen pools and regroups straight into them."""
    ctx, gen, _ = CASES[case]
    pair = start_pair(daemon_factory, short_tmp, ctx, gen, mapped=True)
    out = await run_transfer(pair, ctx, gen, request_id=f"req-m-{case}", blocks=8)
    assert_exact(out, gen)
    for c in [*out.ctx.values(), *out.gen.values()]:
        assert c.ok and c.path == "mapped", c
    assert '"peer.pools_mapped"' in pair.ctx.log()


async def test_the_direct_path_says_how_many_writes_it_planned(
        daemon_factory: Factory, short_tmp: Path) -> None:
    """The NIXL write paths (direct; fragment shares its writer) tell the transfer how many
    writes they will make (what ``kvctl transfers`` shows progress against): after the
    request, the ctx side's chunks_total equals the writes that landed. Equal layouts go
    direct, one write per descs_per_write merged runs; 2 descriptors a write forces several."""
    from clients import open_client

    ctx = gen = L(tp_size=2)
    pair = start_pair(daemon_factory, short_tmp, ctx, gen, transfer={"descs_per_write": 2})
    out = await run_transfer(pair, ctx, gen, request_id="req-writes", blocks=8)
    assert_exact(out, gen)
    async with open_client(pair.ctx.socket_path) as c:
        rows = [t for t in await c.transfers() if t.request_id == "req-writes"]
    assert rows and all(t.path == "direct" for t in rows)
    for t in rows:
        assert t.chunks_total >= 1 and t.chunks_total == t.chunks_done, t
