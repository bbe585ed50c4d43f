"""Whole-block box copies (mapped path) agree with the planner's fragment copies, byte for byte."""

from __future__ import annotations

import random

import pytest
import torch

from kvd.regroup.boxcopy import copy_boxes, supports_box_copy, widest_view
from kvd.regroup.gpu_pipeline import _box_view
from kvd.regroup.plan import Plan, plan
from protocol.layout import VLLM_AXIS_ORDER, KVLayout
from tests.layout_fields import LayoutFields

GEO: LayoutFields = {"num_layers": 6, "num_kv_heads": 4, "head_dim": 8, "tokens_per_block": 4, "dtype": "bfloat16", "num_blocks": 12}
CASES: dict[str, tuple[LayoutFields, LayoutFields]] = {
    "tp1_tp4": ({}, {"tp_size": 4}),
    "tp4_tp1": ({"tp_size": 4}, {}),
    "pp2_pp1_uneven": ({"pp_size": 2, "layer_split": (2, 4)}, {}),
    "tp2_tp8_replicas": ({"tp_size": 2}, {"tp_size": 8}),
    "vllm_to_trtllm": ({"tp_size": 2, "axis_order": VLLM_AXIS_ORDER}, {"pp_size": 3}),
    "equal": ({"tp_size": 2}, {"tp_size": 2}),
}


def _setup(case: str) -> tuple[Plan, dict[int, torch.Tensor], dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    c_kw, g_kw = CASES[case]
    ctx_kw: LayoutFields = {**GEO, **c_kw}
    gen_kw: LayoutFields = {**GEO, **g_kw}
    ctx, gen = KVLayout(**ctx_kw), KVLayout(**gen_kw)
    rng = random.Random(case)
    cb = {r: rng.sample(range(12), 5) for r in range(ctx.world_size)}
    gb = {r: rng.sample(range(12), 5) for r in range(gen.world_size)}
    p = plan(ctx, gen, cb, gb)
    src = {r: torch.randint(-(2**15), 2**15, ctx.pool_shape(r), dtype=torch.int16).view(torch.bfloat16)
           for r in range(ctx.world_size)}
    ref = {r: torch.zeros(gen.pool_shape(r), dtype=torch.bfloat16) for r in range(gen.world_size)}
    p.apply({r: t.view(torch.uint8).reshape(-1) for r, t in src.items()},
            {r: t.view(torch.uint8).reshape(-1) for r, t in ref.items()})
    dst = {r: torch.zeros(gen.pool_shape(r), dtype=torch.bfloat16) for r in range(gen.world_size)}
    return p, src, ref, dst


@pytest.mark.parametrize("case", sorted(CASES))
def test_block_by_block_box_copy_matches_plan(case: str) -> None:
    p, src, ref, dst = _setup(case)
    assert supports_box_copy(p)
    for s, d in p.pairs():  # one pair at a time, on this thread
        copy_boxes(p, {s: src[s]}, {d: dst[d]}, [(s, d)], workers=1)
    for r in ref:
        assert torch.equal(dst[r].view(torch.int16), ref[r].view(torch.int16)), r


@pytest.mark.parametrize("case", sorted(CASES))
def test_vectorised_box_views_match_plan(case: str) -> None:
    """The GPU pipeline's per-chunk kernels (index_select on the source box view, index_copy_
    into the destination box view), run here on CPU tensors without the streams."""
    p, src, ref, dst = _setup(case)
    for s, d in p.pairs():
        box = p.box(s, d)
        assert box is not None
        sv = _box_view(src[s], p.ctx, *box.src_local)
        dv = _box_view(dst[d], p.gen, *box.dst_local)
        sids = torch.as_tensor(p.ctx_blocks[s])
        dids = torch.as_tensor(p.gen_blocks[d])
        for lo in range(0, len(sids), 2):  # chunks of two blocks, as the pipeline cuts them
            staged = torch.index_select(sv, 0, sids[lo : lo + 2])
            dv.index_copy_(0, dids[lo : lo + 2], staged.clone())
    for r in ref:
        assert torch.equal(dst[r].view(torch.int16), ref[r].view(torch.int16)), r


def test_widest_view_keeps_bytes() -> None:
    t = torch.arange(2 * 3 * 64, dtype=torch.int16).view(torch.bfloat16).view(2, 3, 64)
    w = widest_view(t)
    assert w.dtype == torch.int64 and w.shape == (2, 3, 16)
    assert torch.equal(w.view(torch.int16).view(2, 3, 64), t.view(torch.int16))
    odd = torch.zeros(2, 3, dtype=torch.bfloat16)  # 6-byte rows: int16 is the widest that fits
    assert widest_view(odd).dtype == torch.int16


@pytest.mark.parametrize("case", sorted(CASES))
def test_parallel_box_copy_matches_plan(case: str) -> None:
    p, src, ref, dst = _setup(case)
    moved = copy_boxes(p, src, dst, workers=3)
    assert moved == p.total_bytes()
    for r in ref:
        assert torch.equal(dst[r].view(torch.int16), ref[r].view(torch.int16)), r


@pytest.mark.parametrize("case", sorted(CASES))
def test_box_bounce_chunks_match_plan(case: str) -> None:
    """gather_box -> slot -> scatter_box, chunk by chunk (slots smaller than a pair's blocks)."""
    from kvd.regroup.boxbounce import box_chunks, fits, gather_box, scatter_box

    p, src, ref, dst = _setup(case)
    chunk = 3 * max(1, p.total_bytes() // max(1, sum(len(p.ctx_blocks[s]) for s, _ in p.pairs())))
    assert fits(p, chunk)
    chunks = box_chunks(p, chunk)
    assert sum(c.nbytes for c in chunks) == p.total_bytes()
    slot = torch.zeros(chunk, dtype=torch.uint8)
    for c in chunks:
        assert c.nbytes <= chunk
        gather_box(p, c, src[c.src], slot)
        scatter_box(p, c, slot, dst[c.dst])
    for r in ref:
        assert torch.equal(dst[r].view(torch.int16), ref[r].view(torch.int16)), r
