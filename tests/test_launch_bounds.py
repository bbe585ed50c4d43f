"""What lets a launch recipe skip the per-request bounds check of its launch tables
(``kvd.transfer.paths.mapped.Recipe.bounded``): :meth:`Plan.offset_bounds` is the largest
offset any valid request of a shape reaches, and :func:`kvd.regroup.kernel.within` says
whether a template's pools hold that; a pool smaller than its layout keeps the check, which
still refuses a table reaching outside it. Host-only: templates are plain numpy."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvd.regroup import kernel
from kvd.regroup.plan import Plan, plan, pool_strides
from kvd.regroup.table import pair_grid
from protocol.layout import KVLayout

GEO = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 16, "dtype": "bfloat16"}


def _layouts(tpb_ctx: int, tpb_gen: int, gen_tp: int) -> tuple[KVLayout, KVLayout]:
    ctx = KVLayout(**GEO, tokens_per_block=tpb_ctx, num_blocks=12)  # type: ignore[arg-type]
    gen = KVLayout(**GEO, tokens_per_block=tpb_gen, num_blocks=20, tp_size=gen_tp)  # type: ignore[arg-type]
    return ctx, gen


CASES = [(32, 32, 4), (32, 16, 2), (16, 32, 4), (32, 32, 1)]


@pytest.mark.parametrize(("tpb_ctx", "tpb_gen", "gen_tp"), CASES)
def test_offset_bounds_cover_every_valid_request_and_are_reached(tpb_ctx: int, tpb_gen: int, gen_tp: int) -> None:
    ctx, gen = _layouts(tpb_ctx, tpb_gen, gen_tp)
    n_ctx = 2
    n_gen = n_ctx * tpb_ctx // tpb_gen
    rng = random.Random(7)
    seen_ctx: dict[int, int] = {}
    seen_gen: dict[int, int] = {}
    bounds = None
    for trial in range(60):
        top = trial == 0  # the first request names the last blocks: it reaches the bounds
        cb = {0: [ctx.num_blocks - 1 - i for i in range(n_ctx)] if top else rng.sample(range(ctx.num_blocks), n_ctx)}
        gb = {r: [gen.num_blocks - 1 - i for i in range(n_gen)] if top else rng.sample(range(gen.num_blocks), n_gen)
              for r in range(gen.world_size)}
        p = plan(ctx, gen, cb, gb)
        got = p.offset_bounds()
        assert got is not None
        assert bounds is None or got is bounds  # once per shape
        bounds = got
        for r, off in p.ctx_offsets.items():
            assert int(off.max()) <= got[0][r]
            seen_ctx[r] = max(seen_ctx.get(r, 0), int(off.max()))
        for r, off in p.gen_offsets.items():
            assert int(off.max()) <= got[1][r]
            seen_gen[r] = max(seen_gen.get(r, 0), int(off.max()))
    assert bounds is not None and seen_ctx == bounds[0] and seen_gen == bounds[1]


def _template(p: Plan, pool_bytes_ctx: int, pool_bytes_gen: int) -> tuple[kernel.LaunchTemplate, list[tuple[int, int]]]:
    """A template of plan ``p``'s pairs of ctx rank 0 into pools of these sizes (at made-up
    16-byte-aligned addresses: nothing is launched), as the mapped path builds it."""
    grids = [g for d in p.dst_ranks() if (g := pair_grid(p, 0, d)) is not None and g.nruns]
    launches = [kernel.PairLaunch(g, 1 << 20, 1 << 30, 0, g.nbytes) for g in grids]
    limits = [(pool_bytes_ctx - g.extent_without_table("src"), pool_bytes_gen - g.extent_without_table("dst"))
              for g in grids]
    return kernel.template(launches, [(16, 16)] * len(grids), limits), [(g.src, g.dst) for g in grids]


def _pool_bytes(layout: KVLayout, rank: int, blocks: int) -> int:
    return blocks * pool_strides(layout, rank)["block"]


def test_pools_as_large_as_their_layouts_skip_the_check_and_tables_match() -> None:
    ctx, gen = _layouts(32, 32, 4)
    p = plan(ctx, gen, {0: [11, 3]}, {r: [19, r] for r in range(4)})
    tpl, pairs = _template(p, _pool_bytes(ctx, 0, ctx.num_blocks), _pool_bytes(gen, 0, gen.num_blocks))
    bounds = p.offset_bounds()
    assert bounds is not None
    assert kernel.within(tpl, [(bounds[0][s], bounds[1][d]) for s, d in pairs])
    tables = [(p.ctx_offsets[s], p.gen_offsets[d]) for s, d in pairs]
    np.testing.assert_array_equal(tpl.table(tables, check=False), tpl.table(tables))


def test_a_pool_smaller_than_its_layout_keeps_the_check_which_refuses_the_last_blocks() -> None:
    ctx, gen = _layouts(32, 32, 4)
    p = plan(ctx, gen, {0: [11, 3]}, {r: [19, r] for r in range(4)})
    # gen's pools hold 10 of the layout's 20 blocks: block 19 lies outside them
    tpl, pairs = _template(p, _pool_bytes(ctx, 0, ctx.num_blocks), _pool_bytes(gen, 0, 10))
    bounds = p.offset_bounds()
    assert bounds is not None
    assert not kernel.within(tpl, [(bounds[0][s], bounds[1][d]) for s, d in pairs])
    with pytest.raises(ValueError, match="outside its pool"):
        tpl.table([(p.ctx_offsets[s], p.gen_offsets[d]) for s, d in pairs])
    # and a bounds list of another length is never "within"
    assert not kernel.within(tpl, [(0, 0)])
