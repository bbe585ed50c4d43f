"""kvd.regroup.gpu_copy on the CPU: grouping fragments into 2D copies, the raw struct layouts, errors.

The GPU runs of the same copies are in tests/gpu/test_gpu_copy.py. Here the copy tables are
executed by a numpy model of ``cuMemcpy2D`` (row ``j`` of a copy moves ``width`` bytes from
``src + j * src_pitch`` to ``dst + j * dst_pitch``) and must reproduce :meth:`Plan.apply`.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.regroup import gpu_copy
from kvd.regroup.gpu_copy import (
    DST,
    DST_PITCH,
    HEIGHT,
    MAX_PITCH,
    SRC,
    SRC_PITCH,
    WIDTH,
    chunk_copies,
    expand_2d,
    group_2d,
    pair_copies,
)
from kvd.regroup.plan import KVLayout, Plan, plan
from kvd.regroup.stager import schedule
from protocol.errors import TransferError
from protocol.layout import VLLM_AXIS_ORDER

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]


def bytes_of(offsets: I64, widths: I64) -> I64:
    """Every byte address of the pieces (offsets[i], widths[i]), in order."""
    if offsets.size == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(o, o + w, dtype=np.int64) for o, w in zip(offsets, widths, strict=True)])


def check_table(copies: I64, src: I64, dst: I64, width: I64, max_pitch: int = MAX_PITCH) -> None:
    """``copies`` moves exactly the input's bytes in the input's order, with legal pitches."""
    assert copies.dtype == np.int64 and copies.ndim == 2 and copies.shape[1] == 6
    assert (copies[:, WIDTH] > 0).all() and (copies[:, HEIGHT] > 0).all()
    tall = copies[:, HEIGHT] > 1
    for col in (SRC_PITCH, DST_PITCH):
        assert (copies[tall, col] >= copies[tall, WIDTH]).all()
        assert (copies[tall, col] <= max_pitch).all()
    rows = expand_2d(copies)
    np.testing.assert_array_equal(bytes_of(rows[:, 0], rows[:, 2]), bytes_of(src, width))
    np.testing.assert_array_equal(bytes_of(rows[:, 1], rows[:, 2]), bytes_of(dst, width))


def run_copies(copies: I64, src: U8, dst: U8, src_base: int = 0, dst_base: int = 0) -> None:
    """The numpy model of the copy engine: execute a copy table on flat uint8 buffers."""
    for so, sp, do, dp, w, h in copies.tolist():
        for j in range(h):
            s, d = src_base + so + j * sp, dst_base + do + j * dp
            dst[d : d + w] = src[s : s + w]


# -- group_2d ----------------------------------------------------------------------------------


@st.composite
def copy_lists(draw: st.DrawFn) -> tuple[I64, I64, I64]:
    """Runs of equal-width pieces at constant (possibly negative, small or equal) pitches."""
    src: list[int] = []
    dst: list[int] = []
    width: list[int] = []
    s, d = draw(st.integers(0, 10_000)), draw(st.integers(0, 10_000))
    for _ in range(draw(st.integers(1, 8))):
        w = draw(st.sampled_from([1, 4, 8, 16]))
        sp = draw(st.sampled_from([-64, -16, 0, 4, 8, 16, 32, 100]))
        dp = draw(st.sampled_from([-32, 4, 8, 16, 24, 64]))
        for _ in range(draw(st.integers(1, 6))):
            src.append(s)
            dst.append(d)
            width.append(w)
            s += sp
            d += dp
        s += draw(st.integers(-50, 200))
        d += draw(st.integers(-50, 200))
    return (
        np.asarray(src, dtype=np.int64),
        np.asarray(dst, dtype=np.int64),
        np.asarray(width, dtype=np.int64),
    )


@settings(max_examples=300, deadline=None)
@given(case=copy_lists(), max_pitch=st.sampled_from([MAX_PITCH, 16, 33]))
def test_group_2d_expands_to_its_input(case: tuple[I64, I64, I64], max_pitch: int) -> None:
    src, dst, width = case
    copies = group_2d(src, dst, width, max_pitch=max_pitch)
    check_table(copies, src, dst, width, max_pitch)
    assert len(copies) <= len(src)


def test_group_2d_regular_runs() -> None:
    # 3 runs: 5 x 8 bytes at pitches (32, 8) [-> 2D]; 4 x 8 contiguous on both sides [-> 1D of
    # 32]; 3 x 16 at a negative source pitch [-> 3 copies]; zero widths dropped.
    src = [0, 32, 64, 96, 128, 1000, 1008, 1016, 1024, 5000, 4900, 4800, 7000]
    dst = [0, 8, 16, 24, 32, 100, 108, 116, 124, 200, 216, 232, 300]
    width = [8] * 9 + [16] * 3 + [0]
    copies = group_2d(src, dst, width)
    assert copies.tolist() == [
        [0, 32, 0, 8, 8, 5],
        [1000, 32, 100, 32, 32, 1],
        [5000, 16, 200, 16, 16, 1],
        [4900, 16, 216, 16, 16, 1],
        [4800, 16, 232, 16, 16, 1],
    ]
    assert group_2d([], [], []).shape == (0, 6)
    with pytest.raises(ValueError, match="same length"):
        group_2d([0], [0, 1], [1])


def test_group_2d_splits_pitches_above_max() -> None:
    src = np.arange(4, dtype=np.int64) * (MAX_PITCH + 1)
    dst = np.arange(4, dtype=np.int64) * 64
    copies = group_2d(src, dst, np.full(4, 64, dtype=np.int64))
    assert len(copies) == 4
    check_table(copies, src, dst, np.full(4, 64, dtype=np.int64))


# -- plans -------------------------------------------------------------------------------------

SMALL: dict[str, Any] = {
    "num_layers": 4,
    "num_kv_heads": 8,
    "head_dim": 16,
    "tokens_per_block": 4,
    "dtype": "bfloat16",
}


def layouts(case: str, nblk: int) -> tuple[KVLayout, KVLayout]:
    g: dict[str, Any] = dict(SMALL, num_blocks=nblk)
    if case == "tp1_tp4":
        return KVLayout(**g), KVLayout(**g, tp_size=4)
    if case == "tp4_tp1":
        return KVLayout(**g, tp_size=4), KVLayout(**g)
    if case == "pp2_pp1":
        return KVLayout(**g, pp_size=2), KVLayout(**g)
    if case == "equal":
        return KVLayout(**g, tp_size=2), KVLayout(**g, tp_size=2)
    if case == "vllm_tp2_tp1":
        return KVLayout(**g, tp_size=2, axis_order=VLLM_AXIS_ORDER), KVLayout(**g)
    if case == "tp16_tp2":  # replicated heads on the ctx side
        return KVLayout(**g, tp_size=16), KVLayout(**g, tp_size=2)
    if case == "tpb_mix":
        return KVLayout(**g), KVLayout(**dict(g, tokens_per_block=8), tp_size=4)
    raise AssertionError(case)


CASES = ["tp1_tp4", "tp4_tp1", "pp2_pp1", "equal", "vllm_tp2_tp1", "tp16_tp2", "tpb_mix"]


def make_plan(case: str, nreq: int = 5, nblk: int = 12, seed: int = 0) -> Plan:
    ctx, gen = layouts(case, nblk)
    rng = np.random.default_rng(seed)
    n_c = nreq
    n_g = -(-nreq * ctx.tokens_per_block // gen.tokens_per_block)
    cb = {r: rng.choice(nblk, n_c, replace=False) for r in range(ctx.world_size)}
    gb = {r: rng.choice(nblk, n_g, replace=False) for r in range(gen.world_size)}
    return plan(ctx, gen, cb, gb)


def pools(p: Plan, rng: np.random.Generator) -> tuple[dict[int, U8], dict[int, U8]]:
    src = {r: rng.integers(0, 256, size=p.ctx.pool_bytes(r), dtype=np.uint8) for r in p.ctx_blocks}
    dst = {r: np.full(p.gen.pool_bytes(r), 0xA5, dtype=np.uint8) for r in p.gen_blocks}
    return src, dst


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_pair_copies_reproduce_apply(case: str, seed: int) -> None:
    p = make_plan(case, seed=seed)
    rng = np.random.default_rng(seed)
    src, want = pools(p, rng)
    got = {r: a.copy() for r, a in want.items()}
    p.apply(src, want)
    for s, d in p.pairs():
        c = pair_copies(p, s, d)
        assert pair_copies(p, s, d) is c  # cached
        f = p.fragments(s, d)
        check_table(c.table, f[:, 0], f[:, 1], f[:, 2])
        assert c.nbytes == p.total_bytes(s, d) and len(c) <= len(f)
        assert c.bytes_per_copy == c.nbytes / len(c)
        run_copies(c.table, src[s], got[d])
    for r in want:
        np.testing.assert_array_equal(got[r], want[r], err_msg=f"gen rank {r}")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk_bytes", [512, 4096, 1 << 20])
def test_chunk_copies_reproduce_apply(case: str, chunk_bytes: int) -> None:
    p = make_plan(case, seed=3)
    rng = np.random.default_rng(3)
    src, want = pools(p, rng)
    got = {r: a.copy() for r, a in want.items()}
    p.apply(src, want)
    sched = schedule(p, chunk_bytes=chunk_bytes, bounce_size_mb=1)
    bounce = np.zeros(sched.bounce_bytes, dtype=np.uint8)
    for ch in sched.all_chunks():
        g, s = chunk_copies(ch, "gather"), chunk_copies(ch, "scatter")
        assert chunk_copies(ch, "gather") is g
        pc = ch.pieces
        check_table(g.table, pc[:, 0], pc[:, 3], pc[:, 2])
        check_table(s.table, pc[:, 3], pc[:, 1], pc[:, 2])
        assert g.nbytes == s.nbytes == ch.nbytes
        run_copies(g.table, src[ch.src], bounce, dst_base=ch.bounce_offset)
        run_copies(s.table, bounce, got[ch.dst], src_base=ch.bounce_offset)
    for r in want:
        np.testing.assert_array_equal(got[r], want[r], err_msg=f"gen rank {r}")
    with pytest.raises(ValueError, match="gather"):
        chunk_copies(sched.all_chunks()[0], "both")  # type: ignore[arg-type]


def test_gather_copies_no_more_than_stager_copy2d() -> None:
    # Where pool offsets only increase, the grouping is the stager's copy2d (or fewer copies,
    # where rows contiguous on both sides become one 1D copy).
    ctx, gen = layouts("tp1_tp4", 40)
    p = plan(ctx, gen, {0: np.arange(3, 33)}, {r: np.arange(40)[r : r + 30] for r in range(4)})
    for ch in schedule(p, chunk_bytes=16384, bounce_size_mb=1).all_chunks():
        ours = chunk_copies(ch, "gather").table
        theirs = ch.copy2d("src")
        assert len(ours) <= len(theirs)
        tall = ours[:, HEIGHT] > 1
        if not tall.all():
            continue
        np.testing.assert_array_equal(ours[:, [SRC, SRC_PITCH, DST, WIDTH, HEIGHT]], theirs)


GPT_OSS_120B: dict[str, Any] = {
    "num_layers": 36,
    "num_kv_heads": 8,
    "head_dim": 64,
    "tokens_per_block": 32,
    "dtype": "bfloat16",
}


def test_gpt_oss_tp1_tp4_is_one_copy_per_block() -> None:
    ctx = KVLayout(**GPT_OSS_120B, num_blocks=1024)
    gen = KVLayout(**GPT_OSS_120B, tp_size=4, num_blocks=1024)
    rng = np.random.default_rng(0)
    cb = {0: rng.choice(1024, 256, replace=False)}
    gb = {r: rng.choice(1024, 256, replace=False) for r in range(4)}
    p = plan(ctx, gen, cb, gb)
    for s, d in p.pairs():
        c = pair_copies(p, s, d)
        assert len(c) == 256  # random block ids: one 2D copy per block
        assert set(c.table[:, WIDTH].tolist()) == {8192}
        assert set(c.table[:, HEIGHT].tolist()) == {72}
        assert set(c.table[:, SRC_PITCH].tolist()) == {32768}
        assert set(c.table[:, DST_PITCH].tolist()) == {8192}
    sched = schedule(p)
    total = sum(len(chunk_copies(ch, "gather")) for ch in sched.all_chunks())
    assert total <= 1024 + sched.num_chunks()  # a block cut by a chunk boundary costs one more
    # Consecutive block ids on both sides: the copies run on across blocks.
    p2 = plan(ctx, gen, {0: np.arange(256)}, {r: np.arange(256) + 256 for r in range(4)})
    assert [len(pair_copies(p2, s, d)) for s, d in p2.pairs()] == [1, 1, 1, 1]
    assert all(
        pair_copies(p2, s, d).bytes_per_copy >= gpu_copy.COPY_ENGINE_MIN_COPY_BYTES for s, d in p2.pairs()
    )
    assert gpu_copy.Copies2D(np.zeros((0, 6), dtype=np.int64)).bytes_per_copy == 0.0


# -- raw struct layouts against cuda-python's structs -------------------------------------------


def raw_bytes(obj: Any, n: int) -> bytes:
    return ctypes.string_at(obj.getPtr(), n)


def sample_table() -> I64:
    return np.array([[0, 32768, 64, 8192, 8192, 72], [1 << 33, 100, 5, 300, 7, 3]], dtype=np.int64)


def test_memcpy2d_records_match_cuda_python() -> None:
    t = sample_table()
    rec = gpu_copy._memcpy2d_records(t, 0x7F00_0000_0000, 0x7E00_0000_1000)
    py = gpu_copy._py_memcpy2d(t, 0x7F00_0000_0000, 0x7E00_0000_1000)
    assert rec.dtype.itemsize == 128
    for i, m in enumerate(py):
        assert rec[i : i + 1].tobytes() == raw_bytes(m, 128)


def test_batch_op_records_match_cuda_python() -> None:
    t = sample_table()
    rec = gpu_copy._batch_op_records(t, 0x7F00_0000_0000, 0x1000)
    py = gpu_copy._py_batch_ops(t, 0x7F00_0000_0000, 0x1000)
    assert rec.dtype.itemsize == 112
    for i, op in enumerate(py):
        assert rec[i : i + 1].tobytes() == raw_bytes(op, 112)


def test_memcpy_attrs_record_matches_cuda_python() -> None:
    from cuda.bindings import driver as cu

    a = cu.CUmemcpyAttributes()
    a.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    assert gpu_copy._attrs_record().tobytes() == raw_bytes(a, 24)


# -- errors and CPU behaviour ------------------------------------------------------------------


def test_check_raises_transfer_error_with_cuda_name() -> None:
    from cuda.bindings import driver as cu

    with pytest.raises(TransferError, match=r"cuMemcpy2DAsync: CUDA_ERROR_INVALID_VALUE"):
        gpu_copy._check((cu.CUresult.CUDA_ERROR_INVALID_VALUE,), "cuMemcpy2DAsync")
    with pytest.raises(TransferError, match=r"cuMemcpyBatchAsync: CUDA_ERROR_INVALID_VALUE"):
        gpu_copy._raise_rc(1, "cuMemcpyBatchAsync")
    assert gpu_copy._check((cu.CUresult.CUDA_SUCCESS, 7), "x") == 7
    assert gpu_copy._check((cu.CUresult.CUDA_SUCCESS,), "x") is None


def test_import_does_not_load_cuda() -> None:
    code = "import sys, kvd.regroup.gpu_copy; sys.exit('cuda.bindings.driver' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_unavailable_without_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert gpu_copy.available(0) is False
    with pytest.raises(TransferError):
        gpu_copy.CopyStream(0)


def emulated_submit(
    self: gpu_copy.Copies2D, src_base: int, dst_base: int, stream: Any, method: str = "auto"
) -> None:
    """The copy engine emulated on host memory: ctypes.memmove per row, at real addresses."""
    for so, sp, do, dp, w, h in self.table.tolist():
        for j in range(h):
            ctypes.memmove(dst_base + do + j * dp, src_base + so + j * sp, w)


@pytest.mark.parametrize("case", CASES)
def test_entry_points_address_arithmetic(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # gather_2d / scatter_2d / apply_pair_2d on host tensors with the submission emulated:
    # checks which base goes where (pool, bounce region) against Plan.apply.
    import torch

    monkeypatch.setattr(gpu_copy.Copies2D, "submit", emulated_submit)
    p = make_plan(case, seed=7)
    rng = np.random.default_rng(7)
    src_np, want_np = pools(p, rng)
    src = {r: torch.from_numpy(a) for r, a in src_np.items()}
    want = {r: torch.from_numpy(a.copy()) for r, a in want_np.items()}
    p.apply(src, want)
    sched = schedule(p, chunk_bytes=2048, bounce_size_mb=1)
    bounce = torch.zeros(sched.bounce_bytes, dtype=torch.uint8)
    got = {r: torch.from_numpy(a.copy()) for r, a in want_np.items()}
    for ch in sched.all_chunks():
        region = bounce.data_ptr() + ch.bounce_offset
        gpu_copy.gather_2d(ch, src[ch.src].data_ptr(), region, None)  # type: ignore[arg-type]
        gpu_copy.scatter_2d(ch, region, got[ch.dst].data_ptr(), None)  # type: ignore[arg-type]
    assert all(torch.equal(got[r], want[r]) for r in want)
    got = {r: torch.from_numpy(a.copy()) for r, a in want_np.items()}
    for s, d in p.pairs():
        gpu_copy.apply_pair_2d(p, s, d, src[s].data_ptr(), got[d].data_ptr(), None)  # type: ignore[arg-type]
    assert all(torch.equal(got[r], want[r]) for r in want)
