"""The regroup kernel's host twin: the same runs, the same stream, on host memory with numpy.

Host pools (CPU machines, tests, the demo) get exactly the semantics of the CUDA kernel
(:mod:`kvd.regroup.kernel`): a pair's runs (:class:`~kvd.regroup.table.PairGrid`) copied
pool to pool, gathered into a packed staging buffer, or scattered from one, for any byte range
of the pair's stream. Vectorised: the pools are viewed as rows of R bytes (R = the largest
power of two up to 16 KiB dividing every offset, the run and the range), the row indices of a
step of rows are computed with numpy (:func:`~kvd.regroup.table.row_tables`), and each step is
one ``np.take`` into scratch plus one fancy-indexed store; Python loops once per step of
``STEP_BYTES``, never per row.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvd.regroup.table import Int64Array, PairGrid, row_tables

__all__ = ["SCRATCH_BYTES", "STEP_BYTES", "as_bytes", "copy_range", "copy_rows", "host_view", "row_bytes",
           "scratch_rows"]

#: Bytes moved per indexed step (bounds the scratch buffer; see kvd.regroup.plan.APPLY_STEP_BYTES for
#: why 16 MiB stays fast on glibc).
STEP_BYTES = 16 << 20
#: Bytes per step of a pool-to-pool copy, which goes through a scratch buffer: small enough
#: that the scratch stays in cache between its fill and its drain. GPT-OSS TP1 -> TP4 on the
#: 2-core dev box: 6-8 GB/s, where 16 MiB steps with a buffered ``np.take`` moved ~2.5 (and
#: torch's indexed copies of CPU tensors 0.5).
SCRATCH_BYTES = 1 << 20
#: Largest row considered: big enough that per-row indexing costs nothing next to the copy.
MAX_ROW = 16 << 10

U8 = npt.NDArray[np.uint8]


def as_bytes(pool: Any) -> U8:
    """A C-contiguous numpy array or CPU torch tensor (any dtype) as flat uint8 numpy, no copy."""
    if isinstance(pool, np.ndarray):
        if not pool.flags.c_contiguous:
            raise ValueError("pool must be C-contiguous")
        flat: U8 = pool.reshape(-1).view(np.uint8)
        return flat
    import torch

    if not isinstance(pool, torch.Tensor) or pool.device.type != "cpu":
        raise TypeError(f"host pools are numpy arrays or CPU torch tensors, got {type(pool).__name__}")
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous")
    t = pool.reshape(-1)
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    out: U8 = t.numpy()
    return out


def row_bytes(grid: PairGrid, lo: int, hi: int, *, src_packed: bool, dst_packed: bool) -> int:
    """Row size for copying stream bytes ``[lo, hi)`` of ``grid``: the largest power of two
    (up to :data:`MAX_ROW`) dividing the run, the range ends and the pool-side offsets."""
    g = math.gcd(grid.run, lo, hi, MAX_ROW)
    for side, packed in (("src", src_packed), ("dst", dst_packed)):
        if packed:
            continue
        base, strides, table = (
            (grid.src_base, grid.src_strides, grid.src_table)
            if side == "src"
            else (grid.dst_base, grid.dst_strides, grid.dst_table)
        )
        g = math.gcd(g, base, *strides)
        if table.size:
            g = math.gcd(g, int(np.gcd.reduce(table)))
    return 1 << ((g & -g).bit_length() - 1)


def _rows(flat: U8, row: int) -> U8:
    n = flat.size // row
    out: U8 = flat[: n * row].reshape(n, row)
    return out


def copy_range(
    grid: PairGrid,
    src: U8,
    dst: U8,
    lo: int,
    hi: int,
    *,
    src_packed: bool = False,
    dst_packed: bool = False,
) -> int:
    """Copy stream bytes ``[lo, hi)`` of ``grid`` from ``src`` to ``dst`` (flat uint8 arrays).

    A packed side holds the range back to back from its first byte (a staging buffer); the
    other side is the pool. Returns the bytes copied. Bounds are checked before any write.
    """
    if hi <= lo:
        return 0
    if not 0 <= lo < hi <= grid.nbytes:
        raise ValueError(f"range [{lo}, {hi}) outside the pair's {grid.nbytes}-byte stream")
    for side, arr, packed in (("src", src, src_packed), ("dst", dst, dst_packed)):
        need = hi - lo if packed else grid.extent(side)  # type: ignore[arg-type]
        if arr.size < need:
            raise ValueError(f"{side} holds {arr.size} bytes, the copy touches {need}")
    row = row_bytes(grid, lo, hi, src_packed=src_packed, dst_packed=dst_packed)
    src_rows, dst_rows = _rows(src, row), _rows(dst, row)
    if src_packed or dst_packed:
        # one side is a staging buffer: its rows of a step are consecutive, so the rows are
        # copied straight between the two buffers (no scratch: half the memory traffic)
        step = max(1, STEP_BYTES // row)
        for si, di in row_tables(grid, lo, hi, row, src_packed=src_packed, dst_packed=dst_packed, step_rows=step):
            n = si.size
            if dst_packed:
                a = int(di[0])
                # mode="clip": the indices were bounds-checked above; with the default "raise"
                # numpy buffers ``out`` (a hidden copy of the whole step)
                np.take(src_rows, si, axis=0, out=dst_rows[a : a + n], mode="clip")
            else:
                a = int(si[0])
                dst_rows[di] = src_rows[a : a + n]
        return hi - lo
    copy_rows(src_rows, dst_rows, row_tables(grid, lo, hi, row, step_rows=scratch_rows(row)))
    return hi - lo


def scratch_rows(row: int) -> int:
    """Rows of ``row`` bytes per step of :func:`copy_rows` (``SCRATCH_BYTES`` of them)."""
    return max(1, SCRATCH_BYTES // row)


def copy_rows(src_rows: U8, dst_rows: U8, steps: Iterable[tuple[Int64Array, Int64Array]]) -> None:
    """Pool to pool: ``dst_rows[di] = src_rows[si]`` for each step ``(si, di)`` of at most
    :func:`scratch_rows` rows (the first the largest), through one scratch buffer small enough
    to stay in cache between its fill and its drain. The indices must be in range (checked by
    the caller): ``np.take`` runs with ``mode="clip"``, as the default ``"raise"`` makes numpy
    buffer ``out`` (a hidden extra copy)."""
    scratch: U8 | None = None
    for si, di in steps:
        n = si.size
        if scratch is None:
            scratch = np.empty((n, src_rows.shape[1]), dtype=np.uint8)
        np.take(src_rows, si, axis=0, out=scratch[:n], mode="clip")
        dst_rows[di] = scratch[:n]


def host_view(pool: Any) -> U8 | None:
    """``pool`` as flat uint8 numpy (:func:`as_bytes`: no copy; a numpy array that is not
    C-contiguous raises ``ValueError``) when it is host memory; None for device memory and for
    a CPU torch tensor that is not contiguous (the torch paths handle those)."""
    if not isinstance(pool, np.ndarray) and (pool.device.type != "cpu" or not pool.is_contiguous()):
        return None
    return as_bytes(pool)
