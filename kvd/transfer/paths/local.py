"""ctx and gen pools on one daemon: regroup pool to pool (path ``local``).

On GPUs the run-time compiled regroup kernel does it when every pool can be reached from the
launching GPU (one launch per source rank, completion by CUDA event polled from the event
loop, as on the mapped path); otherwise, and on host memory, the movers' torch / numpy
regroup (small host requests on the event loop, the rest in a worker thread).
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import torch
import trio

from kvd.transfer.movers import (
    INLINE_BYTES,
    KernelLaunch,
    kernel_done,
    kernel_done_now,
    kernels_loaded,
    launch_kernel,
    regroup_into,
)
from kvd.transfer.paths.base import Job, Sent
from protocol.errors import InternalError


def fits_inline(job: Job) -> bool:
    """Whether :func:`send_now` may copy the request in the caller's step: host pools (no
    CUDA work to wait for) and at most ``INLINE_BYTES`` (less than a worker-thread hop)."""
    return job.plan.total_bytes() <= INLINE_BYTES and all(pool.device < 0 for pool in job.src.values())


def send_now(job: Job) -> Sent:
    """:func:`send` for a request that :func:`fits_inline`, without awaiting (no task needed)."""
    p = job.plan
    src = {r: pool.tensor() for r, pool in job.src.items()}
    job.progress.posted()
    try:
        regroup_into(p, src, job.dst, gpu_chunk_bytes=job.gpu_chunk_bytes, chunk_bytes=job.chunk_bytes,
                     timings=job.stages)
    finally:
        job.progress.ended()
    nbytes = p.total_bytes()
    job.progress.moved(nbytes, len(p.pairs()))
    return Sent(writes=0, chunks=len(p.pairs()), nbytes=nbytes)


async def kernel_side(job: Job) -> Literal["src", "dst"] | None:
    """Where the regroup kernel runs for a local request, or None when it cannot: on the
    source GPU when every pool is on it; on each destination GPU (pull) when the sources are
    plain device memory, which peer GPUs can read (VMM pools are mapped for their own GPU
    only). The first call per device compiles or loads the kernel in a worker thread."""
    src_devices = {pool.device for pool in job.src.values()}
    dst_devices = {t.device.index if t.is_cuda else -1 for t in job.dst.values()}
    if min(src_devices | dst_devices) < 0:
        return None
    where: Literal["src", "dst"]
    if len(src_devices | dst_devices) == 1:
        where, need = "src", src_devices
    elif all(pool.kind == "device" for pool in job.src.values()):
        where, need = "dst", dst_devices
    else:
        return None
    return where if await kernels_loaded(need) else None


class KernelRun:
    """A request's regroup kernel, launched: :meth:`finish` awaits its CUDA events and reports
    the bytes; :meth:`finish_now` does the same without awaiting when the events have already
    completed (a small request's kernel is done in microseconds: the launching step can report
    it at once instead of handing it to a task)."""

    def __init__(self, job: Job, launched: KernelLaunch) -> None:
        self.job = job
        self.launched = launched
        self._over = False
        self._result: Sent | None = None  # what finish_now found (a later finish returns it)

    def finish_now(self) -> Sent | None:
        """The bytes, if every launch has completed (a failed one raises); else None."""
        if self._result is not None:
            return self._result
        if not kernel_done_now(self.launched, self.job.stages):
            return None
        return self._end()

    async def finish(self) -> Sent:
        """Wait for every launch (even when cancelled: see :func:`kernel_done`); the bytes."""
        if self._result is not None:
            return self._result
        if self._over:
            raise InternalError("kernel run reported twice")
        try:
            await kernel_done(self.launched, self.job.stages)
        except BaseException:
            self._ended()
            raise
        return self._end()

    def _ended(self) -> None:
        if not self._over:
            self._over = True
            self.job.progress.ended()

    def _end(self) -> Sent:
        self._ended()
        nbytes = self.launched.nbytes
        self.job.progress.moved(nbytes, len(self.job.plan.pairs()))
        self._result = Sent(writes=0, chunks=len(self.job.plan.src_ranks()), nbytes=nbytes)
        return self._result


def start_kernel(job: Job, src: dict[int, torch.Tensor], dst: dict[int, torch.Tensor],
                 where: Literal["src", "dst"], *, landed: bool = False) -> KernelRun:
    """Launch the request's regroup kernel now (flat-byte ``src`` pools into flat-byte ``dst``
    pools, launched on the ``where`` side), counted as a posted write before it is enqueued, so
    a failure or cancel meanwhile waits for it before anyone hears the request ended. Returns
    the launched run: the local and mapped paths await :meth:`KernelRun.finish` at once; the
    mapped path's publish-step launch first tries :meth:`KernelRun.finish_now`, then hands
    ``finish`` to a task. ``landed``: record a landed event after it, when it can (the mapped
    path's, for the peer: :mod:`kvd.regroup.landed`)."""
    job.progress.posted()
    try:
        launched = launch_kernel(job.plan, src, dst, launch_on=where, landed=landed,
                                 stores=job.stores if landed else None)
    except BaseException:
        job.progress.ended()  # nothing of it is running (launch_kernel waited for what it enqueued)
        raise
    return KernelRun(job, launched)


async def send(job: Job) -> Sent:
    """Copy the request's bytes from ``job.src`` into ``job.dst``."""
    p = job.plan
    nbytes = p.total_bytes()
    where = await kernel_side(job)
    if where is not None:
        return await start_kernel(job, {r: pool.tensor_u8() for r, pool in job.src.items()},
                                  {r: _flat_bytes(t) for r, t in job.dst.items()}, where).finish()
    src = {r: pool.tensor() for r, pool in job.src.items()}
    move = partial(regroup_into, p, src, job.dst, gpu_chunk_bytes=job.gpu_chunk_bytes,
                   chunk_bytes=job.chunk_bytes, timings=job.stages)
    job.progress.posted()
    try:
        on_gpu = next(iter(src.values())).is_cuda
        if nbytes <= INLINE_BYTES and not on_gpu:
            move()
        else:
            # a worker thread cannot be abandoned: the copy is over when this returns
            await trio.to_thread.run_sync(move)
    finally:
        job.progress.ended()
    job.progress.moved(nbytes, len(p.pairs()))
    return Sent(writes=0, chunks=len(p.pairs()), nbytes=nbytes)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A pool tensor as the flat bytes the kernel addresses (zero-copy)."""
    return t.view(-1).view(torch.uint8)
