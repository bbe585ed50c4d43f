"""The regroup planner: which bytes of which ctx rank's pool go where in which gen rank's pool.

:func:`plan` is pure (no torch, no I/O): it turns the two sides' :class:`KVLayout` and the
request's block ids into, for every (ctx rank, gen rank) pair that moves bytes, an int64
array of fragments ``(src byte offset, dst byte offset, nbytes)``.

How it works, and why it is fast. A request is the logical tensor
``[token, layer, kv, head, dim]``. Each side stores it in per-rank pools whose axes are in
some order (``axis_order``, C-contiguous), so every logical axis has a byte *stride* on each
side, except ``token``, which is split into (block id, slot). For a pair the moved region is
a box: a layer range (PP ownership), a head range (TP / attention-DP ownership), ``kv``,
all tokens and ``dim``. Starting from ``dim`` (always innermost, so a head vector is always
contiguous), every box axis whose stride equals the current run length on *both* sides is
absorbed into the run; what is left is a small grid of equal-length runs whose offsets are an
outer sum of per-axis offset vectors (numpy broadcasting, no per-fragment Python). A final
vectorized pass merges consecutive runs that are contiguous on both sides (consecutive block
ids with whole-block runs, for instance). The GPT-OSS-120B case (TP1 -> TP4, 256 blocks,
73,728 fragments) plans in about 2 ms on one CPU core.

Tokens: token ``t`` of the request lives in each side's block ``t // tokens_per_block`` at slot
``t % tokens_per_block``. When the two sides' ``tokens_per_block`` differ (one must divide the
other) the planner walks the request in sub-blocks of the smaller size. The request covers
``min(ctx token slots, gen token slots)`` tokens; each side must name exactly the blocks
needed for that many tokens.

Replication: when TP > num_kv_heads a head has several holders. A gen replica is a
destination like any other (every replica is written); a ctx replica is a source, and each
(head, gen rank) is read from exactly ONE ctx replica, chosen as ``gen tp_rank % replicas``
so that reads spread over the replicas and equal layouts map rank to rank.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from protocol.errors import BadRequest, IncompatibleLayout
from protocol.layout import KVLayout

__all__ = [
    "Box",
    "FragmentCopier",
    "KVLayout",
    "Plan",
    "Pool",
    "copy_fragments",
    "plan",
    "pool_strides",
    "row_indices",
    "row_size",
]

Int64Array = npt.NDArray[np.int64]
#: A rank's pool as seen by :meth:`Plan.apply`: a contiguous uint8 torch tensor or numpy array
#: (any shape; it is viewed as flat bytes). Typed loosely so plan.py does not import torch.
Pool = Any

_EMPTY = np.zeros((0, 3), dtype=np.int64)


@functools.lru_cache(maxsize=4096)
def pool_strides(layout: KVLayout, rank: int) -> dict[str, int]:
    """Byte stride of every axis of rank ``rank``'s (C-contiguous) pool (remembered per layout
    and rank: the returned dict is shared, read it only)."""
    sizes = layout.local_shape(rank)
    strides: dict[str, int] = {}
    step = layout.itemsize
    for axis in reversed(layout.axis_order):
        strides[axis] = step
        step *= sizes[axis]
    return strides


@dataclass(frozen=True, slots=True)
class Box:
    """The region one (src rank, dst rank) pair moves, in global layer/head coordinates."""

    src: int
    dst: int
    layers: tuple[int, int]  # half-open global layer range
    heads: tuple[int, int]  # half-open global head range
    src_layer0: int  # first global layer of the src rank's pool
    dst_layer0: int
    src_head0: int  # first global head of the src rank's pool
    dst_head0: int

    @property
    def src_local(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(layers, heads) of the box as half-open ranges local to the src rank's pool."""
        return (
            (self.layers[0] - self.src_layer0, self.layers[1] - self.src_layer0),
            (self.heads[0] - self.src_head0, self.heads[1] - self.src_head0),
        )

    @property
    def dst_local(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(layers, heads) of the box as half-open ranges local to the dst rank's pool."""
        return (
            (self.layers[0] - self.dst_layer0, self.layers[1] - self.dst_layer0),
            (self.heads[0] - self.dst_head0, self.heads[1] - self.dst_head0),
        )


class Plan:
    """Fragments for every (ctx rank, gen rank) pair of one request. Build with :func:`plan`."""

    def __init__(
        self,
        ctx: KVLayout,
        gen: KVLayout,
        ctx_blocks: dict[int, Int64Array],
        gen_blocks: dict[int, Int64Array],
        num_tokens: int,
        fragments: Mapping[tuple[int, int], Callable[[], Int64Array]] | None,
        boxes: dict[tuple[int, int], Box],
        *,
        shape: _Shape | None = None,
        offsets: tuple[dict[int, Int64Array], dict[int, Int64Array]] | None = None,
    ) -> None:
        self.ctx = ctx
        self.gen = gen
        #: The request's block ids per rank, as validated int64 arrays.
        self.ctx_blocks = ctx_blocks
        self.gen_blocks = gen_blocks
        #: Tokens moved: min(ctx token slots, gen token slots) of the request's blocks.
        self.num_tokens = num_tokens
        # Fragments are computed on first use per pair: the whole-block box paths (mapped,
        # GPU pipeline) never need them, and they are most of plan()'s cost. ``fragments``
        # None: from the planner's shape and offsets (:meth:`_compute`).
        self._fragment_fns = fragments
        self._fragments: dict[tuple[int, int], Int64Array] = {}
        self._boxes = boxes
        self._shape = shape
        self._pairs = shape.pairs if shape is not None else sorted(fragments or ())
        #: What every request of this layout pair, rank set and size shares (None when built
        #: by hand): kernels cache their launch descriptors by it.
        self.shape_key: tuple[object, ...] | None = shape.key if shape is not None else None
        #: Byte offset of each sub-block of the request in each rank's pool (ctx, gen), as
        #: the planner walks it; set by :func:`plan`.
        self.ctx_offsets: dict[int, Int64Array] = offsets[0] if offsets is not None else {}
        self.gen_offsets: dict[int, Int64Array] = offsets[1] if offsets is not None else {}
        self._copiers: dict[tuple[int, int], FragmentCopier] = {}
        #: What other modules derive from this plan and keep with it (kvd.regroup.table: the
        #: pairs' grids), dropped with the plan.
        self.memo: dict[object, object] = {}
        #: What other modules derive from the shape alone (kvd.regroup.table: each pair's grid
        #: without its block tables), shared by every plan of the shape; a plan built by hand
        #: has its own.
        self.shape_memo: dict[object, object] = shape.memo if shape is not None else {}
        # asked several times per request on the daemon's hot path: computed once (per shape)
        self._total: int | None = shape.total if shape is not None else None
        self._direct: bool | None = shape.direct if shape is not None else None

    def __repr__(self) -> str:
        return (
            f"Plan(pairs={len(self._pairs)}, fragments={self.num_fragments()}, "
            f"bytes={self.total_bytes()}, tokens={self.num_tokens})"
        )

    # -- queries ---------------------------------------------------------------------------
    def pairs(self) -> list[tuple[int, int]]:
        """(src_rank, dst_rank) pairs that move bytes, sorted."""
        return list(self._pairs)

    def fragments(self, s: int, d: int) -> Int64Array:
        """int64 array (N, 3): (src byte offset in rank s's pool, dst byte offset in rank d's
        pool, nbytes). Empty (0, 3) for a pair that moves nothing. Do not modify it."""
        key = (s, d)
        frags = self._fragments.get(key)
        if frags is None:
            frags = self._compute(key)
            if frags is None:
                return _EMPTY
            self._fragments[key] = frags
        return frags

    def _compute(self, key: tuple[int, int]) -> Int64Array | None:
        if self._fragment_fns is not None:
            fn = self._fragment_fns.get(key)
            return fn() if fn is not None else None
        box, shape = self._boxes.get(key), self._shape
        if box is None or shape is None:
            return None
        s, d = key
        return _pair_fragments(box, self.ctx, self.gen, shape.src_strides[s], shape.dst_strides[d],
                               self.ctx_offsets[s], self.gen_offsets[d], shape.sub)

    def offset_bounds(self) -> tuple[dict[int, int], dict[int, int]] | None:
        """Per rank, the largest byte offset :attr:`ctx_offsets` / :attr:`gen_offsets` can hold
        for any request of this plan's shape whose block ids are valid (below each layout's
        ``num_blocks``, as :func:`plan` checks): what a launch table of the shape can reach.
        Computed once per shape; None for a plan built by hand."""
        shape = self._shape
        if shape is None:
            return None
        got = shape.memo.get("offset_bounds")
        if got is None:
            got = shape.memo["offset_bounds"] = (_walk_bounds(shape.src_walk, self.ctx),
                                                 _walk_bounds(shape.dst_walk, self.gen))
        return got  # type: ignore[return-value]

    def box(self, s: int, d: int) -> Box | None:
        """The layer/head region pair (s, d) moves, or None."""
        return self._boxes.get((s, d))

    def src_ranks(self) -> list[int]:
        """ctx ranks that send bytes, sorted."""
        if self._shape is not None:
            return list(self._shape.src_ranks)
        return sorted({s for s, _ in self._pairs})

    def dst_ranks(self) -> list[int]:
        """gen ranks that receive bytes, sorted."""
        if self._shape is not None:
            return list(self._shape.dst_ranks)
        return sorted({d for _, d in self._pairs})

    def total_bytes(self, s: int | None = None, d: int | None = None) -> int:
        """Bytes moved, over all pairs or those with the given src and/or dst rank."""
        if s is None and d is None:
            if self._total is None:
                self._total = _box_bytes(self.ctx, self._boxes.values(), self.num_tokens)
            return self._total
        if s is not None and d is not None:
            box = self._boxes.get((s, d))
            return _box_bytes(self.ctx, () if box is None else (box,), self.num_tokens)
        return _box_bytes(
            self.ctx,
            (b for (ps, pd), b in self._boxes.items() if (s is None or ps == s) and (d is None or pd == d)),
            self.num_tokens,
        )

    def num_fragments(self, s: int | None = None, d: int | None = None) -> int:
        """Fragments, over all pairs or those with the given src and/or dst rank."""
        return sum(
            len(self.fragments(ps, pd))
            for (ps, pd) in self._pairs
            if (s is None or ps == s) and (d is None or pd == d)
        )

    def is_direct(self, s: int, d: int) -> bool:
        """True when pair (s, d) moves whole blocks: both pools have the same axis order and
        tokens per block, and the pair covers all layers and heads of both ranks' pools, so
        every source block maps byte for byte onto a destination block (no regroup)."""
        box = self._boxes.get((s, d))
        return box is not None and _is_direct(self.ctx, self.gen, box)

    @property
    def direct(self) -> bool:
        """True when every pair is direct (equal layouts): whole blocks move, no regroup."""
        if self._direct is None:
            self._direct = bool(self._pairs) and all(self.is_direct(s, d) for s, d in self._pairs)
        return self._direct

    # -- execution -------------------------------------------------------------------------
    def apply(self, src_pools: Mapping[int, Pool], dst_pools: Mapping[int, Pool]) -> None:
        """Copy the request's bytes straight from ``src_pools[s]`` into ``dst_pools[d]`` for
        every pair (the direct path, and the reference in tests). Pools are contiguous uint8
        torch tensors (CPU or CUDA) or numpy arrays, viewed as flat bytes."""
        for s, d in self._pairs:
            self.copier(s, d).copy(src_pools[s], dst_pools[d])

    def copier(self, s: int, d: int) -> FragmentCopier:
        """Pair (s, d)'s :class:`FragmentCopier` (row indices built on first use, then cached)."""
        c = self._copiers.get((s, d))
        if c is None:
            c = self._copiers[(s, d)] = FragmentCopier(self.fragments(s, d))
        return c


# -- building a plan --------------------------------------------------------------------------


def _check_compatible(ctx: KVLayout, gen: KVLayout) -> None:
    for name in ("num_layers", "num_kv_heads", "head_dim", "dtype"):
        a, b = getattr(ctx, name), getattr(gen, name)
        if a != b:
            raise IncompatibleLayout(f"{name} differs: ctx {name}={a!r}, gen {name}={b!r}")
    a, b = ctx.tokens_per_block, gen.tokens_per_block
    if max(a, b) % min(a, b):
        raise IncompatibleLayout(
            f"tokens_per_block mix is unsupported: ctx tokens_per_block={a}, gen tokens_per_block={b}; "
            "one must divide the other"
        )


def _has_duplicates(arr: Int64Array) -> bool:
    """Whether a flat int64 array repeats a value: a sort and one comparison (512 ids: ~3 µs,
    where ``np.unique`` took ~32 µs and a Python set ~14 µs)."""
    if arr.size < 2:
        return False
    s = np.sort(arr)
    return bool((s[1:] == s[:-1]).any())


def _check_blocks(side: str, layout: KVLayout, blocks: Mapping[int, Iterable[int]]) -> dict[int, Int64Array]:
    """Validate one side's ``{rank: block ids}``; return int64 arrays."""
    return _validate(side, layout, blocks)[0]


def _validate(
    side: str, layout: KVLayout, blocks: Mapping[int, Iterable[int]]
) -> tuple[dict[int, Int64Array], Int64Array | None]:
    """:func:`_check_blocks`, and the ids as one (ranks, blocks) matrix whose rows are the
    returned arrays when the fast path built them so (else None)."""
    fast = _check_blocks_at_once(side, layout, blocks)
    if fast is not None:
        return fast
    return _check_blocks_each(side, layout, blocks), None


@functools.lru_cache(maxsize=512)
def _ranks_ok(layout: KVLayout, ranks: tuple[int, ...], ctx_side: bool) -> bool:
    """Whether naming exactly ``ranks`` (plain ints) passes :func:`_check_blocks_each`'s rank
    checks (the same for every request of a layout and rank set, so answered once)."""
    world = layout.world_size
    if not ranks or any(not 0 <= r < world for r in ranks):
        return False
    tp = layout.tp_size
    named = set(ranks)
    for stage in range(layout.pp_size):
        held = [r for r in named if r // tp == stage]
        if layout.attention_dp:
            if not held or (ctx_side and len(held) > 1):
                return False
        elif any(r not in named for r in range(stage * tp, (stage + 1) * tp)):
            return False
    return True


def _check_blocks_at_once(
    side: str, layout: KVLayout, blocks: Mapping[int, Iterable[int]]
) -> tuple[dict[int, Int64Array], Int64Array] | None:
    """The common case of :func:`_check_blocks_each` in a few numpy calls over all ranks at
    once: a dict of equally long, non-empty lists (or 1-d arrays) of valid, distinct ids per
    rank. None when anything is off (or unusual): the per-rank check then says what. A 1-block
    GPT-OSS request, TP1 -> TP4, was ~60 us of per-rank numpy calls on the event loop."""
    if type(blocks) is not dict or not blocks or layout.num_blocks < 1:
        return None
    ranks = tuple(blocks)
    values = list(blocks.values())
    for v in values:
        # a rank of bools alone is refused, but beside integer ranks numpy would read it as
        # integers: such (odd) input takes the per-rank check
        if type(v) is list:
            if v and isinstance(v[0], bool | np.bool_):
                return None
        elif type(v) is not np.ndarray or v.dtype.kind not in "iu":
            return None
    # (types first: the cache below takes True for 1)
    if not all(type(r) is int for r in ranks) or not _ranks_ok(layout, ranks, side == "ctx"):
        return None
    small = _check_small_lists(values, layout.num_blocks)
    if small is not None:
        return {r: small[i] for i, r in enumerate(ranks)}, small
    try:
        mat = np.array(values)
    except (ValueError, TypeError, OverflowError):
        return None
    if mat.ndim != 2 or mat.shape[1] == 0 or mat.dtype.kind not in "iu":
        return None
    if mat.dtype != np.int64:
        mat = mat.astype(np.int64)
    if int(mat.view(np.uint64).max()) >= layout.num_blocks:  # (a negative id reads as huge)
        return None
    if mat.shape[1] > 1:
        srt = np.sort(mat, axis=1)
        if (srt[:, 1:] == srt[:, :-1]).any():
            return None
    return {r: mat[i] for i, r in enumerate(ranks)}, mat


#: Up to this many ids per rank, :func:`_check_small_lists` checks them in plain Python.
SMALL_CHECK_IDS = 32


def _check_small_lists(values: list[Any], num_blocks: int) -> Int64Array | None:
    """The ids as one int64 (ranks, blocks) matrix when every rank's ids are a list of at most
    :data:`SMALL_CHECK_IDS` plain ints, equally long, non-empty, in ``[0, num_blocks)`` and
    distinct; None for anything else (the numpy check then decides, as before). A few-block
    request's ids (the ones executors send) are checked in Python and converted in one numpy
    call: the five numpy calls of the general check cost ~40 us on a daemon's event loop (each
    request's step starts with cold caches), ~10x what they cost back to back."""
    n = len(values[0]) if type(values[0]) is list else 0
    if not 0 < n <= SMALL_CHECK_IDS:
        return None
    for v in values:
        if type(v) is not list or len(v) != n:
            return None
        for b in v:
            if type(b) is not int or not 0 <= b < num_blocks:  # (bools and numpy ints: not here)
                return None
        if n > 1 and len(set(v)) != n:
            return None
    return np.array(values, dtype=np.int64)


def _check_blocks_each(side: str, layout: KVLayout, blocks: Mapping[int, Iterable[int]]) -> dict[int, Int64Array]:
    """Validate one side's ``{rank: block ids}`` rank by rank; raise the first error found."""
    if not isinstance(blocks, Mapping):
        raise BadRequest(
            f"{side}_blocks must be a mapping {{rank: [block id, ...]}}, got {type(blocks).__name__}"
        )
    world = layout.world_size
    out: dict[int, Int64Array] = {}
    for rank, ids in blocks.items():
        if not isinstance(rank, int | np.integer) or isinstance(rank, bool) or not 0 <= rank < world:
            raise BadRequest(f"{side}_blocks names rank {rank!r}, outside the layout's ranks [0, {world})")
        try:
            arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids)
        except (TypeError, ValueError) as exc:  # (ValueError: ragged, e.g. [[0], 1])
            raise BadRequest(f"{side} rank {rank}: block ids must be a sequence of integers") from exc
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise BadRequest(
                f"{side} rank {rank}: block ids must be a flat sequence of integers, got {arr.dtype}"
            )
        arr = arr.astype(np.int64)
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if layout.num_blocks < 1:
                raise BadRequest(
                    f"{side} layout has num_blocks={layout.num_blocks}; the planner needs the pool size"
                )
            if lo < 0 or hi >= layout.num_blocks:
                bad = lo if lo < 0 else hi
                raise BadRequest(
                    f"{side} rank {rank}: block id {bad} out of range [0, {layout.num_blocks}) (num_blocks)"
                )
            if _has_duplicates(arr):
                vals, counts = np.unique(arr, return_counts=True)
                raise BadRequest(f"{side} rank {rank}: duplicate block id {int(vals[counts > 1][0])}")
        out[int(rank)] = arr
    if not out:
        raise BadRequest(f"{side}_blocks names no rank")
    tp = layout.tp_size
    for stage in range(layout.pp_size):
        named = [r for r in out if r // tp == stage]
        if layout.attention_dp:
            if not named:
                raise BadRequest(
                    f"{side}_blocks names no rank of PP stage {stage} (attention DP: name the DP rank)"
                )
            if side == "ctx" and len(named) > 1:
                raise BadRequest(
                    f"ctx_blocks names ranks {sorted(named)} of PP stage {stage}; with ctx attention DP the "
                    "request lives on exactly one DP rank per stage"
                )
        else:
            missing = [r for r in range(stage * tp, (stage + 1) * tp) if r not in out]
            if missing:
                raise BadRequest(
                    f"{side}_blocks lacks rank(s) {missing}: every rank of the layout holds the request"
                )
    sizes = {r: a.size for r, a in out.items()}
    if len(set(sizes.values())) > 1:
        raise BadRequest(
            f"{side} ranks hold different numbers of blocks {dict(sorted(sizes.items()))}; every rank holds "
            "all of the request's tokens"
        )
    return out


@dataclass(frozen=True)
class CheckedBlocks:
    """One side's ``{rank: block ids}`` already validated against ``layout`` (int64 arrays), for
    :func:`plan`: a side known before the request completes (gen's announced destination) is
    checked when it arrives, and the planner skips that work on the critical path."""

    layout: KVLayout
    arrays: dict[int, Int64Array]
    #: The same ids as one (ranks in ``arrays`` order, blocks) matrix, when validated so.
    matrix: Int64Array | None = None


def check_blocks(side: str, layout: KVLayout, blocks: Mapping[int, Iterable[int]]) -> CheckedBlocks:
    """Validate one side (``side``: "ctx" or "gen") as :func:`plan` does; raises the same errors."""
    arrays, matrix = _validate(side, layout, blocks)
    return CheckedBlocks(layout, arrays, matrix)


def _blocks_of(
    side: str, layout: KVLayout, blocks: Mapping[int, Iterable[int]] | CheckedBlocks
) -> tuple[dict[int, Int64Array], Int64Array | None]:
    if isinstance(blocks, CheckedBlocks):
        if blocks.layout is layout or blocks.layout == layout:
            return blocks.arrays, blocks.matrix
        return _validate(side, layout, blocks.arrays)  # checked against another layout: again
    return _validate(side, layout, blocks)


def _sources(
    ctx: KVLayout, ctx_ranks: Iterable[int], stage: int, heads: tuple[int, int], dst_tp: int
) -> list[tuple[int, int, int]]:
    """ctx ranks of PP stage ``stage`` that supply ``heads`` to a gen rank of TP rank ``dst_tp``:
    [(src rank, first head, end head)], each head exactly once."""
    tp = ctx.tp_size
    if ctx.attention_dp:
        (src,) = [r for r in ctx_ranks if r // tp == stage]  # validated: exactly one
        return [(src, heads[0], heads[1])]
    out: list[tuple[int, int, int]] = []
    if tp <= ctx.num_kv_heads:
        per = ctx.num_kv_heads // tp
        for tc in range(heads[0] // per, (heads[1] - 1) // per + 1):
            lo, hi = max(heads[0], tc * per), min(heads[1], (tc + 1) * per)
            out.append((stage * tp + tc, lo, hi))
    else:
        rep = tp // ctx.num_kv_heads
        for h in range(heads[0], heads[1]):
            # One source per (head, gen rank); spread reads over the replicas.
            out.append((stage * tp + h * rep + dst_tp % rep, h, h + 1))
    return out


def _coalesce(src: Int64Array, dst: Int64Array, run: int) -> Int64Array:
    """Merge consecutive equal-length runs that are contiguous on both sides -> (N, 3)."""
    n = src.size
    if n == 0:
        return _EMPTY
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    np.not_equal(src[1:], src[:-1] + run, out=brk[1:])
    brk[1:] |= dst[1:] != dst[:-1] + run
    starts = np.flatnonzero(brk)
    out = np.empty((starts.size, 3), dtype=np.int64)
    out[:, 0] = src[starts]
    out[:, 1] = dst[starts]
    out[:-1, 2] = np.diff(starts)
    out[-1, 2] = n - starts[-1]
    out[:, 2] *= run
    return out


def _pair_fragments(
    box: Box,
    ctx: KVLayout,
    gen: KVLayout,
    src_strides: dict[str, int],
    dst_strides: dict[str, int],
    src_chunk_off: Int64Array,
    dst_chunk_off: Int64Array,
    sub: int,
) -> Int64Array:
    nl = box.layers[1] - box.layers[0]
    nh = box.heads[1] - box.heads[0]
    src_base = (box.layers[0] - box.src_layer0) * src_strides["layer"] + (
        box.heads[0] - box.src_head0
    ) * src_strides["head"]
    dst_base = (box.layers[0] - box.dst_layer0) * dst_strides["layer"] + (
        box.heads[0] - box.dst_head0
    ) * dst_strides["head"]
    # Regular axes of the box: (count, src stride, dst stride). Axes of count 1 contribute only
    # their start (in the bases), and dropping them keeps strides distinct, so the greedy
    # absorption below is unambiguous.
    axes = [
        (n, src_strides[a], dst_strides[a])
        for a, n in (("layer", nl), ("kv", 2), ("head", nh), ("token", sub))
        if n > 1
    ]
    run = ctx.head_dim * ctx.itemsize
    absorbed = True
    while absorbed:
        absorbed = False
        for i, (n, ss, ds) in enumerate(axes):
            if ss == run and ds == run:
                run *= n
                del axes[i]
                absorbed = True
                break
    # Enumerate the remaining grid slowest-first in destination order (so that runs contiguous
    # in the destination end up adjacent and the coalescing pass can merge them). The chunk
    # axis (blocks, irregular offsets) sits where the destination's block axis sits.
    grid: list[tuple[int, Int64Array, Int64Array]] = [
        (ds, np.arange(n, dtype=np.int64) * ss, np.arange(n, dtype=np.int64) * ds) for n, ss, ds in axes
    ]
    grid.append((dst_strides["block"], src_chunk_off, dst_chunk_off))
    grid.sort(key=lambda g: -g[0])
    src = np.array([src_base], dtype=np.int64)
    dst = np.array([dst_base], dtype=np.int64)
    for _, sv, dv in grid:
        src = np.add.outer(src, sv).ravel()
        dst = np.add.outer(dst, dv).ravel()
    return _coalesce(src, dst, run)


#: Bounds on what one plan may size (checked before anything is allocated from the layouts,
#: which may come from a peer): (gen rank, ctx stage) pairs walked, and fragment rows before
#: coalescing (src + dst int64 each: 16 bytes a row; 2**26 rows is a ~3.7M-token GPT-OSS
#: request regrouped TP1 -> TP4).
MAX_PLAN_PAIRS = 1 << 16
MAX_PLAN_ROWS = 1 << 26


def _check_plan_size(ctx: KVLayout, gen: KVLayout, n_ctx_ranks: int, n_gen_ranks: int, nsub: int) -> None:
    """Refuse a plan too large to build (raises :class:`BadRequest` naming the figure)."""
    pairs = n_gen_ranks * ctx.pp_size + n_ctx_ranks * gen.pp_size
    if pairs > MAX_PLAN_PAIRS:
        raise BadRequest(
            f"plan too large: {n_gen_ranks} gen ranks x {ctx.pp_size} ctx stages exceed {MAX_PLAN_PAIRS} pairs"
        )
    # every gen rank receives at most (its layers) x K/V x (its heads) rows per sub-block
    rows = nsub * gen.num_layers * 2 * gen.heads_held() * n_gen_ranks
    if rows > MAX_PLAN_ROWS:
        raise BadRequest(
            f"plan too large: up to {rows} fragment rows ({nsub} sub-blocks x {gen.num_layers} layers x 2 x "
            f"{gen.heads_held()} heads x {n_gen_ranks} gen ranks) exceed the limit of {MAX_PLAN_ROWS}"
        )


#: Layout pairs (with rank set and request size) whose block-independent planning is kept.
PLAN_CACHE_SIZE = 512


def plan(
    ctx: KVLayout,
    gen: KVLayout,
    ctx_blocks: Mapping[int, Sequence[int] | Int64Array] | CheckedBlocks,
    gen_blocks: Mapping[int, Sequence[int] | Int64Array] | CheckedBlocks,
) -> Plan:
    """Plan moving one request's KV from the ctx layout to the gen layout.

    ``*_blocks`` maps rank (``pp_rank * tp_size + tp_rank``) to the block ids of the request's
    0th, 1st, ... block in that rank's pool. Non-attention-DP layouts must name every rank;
    attention-DP layouts name the DP rank(s) the request lives on (ctx: exactly one per PP
    stage; gen: one or more, each gets all heads). All ranks of a side hold the same number of
    blocks. Either side may be given as :class:`CheckedBlocks` (validated earlier, by
    :func:`check_blocks`, against the same layout).

    Raises :class:`IncompatibleLayout` when the layouts cannot be regrouped into each other
    (different num_layers / num_kv_heads / head_dim / dtype, or tokens_per_block where neither
    divides the other) and :class:`BadRequest` for bad block ids or rank sets.
    """
    _compatible(ctx, gen)
    cb, cmat = _blocks_of("ctx", ctx, ctx_blocks)
    gb, gmat = _blocks_of("gen", gen, gen_blocks)
    shape = _shape(ctx, gen, tuple(cb), tuple(gb), next(iter(cb.values())).size, next(iter(gb.values())).size)
    return Plan(ctx, gen, cb, gb, shape.tokens, None, shape.boxes, shape=shape,
                offsets=(shape.src_walk.offsets(cb, cmat), shape.dst_walk.offsets(gb, gmat)))


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _compatible(ctx: KVLayout, gen: KVLayout) -> None:
    """:func:`_check_compatible`, remembered per layout pair (it raises when they are not)."""
    _check_compatible(ctx, gen)


@dataclass(frozen=True, eq=False)
class _Walk:
    """How one side's block ids become the byte offsets of the request's sub-blocks in each
    rank's pool (the same for every request of a shape): ``off = ids[c // k] * block stride +
    (c % k) * sub * token stride`` for sub-block ``c``, all ranks at once."""

    ranks: tuple[int, ...]
    nsub: int
    #: sub-blocks per block of this side (1: a block is one sub-block)
    k: int
    #: (ranks, 1) per-rank block stride and sub-block stride (sub * token stride), in ``ranks`` order
    block: Int64Array
    step: Int64Array
    #: c // k and c % k for every sub-block c (k > 1 only)
    blk: Int64Array
    within: Int64Array

    @classmethod
    def build(cls, layout: KVLayout, ranks: tuple[int, ...], strides: dict[int, dict[str, int]], sub: int,
              nsub: int) -> _Walk:
        c = np.arange(nsub, dtype=np.int64)
        k = layout.tokens_per_block // sub
        col = [[strides[r]["block"]] for r in ranks]
        step = [[sub * strides[r]["token"]] for r in ranks]
        return cls(ranks, nsub, k, np.array(col, dtype=np.int64).reshape(len(ranks), 1),
                   np.array(step, dtype=np.int64).reshape(len(ranks), 1), c // k, c % k)

    def offsets(self, ids: dict[int, Int64Array], matrix: Int64Array | None) -> dict[int, Int64Array]:
        """Per rank, the byte offset of each sub-block (``matrix``: the ids as one matrix whose
        rows are ``ids``' arrays in ``ranks`` order, when the validation built one)."""
        if matrix is None:
            matrix = np.stack([ids[r] for r in self.ranks])
        if self.k == 1:
            off: Int64Array = matrix[:, : self.nsub] * self.block
        else:
            off = matrix[:, self.blk] * self.block + self.within * self.step
        return {r: off[i] for i, r in enumerate(self.ranks)}


def _walk_bounds(walk: _Walk, layout: KVLayout) -> dict[int, int]:
    """Per rank of ``walk``, the largest offset it yields for valid ids (every id the last
    block: offsets grow with the id)."""
    if walk.nsub == 0:
        return dict.fromkeys(walk.ranks, 0)
    cols = walk.nsub if walk.k == 1 else int(walk.blk.max()) + 1
    top = np.full((len(walk.ranks), cols), max(layout.num_blocks - 1, 0), dtype=np.int64)
    return {r: int(off.max()) for r, off in walk.offsets({}, top).items()}


@dataclass(frozen=True, eq=False)
class _Shape:
    """What a plan needs beyond the block ids: the same for every request of one layout pair,
    rank set and size, so :func:`_shape` computes it once (boxes, strides, what the plan
    answers about them; a 1-block plan took ~0.1 ms, most of it here, on the event loop of
    every transfer)."""

    tokens: int
    sub: int
    nsub: int
    src_strides: dict[int, dict[str, int]]
    dst_strides: dict[int, dict[str, int]]
    #: shared by every plan of the shape: read only
    boxes: dict[tuple[int, int], Box]
    pairs: list[tuple[int, int]]
    src_ranks: tuple[int, ...]
    dst_ranks: tuple[int, ...]
    total: int
    direct: bool
    key: tuple[object, ...]
    src_walk: _Walk
    dst_walk: _Walk
    #: :attr:`Plan.shape_memo`
    memo: dict[object, object] = field(default_factory=dict)


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _shape(
    ctx: KVLayout, gen: KVLayout, ctx_ranks: tuple[int, ...], gen_ranks: tuple[int, ...], n_ctx: int, n_gen: int
) -> _Shape:
    tpb_c, tpb_g = ctx.tokens_per_block, gen.tokens_per_block
    tokens = min(n_ctx * tpb_c, n_gen * tpb_g)
    if -(-tokens // tpb_c) != n_ctx or -(-tokens // tpb_g) != n_gen:
        # the fix, both ways: the caller does not know which side miscounted
        gen_needs, ctx_needs = -(-n_ctx * tpb_c // tpb_g), -(-n_gen * tpb_g // tpb_c)
        raise BadRequest(
            f"ctx and gen hold different token counts: ctx has {n_ctx} blocks x {tpb_c} tokens = "
            f"{n_ctx * tpb_c} token slots, gen has {n_gen} blocks x {tpb_g} tokens = {n_gen * tpb_g}; "
            f"each rank registers the blocks of the same tokens: for ctx's {n_ctx} blocks a gen rank "
            f"registers {gen_needs}, for gen's {n_gen} a ctx rank registers {ctx_needs} (a last block "
            "may be partly filled)"
        )

    # Walk the request in sub-blocks of the smaller tokens_per_block; a larger block holds k of them.
    sub = min(tpb_c, tpb_g)
    nsub = tokens // sub
    _check_plan_size(ctx, gen, len(ctx_ranks), len(gen_ranks), nsub)
    src_strides = {r: pool_strides(ctx, r) for r in ctx_ranks}
    dst_strides = {r: pool_strides(gen, r) for r in gen_ranks}
    boxes: dict[tuple[int, int], Box] = {}
    if nsub:
        for d in sorted(gen_ranks):
            g_stage, g_tp = divmod(d, gen.tp_size)
            g_layers = gen.layer_range(g_stage)
            g_heads = gen.head_range(g_tp)
            for c_stage in range(ctx.pp_size):
                c_layers = ctx.layer_range(c_stage)
                layers = (max(g_layers[0], c_layers[0]), min(g_layers[1], c_layers[1]))
                if layers[0] >= layers[1]:
                    continue
                for s, h0, h1 in _sources(ctx, ctx_ranks, c_stage, g_heads, g_tp):
                    boxes[(s, d)] = Box(
                        src=s,
                        dst=d,
                        layers=layers,
                        heads=(h0, h1),
                        src_layer0=c_layers[0],
                        dst_layer0=g_layers[0],
                        src_head0=ctx.head_range(s % ctx.tp_size)[0],
                        dst_head0=g_heads[0],
                    )
    pairs = sorted(boxes)
    return _Shape(
        tokens, sub, nsub, src_strides, dst_strides, boxes, pairs,
        src_ranks=tuple(sorted({s for s, _ in pairs})),
        dst_ranks=tuple(sorted({d for _, d in pairs})),
        total=_box_bytes(ctx, boxes.values(), tokens),
        direct=bool(pairs) and all(_is_direct(ctx, gen, b) for b in boxes.values()),
        key=(ctx, gen, ctx_ranks, gen_ranks, n_ctx, n_gen),
        src_walk=_Walk.build(ctx, ctx_ranks, src_strides, sub, nsub),
        dst_walk=_Walk.build(gen, gen_ranks, dst_strides, sub, nsub),
    )


def _box_bytes(ctx: KVLayout, boxes: Iterable[Box], num_tokens: int) -> int:
    """Bytes ``boxes`` move: each its box (layers x K/V x heads x head_dim) for every token."""
    per_token = 2 * ctx.head_dim * ctx.itemsize
    return sum((b.layers[1] - b.layers[0]) * (b.heads[1] - b.heads[0]) * per_token * num_tokens for b in boxes)


def _is_direct(ctx: KVLayout, gen: KVLayout, box: Box) -> bool:
    """:meth:`Plan.is_direct` of ``box``'s pair."""
    if ctx.axis_order != gen.axis_order or ctx.tokens_per_block != gen.tokens_per_block:
        return False
    src_shape = ctx.local_shape(box.src)
    dst_shape = gen.local_shape(box.dst)
    nl = box.layers[1] - box.layers[0]
    nh = box.heads[1] - box.heads[0]
    return src_shape["layer"] == dst_shape["layer"] == nl and src_shape["head"] == dst_shape["head"] == nh


# -- executing fragments ----------------------------------------------------------------------


def row_indices(offsets: Int64Array, nbytes: Int64Array, row: int) -> Int64Array:
    """Indices of the ``row``-byte rows covering fragments ``(offsets[i], nbytes[i])``, in
    fragment order. ``row`` must divide every offset and length."""
    counts = nbytes // row
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    # idx[j] = first_row[frag(j)] + (j - first position of frag(j)): one repeat + one arange.
    starts = np.cumsum(counts) - counts
    idx: Int64Array = np.repeat(offsets // row - starts, counts) + np.arange(total, dtype=np.int64)
    return idx


def row_size(*arrays: Int64Array, limit: int = 0) -> int:
    """Largest row size (bytes) dividing every value of ``arrays`` (and ``limit`` if given)."""
    g = limit
    for a in arrays:
        if a.size:
            g = math.gcd(g, int(np.gcd.reduce(a)))
    return g or 1


#: Bytes a :class:`FragmentCopier` moves per indexed copy of a torch CPU tensor that is not
#: contiguous (torch path). It bounds the scratch buffer: glibc maps allocations above 32 MiB
#: fresh each time, and first-touch page faults then dominate; 16 MiB stays in the heap.
APPLY_STEP_BYTES = 16 << 20
#: The same on CUDA, where the caching allocator reuses memory: fewer, larger steps.
APPLY_STEP_BYTES_CUDA = 256 << 20


class FragmentCopier:
    """Row indices of one fragment list (N, 3), built once; :meth:`copy` then moves the bytes
    from a source pool to a destination pool with indexed row copies.

    Rows are R = gcd(all offsets and lengths) bytes, so the index has total/R entries (R = 8 KiB
    for the GPT-OSS regroup), never one per byte; the copy goes through a scratch buffer of at
    most ``kvd.regroup.hostkernel.SCRATCH_BYTES`` on host memory (``APPLY_STEP_BYTES_CUDA`` on CUDA) and Python
    loops once per step, not per fragment. Device copies of the index are cached per device."""

    def __init__(self, frags: Int64Array) -> None:
        self.nbytes = int(frags[:, 2].sum()) if frags.size else 0
        self.row = row_size(frags[:, 0], frags[:, 1], frags[:, 2]) if frags.size else 1
        self.src_index = row_indices(frags[:, 0], frags[:, 2], self.row) if frags.size else _EMPTY[:, 0]
        self.dst_index = row_indices(frags[:, 1], frags[:, 2], self.row) if frags.size else _EMPTY[:, 0]
        self._device_index: dict[str, tuple[Any, Any]] = {}

    def copy(self, src_pool: Pool, dst_pool: Pool) -> None:
        """Copy into ``dst_pool`` (same kind as ``src_pool``: both numpy or both torch; torch
        pools may be on different devices)."""
        if self.nbytes == 0:
            return
        r, si, di = self.row, self.src_index, self.dst_index
        from kvd.regroup import hostkernel  # (it imports this module: imported when first used)

        src_np, dst_np = hostkernel.host_view(src_pool), hostkernel.host_view(dst_pool)
        if src_np is not None and dst_np is not None:
            # host memory, numpy or CPU torch: numpy's indexed copies (the row indices are in
            # range by construction)
            step = hostkernel.scratch_rows(r)
            hostkernel.copy_rows(_np_rows(src_np, r), _np_rows(dst_np, r),
                                 ((si[k : k + step], di[k : k + step]) for k in range(0, si.size, step)))
            return
        import torch

        from kvd.regroup.stager import elem_width, torch_rows  # torch only where torch pools are used

        w = elem_width(r, src_pool, dst_pool)
        src_t = torch_rows(src_pool, r, w)
        dst_t = torch_rows(dst_pool, r, w)
        key = f"{src_t.device}>{dst_t.device}"
        idx = self._device_index.get(key)
        if idx is None:
            idx = self._device_index[key] = (
                torch.from_numpy(si).to(src_t.device),
                torch.from_numpy(di).to(dst_t.device),
            )
        sidx, didx = idx
        if src_t.device.type == "cuda":
            step = max(1, APPLY_STEP_BYTES_CUDA // r)
        buf = torch.empty((min(step, si.size), r // w), dtype=src_t.dtype, device=src_t.device)
        for k in range(0, si.size, step):
            n = min(step, si.size - k)
            torch.index_select(src_t, 0, sidx[k : k + n], out=buf[:n])
            dst_t.index_copy_(0, didx[k : k + n], buf[:n].to(dst_t.device))


def copy_fragments(frags: Int64Array, src_pool: Pool, dst_pool: Pool) -> None:
    """One-off :meth:`FragmentCopier.copy` of fragments (N, 3) from ``src_pool`` to ``dst_pool``."""
    FragmentCopier(frags).copy(src_pool, dst_pool)


def _np_rows(pool: npt.NDArray[Any], row: int) -> npt.NDArray[Any]:
    if not pool.flags.c_contiguous:
        raise ValueError("pool must be C-contiguous (a non-contiguous reshape would copy)")
    flat = pool.reshape(-1).view(np.uint8)
    n = flat.size // row
    return flat[: n * row].reshape(n, row)
