"""The peer's pools are mapped into this process (same node: CUDA IPC / POSIX fd; NVLink
domain: fabric handles): regroup straight into them, no NIXL, no bounce (path ``mapped``).

On GPUs the run-time compiled regroup kernel does it when it can (completion by CUDA event,
polled from the event loop); equal layouts whose blocks make a few long contiguous runs go to
the copy engines instead, one copy per run (:func:`copy_engine_runs`); otherwise, and on host
memory, the local path's movers.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from kvd.regroup import landed as landed_mod
from kvd.regroup.kernel import kernel_ready
from kvd.regroup.plan import Plan
from kvd.transfer.movers import copy_runs, kernels_loaded
from kvd.transfer.paths import local
from kvd.transfer.paths.base import Job, Sent
from kvd.transfer.paths.direct import merge_runs

#: The copy engines take a request when it is at most this many contiguous runs ...
COPY_ENGINE_MAX_RUNS = 16
#: ... none shorter than this. Measured on H200 x2 (GPU0 -> GPU1, TP1 -> TP1, the daemon's
#: GPU time): one 576 MiB run took 1.56 ms on the copy engines against 1.64 on the kernel,
#: one 36 MiB run 0.120 against 0.110 (the kernel won). Block-sized runs (random block ids)
#: cost the copy engines a fixed ~2.5 us each and stay on the kernel.
COPY_ENGINE_MIN_RUN = 128 << 20


#: ``KVD_COPY_ENGINE=0`` keeps every request on the kernel (to measure one against the other).
COPY_ENGINE_ENABLED = os.environ.get("KVD_COPY_ENGINE", "1") != "0"


def copy_engine_runs(p: Plan) -> dict[tuple[int, int], npt.NDArray[np.int64]] | None:
    """The request as contiguous runs per pair when it is a plain copy of a few long runs
    (equal layouts, consecutive block ids on both sides), else None (the kernel's case)."""
    if not p.direct or not COPY_ENGINE_ENABLED or p.total_bytes() < COPY_ENGINE_MIN_RUN:
        return None  # (a request smaller than one long run is the kernel's, without merging its runs)
    runs = {pair: merge_runs(p.fragments(*pair)) for pair in p.pairs()}
    sizes = [r[:, 2] for r in runs.values() if len(r)]
    count = sum(len(x) for x in sizes)
    if count == 0 or count > COPY_ENGINE_MAX_RUNS or min(int(x.min()) for x in sizes) < COPY_ENGINE_MIN_RUN:
        return None
    return runs


def _placement(job: Job) -> tuple[Literal["src", "dst"], set[int]] | None:
    """Where the regroup kernel would run and the devices it needs there (see
    :func:`launch_side`), or None when the pools rule it out."""
    pools = list(job.src.values())
    devices = {pool.device for pool in pools}
    first = min(devices)
    if not job.mapped or first < 0:
        return None
    mapped: list[Any] = list(job.mapped.values())
    if len(devices) == 1 and all(mp.device == first for mp in mapped):
        return "src", devices
    if all(mp.handle_kind == "cuda_ipc" for mp in mapped) and all(pool.kind == "device" for pool in pools):
        # ctx ranks on several GPUs too: each destination GPU pulls from every source GPU
        return "dst", {mp.device for mp in mapped}
    return None


async def launch_side(job: Job) -> Literal["src", "dst"] | None:
    """Where the regroup kernel runs, or None when it cannot: on the source GPU when every
    source and mapped pool is on it; on each destination GPU (pull) when the mapped pools are
    CUDA IPC mappings on other GPUs (only their own GPU's context can address them) and the
    source pools, on one GPU or several, are plain device memory (reachable from peer GPUs). VMM mappings (posix_fd, fabric)
    elsewhere keep the torch path. The first call per device compiles or loads the kernel in a
    worker thread; later ones answer on the event loop."""
    placed = _placement(job)
    if placed is None:
        return None
    where, need = placed
    return where if await kernels_loaded(need) else None


def launch_now(job: Job) -> local.KernelRun | None:
    """Launch the request's regroup kernel now, in the caller's step (the executor's publish),
    when that needs no waiting: GPU pools, the kernel already loaded on every device it needs,
    and not a copy-engine request. Returns the launched run (its ``finish_now`` reports it in
    the caller's step if it is already done, else a task awaits its ``finish``: the kernel's
    bytes land while the event loop goes on); None: nothing done, use :func:`send`. The launch counts as a posted write (:func:`local.start_kernel`)."""
    placed = _placement(job)
    if placed is None or copy_engine_runs(job.plan) is not None:
        return None
    where, need = placed
    if not all(kernel_ready(dev) and landed_mod.prepared(dev) for dev in need):
        return None  # not loaded yet (or unavailable): send() loads it in a worker thread
    return _start_kernel(job, where, landed=where == "src")


def _start_kernel(job: Job, where: Literal["src", "dst"], *, landed: bool = False) -> local.KernelRun:
    """The kernel from the source pools into the mapped pools (:func:`local.start_kernel`);
    ``landed``: with a landed event after it (the run's ``launched.landed``) when it can."""
    return local.start_kernel(job, {r: pool.tensor_u8() for r, pool in job.src.items()},
                              {r: mp.raw for r, mp in job.mapped.items()}, where, landed=landed)


def send_now(job: Job) -> Sent | None:
    """The whole request now, in the caller's step, when that needs no waiting: host pools (the
    local path's movers, no kernel) and a request small enough to copy on the event loop
    (:func:`kvd.transfer.paths.local.fits_inline`). None: nothing done, use :func:`send`."""
    if not local.fits_inline(job) or any(getattr(mp, "device", -1) >= 0 for mp in job.mapped.values()):
        return None
    return local.send_now(job)


async def send(job: Job) -> Sent:
    """The regroup kernel into the mapped pools when it applies, else the local path's movers."""
    where = await launch_side(job)
    if where is None:
        return await local.send(job)
    runs = copy_engine_runs(job.plan)
    if runs is None:
        return await _start_kernel(job, where).finish()
    job.progress.posted()
    try:
        devices = {(s, d): (job.src[s].device, job.mapped[d].device) if where == "src"
                   else (job.mapped[d].device, job.src[s].device) for s, d in runs}
        nbytes = await copy_runs(runs, {r: pool.ptr for r, pool in job.src.items()},
                                 {r: mp.ptr for r, mp in job.mapped.items()}, devices, timings=job.stages)
        job.progress.moved(nbytes, len(runs))
        return Sent(writes=0, chunks=len(runs), nbytes=nbytes)
    finally:
        job.progress.ended()
