"""``kvd bench transfer --layout KIND|FILE --ctx-gpus 0 --gen-gpus 1,2,3,4 [--concurrent N]``.

One bench run per layout (:mod:`kvd.bench.layout_spec`: ``tp1-tp4``, ``tp2-tp4``, ``tp4-tp1``,
``pp2-pp1``, ``tp1-dp4`` or a TOML file), GPT-OSS-120B KV geometry. Two daemons on loopback:
``ctx`` holds every ctx rank's pool (each on its ``--ctx-gpus`` GPU; a list of several ctx
world sizes gives several ctx instances), ``gen`` one pool per gen rank (each on its
``--gen-gpus`` GPU). One executor session per rank, every pool mapped into this process. For
each of ``--paths`` (``mapped``: the same-node path; ``nixl``: mapped off, the NIXL paths):

- ``sweep``: one request at a time per size in ``--sizes`` (blocks), best and median of
  ``--repeat`` after a warm-up; GB/s = bytes landed on the gen ranks / (first publish -> last
  completion), in aggregate and per gen GPU (its bytes / publish -> its ranks' last completion);
- ``concurrent`` (``--concurrent N``): N requests of ``--concurrent-blocks`` blocks in flight at
  once (round robin over ctx instances and attention-DP ranks), aggregate GB/s;
- ``ctx_instances`` (more than one ctx instance): one request per ctx instance at once.

Every request is verified byte for byte: each gen rank's blocks hold its layers and heads of
the ctx data, and every gen-pool byte outside the requests keeps its sentinel. With
``--device cuda`` the same run first measures the ceilings (:mod:`kvd.bench.ceiling`) and
reports the end-to-end figures against them; with ``--device cpu`` the pools are host memory
and there is no ceiling.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvd.bench.layout_spec import LayoutSpec, Placement, Side, SpecError, load_layout, parse_gpus, place
from kvd.startup import one_line
from protocol.errors import KvdError
from protocol.layout import TRTLLM_AXIS_ORDER
from protocol.limits import MAX_NUM_BLOCKS

if TYPE_CHECKING:  # (torch comes with them: imported once the options are known to be good)
    from kvd.bench.layout_rig import Request, Rig

MiB = 1 << 20


def failure(exc: BaseException) -> str | None:
    """One line for a kvd error a run ended with (a daemon that did not start, a request a
    daemon refused or failed), alone or inside the exception groups of the tasks that
    raised it; None for anything else (a bug: its traceback is worth more)."""
    while isinstance(exc, BaseExceptionGroup):
        kvd = exc.subgroup(KvdError)
        if kvd is None:
            return None
        exc = kvd.exceptions[0]
    if not isinstance(exc, KvdError):
        return None
    return one_line(f"{type(exc).__name__}: {exc.message or exc}")


async def _section(rig: Rig, name: str, reqs: list[Request], repeat: int, seed: int) -> dict[str, Any]:
    """Warm-up, then ``repeat`` timed runs of ``reqs`` in flight together, each verified."""
    await rig.prepare(reqs, seed)
    runs: list[tuple[float, dict[str, Any]]] = []
    checks = {"exact": True, "untouched": True}
    for it in range(repeat + 1):
        rig.reset()
        wall = await rig.run(reqs, f"{name}-{it}")
        for k, v in rig.verify(reqs).items():
            checks[k] &= v
        if it:  # the first run warms up (first touch of pools, index building, UCX lanes)
            runs.append((wall, rig.figures(reqs, wall)))
    await rig.release(reqs)  # not after a failed run: its blocks may still be the daemons' (they stop next)
    best = min(runs, key=lambda x: x[0])[1]
    return {**best, "requests": len(reqs), "blocks_each": reqs[0].blocks, "best_s": best["wall_s"],
            "median_s": statistics.median(w for w, _ in runs), "verified": checks["exact"] and checks["untouched"],
            "checks": checks}


async def _path_run(workdir: Path, spec: LayoutSpec, placement: Placement, args: argparse.Namespace, mapped: bool,
                    sizes: list[int]) -> dict[str, Any]:
    from kvd.bench.layout_rig import Request, Rig, ctx_pool_name
    from kvd.demo.pair import pool_entry, start_pools_pair

    ctx_layout, gen_layout = spec.layouts()
    cuda = args.device == "cuda"
    memory = "auto" if cuda else "host"
    k_inst, conc, cb = placement.instances, args.concurrent, args.concurrent_blocks
    ctx_blocks = max(max(sizes), -(-conc // k_inst) * cb, cb if k_inst > 1 else 0)
    gen_blocks = max(max(sizes), conc * cb, k_inst * cb if k_inst > 1 else 0)
    ctx_pools = [pool_entry(ctx_pool_name(k, r), ctx_layout, r, memory=memory,
                            device=placement.ctx_gpu(k, r) if cuda else -1, num_blocks=ctx_blocks)
                 for k in range(k_inst) for r in range(placement.ctx_world)]
    gen_pools = [pool_entry(f"gen{g}", gen_layout, g, memory=memory, device=placement.gen_gpu(g) if cuda else -1,
                            num_blocks=gen_blocks) for g in range(placement.gen_world)]
    sub = workdir / ("mapped" if mapped else "nixl")
    sub.mkdir()
    ctx_d, gen_d = start_pools_pair(sub, ctx_pools=ctx_pools, gen_pools=gen_pools, bounce_mb=args.bounce_mb,
                                    chunk_mb=args.chunk_mb, extra_transfer={"mapped": mapped})
    out: dict[str, Any] = {"sweep": []}
    try:
        rig = Rig(ctx_d, gen_d, spec, placement)
        async with contextlib.AsyncExitStack() as stack:
            await rig.open(stack)

            def make(i: int, n: int, instance: int = 0) -> Request:
                return Request(i, instance, spec.ctx.request_ranks(i), spec.gen.request_ranks(i), n)

            for n in sizes:
                out["sweep"].append(await _section(rig, f"s{n}", [make(0, n)], args.repeat, seed=n))
            if conc:
                reqs = [make(i, cb, i % k_inst) for i in range(conc)]
                out["concurrent"] = await _section(rig, "c", reqs, args.repeat, seed=1000)
            if k_inst > 1:
                reqs = [make(i, cb, i) for i in range(k_inst)]
                out["ctx_instances"] = await _section(rig, "i", reqs, args.repeat, seed=2000)
    finally:
        ctx_d.stop()
        gen_d.stop()
    return out


def _ratios(report: dict[str, Any]) -> dict[str, Any]:
    """Each path's end-to-end GB/s over the ceilings of the same run."""
    ceil = report["ceilings"]
    if not ceil:
        return {}
    fan = ceil["fanout"]
    per_dst = {str(c["dst"]): c["gbps"] for c in fan["copies"]}
    out: dict[str, Any] = {}
    for path, res in report["paths"].items():
        largest = res["sweep"][-1]
        r: dict[str, Any] = {
            "largest_vs_single": largest["gbps"] / ceil["single"]["gbps"],
            "largest_vs_fanout_egress": largest["gbps"] / fan["gbps"],
            "largest_per_gen_gpu_vs_fanout_dst": {d: v["gbps"] / per_dst[d] for d, v in largest["per_gen_gpu"].items()
                                                  if per_dst.get(d)},
        }
        if "concurrent" in res:
            r["concurrent_vs_fanout_egress"] = res["concurrent"]["gbps"] / fan["gbps"]
            r["concurrent_vs_single"] = res["concurrent"]["gbps"] / ceil["single"]["gbps"]
        if "ctx_instances" in res and "all_pairs" in ceil:
            r["ctx_instances_vs_all_pairs"] = res["ctx_instances"]["gbps"] / ceil["all_pairs"]["gbps"]
        out[path] = r
    return out


def _print(report: dict[str, Any]) -> None:
    sc = report["scenario"]
    pl = report["placement"]
    print(f"kvd bench transfer: {sc['layout']} (ctx {sc['ctx']} -> gen {sc['gen']}), GPT-OSS-120B-shaped KV "
          f"({sc['block_bytes_tp1'] / MiB:.2f} MiB a block), {sc['device']} pools, best of {sc['repeat']}")
    ctx_where = ", ".join(f"i{c['instance']}r{c['rank']}@{c['gpu']}" for c in pl["ctx_ranks"])
    gen_where = ", ".join(f"r{g['rank']}@{g['gpu']}" for g in pl["gen_ranks"])
    unit = "GPU" if sc["device"] == "cuda" else "slot (host memory)"
    print(f"  ctx ranks per {unit}: {ctx_where};  gen ranks: {gen_where}")
    ceil = report["ceilings"]
    if ceil:
        s = ceil["single"]["copies"][0]
        print(f"  ceiling: contiguous copy GPU{s['src']} -> GPU{s['dst']} alone    {ceil['single']['gbps']:8.1f} GB/s")
        fan = ceil["fanout"]
        dsts = "  ".join(f"GPU{c['dst']} {c['gbps']:.1f}" for c in fan["copies"])
        print(f"  ceiling: GPU{s['src']} -> every gen GPU at once, egress {fan['gbps']:8.1f} GB/s   per destination: {dsts}")
        if "all_pairs" in ceil:
            ap = ceil["all_pairs"]
            eg = "  ".join(f"GPU{k} {v:.1f}" for k, v in ap["egress_gbps"].items())
            print(f"  ceiling: every ctx GPU -> every gen GPU at once {ap['gbps']:8.1f} GB/s   egress: {eg}")
    else:
        print(f"  ceiling: {report['ceiling_note']}")
    for path, res in report["paths"].items():
        print(f"  path config {path!r}:")
        print(f"    {'blocks':>9} {'MiB':>8} {'path':<8} {'best ms':>8} {'med ms':>8} {'GB/s':>8}  per gen GPU GB/s"
              "  verified")
        rows = [(str(r["blocks_each"]), r) for r in res["sweep"]]
        if "concurrent" in res:
            c = res["concurrent"]
            rows.append((f"{c['requests']}x{c['blocks_each']}", c))
        if "ctx_instances" in res:
            c = res["ctx_instances"]
            rows.append((f"{c['requests']}ctx x{c['blocks_each']}", c))
        for label, r in rows:
            per = " ".join(f"{d}:{v['gbps']:.1f}" for d, v in r["per_gen_gpu"].items())
            print(f"    {label:>9} {r['bytes'] / MiB:>8.1f} {r['path']:<8} {r['best_s'] * 1e3:>8.2f} "
                  f"{r['median_s'] * 1e3:>8.2f} {r['gbps']:>8.2f}  {per}  {r['verified']}")
        for k, v in report["ratios"].get(path, {}).items():
            shown = " ".join(f"{d}:{x:.2f}" for d, x in v.items()) if isinstance(v, dict) else f"{v:.2f}"
            print(f"    ratio {k:<36} {shown}")
    print(f"  verification (every request byte-exact, untouched bytes intact): {report['verified']}")


def build_parser() -> argparse.ArgumentParser:
    """The options of ``kvd bench transfer --layout``."""
    p = argparse.ArgumentParser(
        prog="kvd bench transfer",
        description="One ctx/gen layout, each rank's pool on its GPU, through two daemons: GB/s per gen GPU and in "
                    "aggregate, one request at a time and several in flight, every request verified; with "
                    "--device cuda against contiguous-copy ceilings measured in the same run.")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="host pools (default) or each rank's pool on its GPU (two or more GPUs)")
    p.add_argument("--layout", default="tp1-tp4", help="tp1-tp4 (default), tp2-tp4, tp4-tp1, pp2-pp1, tp1-dp4 or a TOML file")
    p.add_argument("--ctx-gpus", default="0", help="GPUs of the ctx ranks' pools (a multiple of the ctx world "
                                                   "size: one ctx instance per group; default 0)")
    p.add_argument("--gen-gpus", default="1", help="GPUs of the gen ranks' pools (shorter lists wrap; default 1)")
    p.add_argument("--sizes", default="", help="request sizes in blocks (default cuda 1,16,64,256,512; cpu 1,4)")
    p.add_argument("--repeat", type=int, default=0, help="timed runs per row after a warm-up (default cuda 5, cpu 2)")
    p.add_argument("--concurrent", type=int, default=0, help="also N requests in flight at once (default 0: none)")
    p.add_argument("--concurrent-blocks", type=int, default=32, help="blocks per concurrent request (default 32 = 72 MiB)")
    p.add_argument("--paths", default="mapped,nixl", help="mapped (same-node path) and/or nixl (mapped off); default both: mapped,nixl")
    p.add_argument("--chunk-mb", type=int, default=0, help="NIXL chunk (default cuda 64, cpu 16)")
    p.add_argument("--bounce-mb", type=int, default=0, help="bounce region (default cuda 512, cpu 64)")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    p.add_argument("--json-out", default="", help="also write the JSON report to this file")
    return p


def _check_args(args: argparse.Namespace) -> tuple[LayoutSpec, Placement, list[int], list[str]]:
    cuda = args.device == "cuda"
    spec = load_layout(args.layout)
    if tuple(spec.ctx.layout(spec.geometry).axis_order) != TRTLLM_AXIS_ORDER:  # pragma: no cover - files cannot set it
        raise SpecError("the layout bench runs the TensorRT-LLM axis order only")
    have = None
    if cuda:
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < 2:
            raise SpecError(f"--device cuda needs two or more CUDA GPUs, {have} here")
    placement = place(parse_gpus("--ctx-gpus", args.ctx_gpus), parse_gpus("--gen-gpus", args.gen_gpus), spec, have)
    try:
        sizes = sorted({int(x) for x in (args.sizes or ("1,16,64,256,512" if cuda else "1,4")).split(",") if x})
    except ValueError:
        raise SpecError(f"--sizes {args.sizes!r}: give comma-separated block counts") from None
    if not sizes or sizes[0] < 1 or sizes[-1] > MAX_NUM_BLOCKS:
        raise SpecError(f"--sizes {args.sizes!r}: block counts must be in [1, {MAX_NUM_BLOCKS}]")
    paths = [p for p in args.paths.split(",") if p]
    if not paths or set(paths) - {"mapped", "nixl"}:
        raise SpecError(f"--paths {args.paths!r}: give mapped and/or nixl")
    for name in ("concurrent", "concurrent_blocks", "repeat", "chunk_mb", "bounce_mb"):
        if getattr(args, name) < 0 or (name == "concurrent_blocks" and args.concurrent_blocks < 1):
            raise SpecError(f"--{name.replace('_', '-')} must be positive")
    args.repeat = args.repeat or (5 if cuda else 2)
    args.chunk_mb = args.chunk_mb or (64 if cuda else 16)
    args.bounce_mb = args.bounce_mb or (512 if cuda else 64)
    return spec, placement, sizes, paths


def main(argv: list[str] | None = None) -> int:
    """Run one layout; 0 when every request verified, 1 when one did not, 2 on a bad option."""
    args = build_parser().parse_args(argv)
    try:
        spec, placement, sizes, paths = _check_args(args)
    except SpecError as exc:
        print(f"kvd bench transfer: error: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    import torch  # (here, not at the top: a usage error is told without it, at once)
    import trio

    gen_layout = spec.layouts()[1]
    cuda = args.device == "cuda"
    report: dict[str, Any] = {
        "scenario": {"layout": spec.name, "ctx": spec.ctx.describe(), "gen": spec.gen.describe(),
                     "ctx_side": spec.ctx.as_dict(), "gen_side": spec.gen.as_dict(), "geometry": spec.geometry,
                     "block_bytes_tp1": Side().layout(spec.geometry).block_bytes(0),
                     "device": args.device, "sizes": sizes, "repeat": args.repeat, "concurrent": args.concurrent,
                     "concurrent_blocks": args.concurrent_blocks, "chunk_mb": args.chunk_mb,
                     "bounce_mb": args.bounce_mb},
        "placement": placement.as_dict(),
        "ceilings": None,
        "ceiling_note": "",
        "paths": {},
    }
    if cuda:
        from kvd.bench import ceiling

        # each gen GPU's share of the largest request; under attention DP consecutive requests go
        # to consecutive DP ranks, so the share is the average over a round of them
        gen_bytes: dict[int, int] = {}
        rounds = spec.gen.tp_size if spec.gen.attention_dp else 1
        for i in range(rounds):
            for rank in spec.gen.request_ranks(i):
                gpu = placement.gen_gpu(rank)
                gen_bytes[gpu] = gen_bytes.get(gpu, 0) + max(sizes) * gen_layout.block_bytes(rank) // rounds
        report["scenario"]["gpus"] = {str(i): torch.cuda.get_device_name(i)
                                      for i in sorted({*placement.ctx_gpus, *placement.gen_gpus})}
        report["ceilings"] = ceiling.measure(list(placement.ctx_gpus), gen_bytes, args.repeat)
    else:
        report["ceiling_note"] = "not measured: the contiguous-copy ceiling needs CUDA GPUs (--device cuda)"
    workdir = Path(tempfile.mkdtemp(prefix="kvd-lbench-", dir="/tmp"))
    try:
        for path in paths:
            try:
                report["paths"][path] = trio.run(_path_run, workdir, spec, placement, args, path == "mapped", sizes)
            except (KvdError, BaseExceptionGroup) as exc:
                why = failure(exc)
                if why is None:
                    raise
                print(f"kvd bench transfer: error: {spec.name}, path config {path}: {why}", file=sys.stderr)
                return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report["ratios"] = _ratios(report)
    report["verified"] = all(r["verified"] for res in report["paths"].values()
                             for r in [*res["sweep"], *(res[k] for k in ("concurrent", "ctx_instances") if k in res)])
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0 if report["verified"] else 1
