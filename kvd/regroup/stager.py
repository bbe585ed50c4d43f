"""The bounce stager: a plan's fragments, cut into bounce-buffer chunks, gathered and scattered.

Per-head fragments are tiny (8 KiB for GPT-OSS-120B TP1 -> TP4), and a transport that sees one
descriptor per fragment crawls (1.2 GB/s against 390 on one H200 pair). So the sender *gathers* the
fragments bound for one receiver rank into a contiguous bounce region, ships it as one large
write, and the receiver *scatters* it into its blocks.

:func:`schedule` cuts each (src, dst) pair's fragment stream into chunks of at most
``chunk_bytes``: the stream is packed back to back and cut at multiples of ``chunk_bytes``, so
every chunk but the pair's last is full and a fragment larger than a chunk spans several.
A chunk is an int64 array of pieces ``(src_off, dst_off, nbytes, bounce_off)`` with
``bounce_off`` relative to the chunk's start in the bounce region.

:class:`Stager` turns one chunk into index tensors ONCE; :meth:`Stager.gather` and
:meth:`Stager.scatter` are then a single torch indexed copy each, on CPU or CUDA tensors alike.
The pools are viewed as rows of R bytes, R = gcd of the chunk's offsets and lengths on that
side (8 KiB for the GPT-OSS regroup), and rows as int64 (or the widest integer type R and the
pointers allow), so the index holds one entry per row, never one per byte; a fragment of k rows
takes k entries. Measured (64 MiB of random rows out of a 2.25 GiB pool; CPU: the 2-core dev
box, torch 2.13, median of 5; CUDA: one H200, torch 2.11, CUDA events, median of 20), GB/s:

=====================================================  =====  =========  ==========
method                                                  CPU    H200 8K    H200 128B
=====================================================  =====  =========  ==========
contiguous ``copy_`` of the same 64 MiB                  4.4    991-1395
gather: ``index_select(rows_int64, 0, idx, out=...)``    3.7    1171       193
gather: same with uint8 rows                             2.9    1212       189
gather: ``bounce.copy_(rows[idx])`` (temporary)          0.9    723        175
scatter: ``rows_int64.index_copy_(0, idx, bounce)``      2.8    1267       1069
scatter: ``index_put_``                                  2.8    1035       895
scatter: ``index_copy_`` with uint8 rows                 1.1    327        314
=====================================================  =====  =========  ==========

so gather uses ``index_select(out=)`` and scatter ``index_copy_``, both on int64 rows
(16-byte complex128 rows scatter 12% faster on CPU; not used, integer types are the safe
choice for arbitrary bytes). Known gap: ``index_select`` on CUDA is slow for small rows
(128-byte head vectors: 193 GB/s); the regroups that matter have rows of KiBs. End to end
(``python -m kvd.bench.regroup``, GPT-OSS TP1 -> TP4, 576 MiB, 64 MiB chunks): H200 gather
1590, scatter 1516, gather+scatter 799 GB/s (729 with 16 MiB chunks) vs a 1987 GB/s
contiguous copy; CPU dev box
gather ~10, scatter ~9, gather+scatter ~4.5 vs ~10 GB/s. Per call, a stager costs ~3 us of
Python once its views are cached (~19 us before: it matters for small chunks on a GPU).

For a copy-engine path (``cuMemcpy2DAsync``), :meth:`Chunk.copy2d` groups a chunk's pieces
into 2D copies (equal widths at a constant pitch): one per block for the GPT-OSS regroup.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from kvd.regroup.plan import Plan, row_indices, row_size

if TYPE_CHECKING:
    import torch

    # (pool, bounce, pool rows, bounce rows, index): views cached by the pair's identity.
    _Views = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

__all__ = [
    "BounceSchedule",
    "Chunk",
    "Stager",
    "elem_width",
    "gather",
    "scatter",
    "schedule",
    "torch_rows",
]

Int64Array = npt.NDArray[np.int64]

#: Default bounce buffer size, as TensorRT-LLM's ``kv_cache_bounce_size_mb``.
DEFAULT_BOUNCE_SIZE_MB = 512
#: Default chunk size: 8 chunks in flight in the default bounce buffer.
DEFAULT_CHUNK_BYTES = 64 << 20


@dataclass(eq=False)
class Chunk:
    """One bounce-buffer load of a (src, dst) pair: pieces packed back to back."""

    #: ctx rank the pieces are read from.
    src: int
    #: gen rank the pieces are written to.
    dst: int
    #: Position among the pair's chunks (0, 1, ...): the order they are streamed in.
    index: int
    #: int64 (N, 4): (src byte offset, dst byte offset, nbytes, byte offset in this chunk's bounce region).
    pieces: Int64Array
    #: Bytes in the chunk (sum of pieces' nbytes; <= the schedule's chunk_bytes).
    nbytes: int
    #: Bounce slot assigned round-robin over the schedule (slots = bounce bytes // chunk bytes).
    slot: int = 0
    #: Byte offset of the slot in the bounce buffer (slot * chunk_bytes).
    bounce_offset: int = 0
    _stagers: dict[str, Stager] = field(default_factory=dict, repr=False)

    def stager(self, device: torch.device | str = "cpu") -> Stager:
        """The chunk's :class:`Stager` for ``device``, built on first use and cached."""
        import torch

        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:  # "cuda" and "cuda:0" share one stager
            dev = torch.device("cuda", torch.cuda.current_device())
        key = str(dev)
        st = self._stagers.get(key)
        if st is None:
            st = self._stagers[key] = Stager(self, dev)
        return st

    def copy2d(self, side: Literal["src", "dst"] = "src") -> Int64Array:
        """The chunk's pieces on ``side`` as 2D copies, int64 (M, 5):
        ``(pool_off, pool_pitch, bounce_off, width, height)``. Row ``j`` of copy ``i`` is
        ``width`` bytes at ``pool_off + j * pool_pitch`` in the pool and at
        ``bounce_off + j * width`` in the bounce region (pieces are packed, so the bounce pitch
        is the width): one ``cuMemcpy2DAsync`` each. Maximal runs of equal widths at a constant
        pitch are found with a vectorized pass (no per-piece Python)."""
        p = self.pieces
        off = p[:, 0] if side == "src" else p[:, 1]
        return _copy2d(off, p[:, 2], p[:, 3])


def _copy2d(off: Int64Array, width: Int64Array, boff: Int64Array) -> Int64Array:
    n = off.size
    if n == 0:
        return np.zeros((0, 5), dtype=np.int64)
    d = np.zeros(n, dtype=np.int64)
    d[1:] = np.diff(off)
    valid = np.zeros(n, dtype=bool)  # piece i may follow piece i-1 in a 2D copy
    valid[1:] = width[1:] == width[:-1]
    # Runs, in index space: maximal stretches of valid i with equal pitch d[i]; a run over
    # indices [a, b] can make pieces a-1..b one 2D copy. Neighbouring runs compete for the
    # piece between them; the rules below settle that without a sequential scan:
    # - a long run (>= 2 indices) takes its first piece a-1 unless the run before holds it;
    # - a stretch of one-index runs (pairs of pieces) pairs up every other index, starting
    #   so as not to take a piece a long run holds, and yields its last pair to a long run
    #   that follows. So a pitch break between blocks costs no extra copy.
    run_start = valid.copy()
    run_start[2:] &= ~(valid[1:-1] & (d[2:] == d[1:-1]))
    run_id = np.cumsum(run_start) - 1
    run_len = np.bincount(run_id[valid], minlength=int(run_id[-1]) + 1 if run_id[-1] >= 0 else 0)
    long_ = valid.copy()
    long_[valid] = run_len[run_id[valid]] >= 2
    short = valid & ~long_
    # Stretches of consecutive short indices; parity within each stretch picks the pairs.
    s_start = short.copy()
    s_start[1:] &= ~short[:-1]
    first = np.maximum.accumulate(np.where(s_start, np.arange(n), 0))
    shift = np.zeros(n, dtype=np.int64)
    shift[1:] = long_[:-1]  # long_[a-1] for a stretch starting at a, read at a then spread
    shift = shift[first]
    link_short = short & ((np.arange(n) - first) % 2 == shift)
    link_short[:-1] &= ~long_[1:]  # a long run right after takes the last piece
    taken = long_ | link_short  # piece i already belongs to a group reaching back to i-1
    link_long = long_.copy()
    link_long[1:] &= ~(run_start[1:] & taken[:-1])
    start = ~(link_long | link_short)
    start[0] = True
    s = np.flatnonzero(start)
    height = np.diff(np.append(s, n))
    out = np.empty((s.size, 5), dtype=np.int64)
    out[:, 0] = off[s]
    out[:, 2] = boff[s]
    out[:, 3] = width[s]
    out[:, 4] = height
    tall = height > 1
    out[:, 1] = out[:, 3]
    out[tall, 1] = off[s[tall] + 1] - off[s[tall]]
    return out


@dataclass(eq=False)
class BounceSchedule:
    """A plan's fragments cut into chunks per (src, dst) pair. Build with :func:`schedule`."""

    plan: Plan
    chunk_bytes: int
    bounce_bytes: int
    _chunks: dict[tuple[int, int], list[Chunk]]

    @property
    def slots(self) -> int:
        """Chunks that fit in the bounce buffer at once."""
        return self.bounce_bytes // self.chunk_bytes

    def pairs(self) -> list[tuple[int, int]]:
        """(src, dst) pairs with chunks, sorted (the plan's pairs)."""
        return sorted(self._chunks)

    def chunks(self, s: int, d: int) -> list[Chunk]:
        """Pair (s, d)'s chunks in stream order; empty if the pair moves nothing."""
        return self._chunks.get((s, d), [])

    def all_chunks(self) -> list[Chunk]:
        """Every chunk, pairs in sorted order, each pair's chunks in stream order."""
        return [c for k in self.pairs() for c in self._chunks[k]]

    def num_chunks(self) -> int:
        """Number of chunks over all pairs."""
        return sum(len(v) for v in self._chunks.values())


def schedule(
    plan: Plan,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    bounce_size_mb: int = DEFAULT_BOUNCE_SIZE_MB,
) -> BounceSchedule:
    """Cut every pair's fragments into chunks of at most ``chunk_bytes`` (the last chunk of a
    pair may be shorter; a fragment may span chunks). Chunks get bounce slots round-robin over
    ``bounce_size_mb << 20 // chunk_bytes`` slots. Use a power-of-two ``chunk_bytes``: cut
    points inherit its alignment, and the stager's row size is the gcd of all offsets."""
    bounce_bytes = bounce_size_mb << 20
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if chunk_bytes > bounce_bytes:
        raise ValueError(f"chunk_bytes={chunk_bytes} exceeds the bounce buffer ({bounce_size_mb} MiB)")
    slots = bounce_bytes // chunk_bytes
    out: dict[tuple[int, int], list[Chunk]] = {}
    k = 0
    for s, d in plan.pairs():
        chunks = _cut(plan.fragments(s, d), chunk_bytes)
        lst = []
        for i, pieces in enumerate(chunks):
            slot = k % slots
            lst.append(Chunk(s, d, i, pieces, int(pieces[:, 2].sum()), slot, slot * chunk_bytes))
            k += 1
        out[(s, d)] = lst
    return BounceSchedule(plan, chunk_bytes, bounce_bytes, out)


def _cut(frags: Int64Array, chunk: int) -> list[Int64Array]:
    """Split a fragment stream (N, 3) at stream positions k * chunk -> pieces (M, 4) per chunk."""
    if frags.size == 0:
        return []
    n = frags[:, 2]
    end = np.cumsum(n)
    start = end - n
    first = start // chunk
    last = (end - 1) // chunk
    count = last - first + 1
    fid = np.repeat(np.arange(n.size, dtype=np.int64), count)
    # Chunk index of each piece: the fragment's first chunk + its rank among the fragment's pieces.
    k = np.repeat(first - (np.cumsum(count) - count), count) + np.arange(fid.size, dtype=np.int64)
    p0 = np.maximum(start[fid], k * chunk)
    p1 = np.minimum(end[fid], (k + 1) * chunk)
    delta = p0 - start[fid]
    pieces = np.empty((fid.size, 4), dtype=np.int64)
    pieces[:, 0] = frags[fid, 0] + delta
    pieces[:, 1] = frags[fid, 1] + delta
    pieces[:, 2] = p1 - p0
    pieces[:, 3] = p0 - k * chunk
    bounds = np.searchsorted(k, np.arange(int(k[-1]) + 2))
    return [pieces[bounds[i] : bounds[i + 1]] for i in range(bounds.size - 1)]


# -- torch execution ---------------------------------------------------------------------------


def _int_dtype(width: int) -> torch.dtype:
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]


def elem_width(row: int, *tensors: torch.Tensor) -> int:
    """Widest integer element (8, 4, 2 or 1 bytes) dividing ``row`` and every tensor's byte
    storage offset, so uint8 pools can be viewed as that type (fewer, wider element copies)."""
    w = 8
    while w > 1:
        if row % w == 0 and all((t.storage_offset() * t.element_size()) % w == 0 for t in tensors):
            return w
        w //= 2
    return 1


def torch_rows(pool: torch.Tensor, row: int, width: int = 1) -> torch.Tensor:
    """View a contiguous pool (any dtype) as (pool bytes // row, row // width) rows of the
    ``width``-byte integer type; the tail shorter than a row is left out. No copy."""
    import torch

    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous")
    flat = pool.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    n = flat.numel() // row
    return flat[: n * row].view(_int_dtype(width)).view(n, row // width)


class Stager:
    """Index tensors of one chunk, built once; gather/scatter are one indexed copy each.

    ``gather`` reads the chunk's pieces from the source pool into ``bounce[:chunk.nbytes]``;
    ``scatter`` writes ``bounce[:chunk.nbytes]`` into the destination pool. Pools and bounce
    are contiguous tensors (uint8, or any dtype viewed as bytes) on CPU or CUDA; the index
    lives on ``device`` (moved, and cached, if a pool is elsewhere). The row views of the
    last (pool, bounce) tensors used are cached by identity (so the stager keeps a reference
    to them); pass the same tensor objects each time for the fast path.
    """

    def __init__(self, chunk: Chunk, device: torch.device | str = "cpu") -> None:
        import torch

        self.chunk = chunk
        self.device = torch.device(device)
        p = chunk.pieces
        # Bounce offsets are running sums of the lengths, so gcd(offsets, lengths) divides them too.
        self.src_row = row_size(p[:, 0], p[:, 2])
        self.dst_row = row_size(p[:, 1], p[:, 2])
        self._src_np = row_indices(p[:, 0], p[:, 2], self.src_row)
        self._dst_np = row_indices(p[:, 1], p[:, 2], self.dst_row)
        self._index: dict[tuple[str, str], torch.Tensor] = {}
        self.src_index = self._idx("src", self.device)
        self.dst_index = self._idx("dst", self.device)
        # The views of the last (pool, bounce) pair used, checked by identity: building them
        # costs ~15 us of Python per call, as much as a 16 MiB gather on an H200.
        self._gather_views: _Views | None = None
        self._scatter_views: _Views | None = None

    def _idx(self, side: str, device: torch.device) -> torch.Tensor:
        import torch

        key = (side, str(device))
        t = self._index.get(key)
        if t is None:
            t = torch.from_numpy(self._src_np if side == "src" else self._dst_np).to(device)
            self._index[key] = t
        return t

    def _bounce(self, bounce: torch.Tensor) -> torch.Tensor:
        if bounce.numel() * bounce.element_size() < self.chunk.nbytes:
            raise ValueError(
                f"bounce region holds {bounce.numel() * bounce.element_size()} bytes, chunk needs {self.chunk.nbytes}"
            )
        import torch

        flat = bounce.reshape(-1)
        if flat.dtype != torch.uint8:
            flat = flat.view(torch.uint8)
        return flat[: self.chunk.nbytes]

    def gather(self, src_pool: torch.Tensor, bounce: torch.Tensor) -> None:
        """Copy the chunk's source pieces from ``src_pool`` into ``bounce[:chunk.nbytes]``."""
        import torch

        if self.chunk.nbytes == 0:
            return
        g = self._gather_views
        if g is None or g[0] is not src_pool or g[1] is not bounce:
            g = self._gather_views = (src_pool, bounce, *self._views(src_pool, bounce, self.src_row, "src"))
        rows, out, idx = g[2], g[3], g[4]
        if out.device == rows.device:
            torch.index_select(rows, 0, idx, out=out)
        else:
            out.copy_(torch.index_select(rows, 0, idx))

    def scatter(self, bounce: torch.Tensor, dst_pool: torch.Tensor) -> None:
        """Copy ``bounce[:chunk.nbytes]`` into the chunk's destination pieces of ``dst_pool``."""
        if self.chunk.nbytes == 0:
            return
        v = self._scatter_views
        if v is None or v[0] is not dst_pool or v[1] is not bounce:
            v = self._scatter_views = (dst_pool, bounce, *self._views(dst_pool, bounce, self.dst_row, "dst"))
        rows, src, idx = v[2], v[3], v[4]
        if src.device != rows.device:
            src = src.to(rows.device)
        rows.index_copy_(0, idx, src)

    def _views(
        self, pool: torch.Tensor, bounce: torch.Tensor, row: int, side: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pool rows, bounce rows, index on the pool's device) for one (pool, bounce) pair."""
        b = self._bounce(bounce)
        w = elem_width(row, pool, b)
        rows = torch_rows(pool, row, w)
        return rows, b.view(_int_dtype(w)).view(-1, row // w), self._idx(side, rows.device)


def gather(chunk: Chunk, src_pool: torch.Tensor, bounce: torch.Tensor) -> None:
    """Gather ``chunk``'s pieces from ``src_pool`` into ``bounce`` (cached :class:`Stager`)."""
    chunk.stager(src_pool.device).gather(src_pool, bounce)


def scatter(chunk: Chunk, bounce: torch.Tensor, dst_pool: torch.Tensor) -> None:
    """Scatter ``bounce`` into ``chunk``'s pieces of ``dst_pool`` (cached :class:`Stager`)."""
    chunk.stager(dst_pool.device).scatter(bounce, dst_pool)
