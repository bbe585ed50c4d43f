"""The regroup planner against a reference written here, plus every rejection.

The reference knows nothing of strides or fragments: it holds the request as a logical array
``[token, layer, kv, head, dim, byte]`` and writes it into each rank's pool through a numpy
view transposed to ``[block, layer, kv, head, token, dim, byte]``, using only the layout's
ownership (layer_range / head_range). The planner's result, applied directly and through the
bounce stager with tiny chunks, must produce the same pools byte for byte.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.regroup.plan import CheckedBlocks, KVLayout, check_blocks, plan
from kvd.regroup.stager import gather, scatter, schedule
from protocol.errors import BadRequest, IncompatibleLayout
from protocol.layout import TRTLLM_AXIS_ORDER, VLLM_AXIS_ORDER

CANON = ("block", "layer", "kv", "head", "token", "dim")
SENTINEL = 0xA5
U8 = npt.NDArray[np.uint8]


# -- reference ---------------------------------------------------------------------------------


def canon_view(pool: U8, layout: KVLayout) -> U8:
    """``pool`` (pool_shape + (itemsize,)) viewed as [block, layer, kv, head, token, dim, byte]."""
    perm = [layout.axis_order.index(a) for a in CANON] + [6]
    return pool.transpose(perm)


def new_pools(layout: KVLayout, ranks: Any, fill: int | None, rng: np.random.Generator) -> dict[int, U8]:
    pools = {}
    for r in ranks:
        shape = (*layout.pool_shape(r), layout.itemsize)
        if fill is None:
            pools[r] = rng.integers(0, 256, size=shape, dtype=np.uint8)
        else:
            pools[r] = np.full(shape, fill, dtype=np.uint8)
    return pools


def write_request(pools: dict[int, U8], layout: KVLayout, blocks: dict[int, list[int]], logical: U8) -> None:
    """Write tokens [0, len(logical)) of the request into every named rank, by ownership."""
    t = np.arange(logical.shape[0])
    tpb = layout.tokens_per_block
    for r, ids in blocks.items():
        l0, l1 = layout.layer_range(r // layout.tp_size)
        h0, h1 = layout.head_range(r % layout.tp_size)
        view = canon_view(pools[r], layout)
        view[np.asarray(ids, dtype=np.int64)[t // tpb], :, :, :, t % tpb] = logical[:, l0:l1, :, h0:h1]


# -- strategies --------------------------------------------------------------------------------


@st.composite
def axis_orders(draw: st.DrawFn) -> tuple[str, ...]:
    kind = draw(st.sampled_from(["trt", "vllm", "random"]))
    if kind == "trt":
        return TRTLLM_AXIS_ORDER
    if kind == "vllm":
        return VLLM_AXIS_ORDER
    return (*draw(st.permutations(["block", "layer", "kv", "head", "token"])), "dim")


@st.composite
def side_layouts(
    draw: st.DrawFn, layers: int, heads: int, head_dim: int, dtype: str, tpb: int, nblk: int
) -> KVLayout:
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    pp = draw(st.integers(1, min(3, layers)))
    split: tuple[int, ...] | None = None
    if pp > 1 and (layers % pp or draw(st.booleans())):
        cuts = sorted(
            draw(st.lists(st.integers(1, layers - 1), min_size=pp - 1, max_size=pp - 1, unique=True))
        )
        bounds = [0, *cuts, layers]
        split = tuple(b - a for a, b in itertools.pairwise(bounds))
    return KVLayout(
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        tokens_per_block=tpb,
        dtype=dtype,
        tp_size=tp,
        pp_size=pp,
        attention_dp=draw(st.booleans()),
        layer_split=split,
        axis_order=draw(axis_orders()),
        num_blocks=nblk + draw(st.integers(0, 3)),
    )


@st.composite
def cases(draw: st.DrawFn) -> tuple[KVLayout, KVLayout, dict[int, list[int]], dict[int, list[int]], int]:
    layers = draw(st.integers(1, 5))
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    head_dim = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(["uint8", "bfloat16", "float32"]))
    base = draw(st.sampled_from([1, 2, 4]))
    mult = draw(st.sampled_from([1, 1, 2, 4]))
    tpb_c, tpb_g = (base * mult, base) if draw(st.booleans()) else (base, base * mult)
    tokens = draw(st.integers(1, 12))
    n_c, n_g = -(-tokens // tpb_c), -(-tokens // tpb_g)
    ctx = draw(side_layouts(layers, heads, head_dim, dtype, tpb_c, n_c))
    gen = draw(side_layouts(layers, heads, head_dim, dtype, tpb_g, n_g))

    def ranks(layout: KVLayout, one: bool) -> list[int]:
        if not layout.attention_dp:
            return list(range(layout.world_size))
        out = []
        for stage in range(layout.pp_size):
            stage_ranks = list(range(stage * layout.tp_size, (stage + 1) * layout.tp_size))
            if one:
                out.append(draw(st.sampled_from(stage_ranks)))
            else:
                out += draw(st.lists(st.sampled_from(stage_ranks), min_size=1, max_size=3, unique=True))
        return out

    def blocks(layout: KVLayout, rs: list[int], n: int) -> dict[int, list[int]]:
        return {r: draw(st.permutations(range(layout.num_blocks)))[:n] for r in rs}

    cb = blocks(ctx, ranks(ctx, one=True), n_c)
    gb = blocks(gen, ranks(gen, one=False), n_g)
    return ctx, gen, cb, gb, draw(st.integers(1, 2**32 - 1))


# -- the property ------------------------------------------------------------------------------


def check_fragments_sound(p: Any, gen: KVLayout) -> None:
    """Destination bytes written once; no two consecutive fragments mergeable; bytes per gen
    rank = what the rank owns of the request."""
    per_dst: dict[int, list[npt.NDArray[np.int64]]] = {}
    for s, d in p.pairs():
        f = p.fragments(s, d)
        assert f.dtype == np.int64 and f.ndim == 2 and f.shape[1] == 3 and len(f)
        assert (f[:, 2] > 0).all()
        merge = (f[1:, 0] == f[:-1, 0] + f[:-1, 2]) & (f[1:, 1] == f[:-1, 1] + f[:-1, 2])
        assert not merge.any(), f"pair {(s, d)}: mergeable fragments left"
        per_dst.setdefault(d, []).append(f)
    for d, fs in per_dst.items():
        f = np.concatenate(fs)
        order = np.argsort(f[:, 1], kind="stable")
        lo, n = f[order, 1], f[order, 2]
        assert (lo[:-1] + n[:-1] <= lo[1:]).all(), f"gen rank {d}: a destination byte is written twice"
        lay = gen.local_shape(d)
        want = p.num_tokens * lay["layer"] * 2 * lay["head"] * gen.head_dim * gen.itemsize
        assert int(n.sum()) == want == p.total_bytes(d=d)
    assert set(per_dst) == set(p.gen_blocks)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(case=cases(), chunk=st.sampled_from([1, 3, 8, 24, 64, 1000]))
def test_plan_matches_reference(
    case: tuple[KVLayout, KVLayout, dict[int, list[int]], dict[int, list[int]], int], chunk: int
) -> None:
    ctx, gen, cb, gb, seed = case
    rng = np.random.default_rng(seed)
    p = plan(ctx, gen, cb, gb)
    tokens = min(
        len(next(iter(cb.values()))) * ctx.tokens_per_block,
        len(next(iter(gb.values()))) * gen.tokens_per_block,
    )
    assert p.num_tokens == tokens

    logical = rng.integers(
        0, 256, size=(tokens, ctx.num_layers, 2, ctx.num_kv_heads, ctx.head_dim, ctx.itemsize), dtype=np.uint8
    )
    src = new_pools(ctx, cb, None, rng)
    write_request(src, ctx, cb, logical)  # every ctx replica holds the same request bytes
    src_before = {r: a.copy() for r, a in src.items()}
    want = new_pools(gen, gb, SENTINEL, rng)
    write_request(want, gen, gb, logical)

    check_fragments_sound(p, gen)

    # Direct application (numpy pools).
    got = new_pools(gen, gb, SENTINEL, rng)
    p.apply(src, got)
    for r in gb:
        np.testing.assert_array_equal(got[r], want[r], err_msg=f"apply: gen rank {r}")

    # Through the bounce stager (torch pools), with chunks small enough to split fragments.
    sched = schedule(p, chunk_bytes=chunk, bounce_size_mb=1)
    src_t = {r: torch.from_numpy(a) for r, a in src.items()}
    got = new_pools(gen, gb, SENTINEL, rng)
    got_t = {r: torch.from_numpy(a) for r, a in got.items()}
    bounce = torch.full((1 << 20,), 0x5A, dtype=torch.uint8)
    for s, d in sched.pairs():
        chunks = sched.chunks(s, d)
        assert [c.index for c in chunks] == list(range(len(chunks)))
        assert sum(c.nbytes for c in chunks) == p.total_bytes(s, d)
        for c in chunks:
            assert c.nbytes <= chunk
            region = bounce[c.bounce_offset : c.bounce_offset + chunk]
            gather(c, src_t[s], region)
            scatter(c, region, got_t[d])
    for r in gb:
        np.testing.assert_array_equal(got[r], want[r], err_msg=f"stager: gen rank {r}")
    for r in cb:
        np.testing.assert_array_equal(src[r], src_before[r], err_msg="source pool modified")


# -- named cases -------------------------------------------------------------------------------

GPT_OSS: dict[str, Any] = {
    "num_layers": 36,
    "num_kv_heads": 8,
    "head_dim": 64,
    "tokens_per_block": 32,
    "dtype": "bfloat16",
}


def oss(**kw: Any) -> KVLayout:
    return KVLayout(**{**GPT_OSS, "num_blocks": 1024, **kw})


def rand_blocks(layout: KVLayout, n: int = 256, seed: int = 0, ranks: Any = None) -> dict[int, list[int]]:
    rng = np.random.default_rng(seed)
    rs = range(layout.world_size) if ranks is None else ranks
    return {r: rng.choice(layout.num_blocks, n, replace=False).tolist() for r in rs}


def test_gpt_oss_tp1_to_tp4() -> None:
    ctx, gen = oss(), oss(tp_size=4)
    p = plan(ctx, gen, rand_blocks(ctx), rand_blocks(gen, seed=1))
    assert p.pairs() == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert p.src_ranks() == [0] and p.dst_ranks() == [0, 1, 2, 3]
    assert p.total_bytes() == 576 << 20
    for d in range(4):
        f = p.fragments(0, d)
        assert p.total_bytes(0, d) == p.total_bytes(d=d) == 144 << 20
        # one 8 KiB fragment (2 heads x 32 tokens x 64 dims x 2 bytes) per (block, layer, K/V)
        assert f.shape == (256 * 36 * 2, 3) and (f[:, 2] == 8192).all()
        assert not p.is_direct(0, d)
    assert p.num_fragments() == 73_728
    assert not p.direct


def test_gpt_oss_tp4_to_tp1_and_vllm() -> None:
    ctx, gen = oss(tp_size=4), oss(axis_order=VLLM_AXIS_ORDER)
    p = plan(ctx, gen, rand_blocks(ctx), rand_blocks(gen, seed=1))
    assert p.pairs() == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert p.num_fragments() == 73_728 and p.total_bytes() == 576 << 20


def test_equal_layouts_move_whole_blocks() -> None:
    ctx = oss()
    p = plan(ctx, ctx, {0: list(range(256))}, {0: list(range(512, 768))})
    assert p.direct and p.is_direct(0, 0)
    np.testing.assert_array_equal(p.fragments(0, 0), [[0, 512 * (2304 << 10), 576 << 20]])
    # Scattered block ids: one fragment per contiguous run of whole blocks.
    p = plan(ctx, ctx, {0: [5, 6, 7, 1, 9]}, {0: [0, 1, 2, 3, 4]})
    bb = ctx.block_bytes(0)
    np.testing.assert_array_equal(
        p.fragments(0, 0), [[5 * bb, 0, 3 * bb], [bb, 3 * bb, bb], [9 * bb, 4 * bb, bb]]
    )
    # vLLM order: a block is 72 (layer, K/V) slabs, consecutive blocks merge within a slab.
    v = oss(axis_order=VLLM_AXIS_ORDER, tp_size=2)
    p = plan(v, v, {0: list(range(10)), 1: list(range(10))}, {0: list(range(10)), 1: list(range(20, 30))})
    assert p.direct and p.pairs() == [(0, 0), (1, 1)] and p.num_fragments(0, 0) == 72


def test_gen_attention_dp_from_ctx_tp1_is_direct() -> None:
    ctx, gen = oss(), oss(tp_size=4, attention_dp=True)
    p = plan(ctx, gen, rand_blocks(ctx), {2: list(range(256))})
    assert p.pairs() == [(0, 2)] and p.direct and p.total_bytes() == 576 << 20


def test_tp_above_heads_reads_each_head_once_writes_every_replica() -> None:
    base: dict[str, Any] = {
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 4,
        "tokens_per_block": 4,
        "dtype": "float16",
        "num_blocks": 4,
    }
    ctx = KVLayout(**base, tp_size=8)  # 4 replicas of each head
    gen = KVLayout(**base, tp_size=1)
    p = plan(ctx, gen, {r: [0] for r in range(8)}, {0: [1]})
    assert len(p.src_ranks()) == 2  # one source per head
    gen8 = KVLayout(**base, tp_size=8)
    p = plan(gen, gen8, {0: [1]}, {r: [r % 4] for r in range(8)})
    assert p.dst_ranks() == list(range(8)) and p.src_ranks() == [0]
    p = plan(gen8, gen8, {r: [0] for r in range(8)}, {r: [1] for r in range(8)})
    assert p.pairs() == [(r, r) for r in range(8)] and p.direct


def test_pp_regroup_uneven_split() -> None:
    ctx = oss(pp_size=2, layer_split=(20, 16), tp_size=2)
    gen = oss(pp_size=3, tp_size=1)
    p = plan(ctx, gen, rand_blocks(ctx, 8), rand_blocks(gen, 8, seed=1))
    # gen stage 1 (layers 12..24) takes layers 12..20 from ctx stage 0 and 20..24 from stage 1.
    assert p.box(0, 1) is not None and p.box(0, 1).layers == (12, 20)  # type: ignore[union-attr]
    assert p.box(2, 1) is not None and p.box(2, 1).layers == (20, 24)  # type: ignore[union-attr]
    assert p.total_bytes() == 8 * (36 * 2 * 8 * 32 * 64 * 2)  # 8 blocks of every layer and head, once
    assert p.total_bytes(d=1) == 8 * (12 * 2 * 8 * 32 * 64 * 2)


def test_mixed_tokens_per_block() -> None:
    ctx = oss(tokens_per_block=64)
    gen = oss(tokens_per_block=32, tp_size=2)
    # 100 tokens: 2 ctx blocks (128 slots), 4 gen blocks (128 slots) -> 128 token slots move.
    p = plan(ctx, gen, {0: [3, 9]}, {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]})
    assert p.num_tokens == 128 and p.total_bytes() == 128 * 36 * 2 * 8 * 64 * 2
    # 90 tokens: 2 ctx blocks (128 slots) and 3 gen blocks (96 slots): the first 96 move.
    p = plan(ctx, gen, {0: [3, 9]}, {0: [0, 1, 2], 1: [4, 5, 6]})
    assert p.num_tokens == 96


def test_empty_request_moves_nothing() -> None:
    ctx = oss()
    p = plan(ctx, ctx, {0: []}, {0: []})
    assert p.pairs() == [] and p.total_bytes() == 0 and p.fragments(0, 0).shape == (0, 3) and not p.direct


def test_reexports_layout() -> None:
    import kvd.regroup.plan
    import protocol.layout

    assert kvd.regroup.plan.KVLayout is protocol.layout.KVLayout


# -- rejections --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "a", "b"),
    [("head_dim", 64, 128), ("dtype", "bfloat16", "float16"), ("num_layers", 36, 24), ("num_kv_heads", 8, 4)],
)
def test_incompatible_fields(field: str, a: Any, b: Any) -> None:
    with pytest.raises(IncompatibleLayout, match=rf"{field} differs: ctx {field}={a!r}, gen {field}={b!r}"):
        plan(oss(**{field: a}), oss(**{field: b}), {0: [0]}, {0: [0]})


def test_incompatible_tokens_per_block() -> None:
    with pytest.raises(
        IncompatibleLayout, match=r"tokens_per_block.*ctx tokens_per_block=48, gen tokens_per_block=32"
    ):
        plan(oss(tokens_per_block=48), oss(), {0: [0]}, {0: [0]})


@pytest.mark.parametrize(
    ("ctx_blocks", "gen_blocks", "match"),
    [
        ({0: [0, 1024]}, {0: [0, 1]}, r"ctx rank 0: block id 1024 out of range \[0, 1024\)"),
        ({0: [0, 1]}, {0: [-1, 1]}, r"gen rank 0: block id -1 out of range"),
        ({0: [3, 3]}, {0: [0, 1]}, r"ctx rank 0: duplicate block id 3"),
        (
            {0: [0, 1]},
            {0: [0]},
            r"different token counts: ctx has 2 blocks x 32 tokens = 64 token slots, gen has 1 blocks x 32 "
            r"tokens = 32; each rank registers the blocks of the same tokens: for ctx's 2 blocks a gen rank "
            r"registers 2, for gen's 1 a ctx rank registers 1",
        ),
        ({0: [0], 1: [1]}, {0: [0]}, r"ctx_blocks names rank 1, outside the layout's ranks \[0, 1\)"),
        ({}, {0: [0]}, r"ctx_blocks names no rank"),
        ({0: [0.5]}, {0: [0]}, r"ctx rank 0: block ids must be a flat sequence of integers"),
        ({0: [[0]]}, {0: [0]}, r"ctx rank 0: block ids must be a flat sequence of integers"),
    ],
)
def test_bad_blocks(ctx_blocks: Any, gen_blocks: Any, match: str) -> None:
    with pytest.raises(BadRequest, match=match):
        plan(oss(), oss(), ctx_blocks, gen_blocks)


@pytest.mark.parametrize(
    ("gen_blocks", "match"),
    [
        ({0: [-1, 1]}, r"gen rank 0: block id -1 out of range"),
        ({0: [3, 3]}, r"gen rank 0: duplicate block id 3"),
        ({0: [0], 1: [1]}, r"gen_blocks names rank 1, outside the layout's ranks \[0, 1\)"),
    ],
)
def test_check_blocks_refuses_what_plan_refuses(gen_blocks: Any, match: str) -> None:
    with pytest.raises(BadRequest, match=match):
        check_blocks("gen", oss(), gen_blocks)


def test_a_side_checked_ahead_plans_the_same() -> None:
    """gen's announced side, checked when it arrives, plans exactly as the raw ids do."""
    ctx, gen = oss(), oss(tp_size=4)
    cb = {0: [5, 2, 9]}
    gb = {r: [7 - r, 3, 11 + r] for r in range(4)}
    checked = check_blocks("gen", gen, gb)
    assert isinstance(checked, CheckedBlocks)
    a, b = plan(ctx, gen, cb, gb), plan(ctx, gen, cb, checked)
    assert a.pairs() == b.pairs() and a.total_bytes() == b.total_bytes()
    for pair in a.pairs():
        assert np.array_equal(a.fragments(*pair), b.fragments(*pair))
    assert all(np.array_equal(a.gen_offsets[r], b.gen_offsets[r]) for r in range(4))


def test_a_side_checked_against_another_layout_is_checked_again() -> None:
    """Checked against a pool of 1024 blocks, id 100 is fine; planned with a layout of 64
    blocks it is refused, as if never checked."""
    small = oss(tp_size=4, num_blocks=64)
    checked = check_blocks("gen", oss(tp_size=4), {r: [100] for r in range(4)})
    with pytest.raises(BadRequest, match=r"gen rank 0: block id 100 out of range \[0, 64\)"):
        plan(oss(), small, {0: [0]}, checked)


def test_missing_rank_and_uneven_counts() -> None:
    gen = oss(tp_size=2, pp_size=2)
    with pytest.raises(BadRequest, match=r"gen_blocks lacks rank\(s\) \[3\]: every rank"):
        plan(oss(), gen, {0: [0]}, {0: [0], 1: [0], 2: [0]})
    with pytest.raises(
        BadRequest, match=r"gen ranks hold different numbers of blocks \{0: 1, 1: 1, 2: 2, 3: 1\}"
    ):
        plan(oss(), gen, {0: [0]}, {0: [0], 1: [0], 2: [0, 1], 3: [0]})


def test_attention_dp_rank_rules() -> None:
    dp = oss(tp_size=4, attention_dp=True, pp_size=2)
    with pytest.raises(
        BadRequest, match=r"ctx_blocks names ranks \[0, 1\] of PP stage 0; with ctx attention DP"
    ):
        plan(dp, oss(), {0: [0], 1: [0], 4: [0]}, {0: [0]})
    with pytest.raises(BadRequest, match=r"gen_blocks names no rank of PP stage 1"):
        plan(oss(), dp, {0: [0]}, {0: [0]})
    p = plan(dp, oss(), {2: [0], 5: [0]}, {0: [1]})
    assert p.pairs() == [(2, 0), (5, 0)]


def test_zero_num_blocks_rejected() -> None:
    with pytest.raises(BadRequest, match=r"ctx layout has num_blocks=0; the planner needs the pool size"):
        plan(KVLayout(**GPT_OSS), oss(), {0: [0]}, {0: [0]})


def test_direct_apply_torch_matches_numpy() -> None:
    lay: dict[str, Any] = {
        "num_layers": 3,
        "num_kv_heads": 4,
        "head_dim": 8,
        "tokens_per_block": 4,
        "dtype": "bfloat16",
        "num_blocks": 6,
    }
    ctx, gen = KVLayout(**lay, tp_size=2), KVLayout(**lay, tp_size=4, axis_order=VLLM_AXIS_ORDER)
    p = plan(ctx, gen, {0: [1, 4], 1: [5, 0]}, {r: [r, 5 - r] for r in range(4)})
    rng = np.random.default_rng(3)
    src = {r: rng.integers(0, 256, ctx.pool_bytes(r), dtype=np.uint8) for r in range(2)}
    a = {r: np.zeros(gen.pool_bytes(r), dtype=np.uint8) for r in range(4)}
    b = {
        r: torch.zeros(gen.pool_shape(r), dtype=torch.bfloat16) for r in range(4)
    }  # any dtype, viewed as bytes
    p.apply(src, a)
    p.apply({r: torch.from_numpy(v) for r, v in src.items()}, b)
    for r in range(4):
        assert bytes(a[r]) == b[r].view(torch.uint8).numpy().tobytes()
    assert math.prod(gen.pool_shape(0)) * 2 == gen.pool_bytes(0)


# -- the all-ranks-at-once validation against the per-rank one ------------------------------------

#: what may replace one id of a valid request: out of range, a duplicate, wrong types
_BAD_ID = st.sampled_from([-1, 12, 0, 0.5, True, "1", None, 2**64, [0]])
_LAYOUTS = [{}, {"tp_size": 4}, {"tp_size": 2, "pp_size": 2}, {"tp_size": 4, "attention_dp": True},
            {"tp_size": 2, "pp_size": 2, "attention_dp": True}]


@st.composite
def _side_blocks(draw: Any, layout: KVLayout) -> Any:
    """A valid side of a request for ``layout`` (lists, or arrays of some integer dtype), then
    often broken one way: a bad id, a rank of bools, a rank too many or missing, odd keys."""
    tp = layout.tp_size
    if layout.attention_dp:
        ranks = sorted({s * tp + draw(st.integers(0, tp - 1)) for s in range(layout.pp_size) for _ in range(2)})
    else:
        ranks = list(range(layout.world_size))
    n = draw(st.integers(1, 4))
    blocks: dict[Any, Any] = {r: draw(st.lists(st.integers(0, 11), min_size=n, max_size=n, unique=True)) for r in ranks}
    kind = draw(st.sampled_from(["list", "int64", "int16", "uint8", "float32"]))
    if kind != "list":
        blocks = {r: np.array(v, dtype=kind) for r, v in blocks.items()}
    r = draw(st.sampled_from(ranks))
    match draw(st.integers(0, 9)):
        case 0:
            ids = list(blocks[r])
            ids[draw(st.integers(0, n - 1))] = draw(_BAD_ID)
            blocks[r] = ids
        case 1:
            blocks[r] = [True] * n
        case 2:
            blocks[r] = [*blocks[r], int(blocks[r][0])]
        case 3:
            del blocks[r]
        case 4:
            blocks[draw(st.sampled_from([layout.world_size, -1, True, np.int64(0)]))] = blocks[r]
        case 5:
            blocks[r] = tuple(int(x) for x in blocks[r])
    return blocks


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), side=st.sampled_from(["ctx", "gen"]), layout_kw=st.sampled_from(_LAYOUTS))
def test_validation_at_once_agrees_with_rank_by_rank(data: Any, side: str, layout_kw: dict[str, Any]) -> None:
    """The fast path over all ranks (one matrix) accepts exactly what the per-rank check
    accepts, with the same int64 ids; whatever it declines, the per-rank check refuses with
    the same message as before, through check_blocks and plan alike."""
    from kvd.regroup import plan as planner

    layout = KVLayout(**{**GPT_OSS, "num_blocks": 12, **layout_kw})
    blocks = data.draw(_side_blocks(layout))
    try:
        want: dict[int, Any] | None = planner._check_blocks_each(side, layout, blocks)
        error = ""
    except BadRequest as exc:
        want, error = None, str(exc)
    fast = planner._check_blocks_at_once(side, layout, blocks)
    if fast is not None:
        assert want is not None, f"fast path accepted what the per-rank check refuses: {error}"
        arrays, matrix = fast
        assert list(arrays) == list(want) and matrix.dtype == np.int64
        for i, (r, ids) in enumerate(arrays.items()):
            assert ids.dtype == np.int64 and np.array_equal(ids, want[r]) and np.array_equal(matrix[i], ids)
    if want is None:
        with pytest.raises(BadRequest) as info:
            check_blocks(side, layout, blocks)
        assert str(info.value) == error
    else:
        got = check_blocks(side, layout, blocks).arrays
        assert list(got) == list(want) and all(np.array_equal(got[r], want[r]) for r in want)
