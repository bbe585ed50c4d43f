"""A paged KV cache over a kvd pool: the model's K/V live in the pool's blocks, in its layout.

The pool tensor an executor gets from ``attach`` is shaped ``layout.pool_shape(rank)`` in the
pool's ``axis_order`` (TensorRT-LLM's block-major ``block, layer, kv, head, token, dim`` or
vLLM's layer-major ``layer, kv, block, head, token, dim``). :func:`canonical_view` permutes it
(a view: no copy) to block-major order, so the cache code is the same for every axis order and
every write lands in kvd's memory where the daemon, and the peer after a transfer, expect it.

A sequence owns a list of block ids; token ``p`` of it lives in block ``ids[p // tpb]`` at slot
``p % tpb``, for every layer, K and V, and every head of this rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvd.demo.model.transformer import ModelConfig
from protocol.errors import IncompatibleLayout
from protocol.layout import TRTLLM_AXIS_ORDER, KVLayout
from protocol.messages import PoolInfo


def canonical_view(pool: torch.Tensor, axis_order: Sequence[str]) -> torch.Tensor:
    """``pool`` (in ``axis_order``) as a ``[block, layer, kv, head, token, dim]`` view."""
    order = list(axis_order)
    if sorted(order) != sorted(TRTLLM_AXIS_ORDER) or pool.dim() != len(order):
        raise ValueError(f"axis order {order} does not describe a {pool.dim()}-d pool tensor")
    return pool.permute(*[order.index(a) for a in TRTLLM_AXIS_ORDER])


def pool_layout(cfg: ModelConfig, dtype: str, tp_size: int, rank: int, info: PoolInfo) -> KVLayout:
    """The :class:`KVLayout` this executor registers requests with, checked against its pool.

    The model fixes layers, KV heads, head_dim and dtype; the executor's parallel config fixes
    ``tp_size`` and its ``rank``; the pool (kvd's configuration) fixes tokens per block, axis
    order and block count. A pool configured for another model or rank is refused here, before
    any K/V is written, with both sides named.
    """
    have = info.layout
    if have is None:
        raise IncompatibleLayout(f"pool {info.name!r} has no model layout configured")
    want = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, have.tokens_per_block, dtype, tp_size=tp_size,
                    axis_order=have.axis_order, num_blocks=have.num_blocks)
    if want != have or info.rank != rank:
        raise IncompatibleLayout(
            f"pool {info.name!r} serves rank {info.rank} of {have}; this executor is rank {rank} of {want}"
        )
    return want


def blocks_for(tokens: int, tokens_per_block: int) -> int:
    """Blocks that hold ``tokens`` tokens."""
    return -(-tokens // tokens_per_block)


class PagedKV:
    """The model's :class:`~kvd.demo.model.transformer.KVStore` over a kvd pool.

    ``add(block_ids)`` registers a sequence and returns its index; its tokens are then written
    and read through the pool tensor only.
    """

    def __init__(self, pool: torch.Tensor, layout: KVLayout, rank: int) -> None:
        want = layout.pool_shape(rank)
        if tuple(pool.shape) != want:
            raise ValueError(f"pool tensor has shape {list(pool.shape)}, rank {rank} of the layout needs {list(want)}")
        self.view = canonical_view(pool, layout.axis_order)
        self.tokens_per_block = layout.tokens_per_block
        self._ids: list[list[int]] = []
        self._index: list[torch.Tensor] = []

    def add(self, block_ids: Sequence[int]) -> int:
        """Register a sequence stored in ``block_ids`` (in token order); returns its index."""
        self._ids.append(list(block_ids))
        self._index.append(torch.tensor(list(block_ids), dtype=torch.long, device=self.view.device))
        return len(self._ids) - 1

    def capacity(self, seq: int) -> int:
        """Tokens sequence ``seq``'s blocks hold."""
        return len(self._ids[seq]) * self.tokens_per_block

    def write(self, seq: int, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[heads, n, dim]`` at positions ``start..start+n``, block by block."""
        n, tpb = k.shape[1], self.tokens_per_block
        if start + n > self.capacity(seq):
            raise ValueError(f"sequence {seq}: position {start + n - 1} is beyond its {len(self._ids[seq])} blocks")
        pos = start
        while pos < start + n:
            block, slot = divmod(pos, tpb)
            take = min(tpb - slot, start + n - pos)
            rows = slice(pos - start, pos - start + take)
            dst = self.view[self._ids[seq][block], layer]  # [kv, head, token, dim]
            dst[0, :, slot : slot + take] = k[:, rows]
            dst[1, :, slot : slot + take] = v[:, rows]
            pos += take

    def read(self, seq: int, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[heads, length, dim]`` of positions ``0..length``, gathered from the blocks."""
        nblk = blocks_for(length, self.tokens_per_block)
        if nblk > len(self._ids[seq]):
            raise ValueError(f"sequence {seq}: {length} tokens need {nblk} blocks, it has {len(self._ids[seq])}")
        blocks = self.view[self._index[seq][:nblk], layer]  # [nblk, kv, head, token, dim] (a copy)
        heads, dim = blocks.shape[2], blocks.shape[4]
        kv = blocks.permute(1, 2, 0, 3, 4).reshape(2, heads, nblk * self.tokens_per_block, dim)
        return kv[0, :, :length], kv[1, :, :length]
