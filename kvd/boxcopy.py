"""Single-pass regroup copies between two mapped pools, block by block.

When both pools are addressable from this process (the same-node *mapped* path), the regroup
of a (src rank, dst rank) pair is, for every request block, one strided tensor copy of the
pair's box (layers x K/V x heads x tokens x dim) from the source block into the destination
block. ``Tensor.copy_`` walks both strided views once, so each byte is read and written once;
the fragment copier (:meth:`kvd.plan.Plan.apply`) gathers into scratch and scatters out again,
touching every byte twice. One Python call per block (256 for an 8k-token request), never
per fragment.

Only for equal ``tokens_per_block`` (block i maps to block i); otherwise callers use the
fragment copier.
"""

from __future__ import annotations

import torch

from kvd.plan import Plan
from protocol.layout import KVLayout

LOGICAL = ("layer", "kv", "head", "token", "dim")


def _block_view(
    pool: torch.Tensor, layout: KVLayout, block: int, layers: tuple[int, int], heads: tuple[int, int]
) -> torch.Tensor:
    """``pool[block]`` restricted to ``layers``/``heads`` (local indices), in LOGICAL order."""
    axes = list(layout.axis_order)
    view = pool.select(axes.index("block"), block)
    axes.remove("block")
    view = view.narrow(axes.index("layer"), layers[0], layers[1] - layers[0])
    view = view.narrow(axes.index("head"), heads[0], heads[1] - heads[0])
    return view.permute(*(axes.index(a) for a in LOGICAL))


def supports_box_copy(p: Plan) -> bool:
    """Block-by-block box copies apply when both sides use the same tokens per block."""
    return p.ctx.tokens_per_block == p.gen.tokens_per_block


def copy_pair_boxes(p: Plan, s: int, d: int, src_pool: torch.Tensor, dst_pool: torch.Tensor) -> int:
    """Copy pair (s, d) of ``p`` from ``src_pool`` into ``dst_pool`` (typed pool tensors shaped
    ``layout.pool_shape(rank)``); returns the bytes copied."""
    box = p.box(s, d)
    if box is None:
        return 0
    src_layers = (box.layers[0] - box.src_layer0, box.layers[1] - box.src_layer0)
    dst_layers = (box.layers[0] - box.dst_layer0, box.layers[1] - box.dst_layer0)
    src_heads = (box.heads[0] - box.src_head0, box.heads[1] - box.src_head0)
    dst_heads = (box.heads[0] - box.dst_head0, box.heads[1] - box.dst_head0)
    src_ids = p.ctx_blocks[s].tolist()
    dst_ids = p.gen_blocks[d].tolist()
    nbytes = 0
    for sb, db in zip(src_ids, dst_ids, strict=True):
        dst = _block_view(dst_pool, p.gen, db, dst_layers, dst_heads)
        dst.copy_(_block_view(src_pool, p.ctx, sb, src_layers, src_heads))
        nbytes += dst.numel() * dst.element_size()
    return nbytes
