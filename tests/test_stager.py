"""The bounce stager: chunk cutting, 2D-copy grouping, gather/scatter on odd alignments.

End-to-end correctness against the reference regroup is in test_plan.py
(``test_plan_matches_reference`` runs every plan through gather/scatter with tiny chunks).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.regroup.plan import KVLayout, plan
from kvd.regroup.stager import Chunk, Stager, _copy2d, _cut, elem_width, gather, scatter, schedule

I64 = npt.NDArray[np.int64]


def frags_from(lengths: list[int], seed: int) -> I64:
    rng = np.random.default_rng(seed)
    n = np.asarray(lengths, dtype=np.int64)
    src = rng.permutation(np.cumsum(n) - n) * 3 + 7  # arbitrary, non-overlapping
    dst = np.cumsum(n) - n + 11
    return np.stack([src, dst, n], axis=1).astype(np.int64)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    chunk=st.integers(1, 500),
    seed=st.integers(0, 99),
)
def test_cut_packs_stream_exactly(lengths: list[int], chunk: int, seed: int) -> None:
    frags = frags_from(lengths, seed)
    chunks = _cut(frags, chunk)
    total = int(frags[:, 2].sum())
    assert len(chunks) == -(-total // chunk)
    for i, c in enumerate(chunks):
        nb = int(c[:, 2].sum())
        assert nb == (chunk if i < len(chunks) - 1 else total - chunk * (len(chunks) - 1))
        np.testing.assert_array_equal(c[:, 3], np.cumsum(c[:, 2]) - c[:, 2])  # packed in order
    # Re-expanding every piece byte by byte gives back every fragment byte in order.
    pieces = np.concatenate(chunks)
    want_src = np.concatenate([np.arange(o, o + n) for o, _, n in frags])
    want_dst = np.concatenate([np.arange(o, o + n) for _, o, n in frags])
    np.testing.assert_array_equal(np.concatenate([np.arange(o, o + n) for o, _, n, _ in pieces]), want_src)
    np.testing.assert_array_equal(np.concatenate([np.arange(o, o + n) for _, o, n, _ in pieces]), want_dst)


@settings(max_examples=200, deadline=None)
@given(
    runs=st.lists(
        st.tuples(st.integers(1, 6), st.sampled_from([4, 8]), st.sampled_from([8, 16, 24, 100])),
        min_size=1,
        max_size=12,
    ),
    seed=st.integers(0, 99),
)
def test_copy2d_reproduces_pieces(runs: list[tuple[int, int, int]], seed: int) -> None:
    rng = np.random.default_rng(seed)
    off, width = [], []
    for height, w, pitch in runs:
        base = int(rng.integers(0, 10_000))
        off += [base + j * pitch for j in range(height)]
        width += [w] * height
    o, w_ = np.asarray(off, dtype=np.int64), np.asarray(width, dtype=np.int64)
    b = np.cumsum(w_) - w_
    c2 = _copy2d(o, w_, b)
    assert int(c2[:, 4].sum()) == o.size
    # Expand the 2D copies row by row.
    rows = [(po + j * pp, bo + j * wd, wd) for po, pp, bo, wd, h in c2 for j in range(h)]
    assert rows == list(zip(o.tolist(), b.tolist(), w_.tolist(), strict=True))
    # No more copies than runs of the generator (pitch breaks between runs cost nothing extra).
    assert len(c2) <= len(runs)


def test_copy2d_gpt_oss_is_one_copy_per_block() -> None:
    lay: dict[str, Any] = {
        "num_layers": 36,
        "num_kv_heads": 8,
        "head_dim": 64,
        "tokens_per_block": 32,
        "dtype": "bfloat16",
        "num_blocks": 1024,
    }
    rng = np.random.default_rng(0)
    p = plan(
        KVLayout(**lay),
        KVLayout(**lay, tp_size=4),
        {0: rng.permutation(1024)[:256]},
        {r: rng.permutation(1024)[:256] for r in range(4)},
    )
    sched = schedule(p)  # 64 MiB chunks, 512 MiB bounce: 8 slots
    assert sched.slots == 8 and sched.num_chunks() == 12
    for d in range(4):
        cs = sched.chunks(0, d)
        assert [c.nbytes for c in cs] == [64 << 20, 64 << 20, 16 << 20]
        assert [c.slot for c in cs] == [(3 * d + i) % 8 for i in range(3)]
        src2d = np.concatenate([c.copy2d("src") for c in cs])
        dst2d = np.concatenate([c.copy2d("dst") for c in cs])
        # gather: 72 rows of 8 KiB at a 32 KiB pitch per block (+1 per chunk boundary cutting a block)
        assert 256 <= len(src2d) <= 256 + 2 and set(src2d[:, 1]) <= {32768, 8192}
        # scatter: a gen block is contiguous (pitch == width)
        assert 256 <= len(dst2d) <= 256 + 2 and (dst2d[:, 1] == dst2d[:, 3]).all()


def test_gather_scatter_odd_alignment_and_dtypes() -> None:
    lay: dict[str, Any] = {
        "num_layers": 2,
        "num_kv_heads": 4,
        "head_dim": 8,
        "tokens_per_block": 4,
        "dtype": "float32",
        "num_blocks": 5,
    }
    ctx, gen = KVLayout(**lay, tp_size=1), KVLayout(**lay, tp_size=2)
    p = plan(ctx, gen, {0: [4, 0, 2]}, {0: [1, 2, 3], 1: [3, 4, 0]})
    src = torch.randn(ctx.pool_shape(0))  # float32 pool, viewed as bytes
    want = {r: torch.zeros(gen.pool_shape(r)) for r in range(2)}
    p.apply({0: src}, want)
    got = {r: torch.zeros(gen.pool_shape(r)) for r in range(2)}
    raw = torch.zeros(4096 + 3, dtype=torch.uint8)
    bounce = raw[3:]  # storage offset 3: rows cannot be viewed wider than bytes
    sched = schedule(p, chunk_bytes=1000, bounce_size_mb=1)
    for c in sched.all_chunks():
        st_ = c.stager("cpu")
        assert st_ is c.stager("cpu")  # cached
        assert elem_width(st_.src_row, src, bounce) == 1
        gather(c, src, bounce)
        scatter(c, bounce, got[c.dst])
    for r in range(2):
        assert torch.equal(got[r], want[r])
    # Cached views follow the tensors passed: a second bounce and fresh pools work too.
    other = torch.zeros(4096, dtype=torch.uint8)
    got2 = {r: torch.zeros(gen.pool_shape(r)) for r in range(2)}
    for c in sched.all_chunks():
        gather(c, src, other)
        scatter(c, other, got2[c.dst])
        gather(c, src, bounce)  # back to the first bounce
        assert torch.equal(bounce[: c.nbytes], other[: c.nbytes])
    for r in range(2):
        assert torch.equal(got2[r], want[r])


def test_stager_rejects_short_bounce_and_bad_schedule() -> None:
    lay: dict[str, Any] = {
        "num_layers": 1,
        "num_kv_heads": 1,
        "head_dim": 4,
        "tokens_per_block": 2,
        "dtype": "uint8",
        "num_blocks": 2,
    }
    p = plan(KVLayout(**lay), KVLayout(**lay), {0: [0, 1]}, {0: [1, 0]})
    (c,) = schedule(p).all_chunks()
    with pytest.raises(ValueError, match=r"bounce region holds 31 bytes, chunk needs 32"):
        Stager(c).gather(torch.zeros(32, dtype=torch.uint8), torch.zeros(31, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"chunk_bytes=2097152 exceeds the bounce buffer \(1 MiB\)"):
        schedule(p, chunk_bytes=2 << 20, bounce_size_mb=1)
    with pytest.raises(ValueError, match=r"chunk_bytes must be positive"):
        schedule(p, chunk_bytes=0)


def test_empty_chunk_is_a_no_op() -> None:
    c = Chunk(0, 0, 0, np.zeros((0, 4), dtype=np.int64), 0)
    pool = torch.ones(8, dtype=torch.uint8)
    gather(c, pool, torch.zeros(0, dtype=torch.uint8))
    scatter(c, torch.zeros(0, dtype=torch.uint8), pool)
    assert c.copy2d().shape == (0, 5) and bool((pool == 1).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gather_scatter_cuda() -> None:
    lay: dict[str, Any] = {
        "num_layers": 4,
        "num_kv_heads": 8,
        "head_dim": 64,
        "tokens_per_block": 16,
        "dtype": "bfloat16",
        "num_blocks": 16,
    }
    ctx, gen = KVLayout(**lay), KVLayout(**lay, tp_size=4)
    p = plan(ctx, gen, {0: list(range(8))}, {r: list(range(8, 16)) for r in range(4)})
    src = torch.randint(0, 256, (ctx.pool_bytes(0),), dtype=torch.uint8, device="cuda")
    want = {r: torch.zeros(gen.pool_bytes(r), dtype=torch.uint8, device="cuda") for r in range(4)}
    got = {r: torch.zeros(gen.pool_bytes(r), dtype=torch.uint8, device="cuda") for r in range(4)}
    p.apply({0: src}, want)
    bounce = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    for c in schedule(p, chunk_bytes=1 << 16, bounce_size_mb=1).all_chunks():
        gather(c, src, bounce)
        scatter(c, bounce, got[c.dst])
    for r in range(4):
        assert torch.equal(got[r], want[r])
