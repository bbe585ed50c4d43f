"""The peer's pools are mapped into this process (same node: CUDA IPC / POSIX fd; NVLink
domain: fabric handles): regroup straight into them, no NIXL, no bounce (path ``mapped``).

On GPUs the run-time compiled regroup kernel does it when it can (completion by CUDA event,
polled from the event loop); equal layouts whose blocks make a few long contiguous runs go to
the copy engines instead, one copy per run (:func:`copy_engine_runs`); otherwise, and on host
memory, the local path's movers.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from kvd.regroup import apply as regroup_apply
from kvd.regroup import landed as landed_mod
from kvd.regroup.kernel import LaunchTemplate, kernel_for, kernel_ready, within
from kvd.regroup.plan import Plan
from kvd.transfer.movers import copy_runs, kernels_loaded, launch_template
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
    bytes land while the event loop goes on); None: nothing done, use :func:`send`. The launch
    counts as a posted write (:func:`local.start_kernel`).

    A request of a shape and pools launched before takes the recipe that launch left
    (:class:`Recipe`): its block tables and the driver calls are all that run."""
    key = _recipe_key(job)
    recipe = _recipes.get(key) if key is not None else None
    if key is not None and recipe is not None:
        if recipe.fits(job):
            _recipes.move_to_end(key)
            return _launch_recipe(job, recipe)
        if recipe.stale():
            del _recipes[key]  # (it holds closed mappings: let them go now, not at eviction)
    placed = _placement(job)
    if placed is None or copy_engine_runs(job.plan) is not None:
        return None
    where, need = placed
    if not all(kernel_ready(dev) and landed_mod.prepared(dev) for dev in need):
        return None  # not loaded yet (or unavailable): send() loads it in a worker thread
    # a landed event (and the GPU's token stores) whenever the launches went to one stream of
    # one device: pushed from the ctx GPU, or pulled by the one GPU that holds gen's pools (ctx
    # and gen on two GPUs of a node: the ring of that device, whose context gen opens it in)
    run = _start_kernel(job, where, landed=True)
    if key is not None:
        _remember(key, job, where)
    return run


@dataclass(eq=False)
class Recipe:
    """What a publish-step launch of one request shape (:attr:`Plan.shape_key`) from one set
    of source pools into one set of mapped pools needs besides the request's block tables:
    the one launching device's kernel, the launch template and its pairs, the stream, where
    it launches. Left by the first such launch (which found all of it the general way) and
    kept while its pools stay mapped; it holds them, so no other pool takes their identity."""

    src: dict[int, Any]
    mapped: dict[int, Any]
    kernel: Any
    template: LaunchTemplate
    pairs: list[tuple[int, int]]
    stream: int
    where: Literal["src", "dst"]
    #: no valid request of the shape can reach outside the pools (the layouts' block counts
    #: fit them): the tables skip the per-request bounds check
    bounded: bool = False

    def fits(self, job: Job) -> bool:
        """Whether ``job``, whose shape and pools are this recipe's (its key), can take it:
        every mapping still open, the kernel still the one loaded there, and not a
        copy-engine request."""
        if self.stale():
            return False
        p = job.plan
        return not (p.direct and COPY_ENGINE_ENABLED and p.total_bytes() >= COPY_ENGINE_MIN_RUN)


    def stale(self) -> bool:
        """Whether no request can take it any more: a mapping of it closed (the peer link went
        down), or the kernel it names is no longer the one loaded (reset or turned off: tests)."""
        return self.kernel is not kernel_for(self.kernel.device) or any(m.closed for m in self.mapped.values())


#: Recipes kept (least recently used dropped beyond :data:`RECIPE_CACHE`), by :func:`_recipe_key`.
_recipes: OrderedDict[tuple[Any, ...], Recipe] = OrderedDict()
RECIPE_CACHE = 64


def _recipe_key(job: Job) -> tuple[Any, ...] | None:
    """The plan's shape and the identities of the job's pools (a recipe holds its pools, so
    an identity is not reused while it is kept); None for a plan built by hand."""
    if job.plan.shape_key is None:
        return None
    return (job.plan.shape_key, tuple((r, id(p)) for r, p in job.src.items()),
            tuple((r, id(m)) for r, m in job.mapped.items()))


def _remember(key: tuple[Any, ...], job: Job, where: Literal["src", "dst"]) -> None:
    """Keep the recipe of the launch just made for ``job`` when it was one launch from one
    source rank on one device (what :func:`_launch_recipe` repeats); else nothing."""
    srcs = job.plan.src_ranks()
    if len(srcs) != 1:
        return
    s = srcs[0]
    src_pool = job.src[s].tensor_u8()
    dst = {r: mp.raw for r, mp in job.mapped.items()}
    parts = regroup_apply.template_parts(job.plan, s, src_pool, dst, launch_on=where)
    if parts is None or len(parts) != 1:
        return
    dev, tpl, pairs = parts[0]
    k = kernel_for(dev)
    if k is None:
        return
    bounds = job.plan.offset_bounds()
    bounded = bounds is not None and within(tpl, [(bounds[0][s], bounds[1][d]) for s, d in pairs])
    _recipes[key] = Recipe(dict(job.src), dict(job.mapped), k, tpl, list(pairs), regroup_apply.raw_stream(dev), where,
                           bounded)
    while len(_recipes) > RECIPE_CACHE:
        _recipes.popitem(last=False)


def _launch_recipe(job: Job, r: Recipe) -> local.KernelRun:
    """The request's launch from recipe ``r``: its block tables, counted as a posted write,
    then the launch, the landed event (its completion event) and the token stores."""
    p = job.plan
    table = r.template.table([(p.ctx_offsets[s], p.gen_offsets[d]) for s, d in r.pairs], check=not r.bounded)
    job.progress.posted()
    try:
        launched = launch_template(r.kernel, r.template, table, r.stream, launch_on=r.where, landed=True,
                                   stores=job.stores)
    except BaseException:
        job.progress.ended()  # nothing of it is running (a refused launch enqueued nothing)
        raise
    job.stages["gpu_recipe"] = 1  # (the transfer.done line says how it was launched)
    return local.KernelRun(job, launched)


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
