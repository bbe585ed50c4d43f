"""Equal layouts: whole blocks written straight into the peer's pools as NIXL writes whose
descriptors are the plan's fragments merged into contiguous runs (path ``direct``)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvd.transfer.paths.base import Job, Sent, mem
from protocol import transfer as x

Int64Array = npt.NDArray[np.int64]


def merge_runs(frags: Int64Array) -> Int64Array:
    """Merge fragments (src, dst, nbytes) that continue each other on both sides."""
    if len(frags) < 2:
        return frags
    order = np.argsort(frags[:, 0], kind="stable")
    f = frags[order]
    cont = (f[1:, 0] == f[:-1, 0] + f[:-1, 2]) & (f[1:, 1] == f[:-1, 1] + f[:-1, 2])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    sizes = np.add.reduceat(f[:, 2], starts)
    return np.stack([f[starts, 0], f[starts, 1], sizes], axis=1)


async def write_fragments(job: Job, frags_of: dict[tuple[int, int], Int64Array]) -> Sent:
    """One NIXL write per ``job.descs_per_write`` descriptors, in order; returns the writes."""
    assert job.nixl is not None
    seq = 0
    nbytes_total = 0
    step = max(1, job.descs_per_write)
    job.progress.planned(sum(-(-len(frags) // step) for frags in frags_of.values()))
    for (s, d), frags in frags_of.items():
        src_pool = job.src[s]
        dst = job.remote_pools[d]
        for lo in range(0, len(frags), step):
            part = frags[lo : lo + step]
            local = np.stack([part[:, 0] + src_pool.ptr, part[:, 2]], axis=1)
            remote = np.stack([part[:, 1] + dst.addr, part[:, 2]], axis=1)
            notif = x.encode_notif(x.Notif(job.request_id, seq, -1, job.peer_ref))
            job.progress.posted()
            try:
                # on cancel, write_async releases the handle (UCX cancels the write) before raising
                await job.nixl.write_async(local, remote, job.remote_agent, notif,
                                           local_mem=mem(src_pool.device), remote_mem=mem(dst.device),
                                           local_device=src_pool.device, remote_device=dst.device)
            finally:
                job.progress.ended()
            seq += 1
            nbytes = int(part[:, 2].sum())
            nbytes_total += nbytes
            job.progress.moved(nbytes)
    return Sent(writes=seq, chunks=seq, nbytes=nbytes_total)


async def send(job: Job) -> Sent:
    p = job.plan
    return await write_fragments(job, {(s, d): merge_runs(p.fragments(s, d)) for s, d in p.pairs()})
