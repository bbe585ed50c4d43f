"""The data movers the paths call, one function each, so a faster mover (a run-time compiled
regroup kernel) can replace one without touching the paths.

- :func:`regroup_into`: a whole request from source pools into destination pools that are
  both addressable here (local path, mapped path); blocks until the bytes landed.
- :func:`regroup_kernel`: the same on GPUs with the run-time compiled regroup kernel
  (:mod:`kvd.regroup.apply`): one launch per source rank, completion by CUDA event polled
  from the event loop (no worker thread, no blocking wait).

The bounce path's gathers and scatters are :func:`kvd.regroup.apply.gather_chunk` /
:func:`~kvd.regroup.apply.scatter_chunk`, launched by :mod:`kvd.transfer.paths.bounce` itself.
"""

from __future__ import annotations

from typing import Literal

import torch
import trio

from kvd.ops.steptrace import mark
from kvd.regroup import boxbounce
from kvd.regroup.boxcopy import copy_boxes, supports_box_copy
from kvd.regroup.plan import Plan
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


#: A regroup kernel's speed, used to time the first poll of its completion event (the kernel
#: alone moves ~370 GB/s over H200 NVLink; above that, the first poll is late).
KERNEL_LINK_BPS = 400e9


async def regroup_kernel(
    p: Plan, src: dict[int, torch.Tensor], dst: dict[int, torch.Tensor], *, launch_on: Literal["src", "dst"],
    timings: dict[str, float] | None = None,
) -> int:
    """Regroup kernel launches from flat-byte CUDA ``src`` pools into flat-byte ``dst`` pools;
    returns once every launch's event completed (even when cancelled: a launched kernel cannot
    be stopped, so the bytes it writes must have landed before anyone hears it ended)."""
    import time

    from kvd.regroup import apply as regroup_apply

    t0 = time.perf_counter()
    launched = [regroup_apply.regroup(p, s, src[s], dst, engine="kernel", launch_on=launch_on)
                for s in p.src_ranks()]
    t1 = time.perf_counter()
    mark("launched")
    try:
        for c in launched:
            # trio's timers wake at millisecond resolution: sleep through most of the expected
            # time, then poll the event at every checkpoint
            expected = c.nbytes / KERNEL_LINK_BPS
            if expected > 2e-3 and not c.done():
                await trio.sleep(expected - 1e-3)
            while not c.done():
                await trio.sleep(0)
    finally:
        with trio.CancelScope(shield=True):
            for c in launched:
                while not c.done():
                    await trio.sleep(0)
    mark("gpu done")
    if timings is not None:
        timings.update({"gpu_enqueue_s": round(t1 - t0, 6), "gpu_wait_s": round(time.perf_counter() - t1, 6),
                        "gpu_kernel_launches": len(launched), "gpu_kernel_pull": int(launch_on == "dst")})
    return sum(c.nbytes for c in launched)
