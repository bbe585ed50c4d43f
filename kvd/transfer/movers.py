"""The data movers the paths call, one function each, so a faster mover (a run-time compiled
regroup kernel) can replace one without touching the paths.

- :func:`regroup_into`: a whole request from source pools into destination pools that are
  both addressable here (local path, mapped path); blocks until the bytes landed.
- :func:`gather` / :func:`scatter`: one bounce chunk into / out of a staging slot.
- :func:`bounce_chunks`: the chunk list sender and receiver derive from one plan.
"""

from __future__ import annotations

from typing import Any

import torch

from kvd.regroup import boxbounce
from kvd.regroup.boxcopy import copy_boxes, supports_box_copy
from kvd.regroup.plan import Plan
from kvd.regroup.stager import gather as stager_gather
from kvd.regroup.stager import scatter as stager_scatter
from kvd.regroup.stager import schedule

#: Up to this many bytes a host regroup runs on the event loop: a worker-thread hop costs more.
INLINE_BYTES = 4 << 20


def regroup_into(
    p: Plan, src: dict[int, torch.Tensor], dst: dict[int, torch.Tensor], *, gpu_chunk_bytes: int,
    chunk_bytes: int, timings: dict[str, float] | None = None,
) -> int:
    """Regroup every pair of ``p`` from typed ``src`` tensors into typed ``dst`` tensors;
    returns the bytes moved once they have landed (CUDA work is synchronised)."""
    first = next(iter(src.values()))
    if first.is_cuda:
        from kvd.regroup.gpu_pipeline import pipelined_box_regroup, pipelined_regroup

        if boxbounce.fits(p, gpu_chunk_bytes):
            return pipelined_box_regroup(p, src, dst, chunk_bytes=gpu_chunk_bytes, timings=timings)
        sched = schedule(p, chunk_bytes=chunk_bytes)
        raw_src = {r: t.view(-1).view(torch.uint8) for r, t in src.items()}
        raw_dst = {r: t.view(-1).view(torch.uint8) for r, t in dst.items()}
        return pipelined_regroup(sched, raw_src, raw_dst)
    if supports_box_copy(p):
        return copy_boxes(p, src, dst)
    p.apply({r: t.view(-1).view(torch.uint8) for r, t in src.items()},
            {r: t.view(-1).view(torch.uint8) for r, t in dst.items()})
    return p.total_bytes()


class BouncePlan:
    """The chunk list both daemons derive from one plan, and how to stage each chunk."""

    def __init__(self, p: Plan, chunk_bytes: int) -> None:
        self.plan = p
        self.boxes = boxbounce.fits(p, chunk_bytes)
        self.chunks: list[Any] = (
            boxbounce.box_chunks(p, chunk_bytes) if self.boxes else schedule(p, chunk_bytes=chunk_bytes).all_chunks()
        )


def bounce_chunks(p: Plan, chunk_bytes: int) -> BouncePlan:
    """Chunks for the bounce pipeline: whole-block boxes when they apply, else fragments."""
    return BouncePlan(p, chunk_bytes)


def gather(bp: BouncePlan, chunk: Any, pool: Any, slot: torch.Tensor) -> None:
    """Stage ``chunk`` from ``pool`` into ``slot``; on CUDA, wait: NIXL reads the slot next."""
    if bp.boxes:
        boxbounce.gather_box(bp.plan, chunk, pool.tensor(), slot)
        return
    stager_gather(chunk, pool.tensor_u8(), slot)
    if slot.is_cuda:
        torch.cuda.current_stream(slot.device).synchronize()


def scatter(bp: BouncePlan, chunk: Any, slot: torch.Tensor, pool: Any) -> None:
    """Write ``chunk`` from ``slot`` into ``pool``; on CUDA, wait: the slot is granted again next."""
    if bp.boxes:
        boxbounce.scatter_box(bp.plan, chunk, slot, pool.tensor())
        return
    stager_scatter(chunk, slot, pool.tensor_u8())
    if slot.is_cuda:
        torch.cuda.current_stream(slot.device).synchronize()
