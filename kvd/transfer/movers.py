"""The data movers the paths call, one function each, so a faster mover (a run-time compiled
regroup kernel) can replace one without touching the paths.

- :func:`regroup_into`: a whole request from source pools into destination pools that are
  both addressable here (local path, mapped path); blocks until the bytes landed.
- :func:`launch_kernel` and :func:`kernel_done`: the same on GPUs with the run-time compiled
  regroup kernel (:mod:`kvd.regroup.apply`): one launch per source rank, enqueued without
  awaiting, then completion by CUDA event polled from the event loop (no worker thread, no
  blocking wait).
- :func:`copy_runs`: equal layouts whose blocks form a few long contiguous runs, one
  ``cuMemcpyAsync`` per run on the copy engines (:mod:`kvd.regroup.gpu_copy`), completion by
  CUDA event as for the kernel. A long run is a plain copy at the link's speed; the kernel
  reaches ~0.9 of that (measured on H200, see docs/performance.md).

The bounce path's gathers and scatters are :func:`kvd.regroup.apply.gather_chunk` /
:func:`~kvd.regroup.apply.scatter_chunk`, launched by :mod:`kvd.transfer.paths.bounce` itself.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import structlog
import torch
import trio

from kvd.ops.steptrace import mark
from kvd.regroup import apply as regroup_apply
from kvd.regroup import boxbounce, signal
from kvd.regroup import kernel as kernel_mod
from kvd.regroup import landed as landed_mod
from kvd.regroup.boxcopy import copy_boxes, supports_box_copy
from kvd.regroup.landed import LandedMark
from kvd.regroup.plan import Plan
from kvd.regroup.stager import schedule

log = structlog.get_logger("kvd.transfer")

#: ``KVD_GPU_TOKENS``: by default (or ``1``, ``kernel``) the mapped path's GPU stores the
#: completion tokens of the sides whose executors read the completion page right after the
#: regroup kernel, with a one-thread kernel launched behind it
#: (:meth:`kvd.regroup.kernel.RegroupKernel.store_tokens`); ``memop``: with
#: ``cuStreamWriteValue64`` stream memory operations instead; ``0``: only the daemons store
#: tokens, when they report. Measured on one H200 (docs/performance.md): with page-reading
#: executors, 1-block p50 0.755 -> 0.673 ms and p99 1.949 -> 1.218 ms against ``0``; the
#: stream memory operations were no faster than the kernel there.
GPU_TOKEN_MODES = ("kernel", "memop")
_OFF = ("0", "off", "false", "no")


def gpu_tokens() -> str:
    """How the GPU stores tokens: ``"kernel"`` (the default), ``"memop"``, or ``""`` (it does
    not: ``KVD_GPU_TOKENS=0``). Read at each launch: a daemon started from a warm interpreter
    imported this module before its environment was final."""
    value = os.environ.get("KVD_GPU_TOKENS", "kernel").strip().lower()
    if value in _OFF:
        return ""
    return "memop" if value == "memop" else "kernel"


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
        # up to INLINE_BYTES the copy runs in the caller's thread: handing a few boxes to the
        # copy workers and waiting for them costs more than it saves (1 block of GPT-OSS-120B
        # KV, ctx TP1 -> gen TP4: 100 us over two workers, 68 us here; 9 KiB: 53 -> 25 us)
        return copy_boxes(p, src, dst, workers=1 if p.total_bytes() <= INLINE_BYTES else None)
    p.apply({r: t.view(-1).view(torch.uint8) for r, t in src.items()},
            {r: t.view(-1).view(torch.uint8) for r, t in dst.items()})
    return p.total_bytes()


#: A regroup kernel's speed, used to time the first poll of its completion event (the kernel
#: alone moves ~370 GB/s over H200 NVLink; above that, the first poll is late).
KERNEL_LINK_BPS = 400e9


async def kernels_loaded(devices: set[int]) -> bool:
    """Whether the regroup kernel runs on every one of ``devices``: answered on the event loop
    once known; the first call per device compiles or loads it (and makes the device's landed
    events) in a worker thread."""
    for dev in sorted(devices):
        ready = kernel_mod.kernel_ready(dev)
        if ready is None or (ready and not landed_mod.prepared(dev)):
            ready = await trio.to_thread.run_sync(_load_kernel, dev)
        if not ready:
            return False
    return True


def _load_kernel(device: int) -> bool:
    """(A worker thread's) compile or load the kernel on ``device``, and make its landed
    events there (:func:`kvd.regroup.landed.prepare`): whether the kernel runs there."""
    if not kernel_mod.kernel_available(device):
        return False
    landed_mod.prepare(device)
    return True


@dataclass
class KernelLaunch:
    """Regroup kernel launches enqueued by :func:`launch_kernel`, not yet known to be done."""

    completions: list[Any]
    launch_on: Literal["src", "dst"]
    enqueued_at: float
    enqueue_s: float
    #: the landed event recorded after every launch (:mod:`kvd.regroup.landed`), or None
    landed: LandedMark | None = None

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.completions)


def launch_kernel(p: Plan, src: dict[int, torch.Tensor], dst: dict[int, torch.Tensor], *,
                  launch_on: Literal["src", "dst"], landed: bool = False,
                  stores: list[tuple[int, int]] | None = None) -> KernelLaunch:
    """Enqueue the regroup kernel launches of ``p`` (one per source rank) from flat-byte CUDA
    ``src`` pools into flat-byte ``dst`` pools, without waiting: what a caller that must not
    await (the executor's publish step) does; :func:`kernel_done` waits for them. ``landed``:
    also record a landed event after them when every launch went to one stream of one device
    (:func:`landed_after`); ``stores``: completion tokens (device address, value) stored on
    the landed event's stream right after it (:mod:`kvd.regroup.signal`), when one was recorded."""
    t0 = time.perf_counter()
    launched: list[Any] = []
    marks: list[LandedMark] = []

    def event_for(device: int, stream: int) -> Any:
        """The one launch's completion event is the landed event (one record, not two)."""
        got = landed_mod.take(device, stream)
        if got is None:
            return None
        marks.append(got[1])
        return got[0]

    # (one source rank: one launch, unless pulled by several GPUs, when regroup() records
    # the kernel's own events and landed_after() finds no single stream)
    one = landed and len(p.src_ranks()) == 1
    try:
        for s in p.src_ranks():
            launched.append(regroup_apply.regroup(p, s, src[s], dst, engine="kernel", launch_on=launch_on,
                                                  event_for=event_for if one else None))
    except BaseException:
        for c in launched:  # a later rank's launch failed: what is enqueued lands before this raises
            with contextlib.suppress(Exception):
                c.wait()
        raise
    t1 = time.perf_counter()
    mark("launched")
    if marks:
        mark_: LandedMark | None = marks[0]
    else:  # (not from a template: a separate record, when the launches allow one)
        mark_ = landed_after(launched) if landed else None
    if mark_ is not None and stores:
        _store_tokens(mark_.device, stores)
    return KernelLaunch(launched, launch_on, t1, t1 - t0, mark_)


def launch_template(k: kernel_mod.RegroupKernel, tpl: kernel_mod.LaunchTemplate, table: npt.NDArray[np.int64],
                    stream: int, *, launch_on: Literal["src", "dst"], landed: bool = False,
                    stores: list[tuple[int, int]] | None = None) -> KernelLaunch:
    """:func:`launch_kernel` for a request whose one launch is known already (the mapped
    path's recipe: kernel ``k`` on its device, template ``tpl``, the request's ``table`` and
    the ``stream`` handle): the same launch, landed event and token stores, without looking
    any of them up. The landed event is the launch's own completion event and the token
    kernel follows it in the same context push (one push, three enqueues)."""
    t0 = time.perf_counter()
    event: Any = None
    mark_: LandedMark | None = None
    if landed:
        got = landed_mod.take(k.device, stream)
        if got is not None:
            event, mark_ = got
    inline = stores if mark_ is not None and stores and gpu_tokens() == "kernel" else None
    ev = k.run(table, tpl.npairs, tpl.tiles, stream, event=event, stores=inline)
    t1 = time.perf_counter()
    mark("launched")
    if mark_ is not None and stores and inline is None:
        _store_tokens(mark_.device, stores)  # (stream memory operations: their own push)
    return KernelLaunch([regroup_apply.Completion("kernel", tpl.nbytes, [ev])], launch_on, t1, t1 - t0, mark_)


def _store_tokens(device: int, stores: list[tuple[int, int]]) -> None:
    """The completion tokens, on the stream the landed event was recorded on, after it: a
    token read means the event completed too. Speed only: the replies still come."""
    ring = landed_mod.ring_of(device)
    if ring is None or ring.stream is None:
        return
    try:
        if gpu_tokens() == "memop":
            signal.store_after(ring.ctx, ring.stream, stores)
        else:
            signal.store_by_kernel(device, ring.stream, stores)
        mark("tokens stored")
    except kernel_mod.KernelError as exc:
        log.warning("transfer.tokens_not_stored", device=device, error=str(exc),
                    fallback="executors wait for their replies")


def landed_after(completions: list[Any]) -> LandedMark | None:
    """A landed event recorded after ``completions`` (regroup calls), when all of their
    kernels were enqueued on one stream of one device with a landed ring (so the event
    completes only once all of them have); else None (gen then waits for the data-done
    message)."""
    events = [e for c in completions for e in c.events]
    if not events or not all(isinstance(e, kernel_mod.DriverEvent) for e in events):
        return None  # (torch's path records torch events: no landed event after those)
    streams = {int(e.stream) for e in events}
    devices = {e.device for e in events}
    if len(streams) != 1 or len(devices) != 1:
        return None
    device = devices.pop()
    try:
        return landed_mod.record(device, streams.pop())
    except kernel_mod.KernelError as exc:  # speed only: the data-done message still completes gen
        log.warning("transfer.landed_event_not_recorded", device=device, error=str(exc),
                    fallback="gen waits for the data-done message")
        return None


async def kernel_done(k: KernelLaunch, timings: dict[str, float] | None = None) -> int:
    """Wait from the event loop until every launch of ``k`` completed (even when cancelled: a
    launched kernel cannot be stopped, so the bytes it writes must have landed before anyone
    hears it ended); returns the bytes moved."""
    await until_done([(c.done, c.nbytes) for c in k.completions])
    mark("gpu done")
    _record_timings(k, timings)
    return k.nbytes


def kernel_done_now(k: KernelLaunch, timings: dict[str, float] | None = None) -> bool:
    """Whether every launch of ``k`` has completed, without waiting (a failed launch raises,
    as :func:`kernel_done` does); the timings are recorded when it has. A failed launch reads
    as not done: :func:`kernel_done` waits for the others, then raises it."""
    try:
        if not all(c.done() for c in k.completions):
            return False
    except Exception:
        return False
    mark("gpu done")
    _record_timings(k, timings)
    return True


def _record_timings(k: KernelLaunch, timings: dict[str, float] | None) -> None:
    if timings is not None:
        timings.update({"gpu_enqueue_s": round(k.enqueue_s, 6),
                        "gpu_wait_s": round(time.perf_counter() - k.enqueued_at, 6),
                        "gpu_kernel_launches": len(k.completions), "gpu_kernel_pull": int(k.launch_on == "dst")})


async def until_done(work: list[tuple[Callable[[], bool], int]], bps: float = KERNEL_LINK_BPS) -> None:
    """Wait, from the event loop, until every ``(done, nbytes)`` GPU work item reports done
    (``bps``: the expected speed, which times the first poll); a ``done`` that raises (failed
    work) raises here. Even when cancelled or failed, wait for the rest (shielded): work
    already enqueued cannot be stopped, so the bytes it writes must have landed before anyone
    hears it ended."""
    try:
        for done, nbytes in work:
            await wait_polling(done, nbytes, bps)
    finally:
        with trio.CancelScope(shield=True):
            for done, _ in work:
                while not _settled(done):
                    await trio.sleep(0)


async def wait_polling(ready: Callable[[], bool | None], nbytes: int, bps: float = KERNEL_LINK_BPS) -> bool | None:
    """Wait, from the event loop, for GPU work moving ``nbytes`` at about ``bps``: ask
    ``ready()`` (never blocking) until it answers other than False; return that answer (True:
    done; None: the caller stopped asking). Unshielded: a cancel ends the wait.

    trio's timers wake at millisecond resolution: sleep through part of the expected time, then
    ask at every checkpoint. Half of it only: ``bps`` is the NVLink estimate, and the same
    kernel within one GPU runs ~4x faster (a 1152 MiB request slept 1.3 ms past its kernel's
    end there)."""
    expected = nbytes / bps
    if expected > 4e-3:
        first = ready()
        if first is not False:
            return first
        await trio.sleep(expected / 2 - 1e-3)
    while (answer := ready()) is False:
        await trio.sleep(0)
    return answer


def _settled(done: Callable[[], bool]) -> bool:
    try:
        return done()
    except Exception:  # the work failed: it is over (the error surfaced in the unshielded wait)
        return True


#: Copy streams by device, made on first use and kept (creating one costs driver time).
_COPY_STREAMS: dict[int, Any] = {}
#: (device, peer) pairs whose peer access was enabled (or found impossible: False).
_PEER_ACCESS: dict[tuple[int, int], bool] = {}


async def copy_runs(
    runs: dict[tuple[int, int], npt.NDArray[np.int64]], src_ptr: dict[int, int], dst_ptr: dict[int, int],
    device_of: dict[tuple[int, int], tuple[int, int]], *, timings: dict[str, float] | None = None,
) -> int:
    """Contiguous runs ``(src offset, dst offset, nbytes)`` of each (source rank, destination
    rank) pair, one ``cuMemcpyAsync`` each on the copy engines of ``device_of[pair][0]`` (the
    source's device, or the destination's for CUDA IPC mappings, which only their own GPU's
    context addresses; ``device_of[pair][1]`` is the other side's device, given peer access);
    returns the bytes once every copy landed."""
    from kvd.regroup import gpu_copy

    t0 = time.perf_counter()
    used: dict[int, Any] = {}
    nbytes = 0
    for pair, r in runs.items():
        dev, other = device_of[pair]
        stream = _COPY_STREAMS.get(dev)
        if stream is None:
            stream = _COPY_STREAMS[dev] = gpu_copy.CopyStream(dev)
        if (dev, other) not in _PEER_ACCESS:
            _PEER_ACCESS[dev, other] = gpu_copy.enable_peer_access(dev, other)
        used[dev] = stream
        s, d = pair
        for src_off, dst_off, n in r.tolist():
            gpu_copy.copy_contiguous(src_ptr[s] + src_off, dst_ptr[d] + dst_off, n, stream)
            nbytes += n
    events = [stream.record() for stream in used.values()]
    t1 = time.perf_counter()
    try:
        await until_done([(ev.query, nbytes // len(events)) for ev in events])
    finally:
        for ev in events:
            ev.close()
    if timings is not None:
        timings.update({"gpu_enqueue_s": round(t1 - t0, 6), "gpu_wait_s": round(time.perf_counter() - t1, 6),
                        "gpu_copy_runs": sum(len(r) for r in runs.values())})
    return nbytes
