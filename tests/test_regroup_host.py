"""The regroup kernel's host twin (and the torch path) against the planner's reference, byte for byte.

Pools are filled with a sentinel, the request is written by the reference of test_plan (layout
ownership only, no strides), and every engine must reproduce the reference pools exactly: the
request's bytes where they belong and the sentinel everywhere else. Gathered chunks must equal
the fragment stager's bounce chunks byte for byte (either side may run either implementation).
"""

from __future__ import annotations

import random
import weakref

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.regroup import apply as rg
from kvd.regroup.plan import KVLayout, Plan, plan
from kvd.regroup.stager import gather, schedule
from kvd.regroup.table import chunk_ranges, pair_grid
from protocol.layout import TRTLLM_AXIS_ORDER, VLLM_AXIS_ORDER
from tests.layout_fields import Geometry, LayoutFields
from tests.test_plan import SENTINEL, cases, new_pools, write_request

U8 = np.ndarray

#: Named layout kinds: (ctx overrides, gen overrides, geometry overrides).
KINDS: dict[str, tuple[LayoutFields, LayoutFields, LayoutFields]] = {
    "tp1_tp4": ({}, {"tp_size": 4}, {}),
    "tp4_tp1": ({"tp_size": 4}, {}, {}),
    "tp2_tp2_direct": ({"tp_size": 2}, {"tp_size": 2}, {}),
    "vllm_tp2_to_trtllm_tp4": ({"tp_size": 2, "axis_order": VLLM_AXIS_ORDER}, {"tp_size": 4}, {}),
    "trtllm_to_vllm_pp2": ({}, {"pp_size": 2, "layer_split": (3, 2), "axis_order": VLLM_AXIS_ORDER}, {}),
    "tpb_mix_ctx_larger": ({"tokens_per_block": 8}, {"tp_size": 2}, {}),
    "tpb_mix_gen_larger": ({"tp_size": 4}, {"tokens_per_block": 8}, {}),
    "gen_attention_dp": ({"tp_size": 2}, {"tp_size": 4, "attention_dp": True}, {}),
    "pp_uneven": ({"pp_size": 2, "layer_split": (1, 4)}, {"pp_size": 3, "layer_split": (2, 2, 1)}, {}),
    "tp_above_heads": ({"tp_size": 8}, {"tp_size": 2}, {}),
    "tp_above_heads_gen": ({"tp_size": 2}, {"tp_size": 8}, {}),
    "uint8_odd_head_dim": ({}, {"tp_size": 2}, {"dtype": "uint8", "head_dim": 3}),
    "float32": ({"tp_size": 2}, {"tp_size": 4}, {"dtype": "float32"}),
    "nhd_small_runs": (
        {"axis_order": ("block", "layer", "kv", "token", "head", "dim")},
        {"tp_size": 4},
        {},
    ),
}
BASE: LayoutFields = {"num_layers": 5, "num_kv_heads": 4, "head_dim": 8, "tokens_per_block": 4, "dtype": "bfloat16", "num_blocks": 9}


def build(kind: str, seed: int = 0, tokens: int = 19) -> tuple[Plan, dict[int, U8], dict[int, U8]]:
    """Plan, source pools holding the request, and the reference destination pools."""
    c_kw, g_kw, geo = KINDS[kind]
    base: LayoutFields = {**BASE, **geo}
    ctx_kw: LayoutFields = {**base, **c_kw}
    gen_kw: LayoutFields = {**base, **g_kw}
    ctx = KVLayout(**ctx_kw)
    gen = KVLayout(**gen_kw)
    rnd = random.Random(f"{kind}{seed}")
    n_c = -(-tokens // ctx.tokens_per_block)
    n_g = -(-tokens // gen.tokens_per_block)
    tokens = min(n_c * ctx.tokens_per_block, n_g * gen.tokens_per_block)

    def ranks(layout: KVLayout, one: bool) -> list[int]:
        if not layout.attention_dp:
            return list(range(layout.world_size))
        stage = [rnd.randrange(layout.tp_size) for _ in range(layout.pp_size)]
        return [s * layout.tp_size + t for s, t in enumerate(stage)] if one else list(range(layout.world_size))[:2]

    cb = {r: rnd.sample(range(ctx.num_blocks), n_c) for r in ranks(ctx, True)}
    gb = {r: rnd.sample(range(gen.num_blocks), n_g) for r in ranks(gen, False)}
    p = plan(ctx, gen, cb, gb)
    rng = np.random.default_rng(seed)
    logical = rng.integers(0, 256, size=(tokens, ctx.num_layers, 2, ctx.num_kv_heads, ctx.head_dim, ctx.itemsize),
                           dtype=np.uint8)
    src = new_pools(ctx, cb, None, rng)
    write_request(src, ctx, cb, logical)
    want = new_pools(gen, gb, SENTINEL, rng)
    write_request(want, gen, gb, logical)
    return p, src, want


def sentinel_pools(p: Plan) -> dict[int, U8]:
    return {r: np.full((*p.gen.pool_shape(r), p.gen.itemsize), SENTINEL, dtype=np.uint8) for r in p.gen_blocks}


def check(got: dict[int, U8], want: dict[int, U8], what: str) -> None:
    for r in want:
        np.testing.assert_array_equal(got[r], want[r], err_msg=f"{what}: gen rank {r}")


def run_all(p: Plan, src: dict[int, U8], chunk: int, engine: rg.Engine = "host") -> dict[str, dict[int, U8]]:
    """Pool -> pool per source rank, and gather -> scatter per chunk; results per mode."""
    wrap = (lambda a: torch.from_numpy(a)) if engine == "torch" else (lambda a: a)
    direct = sentinel_pools(p)
    before = {r: a.copy() for r, a in src.items()}
    for s in p.src_ranks():
        done = rg.regroup(p, s, wrap(src[s]), {d: wrap(a) for d, a in direct.items()}, engine=engine)
        assert done.done() and done.engine == engine and done.nbytes == p.total_bytes(s=s)
    bounced = sentinel_pools(p)
    sched = schedule(p, chunk_bytes=chunk, bounce_size_mb=1)
    ranges = chunk_ranges(p, chunk)
    assert [(c.src, c.dst, c.index, c.nbytes) for c in sched.all_chunks()] == [
        (r.src, r.dst, r.index, r.nbytes) for r in ranges
    ]
    for r, c in zip(ranges, sched.all_chunks(), strict=True):
        staging = np.full(chunk + 5, 0x3C, dtype=np.uint8)
        rg.gather_chunk(p, r.src, r.dst, wrap(src[r.src]), wrap(staging), offset=r.offset, nbytes=r.nbytes,
                        engine=engine)
        assert (staging[r.nbytes :] == 0x3C).all(), "gather wrote past the chunk"
        stager = torch.zeros(r.nbytes, dtype=torch.uint8)
        gather(c, torch.from_numpy(src[r.src]), stager)
        np.testing.assert_array_equal(staging[: r.nbytes], stager.numpy(), err_msg=f"chunk {r} differs from stager")
        rg.scatter_chunk(p, r.src, r.dst, wrap(staging), wrap(bounced[r.dst]), offset=r.offset, nbytes=r.nbytes,
                         engine=engine)
    for rank, a in src.items():
        np.testing.assert_array_equal(a, before[rank], err_msg="source pool modified")
    return {"regroup": direct, "gather+scatter": bounced}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_host_twin_every_layout_kind(kind: str) -> None:
    p, src, want = build(kind)
    run_len = min(g.run for g in (pair_grid(p, s, d) for s, d in p.pairs()) if g is not None)
    # chunks that cut runs, at an odd size (narrow rows) and a generous one
    for chunk in (max(1, run_len * 3 // 2 + 1), 4096):
        for mode, got in run_all(p, src, chunk).items():
            check(got, want, f"{kind} {mode} chunk={chunk}")


@pytest.mark.parametrize("kind", ["tp1_tp4", "vllm_tp2_to_trtllm_tp4", "tpb_mix_gen_larger", "uint8_odd_head_dim"])
def test_torch_path_matches_on_cpu_tensors(kind: str) -> None:
    p, src, want = build(kind, seed=1)
    for mode, got in run_all(p, src, 1000, engine="torch").items():
        check(got, want, f"{kind} torch {mode}")


def test_stream_is_the_fragment_stream() -> None:
    """Run j of the grid is the planner's fragment stream cut into runs (GPT-OSS TP1 -> TP4)."""
    geo: Geometry = {"num_layers": 36, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 32, "dtype": "bfloat16"}
    ctx, gen = KVLayout(**geo, num_blocks=64), KVLayout(**geo, tp_size=4, num_blocks=64)
    rnd = random.Random(3)
    p = plan(ctx, gen, {0: rnd.sample(range(64), 16)}, {r: rnd.sample(range(64), 16) for r in range(4)})
    for s, d in p.pairs():
        g = pair_grid(p, s, d)
        assert g is not None and g.run == 8192 and g.nruns == 16 * 36 * 2
        so, do = g.offsets(np.arange(g.nruns, dtype=np.int64))
        f = p.fragments(s, d)
        fs = np.concatenate([np.arange(a, a + n, g.run) for a, _, n in f])
        fd = np.concatenate([np.arange(b, b + n, g.run) for _, b, n in f])
        np.testing.assert_array_equal(so, fs)
        np.testing.assert_array_equal(do, fd)
        assert g.alignment("src") == g.alignment("dst") == 16
        assert g.extent("src") <= ctx.pool_bytes(0) and g.extent("dst") <= gen.pool_bytes(d)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases(), chunk=st.sampled_from([1, 7, 64, 1000]))
def test_host_twin_matches_reference_everywhere(
    case: tuple[KVLayout, KVLayout, dict[int, list[int]], dict[int, list[int]], int], chunk: int
) -> None:
    """Random layouts (any axis order, TP/PP/DP, uneven splits, replication, tpb mixes, widths)."""
    ctx, gen, cb, gb, seed = case
    rng = np.random.default_rng(seed)
    p = plan(ctx, gen, cb, gb)
    logical = rng.integers(0, 256, size=(p.num_tokens, ctx.num_layers, 2, ctx.num_kv_heads, ctx.head_dim,
                                         ctx.itemsize), dtype=np.uint8)
    src = new_pools(ctx, cb, None, rng)
    write_request(src, ctx, cb, logical)
    want = new_pools(gen, gb, SENTINEL, rng)
    write_request(want, gen, gb, logical)
    for mode, got in run_all(p, src, chunk).items():
        check(got, want, mode)


def test_bounds_and_arguments_rejected_before_any_write() -> None:
    p, src, _ = build("tp1_tp4")
    dst = sentinel_pools(p)
    small = {d: a.reshape(-1)[: a.size // 2] for d, a in dst.items()}
    with pytest.raises(ValueError, match="touches"):
        rg.regroup(p, 0, src[0], small)
    assert all((a == SENTINEL).all() for a in dst.values())
    g = pair_grid(p, 0, 1)
    assert g is not None
    staging = np.zeros(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="outside the pair"):
        rg.gather_chunk(p, 0, 1, src[0], staging, offset=g.nbytes - 16, nbytes=32)
    with pytest.raises(ValueError, match="staging holds 64 bytes"):
        rg.gather_chunk(p, 0, 1, src[0], staging, offset=0, nbytes=128)
    with pytest.raises(ValueError, match="moves nothing"):
        rg.gather_chunk(p, 0, 9, src[0], staging, offset=0, nbytes=16)
    with pytest.raises(ValueError, match="needs CUDA pools"):
        rg.regroup(p, 0, src[0], dst, engine="kernel")
    with pytest.raises(TypeError, match="host pools"):
        rg.regroup(p, 0, src[0].tolist(), dst)
    with pytest.raises(KeyError):
        rg.regroup(p, 0, src[0], {0: dst[0]})


def test_axis_orders_are_the_two_real_ones() -> None:
    """The named kinds cover both production axis orders on both sides."""
    orders = {KINDS[k][i].get("axis_order", TRTLLM_AXIS_ORDER) for k in KINDS for i in (0, 1)}
    assert {TRTLLM_AXIS_ORDER, VLLM_AXIS_ORDER} <= orders


def test_pool_descriptors_are_remembered_per_tensor_object(monkeypatch: pytest.MonkeyPatch) -> None:
    """The templated launches key their cache by each pool's (address, bytes, device), asked
    of torch once per tensor object: the same object is answered from memory, another object
    under a reused id (a dead tensor's) is asked again, a non-CUDA tensor reads None (the
    kernel is not for it), and the memory is emptied when full."""
    calls: list[int] = []

    def desc(t: torch.Tensor) -> tuple[int, int, int]:
        calls.append(id(t))
        return t.data_ptr(), t.numel() * t.element_size(), 7

    monkeypatch.setattr(rg, "_POOL_DESC", {})
    assert rg._pool_desc(torch.zeros(4, dtype=torch.uint8)) is None  # CPU: not the kernel's
    monkeypatch.setattr(rg, "_is_cuda", lambda t: True)  # CPU tensors stand in for CUDA pools
    monkeypatch.setattr(rg, "_desc", desc)
    a = torch.zeros(64, dtype=torch.uint8)
    assert rg._pool_desc(a) == (a.data_ptr(), 64, 7) and rg._pool_desc(a) == (a.data_ptr(), 64, 7)
    assert calls == [id(a)]  # asked once
    # an entry left by a dead tensor whose id ``b`` now has: not taken for b
    b = torch.zeros(32, dtype=torch.uint8)
    ghost = torch.zeros(1, dtype=torch.uint8)
    rg._POOL_DESC[id(b)] = (weakref.ref(ghost), (1, 2, 3))
    assert rg._pool_desc(b) == (b.data_ptr(), 32, 7) and calls == [id(a), id(b)]
    del ghost
    # full: emptied, then remembered again
    monkeypatch.setattr(rg, "POOL_DESC_KEEP", 2)
    c = torch.zeros(16, dtype=torch.uint8)
    assert rg._pool_desc(c) == (c.data_ptr(), 16, 7)
    assert set(rg._POOL_DESC) == {id(c)}
    assert rg._pool_desc(c) == (c.data_ptr(), 16, 7) and calls == [id(a), id(b), id(c)]
