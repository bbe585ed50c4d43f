"""The regroup between two GPUs as a three-stage pipeline on CUDA streams.

Used by the same-node *mapped* path when the source pool and the (mapped) destination pool are
CUDA memory, possibly on different GPUs. Per chunk of the bounce schedule:

1. gather on the source GPU (torch index kernel, local memory: ~800 GB/s on H200) into a
   staging buffer, stream ``gather``;
2. one contiguous copy of the staging buffer to a staging buffer on the destination GPU over
   NVLink (copy engine, the link's speed), stream ``link``;
3. scatter on the destination GPU (local memory) into the destination blocks, stream ``scatter``.

The streams are chained with events, so chunk k+1 is gathered while chunk k crosses the link
and chunk k-1 is scattered: the slowest stage (the link) sets the pace. Done in one pass over
the schedule from one thread; nothing waits on the host until the end. Measured alternatives
(kvd/gpu_copy.py): copy-engine 2D copies straight into the peer pool pay ~2.5 µs of driver time
per copy (145 GB/s for 1,024 copies), and a single-stream gather→copy→scatter serialises the
three stages (~270 GB/s).
"""

from __future__ import annotations

import torch

from kvd.stager import BounceSchedule, gather, scatter


def pipelined_regroup(
    sched: BounceSchedule,
    src_pools: dict[int, torch.Tensor],
    dst_pools: dict[int, torch.Tensor],
    *,
    buffers: int = 3,
) -> int:
    """Move every chunk of ``sched`` from ``src_pools`` (uint8, CUDA) into ``dst_pools``; blocks
    until done and returns the bytes moved."""
    chunks = sched.all_chunks()
    if not chunks:
        return 0
    cb = max(c.nbytes for c in chunks)
    first = chunks[0]
    sdev = src_pools[first.src].device
    ddev = dst_pools[first.dst].device
    src_bufs = [torch.empty(cb, dtype=torch.uint8, device=sdev) for _ in range(buffers)]
    dst_bufs = [torch.empty(cb, dtype=torch.uint8, device=ddev) for _ in range(buffers)]
    s_gather = torch.cuda.Stream(sdev)  # type: ignore[no-untyped-call]
    s_link = torch.cuda.Stream(sdev)  # type: ignore[no-untyped-call]
    s_scatter = torch.cuda.Stream(ddev)  # type: ignore[no-untyped-call]
    # the pools were written by executors and synchronised by them; order after our own prior work
    s_gather.wait_stream(torch.cuda.current_stream(sdev))
    s_scatter.wait_stream(torch.cuda.current_stream(ddev))
    linked: list[torch.cuda.Event | None] = [None] * buffers
    scattered: list[torch.cuda.Event | None] = [None] * buffers
    total = 0
    for k, chunk in enumerate(chunks):
        i = k % buffers
        n = chunk.nbytes
        total += n
        with torch.cuda.stream(s_gather):
            prev = linked[i]
            if prev is not None:  # src_bufs[i] is free once its previous chunk crossed the link
                s_gather.wait_event(prev)
            gather(chunk, src_pools[chunk.src], src_bufs[i][:n])
            gathered = torch.cuda.Event()  # type: ignore[no-untyped-call]
            gathered.record(s_gather)
        with torch.cuda.stream(s_link):
            s_link.wait_event(gathered)
            prev = scattered[i]
            if prev is not None:  # dst_bufs[i] is free once its previous chunk was scattered
                s_link.wait_event(prev)
            dst_bufs[i][:n].copy_(src_bufs[i][:n], non_blocking=True)
            done_link = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done_link.record(s_link)
            linked[i] = done_link
        with torch.cuda.stream(s_scatter):
            s_scatter.wait_event(done_link)
            scatter(chunk, dst_bufs[i][:n], dst_pools[chunk.dst])
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(s_scatter)
            scattered[i] = done
    s_scatter.synchronize()
    s_link.synchronize()
    return total
