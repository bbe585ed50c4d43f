"""Benchmark the regroup path on the GPT-OSS-120B KV geometry: ``python -m kvd.bench.regroup``.

ctx TP1 -> gen TP4; 36 layers, 8 KV heads, head_dim 64, bf16, 32 tokens/block (2.25 MiB a
block); ``--blocks 256`` (an 8k-token request, 576 MiB) scattered at random over pools of
``--pool-blocks`` blocks. Prints, on ``--device`` (cuda when available, else cpu):

- plan time (median of ``--plan-runs`` runs) and schedule / stager build time;
- gather + scatter through the bounce buffer (every chunk gathered from the ctx pool into its
  bounce slot and scattered into its gen pool), in GB/s of request bytes, with gather-only and
  scatter-only figures;
- the direct path (:meth:`Plan.apply`, no bounce);
- a plain contiguous copy of the same number of bytes in the same run, and the ratio.

``--engine`` picks the torch path (above), the copy-engine path (:mod:`kvd.regroup.gpu_copy`: the same
gather / scatter / direct regroup as 2D or batched memcpy on a copy stream, per submission
method, checked byte for byte against the torch path, next to one contiguous ``cuMemcpyAsync``,
plus a sweep of row width x rows per copy per method), or both (the default on CUDA).
``--peer-device N`` puts the gen pools (and the contiguous copy's destination) on cuda:N: the
scatter and the direct regroup then cross the link (GPU0 -> GPU1 over NVLink).

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
from typing import TYPE_CHECKING, Any

import numpy as np

from kvd.regroup.plan import KVLayout, plan
from kvd.regroup.stager import gather, scatter, schedule

if TYPE_CHECKING:
    import torch

GPT_OSS_120B: dict[str, Any] = {
    "num_layers": 36,
    "num_kv_heads": 8,
    "head_dim": 64,
    "tokens_per_block": 32,
    "dtype": "bfloat16",
}


def build_parser() -> argparse.ArgumentParser:
    """The options of ``kvd bench regroup``."""
    ap = argparse.ArgumentParser(
        prog="kvd bench regroup",
        description="The regroup path on the GPT-OSS-120B KV geometry (ctx TP1 -> gen TP4): plan time, gather and "
                    "scatter through the bounce buffer, box copies, in GB/s of request bytes.",
    )
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
    ap.add_argument("--seed", type=int, default=0, help="seed of the random block placement (default 0)")
    ap.add_argument(
        "--engine",
        choices=["torch", "copy", "both", "kernel"],
        default=None,
        help="torch index copies, copy-engine 2D/batched memcpy, or both (default: both on CUDA, torch on CPU); "
        "kernel: the NVRTC regroup kernel alone vs a contiguous copy, GPU0 -> GPU1 and on one GPU, per size "
        "(kvd.bench.regroup_kernel)",
    )
    ap.add_argument(
        "--sizes",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[1, 4, 16, 64, 256, 512],
        help="request sizes in blocks for --engine kernel (default 1,4,16,64,256,512)",
    )
    ap.add_argument(
        "--tiles",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[4096, 8192, 16384, 32768, 65536],
        help="kernel tile sizes in bytes to sweep with --engine kernel (default 4K..64K)",
    )
    ap.add_argument(
        "--peer-device", type=int, default=None, help="put the gen pools on cuda:N (cross-device regroup)"
    )
    ap.add_argument(
        "--methods",
        default="all",
        help="copy-engine submission methods, comma-separated (default: all available; see kvd.regroup.gpu_copy)",
    )
    ap.add_argument(
        "--lanes",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[1, 2, 4, 8],
        help="copy-engine lane counts to measure, comma-separated (default 1,2,4,8)",
    )
    ap.add_argument("--no-sweep", action="store_true", help="skip the copy-engine width x height sweep")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the process exit status."""
    args = build_parser().parse_args(argv)
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            print(f"kvd bench regroup: error: --device {args.device} needs CUDA device {device.index or 0}: this "
                  f"machine has {count} CUDA GPU(s) (without --device it runs on the CPU)", file=sys.stderr)
            return 2
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    engine = args.engine or ("both" if device.type == "cuda" else "torch")
    if engine == "kernel":
        if device.type != "cuda":
            print(f"--engine kernel needs a CUDA device (got {device})")
            return 2
        from kvd.bench import regroup_kernel

        out = regroup_kernel.run(args)
        if args.json:
            print(json.dumps(out))
        else:
            regroup_kernel.print_results(out)
        return 0 if out["check_ok"] else 1
    if engine != "torch" and device.type != "cuda":
        print(f"--engine {engine} needs a CUDA device (got {device}); the copy engines are GPU hardware")
        return 2
    dst_device = device
    if args.peer_device is not None:
        if device.type != "cuda":
            print("--peer-device needs --device cuda")
            return 2
        if args.peer_device >= torch.cuda.device_count():
            print(f"--peer-device {args.peer_device}: only {torch.cuda.device_count()} CUDA device(s)")
            return 2
        dst_device = torch.device("cuda", args.peer_device)
    run_torch = engine in ("torch", "both")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            if dst_device != device:
                torch.cuda.synchronize(dst_device)

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
    if device.type == "cuda":  # distinct bytes, so that a misplaced copy shows in the check
        torch.randint(0, 256, (src.numel(),), dtype=torch.uint8, device=device, out=src)
    dst = {
        r: torch.zeros(gen.pool_bytes(r), dtype=torch.uint8, device=dst_device) for r in range(gen.world_size)
    }
    bounce = torch.empty(args.bounce_mb << 20, dtype=torch.uint8, device=device)
    regions = [bounce[c.bounce_offset : c.bounce_offset + c.nbytes] for c in chunks]
    # After the pools exist, so that CUDA start-up is not counted as index building.
    t0 = time.perf_counter()
    if run_torch:
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

    flat_dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device)
    flat_src = src[:nbytes]

    def contiguous() -> None:
        flat_dst.copy_(flat_src)

    # The reference: the torch direct path (Plan.apply) into zeroed pools.
    check = {r: torch.zeros_like(t) for r, t in dst.items()}
    p.apply({0: src}, check)
    sync()

    def gbps(t: float) -> float:
        return nbytes / t / 1e9

    where = str(device) if dst_device == device else f"{device} -> {dst_device}"
    result: dict[str, Any] = {
        "device": where,
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
    }
    ok = True
    if run_torch:
        t = timed(
            {"gs": gather_scatter, "g": gather_all, "s": scatter_all, "direct": direct, "copy": contiguous},
            args.repeats,
        )
        t_gs, t_g, t_s, t_direct, t_copy = t["gs"], t["g"], t["s"], t["direct"], t["copy"]
        # Correctness spot check (not timed): the bounce path and the direct path agree.
        for r in dst:
            dst[r].zero_()
        gather_scatter()
        sync()
        ok = all(torch.equal(check[r], dst[r]) for r in dst)
        result.update(
            {
                "gather_scatter_gbps": gbps(t_gs),
                "gather_gbps": gbps(t_g),
                "scatter_gbps": gbps(t_s),
                "direct_apply_gbps": gbps(t_direct),
                "contiguous_copy_gbps": gbps(t_copy),
                "ratio_gather_scatter_to_copy": t_copy / t_gs,
                "ratio_direct_to_copy": t_copy / t_direct,
                "check_ok": ok,
            }
        )
    if run_torch:
        ok = _box_paths(args, p, src, dst, check, ctx, gen, device, dst_device, timed, gbps, t_copy, result) and ok
    ce: dict[str, Any] | None = None
    if engine in ("copy", "both"):
        ce = _copy_engine(args, p, chunks, src, dst, check, bounce, flat_src, flat_dst, device, dst_device)
        result["copy_engine"] = ce
        ok = ok and bool(ce["check_ok"])
    if args.json:
        print(json.dumps(result))
        return 0 if ok else 1
    print(f"regroup bench: {result['case']} on {where} (torch {torch.__version__})")
    print(
        f"  request              {nbytes / 2**20:.0f} MiB, {result['fragments']} fragments, {result['pairs']} pairs"
    )
    print(f"  plan                 {result['plan_ms']:.2f} ms (median of {args.plan_runs})")
    print(
        f"  schedule             {result['schedule_ms']:.2f} ms, {len(chunks)} chunks of <= {args.chunk_mb} MiB; "
        f"stager index build {result['stager_build_ms']:.1f} ms; {copy2d} 2D copies would gather it"
    )
    if run_torch:
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
        print(
            f"  check                {'ok' if result['check_ok'] else 'MISMATCH'} (bounce path == direct path)"
        )
    if "box_gather_scatter_gbps" in result:
        print(f"  box gather+scatter   {result['box_gather_scatter_gbps']:.2f} GB/s (whole-block boxes, one index "
              f"kernel per chunk; ratio to copy {result['ratio_box_gather_scatter_to_copy']:.2f})")
        print(f"  box one-pass         {result['box_one_pass_gbps']:.2f} GB/s ({result['box_one_pass_kind']}; "
              f"ratio to copy {result['ratio_box_one_pass_to_copy']:.2f}, check "
              f"{'ok' if result['box_check_ok'] else 'MISMATCH'})")
    if ce is not None:
        _print_copy_engine(ce)
    return 0 if ok else 1


def _box_paths(
    args: argparse.Namespace,
    p: Any,
    src: torch.Tensor,
    dst: dict[int, torch.Tensor],
    check: dict[int, torch.Tensor],
    ctx: KVLayout,
    gen: KVLayout,
    device: torch.device,
    dst_device: torch.device,
    timed: Callable[[dict[str, Callable[[], None]], int], dict[str, float]],
    gbps: Callable[[float], float],
    t_copy: float,
    result: dict[str, Any],
) -> bool:
    """The whole-block box paths the daemon uses: bounce chunks (gather_box / scatter_box) and
    the one-pass regroup (GPU: the 3-stream pipeline; host: parallel strided block copies)."""
    import torch

    from kvd.regroup import boxbounce
    from kvd.regroup.boxcopy import copy_boxes
    from kvd.regroup.plan import Plan

    assert isinstance(p, Plan)
    chunk_bytes = args.chunk_mb << 20
    if not boxbounce.fits(p, chunk_bytes):
        return True
    dtype = torch.bfloat16 if ctx.dtype == "bfloat16" else torch.uint8
    src_t = src[: ctx.pool_bytes(0)].view(dtype).view(ctx.pool_shape(0))
    dst_t = {r: t.view(dtype).view(gen.pool_shape(r)) for r, t in dst.items()}
    bchunks = boxbounce.box_chunks(p, chunk_bytes)
    slot_src = torch.empty(chunk_bytes, dtype=torch.uint8, device=device)
    slot_dst = slot_src if dst_device == device else torch.empty(chunk_bytes, dtype=torch.uint8, device=dst_device)

    def box_gs() -> None:
        for c in bchunks:
            boxbounce.gather_box(p, c, src_t, slot_src)
            if slot_dst is not slot_src:
                slot_dst[: c.nbytes].copy_(slot_src[: c.nbytes])
            boxbounce.scatter_box(p, c, slot_dst, dst_t[c.dst])

    if device.type == "cuda":
        from kvd.regroup.gpu_pipeline import pipelined_box_regroup

        kind = "3-stream pipeline: index_select / copy / index_copy_"

        def one_pass() -> None:
            pipelined_box_regroup(p, {0: src_t}, dst_t, chunk_bytes=2 * chunk_bytes)
    else:
        kind = "parallel strided block copies"

        def one_pass() -> None:
            copy_boxes(p, {0: src_t}, dst_t)

    t = timed({"box_gs": box_gs, "one_pass": one_pass}, args.repeats)
    for r in dst:
        dst[r].zero_()
    one_pass()
    if device.type == "cuda":
        torch.cuda.synchronize(dst_device)
    ok = all(torch.equal(check[r], dst[r]) for r in dst)
    result.update({
        "box_gather_scatter_gbps": gbps(t["box_gs"]),
        "ratio_box_gather_scatter_to_copy": t_copy / t["box_gs"],
        "box_one_pass_gbps": gbps(t["one_pass"]),
        "box_one_pass_kind": kind,
        "ratio_box_one_pass_to_copy": t_copy / t["one_pass"],
        "box_check_ok": ok,
    })  # fmt: skip
    return ok


def _copy_engine(
    args: argparse.Namespace,
    p: Any,
    chunks: list[Any],
    src: Any,
    dst: dict[int, Any],
    check: dict[int, Any],
    bounce: Any,
    flat_src: Any,
    flat_dst: Any,
    device: Any,
    dst_device: Any,
) -> dict[str, Any]:
    """The copy-engine figures: per method, gather / scatter / gather+scatter (one stream and
    pipelined over two) / direct, each checked against ``check``; the same over several lanes
    (copy streams used at once); a contiguous copy; a sweep of copy shapes."""
    import torch

    from kvd.regroup import gpu_copy as gc

    dev, peer = int(device.index), int(dst_device.index)
    peer_ok = True
    if peer != dev:
        peer_ok = gc.enable_peer_access(dev, peer) and gc.enable_peer_access(peer, dev)
    cs = gc.CopyStream(dev)
    avail = gc.methods_available()
    methods = avail if args.methods == "all" else [m for m in args.methods.split(",") if m]
    nbytes = p.total_bytes()
    src_base = src.data_ptr()
    dst_base = {r: t.data_ptr() for r, t in dst.items()}
    region = [bounce.data_ptr() + c.bounce_offset for c in chunks]
    slots = max(1, bounce.numel() // (args.chunk_mb << 20))

    def med(fn: Callable[[], None], *streams: Any) -> float:
        def once() -> float:
            t0 = time.perf_counter()
            fn()
            for st in streams:
                st.synchronize()
            return time.perf_counter() - t0

        once()
        return statistics.median(once() for _ in range(args.repeats))

    def contiguous() -> None:
        gc.copy_contiguous(flat_src.data_ptr(), flat_dst.data_ptr(), nbytes, cs)

    def measure(m: str, a: Any, b: Any, full: bool = True) -> dict[str, Any]:
        """Figures of method ``m`` with gathers / direct copies on ``a``, scatters on ``b``."""

        def g_all() -> None:
            for c, rb in zip(chunks, region, strict=True):
                gc.gather_2d(c, src_base, rb, a, method=m)

        def s_all() -> None:
            for c, rb in zip(chunks, region, strict=True):
                gc.scatter_2d(c, rb, dst_base[c.dst], a, method=m)

        def gs() -> None:
            for c, rb in zip(chunks, region, strict=True):
                gc.gather_2d(c, src_base, rb, a, method=m)
                gc.scatter_2d(c, rb, dst_base[c.dst], a, method=m)

        def gs_pipe() -> None:
            # gather on a, scatter on b: chunk k+1 is gathered while chunk k is scattered;
            # a bounce slot is gathered into again only once its last scatter finished.
            freed: list[Any] = []
            events: list[Any] = []
            for k, (c, rb) in enumerate(zip(chunks, region, strict=True)):
                if k >= slots:
                    a.wait(freed[k - slots])
                gc.gather_2d(c, src_base, rb, a, method=m)
                ev = a.record()
                b.wait(ev)
                gc.scatter_2d(c, rb, dst_base[c.dst], b, method=m)
                freed.append(b.record())
                events.append(ev)
            for e in events + freed:
                e.close()

        def direct() -> None:
            for s, d in p.pairs():
                gc.apply_pair_2d(p, s, d, src_base, dst_base[d], a, method=m)

        def correct(fn: Callable[[], None]) -> bool:
            for t in dst.values():
                t.zero_()
            torch.cuda.synchronize(dst_device)
            fn()
            a.synchronize()
            b.synchronize()
            return all(torch.equal(check[r], dst[r]) for r in dst)

        row: dict[str, Any] = {}
        try:
            t0 = time.perf_counter()
            direct()
            row["direct_first_call_ms"] = (time.perf_counter() - t0) * 1e3
            a.synchronize()
            t0 = time.perf_counter()
            direct()
            row["direct_submit_ms"] = (time.perf_counter() - t0) * 1e3
            a.synchronize()
            row["check_direct"] = correct(direct)
            row["check_gs_pipelined"] = correct(gs_pipe)
            row["direct_gbps"] = nbytes / med(direct, a) / 1e9
            row["gather_scatter_pipelined_gbps"] = nbytes / med(gs_pipe, a, b) / 1e9
            ok = row["check_direct"] and row["check_gs_pipelined"]
            if full:
                row["check_gs"] = correct(gs)
                row["gather_gbps"] = nbytes / med(g_all, a) / 1e9
                row["scatter_gbps"] = nbytes / med(s_all, a) / 1e9
                row["gather_scatter_gbps"] = nbytes / med(gs, a) / 1e9
                ok = ok and row["check_gs"]
            row["ok"] = ok
        except Exception as exc:  # report and go on with the other methods
            row["error"] = f"{type(exc).__name__}: {exc}"
            row["ok"] = False
        return row

    out: dict[str, Any] = {
        "peer_access": peer_ok,
        "methods_available": avail,
        "gather_copies": sum(len(gc.chunk_copies(c, "gather")) for c in chunks),
        "scatter_copies": sum(len(gc.chunk_copies(c, "scatter")) for c in chunks),
        "direct_copies": sum(len(gc.pair_copies(p, s, d)) for s, d in p.pairs()),
        "contiguous_gbps": nbytes / med(contiguous, cs) / 1e9,
        "methods": {},
        "lanes": [],
    }
    with gc.CopyStream(dev) as cs2:
        for m in methods:
            out["methods"][m] = measure(m, cs, cs2)
    # Several lanes (streams used at once, so several copies in flight), from this thread or
    # one thread per lane; where the pools are on two devices, also pulled by the gen GPU.
    configs: list[tuple[int, bool, int]] = [(n, False, dev) for n in args.lanes] + [
        (n, True, dev) for n in args.lanes if n > 1
    ]
    if peer != dev:
        configs += [(n, False, peer) for n in args.lanes]
    for m in [m for m in ("batch3d", "memcpy2d_raw") if m in methods]:
        for lanes, threads, on in configs:
            with (
                gc.CopyStream(on, lanes, threads=threads) as a,
                gc.CopyStream(on, lanes, threads=threads) as b,
            ):
                row = measure(m, a, b, full=False)
            row.update(method=m, lanes=lanes, threads=threads, stream_device=on)
            out["lanes"].append(row)
    out["check_ok"] = all(r["ok"] for r in out["methods"].values()) and all(r["ok"] for r in out["lanes"])
    if not args.no_sweep:
        out["sweep"] = _sweep(gc, cs, methods, device, dst_device, args.repeats)
    cs.close()
    return out


def _sweep(
    gc: Any, cs: Any, methods: list[str], device: Any, dst_device: Any, repeats: int
) -> list[dict[str, Any]]:
    """Row width x rows per 2D copy, per method: a TP4-like gather (source pitch 4 x width,
    destination packed), at most 64 MiB and 16384 copies a point."""
    import torch

    cap = 64 << 20
    src = torch.empty(4 * cap, dtype=torch.uint8, device=device)
    dst = torch.empty(cap, dtype=torch.uint8, device=dst_device)
    rows = []
    for w in (256, 1024, 4096, 8192, 32768):
        for h in (1, 8, 72):
            m = max(1, min(16384, cap // (w * h)))
            i = np.arange(m, dtype=np.int64)
            table = np.empty((m, 6), dtype=np.int64)
            table[:, 0] = i * h * 4 * w
            table[:, 1] = 4 * w
            table[:, 2] = i * h * w
            table[:, 3] = w
            table[:, 4] = w
            table[:, 5] = h
            copies = gc.Copies2D(table)
            point: dict[str, Any] = {"width": w, "height": h, "copies": m, "bytes": copies.nbytes}
            for meth in methods:
                try:
                    copies.submit(src.data_ptr(), dst.data_ptr(), cs, meth)  # prepare + warm
                    cs.synchronize()
                    times, subs = [], []
                    for _ in range(max(3, repeats // 2)):
                        t0 = time.perf_counter()
                        copies.submit(src.data_ptr(), dst.data_ptr(), cs, meth)
                        t1 = time.perf_counter()
                        cs.synchronize()
                        times.append(time.perf_counter() - t0)
                        subs.append(t1 - t0)
                    point[meth] = {
                        "gbps": copies.nbytes / statistics.median(times) / 1e9,
                        "submit_us_per_copy": statistics.median(subs) / m * 1e6,
                    }
                except Exception as exc:
                    point[meth] = {"error": f"{type(exc).__name__}: {exc}"}
            rows.append(point)
    return rows


def _print_copy_engine(ce: dict[str, Any]) -> None:
    print(
        f"  copy engines         {ce['gather_copies']} gather / {ce['scatter_copies']} scatter / "
        f"{ce['direct_copies']} direct 2D copies; methods here: {', '.join(ce['methods_available'])}"
        + ("" if ce["peer_access"] else "; NO peer access")
    )
    print(f"    contiguous cuMemcpyAsync {ce['contiguous_gbps']:.2f} GB/s")
    hdr = f"    {'method':<14}{'gather':>9}{'scatter':>9}{'g+s':>9}{'g+s pipe':>10}{'direct':>9}  submit(direct) check"
    print(hdr + "   (GB/s)")
    for m, r in ce["methods"].items():
        if "error" in r:
            print(f"    {m:<14}ERROR {r['error']}")
            continue
        chk = (
            "ok"
            if r["ok"]
            else (f"MISMATCH gs={r['check_gs']} pipe={r['check_gs_pipelined']} direct={r['check_direct']}")
        )
        print(
            f"    {m:<14}{r['gather_gbps']:>9.1f}{r['scatter_gbps']:>9.1f}{r['gather_scatter_gbps']:>9.1f}"
            f"{r['gather_scatter_pipelined_gbps']:>10.1f}{r['direct_gbps']:>9.1f}  "
            f"{r['direct_submit_ms']:.2f} ms (first {r['direct_first_call_ms']:.1f}) {chk}"
        )
    if ce["lanes"]:
        print("    lanes: copies spread over N streams at once (GB/s); thr = one submitting thread per lane")
        print(
            f"    {'method':<14}{'lanes':>6}{'thr':>5}{'stream':>8}{'direct':>9}{'g+s pipe':>10}  submit(direct) check"
        )
        for r in ce["lanes"]:
            head = f"    {r['method']:<14}{r['lanes']:>6}{'y' if r['threads'] else '-':>5}{'cuda:' + str(r['stream_device']):>8}"
            if "error" in r:
                print(head + f"  ERROR {r['error']}")
                continue
            print(
                head + f"{r['direct_gbps']:>9.1f}{r['gather_scatter_pipelined_gbps']:>10.1f}  "
                f"{r['direct_submit_ms']:.2f} ms {'ok' if r['ok'] else 'MISMATCH'}"
            )
    sweep = ce.get("sweep")
    if sweep:
        methods = [m for m in ce["methods"] if m in sweep[0]]
        print("    sweep: GB/s (submit us/copy) per method; rows of <width> bytes, <height> rows a copy")
        print("    " + f"{'width':>6}{'height':>7}{'copies':>7}" + "".join(f"{m:>22}" for m in methods))
        for pt in sweep:
            cells = []
            for m in methods:
                c = pt[m]
                cells.append(
                    f"{'ERR':>22}" if "error" in c else f"{c['gbps']:>12.1f} ({c['submit_us_per_copy']:6.2f})"
                )
            print("    " + f"{pt['width']:>6}{pt['height']:>7}{pt['copies']:>7}" + "".join(cells))
        errs = {
            f"{pt['width']}x{pt['height']} {m}": pt[m]["error"]
            for pt in sweep
            for m in methods
            if "error" in pt[m]
        }
        for k, v in list(errs.items())[:5]:
            print(f"    sweep error {k}: {v}")


if __name__ == "__main__":
    sys.exit(main())
