"""The regroup kernel alone against a contiguous copy of the same bytes, in the same run.

``kvd bench regroup --device cuda --engine kernel`` (see :mod:`kvd.bench.regroup`) runs
:func:`run`: GPT-OSS-120B KV geometry (36 layers, 8 KV heads, head_dim 64, bf16, 32 tokens a
block = 2.25 MiB), ctx TP1 -> gen TP4, request sizes ``--sizes`` (blocks), block ids shuffled
over pools of ``--pool-blocks`` blocks and contiguous; GPU0 -> GPU1 (the kernel on GPU 0
storing into GPU 1's pools: the mapped path's push), the same launched on GPU 1 loading from
GPU 0 (pull: what the daemon does for CUDA IPC mappings) where two GPUs exist, and on one GPU.

Per point: ONE :func:`kvd.regroup.apply.regroup` call (table upload + one launch for the four
destination ranks) and one ``cuMemcpyDtoDAsync`` of the same number of bytes between the same
devices, both on one stream and timed with CUDA events (median of ``--repeats`` after a warm-up,
interleaved so machine noise hits both alike; the GPU spins for ~1 ms before each so that the
host's enqueue is not timed), the host time of the regroup call, and a byte
check against the planner's own fragment copier (:meth:`kvd.regroup.plan.Plan.apply`). Then the bounce
path's halves at the largest size (gather every 64 MiB chunk into staging, scatter them back
out; one launch a chunk) and a sweep of the kernel's tile size. Prints a table; ``--json``
prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from kvd.regroup import apply as rg
from kvd.regroup import kernel
from kvd.regroup.plan import KVLayout, plan

GPT_OSS_120B: dict[str, Any] = {
    "num_layers": 36,
    "num_kv_heads": 8,
    "head_dim": 64,
    "tokens_per_block": 32,
    "dtype": "bfloat16",
}


#: GPU cycles (~1 ms) spun before each timed call.
_SPIN_CYCLES = 2_000_000


def _events_median(stream: Any, fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each fn on ``stream`` by CUDA events, round-robin after a warm-up."""
    import torch

    for fn in fns.values():
        fn()
    stream.synchronize()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            a = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            b = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            # Keep the GPU busy while the host enqueues, so that the events time the device
            # work alone (the host cost of a call is reported separately).
            with torch.cuda.stream(stream):
                getattr(torch.cuda, "_sleep")(_SPIN_CYCLES)  # noqa: B009 - private, untyped
            a.record(stream)
            fn()
            b.record(stream)
            b.synchronize()
            times[k].append(a.elapsed_time(b) / 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def _timed_regroup(p: Any, src: Any, dst: dict[int, Any], stream: Any, host: list[float], where: Any) -> None:
    t = time.perf_counter()
    rg.regroup(p, 0, src, dst, stream=stream, engine="kernel", launch_on=where)
    host.append(time.perf_counter() - t)


def _copy(cu: Any, dst: int, src: int, nbytes: int, stream: Any) -> None:
    import torch

    with torch.cuda.device(stream.device):  # the stream's context current for the driver call
        r = cu.cuMemcpyDtoDAsync(dst, src, nbytes, stream.cuda_stream)
    if r[0] != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemcpyDtoDAsync: {r[0]}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure; returns the results (printed by :func:`print_results`)."""
    import torch
    from cuda.bindings import driver as cu

    sizes = sorted(args.sizes)
    pool_blocks = max(args.pool_blocks, max(sizes))
    t0 = time.perf_counter()
    k0 = kernel.kernel_for(0)
    load_s = time.perf_counter() - t0
    if k0 is None:
        raise SystemExit("the regroup kernel is unavailable here (see the regroup.kernel_unavailable warning)")
    # (source GPU, destination GPU, where the kernel runs): push, pull, one GPU
    places: list[tuple[int, int, Literal["src", "dst"]]] = [(0, 0, "src")]
    if torch.cuda.device_count() >= 2:
        places = [(0, 1, "src"), (0, 1, "dst"), (0, 0, "src")]
    ctx = KVLayout(**GPT_OSS_120B, num_blocks=pool_blocks)
    gen = KVLayout(**GPT_OSS_120B, tp_size=args.gen_tp, num_blocks=pool_blocks)
    rng = np.random.default_rng(args.seed)
    src = torch.randint(0, 256, (ctx.pool_bytes(0),), dtype=torch.uint8, device="cuda:0")
    nmax = max(sizes) * ctx.block_bytes(0)
    flat_src = torch.empty(nmax, dtype=torch.uint8, device="cuda:0")
    out: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "arch": k0.arch,
        "nvrtc": "{}.{}".format(*kernel.nvrtc_version()),
        "kernel_load_s": load_s,
        "case": f"GPT-OSS-120B ctx TP1 -> gen TP{args.gen_tp}, pools of {pool_blocks} blocks",
        "repeats": args.repeats,
        "points": [],
    }
    for sdev, ddev, where in places:
        run_dev = sdev if where == "src" else ddev
        kr = kernel.kernel_for(run_dev)
        assert kr is not None
        if ddev != sdev:
            kr.enable_peer(sdev if where == "dst" else ddev)
        stream = torch.cuda.Stream(f"cuda:{run_dev}")  # type: ignore[no-untyped-call]
        dst = {r: torch.zeros(gen.pool_bytes(r), dtype=torch.uint8, device=f"cuda:{ddev}") for r in range(gen.world_size)}
        ref = {r: torch.zeros_like(t) for r, t in dst.items()}
        flat_dst = torch.empty(nmax, dtype=torch.uint8, device=f"cuda:{ddev}")
        for ids in ("shuffled", "contiguous"):
            for n in sizes:
                if ids == "shuffled":
                    cb = {0: rng.choice(pool_blocks, n, replace=False)}
                    gb = {r: rng.choice(pool_blocks, n, replace=False) for r in range(gen.world_size)}
                else:
                    start = int(rng.integers(0, pool_blocks - n + 1))
                    cb = {0: np.arange(start, start + n)}
                    gb = {r: np.arange(start, start + n) for r in range(gen.world_size)}
                p = plan(ctx, gen, cb, gb)
                nbytes = p.total_bytes()
                host: list[float] = []
                regroup = functools.partial(_timed_regroup, p, src, dst, stream, host, where)
                contiguous = functools.partial(_copy, cu, flat_dst.data_ptr(), flat_src.data_ptr(), nbytes, stream)
                t = _events_median(stream, {"kernel": regroup, "copy": contiguous}, args.repeats)
                for d in dst.values():
                    d.zero_()
                for d in ref.values():
                    d.zero_()
                torch.cuda.synchronize(ddev)
                rg.regroup(p, 0, src, dst, stream=stream, launch_on=where).wait()
                p.apply({0: src}, ref)
                torch.cuda.synchronize(ddev)
                ok = all(torch.equal(dst[r], ref[r]) for r in dst)
                out["points"].append({
                    "place": f"cuda:{sdev}->cuda:{ddev}" + (" pull" if where == "dst" else ""), "ids": ids, "blocks": n, "bytes": nbytes,
                    "kernel_gbps": nbytes / t["kernel"] / 1e9, "copy_gbps": nbytes / t["copy"] / 1e9,
                    "ratio": t["copy"] / t["kernel"], "kernel_us": t["kernel"] * 1e6,
                    "host_us": statistics.median(host) * 1e6, "check_ok": ok,
                })  # fmt: skip
        if (sdev, ddev, where) == places[0]:
            out["tiles"] = _tile_sweep(args, ctx, gen, pool_blocks, src, dst, stream, rng, max(sizes))
        dst.clear()
        ref.clear()
        torch.cuda.empty_cache()
    out["bounce"] = _bounce(args, ctx, gen, pool_blocks, src, torch.cuda.Stream("cuda:0"), rng, max(sizes))  # type: ignore[no-untyped-call]
    out["check_ok"] = all(pt["check_ok"] for pt in out["points"]) and out["bounce"]["check_ok"]
    return out


def _tile_sweep(args: argparse.Namespace, ctx: KVLayout, gen: KVLayout, pool_blocks: int, src: Any,
                dst: dict[int, Any], stream: Any, rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
    p = plan(ctx, gen, {0: rng.choice(pool_blocks, n, replace=False)},
             {r: rng.choice(pool_blocks, n, replace=False) for r in range(gen.world_size)})
    fns = {
        tb: (lambda tb=tb: rg.regroup(p, 0, src, dst, stream=stream, engine="kernel", tile_bytes=tb))
        for tb in args.tiles
    }
    t = _events_median(stream, {str(k): v for k, v in fns.items()}, args.repeats)
    return [{"tile_bytes": tb, "kernel_gbps": p.total_bytes() / t[str(tb)] / 1e9} for tb in args.tiles]


def _bounce(args: argparse.Namespace, ctx: KVLayout, gen: KVLayout, pool_blocks: int, src: Any, stream: Any,
            rng: np.random.Generator, n: int) -> dict[str, Any]:
    """Gather every chunk into one staging area on GPU 0, then scatter them into GPU 0 pools."""
    import torch

    p = plan(ctx, gen, {0: rng.choice(pool_blocks, n, replace=False)},
             {r: rng.choice(pool_blocks, n, replace=False) for r in range(gen.world_size)})
    chunks = rg.chunk_ranges(p, args.chunk_mb << 20)
    staging = torch.empty(p.total_bytes(), dtype=torch.uint8, device="cuda:0")
    at = np.cumsum([0] + [c.nbytes for c in chunks])
    dst = {r: torch.zeros(gen.pool_bytes(r), dtype=torch.uint8, device="cuda:0") for r in range(gen.world_size)}

    def gather_all() -> None:
        for c, a in zip(chunks, at, strict=False):
            rg.gather_chunk(p, c.src, c.dst, src, staging[a : a + c.nbytes], offset=c.offset, nbytes=c.nbytes,
                            stream=stream, engine="kernel")

    def scatter_all() -> None:
        for c, a in zip(chunks, at, strict=False):
            rg.scatter_chunk(p, c.src, c.dst, staging[a : a + c.nbytes], dst[c.dst], offset=c.offset,
                             nbytes=c.nbytes, stream=stream, engine="kernel")

    flat = torch.empty_like(staging)
    from cuda.bindings import driver as cu

    copy = functools.partial(_copy, cu, flat.data_ptr(), staging.data_ptr(), p.total_bytes(), stream)
    t = _events_median(stream, {"gather": gather_all, "scatter": scatter_all, "copy": copy}, args.repeats)
    ref = {r: torch.zeros_like(d) for r, d in dst.items()}
    for d in dst.values():
        d.zero_()
    gather_all()
    scatter_all()
    p.apply({0: src}, ref)
    torch.cuda.synchronize(0)
    nbytes = p.total_bytes()
    return {
        "blocks": n, "chunks": len(chunks), "chunk_mb": args.chunk_mb,
        "gather_gbps": nbytes / t["gather"] / 1e9, "scatter_gbps": nbytes / t["scatter"] / 1e9,
        "copy_gbps": nbytes / t["copy"] / 1e9, "check_ok": all(torch.equal(dst[r], ref[r]) for r in dst),
    }  # fmt: skip


def print_results(out: dict[str, Any]) -> None:
    """The human-readable table."""
    print(f"regroup kernel bench: {out['case']}; {out['gpus']} x {out['gpu']}, {out['arch']}, "
          f"NVRTC {out['nvrtc']}, torch {out['torch']}; kernel ready in {out['kernel_load_s'] * 1e3:.0f} ms; "
          f"median of {out['repeats']} (CUDA events)")
    print(f"  {'place':<16}{'ids':<12}{'blocks':>7}{'MiB':>9}{'kernel GB/s':>13}{'copy GB/s':>11}{'ratio':>7}"
          f"{'kernel us':>11}{'host us':>9}  check")
    for pt in out["points"]:
        print(f"  {pt['place']:<16}{pt['ids']:<12}{pt['blocks']:>7}{pt['bytes'] / 2**20:>9.1f}"
              f"{pt['kernel_gbps']:>13.1f}{pt['copy_gbps']:>11.1f}{pt['ratio']:>7.2f}{pt['kernel_us']:>11.0f}"
              f"{pt['host_us']:>9.0f}  {'ok' if pt['check_ok'] else 'MISMATCH'}")
    if out.get("tiles"):
        print("  tile size sweep (largest size, shuffled, first placement): "
              + ", ".join(f"{t['tile_bytes'] // 1024} KiB {t['kernel_gbps']:.1f}" for t in out["tiles"]) + " GB/s")
    b = out["bounce"]
    print(f"  bounce halves on cuda:0, {b['blocks']} blocks in {b['chunks']} chunks of {b['chunk_mb']} MiB: gather "
          f"{b['gather_gbps']:.1f} GB/s, scatter {b['scatter_gbps']:.1f} GB/s, contiguous copy {b['copy_gbps']:.1f} "
          f"GB/s; check {'ok' if b['check_ok'] else 'MISMATCH'}")
