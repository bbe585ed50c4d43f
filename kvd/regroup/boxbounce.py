"""Bounce chunks made of whole-block boxes: the bounce pipeline without fragment indices.

When both sides use the same ``tokens_per_block`` a (src rank, dst rank) pair moves, for each
request block, one box (layers x K/V x heads x tokens x dim). A :class:`BoxChunk` is a run of
such blocks that fits one bounce slot, staged contiguously in logical order
``[block, layer, kv, head, token, dim]``. Gather and scatter are then one ``index_select`` /
``index_copy_`` per chunk on CUDA (index = one entry per block), or one strided
``numpy.copyto`` per block on host memory — nothing is built per fragment, which is what made
the fragment stager's bounce path slow per request (its index tensors are rebuilt for every new
request's block ids). Sender and receiver derive the same chunk list from the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvd.regroup.boxcopy import _as_array, _block_view, widest_view
from kvd.regroup.gpu_pipeline import _box_view
from kvd.regroup.plan import Plan


@dataclass(frozen=True)
class BoxChunk:
    """Blocks ``src_ids[i] -> dst_ids[i]`` of pair (src, dst), staged as one contiguous slot."""

    index: int
    src: int
    dst: int
    src_ids: tuple[int, ...]
    dst_ids: tuple[int, ...]
    layers_src: tuple[int, int]
    heads_src: tuple[int, int]
    layers_dst: tuple[int, int]
    heads_dst: tuple[int, int]
    block_bytes: int

    @property
    def nbytes(self) -> int:
        return self.block_bytes * len(self.src_ids)


def box_chunks(p: Plan, chunk_bytes: int) -> list[BoxChunk]:
    """Every pair's blocks cut into chunks of at most ``chunk_bytes`` (at least one block)."""
    out: list[BoxChunk] = []
    itemsize = p.ctx.itemsize
    for s, d in p.pairs():
        box = p.box(s, d)
        if box is None:
            continue
        nl, nh = box.layers[1] - box.layers[0], box.heads[1] - box.heads[0]
        block_bytes = nl * 2 * nh * p.ctx.tokens_per_block * p.ctx.head_dim * itemsize
        step = max(1, chunk_bytes // block_bytes)
        if block_bytes > chunk_bytes:
            raise ValueError(f"one block's box ({block_bytes} B) exceeds the chunk size {chunk_bytes} B")
        src_ids, dst_ids = p.ctx_blocks[s].tolist(), p.gen_blocks[d].tolist()
        for lo in range(0, len(src_ids), step):
            out.append(BoxChunk(
                index=len(out), src=s, dst=d,
                src_ids=tuple(src_ids[lo : lo + step]), dst_ids=tuple(dst_ids[lo : lo + step]),
                layers_src=box.src_local[0], heads_src=box.src_local[1],
                layers_dst=box.dst_local[0], heads_dst=box.dst_local[1],
                block_bytes=block_bytes,
            ))  # fmt: skip
    return out


def fits(p: Plan, chunk_bytes: int) -> bool:
    """Box chunks apply: equal tokens per block and every block's box fits one slot."""
    if p.ctx.tokens_per_block != p.gen.tokens_per_block:
        return False
    per_head_layer = 2 * p.ctx.tokens_per_block * p.ctx.head_dim * p.ctx.itemsize
    return all(
        (b.layers[1] - b.layers[0]) * (b.heads[1] - b.heads[0]) * per_head_layer <= chunk_bytes
        for b in (p.box(s, d) for s, d in p.pairs())
        if b is not None
    )


def _staged_shape(c: BoxChunk, view: torch.Tensor) -> tuple[int, ...]:
    return (len(c.src_ids), *view.shape[1:])


def gather_box(p: Plan, c: BoxChunk, src_pool: torch.Tensor, slot: torch.Tensor) -> None:
    """Stage chunk ``c`` from the typed ``src_pool`` into the uint8 ``slot`` (waits on CUDA)."""
    if src_pool.is_cuda:
        view = _box_view(widest_view(src_pool), p.ctx, c.layers_src, c.heads_src)
        shape = _staged_shape(c, view)
        staged = slot[: c.nbytes].view(view.dtype).view(shape)
        ids = torch.tensor(c.src_ids, device=view.device)
        if staged.device == view.device:
            torch.index_select(view, 0, ids, out=staged)
        else:  # a daemon with pools on several GPUs stages on one of them: select, then copy over
            staged.copy_(torch.index_select(view, 0, ids))
            torch.cuda.current_stream(staged.device).synchronize()
        torch.cuda.current_stream(view.device).synchronize()
        return
    src = _as_array(src_pool)
    first = _block_view(src, p.ctx, c.src_ids[0], c.layers_src, c.heads_src)
    out = slot[: c.nbytes].numpy().view(first.dtype).reshape((len(c.src_ids), *first.shape))
    for j, sb in enumerate(c.src_ids):
        np.copyto(out[j], _block_view(src, p.ctx, sb, c.layers_src, c.heads_src))


def scatter_box(p: Plan, c: BoxChunk, slot: torch.Tensor, dst_pool: torch.Tensor) -> None:
    """Write staged chunk ``c`` from the uint8 ``slot`` into the typed ``dst_pool`` (waits on CUDA)."""
    if dst_pool.is_cuda:
        view = _box_view(widest_view(dst_pool), p.gen, c.layers_dst, c.heads_dst)
        shape = _staged_shape(c, view)
        staged = slot[: c.nbytes].view(view.dtype).view(shape)
        ids = torch.tensor(c.dst_ids, device=view.device)
        # Staging may sit on another GPU of this daemon (it lives on the first GPU pool's device).
        view.index_copy_(0, ids, staged if staged.device == view.device else staged.to(view.device))
        torch.cuda.current_stream(view.device).synchronize()
        return
    dst = _as_array(dst_pool)
    first = _block_view(dst, p.gen, c.dst_ids[0], c.layers_dst, c.heads_dst)
    staged_np = slot[: c.nbytes].numpy().view(first.dtype).reshape((len(c.dst_ids), *first.shape))
    for j, db in enumerate(c.dst_ids):
        np.copyto(_block_view(dst, p.gen, db, c.layers_dst, c.heads_dst), staged_np[j])
