"""Benchmark the regroup path on the GPT-OSS-120B KV geometry: ``python -m kvd.bench_regroup``.

ctx TP1 -> gen TP4; 36 layers, 8 KV heads, head_dim 64, bf16, 32 tokens/block (2.25 MiB a
block); ``--blocks 256`` (an 8k-token request, 576 MiB) scattered at random over pools of
``--pool-blocks`` blocks. Prints, on ``--device`` (cuda when available, else cpu):

- plan time (median of ``--plan-runs`` runs) and schedule / stager build time;
- gather + scatter through the bounce buffer (every chunk gathered from the ctx pool into its
  bounce slot and scattered into its gen pool), in GB/s of request bytes, with gather-only and
  scatter-only figures;
- the direct path (:meth:`Plan.apply`, no bounce);
- a plain contiguous copy of the same number of bytes in the same run, and the ratio.

A program that prints figures; tests never assert timings. ``kvd bench regroup`` calls
:func:`main`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvd.plan import KVLayout, plan
from kvd.stager import gather, scatter, schedule

GPT_OSS_120B: dict[str, Any] = {
    "num_layers": 36,
    "num_kv_heads": 8,
    "head_dim": 64,
    "tokens_per_block": 32,
    "dtype": "bfloat16",
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvd bench regroup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    ap.add_argument(
        "--blocks", type=int, default=256, help="request blocks (default 256 = 8k tokens, 576 MiB)"
    )
    ap.add_argument("--pool-blocks", type=int, default=1024, help="blocks in each rank's pool (default 1024)")
    ap.add_argument("--gen-tp", type=int, default=4, help="gen TP size (default 4)")
    ap.add_argument("--chunk-mb", type=int, default=64, help="bounce chunk size in MiB (default 64)")
    ap.add_argument("--bounce-mb", type=int, default=512, help="bounce buffer size in MiB (default 512)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats of each copy (median; default 5)")
    ap.add_argument("--plan-runs", type=int, default=21, help="plan() runs (median; default 21)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the process exit status."""
    args = _parser().parse_args(argv)
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
        # Warm every path first (first touch of pages, lazy index building, CUDA context), then
        # time them round-robin so that machine noise hits all of them alike; median per path.
        for fn in fns.values():
            fn()
        sync()
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(repeats):
            for k, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                sync()
                times[k].append(time.perf_counter() - t0)
        return {k: statistics.median(v) for k, v in times.items()}

    ctx = KVLayout(**GPT_OSS_120B, num_blocks=args.pool_blocks)
    gen = KVLayout(**GPT_OSS_120B, tp_size=args.gen_tp, num_blocks=args.pool_blocks)
    rng = np.random.default_rng(args.seed)
    ctx_blocks = {r: rng.choice(args.pool_blocks, args.blocks, replace=False) for r in range(ctx.world_size)}
    gen_blocks = {r: rng.choice(args.pool_blocks, args.blocks, replace=False) for r in range(gen.world_size)}

    plan_times = []
    for _ in range(args.plan_runs):
        t0 = time.perf_counter()
        p = plan(ctx, gen, ctx_blocks, gen_blocks)
        plan_times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    sched = schedule(p, chunk_bytes=args.chunk_mb << 20, bounce_size_mb=args.bounce_mb)
    schedule_s = time.perf_counter() - t0
    chunks = sched.all_chunks()
    nbytes = p.total_bytes()
    src = torch.empty(ctx.pool_bytes(0), dtype=torch.uint8, device=device).fill_(7)
    dst = {r: torch.zeros(gen.pool_bytes(r), dtype=torch.uint8, device=device) for r in range(gen.world_size)}
    bounce = torch.empty(args.bounce_mb << 20, dtype=torch.uint8, device=device)
    regions = [bounce[c.bounce_offset : c.bounce_offset + c.nbytes] for c in chunks]
    # After the pools exist, so that CUDA start-up is not counted as index building.
    t0 = time.perf_counter()
    for c in chunks:
        c.stager(src.device)
    sync()
    stager_s = time.perf_counter() - t0
    copy2d = sum(len(c.copy2d("src")) for c in chunks)

    def gather_all() -> None:
        for c, b in zip(chunks, regions, strict=True):
            gather(c, src, b)

    def scatter_all() -> None:
        for c, b in zip(chunks, regions, strict=True):
            scatter(c, b, dst[c.dst])

    def gather_scatter() -> None:
        for c, b in zip(chunks, regions, strict=True):
            gather(c, src, b)
            scatter(c, b, dst[c.dst])

    def direct() -> None:
        p.apply({0: src}, dst)

    flat_dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_src = src[:nbytes]

    def contiguous() -> None:
        flat_dst.copy_(flat_src)

    t = timed(
        {"gs": gather_scatter, "g": gather_all, "s": scatter_all, "direct": direct, "copy": contiguous},
        args.repeats,
    )
    t_gs, t_g, t_s, t_direct, t_copy = t["gs"], t["g"], t["s"], t["direct"], t["copy"]
    # Correctness spot check (not timed): the bounce path and the direct path agree.
    check = {r: torch.zeros_like(t) for r, t in dst.items()}
    gather_scatter()
    p.apply({0: src}, check)
    sync()
    ok = all(torch.equal(check[r], dst[r]) for r in dst)

    def gbps(t: float) -> float:
        return nbytes / t / 1e9

    result: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "case": f"GPT-OSS-120B ctx TP1 -> gen TP{args.gen_tp}, {args.blocks} blocks of {args.pool_blocks}",
        "bytes": nbytes,
        "fragments": p.num_fragments(),
        "pairs": len(p.pairs()),
        "plan_ms": statistics.median(plan_times) * 1e3,
        "schedule_ms": schedule_s * 1e3,
        "stager_build_ms": stager_s * 1e3,
        "chunks": len(chunks),
        "chunk_mb": args.chunk_mb,
        "copy2d_src_copies": copy2d,
        "gather_scatter_gbps": gbps(t_gs),
        "gather_gbps": gbps(t_g),
        "scatter_gbps": gbps(t_s),
        "direct_apply_gbps": gbps(t_direct),
        "contiguous_copy_gbps": gbps(t_copy),
        "ratio_gather_scatter_to_copy": t_copy / t_gs,
        "ratio_direct_to_copy": t_copy / t_direct,
        "check_ok": ok,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"regroup bench: {result['case']} on {device} (torch {torch.__version__})")
        print(
            f"  request              {nbytes / 2**20:.0f} MiB, {result['fragments']} fragments, {result['pairs']} pairs"
        )
        print(f"  plan                 {result['plan_ms']:.2f} ms (median of {args.plan_runs})")
        print(
            f"  schedule             {result['schedule_ms']:.2f} ms, {len(chunks)} chunks of <= {args.chunk_mb} MiB; "
            f"stager index build {result['stager_build_ms']:.1f} ms; {copy2d} 2D copies would gather it"
        )
        print(
            f"  gather+scatter       {result['gather_scatter_gbps']:.2f} GB/s (bounce path, request bytes/s)"
        )
        print(f"    gather only        {result['gather_gbps']:.2f} GB/s")
        print(f"    scatter only       {result['scatter_gbps']:.2f} GB/s")
        print(f"  direct (Plan.apply)  {result['direct_apply_gbps']:.2f} GB/s")
        print(f"  contiguous copy      {result['contiguous_copy_gbps']:.2f} GB/s (same bytes, same run)")
        print(
            f"  ratio                gather+scatter/copy {result['ratio_gather_scatter_to_copy']:.2f}, "
            f"direct/copy {result['ratio_direct_to_copy']:.2f}"
        )
        print(f"  check                {'ok' if ok else 'MISMATCH'} (bounce path == direct path)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
