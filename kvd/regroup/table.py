"""A (src rank, dst rank) pair of a plan as a grid of equal runs: what the regroup kernel and
its host twin both execute.

The planner (:func:`kvd.regroup.plan.plan`) describes a pair's bytes as a *box* (a layer range, a head
range, K/V, every token, the head vector). After the axes that are contiguous on both sides are
absorbed into one run of ``run`` bytes, the box is a small grid of *digits*: up to four regular
axes (layer, kv, head, token: a count and a byte stride on each side) and one irregular axis,
the request's (sub-)blocks, whose byte offsets on each side come from a table built from the
block ids. Run ``j`` of the pair is the mixed-radix number ``j = ((d0 * c1 + d1) * c2 + d2)...``
over the digits, slowest first; its source offset is ``src_base + sum(digit offsets)``, its
destination offset likewise.

The digits are ordered exactly as :func:`kvd.regroup.plan._pair_fragments` enumerates runs (by
destination stride, slowest first, the block digit where the destination's block axis sits),
so the pair's *stream* — its runs back to back, run 0 first — is byte for byte the stream the
fragment stager (:func:`kvd.regroup.stager.schedule`) cuts into bounce chunks: a chunk is the byte
range ``[k * chunk_bytes, (k + 1) * chunk_bytes)`` of that stream in both.

Pure numpy, no torch, no I/O. :func:`pair_grid` is cached per plan.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, cast

import numpy as np
import numpy.typing as npt

from kvd.regroup.plan import Box, Plan, pool_strides
from protocol.layout import KVLayout

__all__ = ["ChunkRange", "PairGrid", "chunk_ranges", "pair_grid", "row_tables"]

Int64Array = npt.NDArray[np.int64]

#: Digits a grid can have: layer, kv, head, token and the block table.
MAX_DIGITS = 5


@dataclass(frozen=True, eq=False)
class PairGrid:
    """The runs of pair (src, dst): ``nruns`` runs of ``run`` bytes each, in stream order."""

    src: int
    dst: int
    #: Bytes of one run (contiguous on both sides).
    run: int
    #: Digit counts, slowest first (product = number of runs).
    counts: tuple[int, ...]
    #: Index of the block-table digit in ``counts``.
    table_digit: int
    #: Byte offset of run 0 in the src rank's pool / the dst rank's pool.
    src_base: int
    dst_base: int
    #: Byte stride per digit (0 at the table digit) on each side.
    src_strides: tuple[int, ...]
    dst_strides: tuple[int, ...]
    #: Byte offset of each (sub-)block on each side (the table digit's offsets).
    src_table: Int64Array
    dst_table: Int64Array

    @property
    def nruns(self) -> int:
        """Number of runs."""
        return math.prod(self.counts)

    @property
    def nbytes(self) -> int:
        """Bytes of the pair's stream (= ``plan.total_bytes(src, dst)``)."""
        return self.nruns * self.run

    def alignment(self, side: Literal["src", "dst"]) -> int:
        """Largest power of two up to 16 dividing the run and every offset on ``side``."""
        return self._align[0 if side == "src" else 1]

    @functools.cached_property
    def _align(self) -> tuple[int, int]:
        return self._alignment("src"), self._alignment("dst")

    def _alignment(self, side: Literal["src", "dst"]) -> int:
        base, strides, table = (
            (self.src_base, self.src_strides, self.src_table)
            if side == "src"
            else (self.dst_base, self.dst_strides, self.dst_table)
        )
        g = math.gcd(self.run, base, *strides)
        if table.size:
            g = math.gcd(g, int(np.gcd.reduce(table)))
        return _pow2_align(g)

    def extent_without_table(self, side: Literal["src", "dst"]) -> int:
        """:meth:`extent` less the block table's largest offset (0 when the pair is empty)."""
        base, strides = (self.src_base, self.src_strides) if side == "src" else (self.dst_base, self.dst_strides)
        if self.nruns == 0:
            return 0
        return base + self.run + sum((c - 1) * s for c, s in zip(self.counts, strides, strict=True))

    def extent(self, side: Literal["src", "dst"]) -> int:
        """One past the last pool byte ``side`` touches (for bounds checks)."""
        base, strides, table = (
            (self.src_base, self.src_strides, self.src_table)
            if side == "src"
            else (self.dst_base, self.dst_strides, self.dst_table)
        )
        if self.nruns == 0:
            return 0
        top = base + self.run + sum((c - 1) * s for c, s in zip(self.counts, strides, strict=True))
        return top + (int(table.max()) if table.size else 0)

    def offsets(self, j: Int64Array) -> tuple[Int64Array, Int64Array]:
        """Source and destination byte offsets of runs ``j`` (vectorised decode)."""
        src = np.full(j.shape, self.src_base, dtype=np.int64)
        dst = np.full(j.shape, self.dst_base, dtype=np.int64)
        rest = j.astype(np.int64, copy=True)
        for i in range(len(self.counts) - 1, -1, -1):
            rest, digit = np.divmod(rest, self.counts[i])
            if i == self.table_digit:
                src += self.src_table[digit]
                dst += self.dst_table[digit]
            else:
                src += digit * self.src_strides[i]
                dst += digit * self.dst_strides[i]
        return src, dst


def stride_alignment(p: Plan, g: PairGrid, side: Literal["src", "dst"]) -> int:
    """The alignment of ``side``'s pool offsets that *every* request of ``p``'s layouts has
    (from the run, the base, the strides and the block table's strides; not from this
    request's block ids, as :meth:`PairGrid.alignment` is)."""
    layout, rank = (p.ctx, g.src) if side == "src" else (p.gen, g.dst)
    st = pool_strides(layout, rank)
    sub = min(p.ctx.tokens_per_block, p.gen.tokens_per_block)
    tab = st["block"] if layout.tokens_per_block == sub else math.gcd(st["block"], sub * st["token"])
    base, strides = (g.src_base, g.src_strides) if side == "src" else (g.dst_base, g.dst_strides)
    return _pow2_align(math.gcd(g.run, base, *strides, tab))


def _pow2_align(g: int) -> int:
    w = 16
    while w > 1 and g % w:
        w //= 2
    return w


def pair_grid(p: Plan, s: int, d: int) -> PairGrid | None:
    """Pair (s, d)'s grid, or None when the pair moves nothing. Cached per plan (in
    :attr:`Plan.memo`)."""
    per_plan = cast("dict[tuple[int, int], PairGrid | None] | None", p.memo.get(_GRIDS))
    if per_plan is None:
        per_plan = {}
        p.memo[_GRIDS] = per_plan
    key = (s, d)
    if key not in per_plan:
        per_plan[key] = _build(p, s, d)
    return per_plan[key]


_GRIDS = "kvd.regroup.table.pair_grid"


def _chunk_offsets(p: Plan, side: Literal["ctx", "gen"], rank: int, sub: int, strides: dict[str, int]) -> Int64Array:
    """Byte offset of each sub-block of ``sub`` tokens of the request in ``rank``'s pool (as the
    planner walks the request when the two sides' tokens_per_block differ)."""
    layout = p.ctx if side == "ctx" else p.gen
    ids = (p.ctx_blocks if side == "ctx" else p.gen_blocks)[rank]
    nsub = p.num_tokens // sub
    k = layout.tokens_per_block // sub
    if k == 1:
        out: Int64Array = ids[:nsub] * strides["block"]
        return out
    c = np.arange(nsub, dtype=np.int64)
    out = ids[c // k] * strides["block"] + (c % k) * (sub * strides["token"])
    return out


def _build(p: Plan, s: int, d: int) -> PairGrid | None:
    # Everything but the block tables is the same for every plan of the shape (the table
    # digit's count too: the request's sub-blocks): kept in the plan's shape memo, so a
    # request's grids cost a lookup and the tables (the bounce path builds every pair's grid
    # for every request).
    memo = p.shape_memo
    key = ("pair_grid", s, d)
    shape = memo.get(key)
    if shape is None:  # (a pair without a box is not remembered: it has no grid to build)
        box = p.box(s, d)
        if box is None:
            return None
        run, counts, table_digit, src_base, dst_base, src_strides, dst_strides = _grid_shape(p.ctx, p.gen, box)
        sub = min(p.ctx.tokens_per_block, p.gen.tokens_per_block)
        nsub = p.num_tokens // sub
        shape = memo[key] = (run, tuple(nsub if i == table_digit else c for i, c in enumerate(counts)), table_digit,
                             src_base, dst_base, src_strides, dst_strides)
    run, counts, table_digit, src_base, dst_base, src_strides, dst_strides = cast("_GridShape", shape)
    src_table = p.ctx_offsets.get(s)
    if src_table is None:
        src_table = _chunk_offsets(p, "ctx", s, min(p.ctx.tokens_per_block, p.gen.tokens_per_block),
                                   pool_strides(p.ctx, s))
    dst_table = p.gen_offsets.get(d)
    if dst_table is None:
        dst_table = _chunk_offsets(p, "gen", d, min(p.ctx.tokens_per_block, p.gen.tokens_per_block),
                                   pool_strides(p.gen, d))
    return PairGrid(
        src=s,
        dst=d,
        run=run,
        counts=counts,
        table_digit=table_digit,
        src_base=src_base,
        dst_base=dst_base,
        src_strides=src_strides,
        dst_strides=dst_strides,
        src_table=src_table,
        dst_table=dst_table,
    )


@functools.lru_cache(maxsize=4096)
def _grid_shape(
    ctx: KVLayout, gen: KVLayout, box: Box
) -> tuple[int, tuple[int, ...], int, int, int, tuple[int, ...], tuple[int, ...]]:
    """Everything of a pair's grid but its block tables: the same for every request of a layout
    pair, so computed once (run, counts, table digit, bases, strides; the request's size only
    enters through the table digit's count, filled in by :func:`_build`)."""
    s, d = box.src, box.dst
    ss, ds = pool_strides(ctx, s), pool_strides(gen, d)
    sub = min(ctx.tokens_per_block, gen.tokens_per_block)
    (sl, sh), (dl, dh) = box.src_local, box.dst_local
    nl, nh = sl[1] - sl[0], sh[1] - sh[0]
    src_base = sl[0] * ss["layer"] + sh[0] * ss["head"]
    dst_base = dl[0] * ds["layer"] + dh[0] * ds["head"]
    # The same absorption and ordering as the planner's _pair_fragments (see the module doc:
    # the stream order must match the fragment stager's byte for byte).
    axes = [
        (n, ss[a], ds[a]) for a, n in (("layer", nl), ("kv", 2), ("head", nh), ("token", sub)) if n > 1
    ]
    run = ctx.head_dim * ctx.itemsize
    absorbed = True
    while absorbed:
        absorbed = False
        for i, (n, a, b) in enumerate(axes):
            if a == run and b == run:
                run *= n
                del axes[i]
                absorbed = True
                break
    # (sort key, count, src stride, dst stride, is the table digit); stable sort as the planner's.
    # The table digit's count is -1 here: the request's sub-block count is set per request.
    grid = [(b, n, a, b, False) for n, a, b in axes]
    grid.append((ds["block"], -1, 0, 0, True))
    grid.sort(key=lambda g: -g[0])
    table_digit = next(i for i, g in enumerate(grid) if g[4])
    return (run, tuple(g[1] for g in grid), table_digit, src_base, dst_base,
            tuple(g[2] for g in grid), tuple(g[3] for g in grid))


#: run, counts, table digit, src base, dst base, src strides, dst strides
_GridShape = tuple[int, tuple[int, ...], int, int, int, tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class ChunkRange:
    """Bytes ``[offset, offset + nbytes)`` of pair (src, dst)'s stream: one bounce chunk."""

    src: int
    dst: int
    #: Position among the pair's chunks (0, 1, ...).
    index: int
    offset: int
    nbytes: int


def chunk_ranges(p: Plan, chunk_bytes: int) -> list[ChunkRange]:
    """Every pair's stream cut at multiples of ``chunk_bytes`` (pairs sorted, chunks in stream
    order): the same cuts, and the same staged bytes, as :func:`kvd.regroup.stager.schedule`."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    out: list[ChunkRange] = []
    for s, d in p.pairs():
        total = p.total_bytes(s, d)
        for k, lo in enumerate(range(0, total, chunk_bytes)):
            out.append(ChunkRange(s, d, k, lo, min(chunk_bytes, total - lo)))
    return out


def row_tables(
    grid: PairGrid,
    lo: int,
    hi: int,
    row: int,
    *,
    src_packed: bool = False,
    dst_packed: bool = False,
    step_rows: int = 1 << 16,
) -> Iterator[tuple[Int64Array, Int64Array]]:
    """Row indices (rows of ``row`` bytes) of stream bytes ``[lo, hi)``, ``step_rows`` rows at a
    time: ``(src rows, dst rows)``. A packed side is a staging buffer holding the range back to
    back from its start (row ``i`` = stream row ``lo // row + i``); the other side is the pool.
    ``row`` must divide the run, every pool offset, ``lo`` and ``hi``."""
    per_run = grid.run // row
    first, last = lo // row, hi // row
    for a in range(first, last, step_rows):
        rows = np.arange(a, min(a + step_rows, last), dtype=np.int64)
        j, k = np.divmod(rows, per_run)
        so, do = grid.offsets(j)
        packed = rows - first
        si = packed if src_packed else so // row + k
        di = packed if dst_packed else do // row + k
        yield si, di
