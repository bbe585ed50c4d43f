"""ctx and gen pools on one daemon: regroup pool to pool (path ``local``)."""

from __future__ import annotations

from functools import partial

import trio

from kvd.transfer.movers import INLINE_BYTES, regroup_into
from kvd.transfer.paths.base import Job, Sent


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


async def send(job: Job) -> Sent:
    """Copy the request's bytes from ``job.src`` into ``job.dst``; small ones on the event loop."""
    p = job.plan
    src = {r: pool.tensor() for r, pool in job.src.items()}
    nbytes = p.total_bytes()
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
