"""The peer's pools are mapped into this process (same node: CUDA IPC / POSIX fd; NVLink
domain: fabric handles): regroup straight into them, no NIXL, no bounce (path ``mapped``).

On GPUs the run-time compiled regroup kernel does it when it can (completion by CUDA event,
polled from the event loop); otherwise, and on host memory, the local path's movers.
"""

from __future__ import annotations

from typing import Any, Literal

import trio

from kvd.transfer.movers import regroup_kernel
from kvd.transfer.paths import local
from kvd.transfer.paths.base import Job, Sent


async def launch_side(job: Job) -> Literal["src", "dst"] | None:
    """Where the regroup kernel runs, or None when it cannot: on the source GPU when every
    source and mapped pool is on it; on each destination GPU (pull) when the mapped pools are
    CUDA IPC mappings on other GPUs (only their own GPU's context can address them) and the
    source pools, on one GPU or several, are plain device memory (reachable from peer GPUs). VMM mappings (posix_fd, fabric)
    elsewhere keep the torch path. The first call per device compiles or loads the kernel in a
    worker thread; later ones answer on the event loop."""
    from kvd.regroup import kernel as regroup_kernel_mod

    pools = list(job.src.values())
    devices = {pool.device for pool in pools}
    if not job.mapped or min(devices) < 0:
        return None
    mapped: list[Any] = list(job.mapped.values())
    where: Literal["src", "dst"]
    if len(devices) == 1 and all(mp.device == min(devices) for mp in mapped):
        where, need = "src", devices
    elif all(mp.handle_kind == "cuda_ipc" for mp in mapped) and all(pool.kind == "device" for pool in pools):
        # ctx ranks on several GPUs too: each destination GPU pulls from every source GPU
        where, need = "dst", {mp.device for mp in mapped}
    else:
        return None
    for dev in sorted(need):
        ready = regroup_kernel_mod.kernel_ready(dev)
        if ready is None:
            ready = await trio.to_thread.run_sync(regroup_kernel_mod.kernel_available, dev)
        if not ready:
            return None
    return where


async def send(job: Job) -> Sent:
    """The regroup kernel into the mapped pools when it applies, else the local path's movers."""
    where = await launch_side(job)
    if where is None:
        return await local.send(job)
    p = job.plan
    job.progress.posted()
    try:
        nbytes = await regroup_kernel(p, {r: pool.tensor_u8() for r, pool in job.src.items()},
                                      {r: mp.raw for r, mp in job.mapped.items()}, launch_on=where,
                                      timings=job.stages)
    finally:
        job.progress.ended()
    job.progress.moved(nbytes, len(p.pairs()))
    return Sent(writes=0, chunks=len(p.src_ranks()), nbytes=nbytes)
