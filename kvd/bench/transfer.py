"""``kvd bench transfer``: the demo's scenario sized up, next to raw NIXL writes of the same bytes.

Two daemons (separate processes, loopback), ctx TP1 -> gen TP4, GPT-OSS-120B KV geometry.
Prints, all measured in the same run:

- per request size (``--sizes``, in blocks), the end-to-end latency p50/p99 and GB/s, the
  ctx-side stage timings and the peer round trips before data moved, with gen registering
  first (naming its ctx peer) and with ctx publishing first, for the mapped and the NIXL path
  (:mod:`kvd.bench.latency`; ``--latency-only`` stops there; ``--geometry tiny`` measures it
  with 9 KiB blocks of the same structure, so the figure is nearly all host control work, and
  stops there too; ``--latency-paths`` picks the table's paths);

- end to end through the daemons (executor publish -> completion), for the same-node
  ``mapped`` path and for the NIXL bounce pipeline (``mapped`` off);
- a raw two-process NIXL write of the same bytes with large (64 MiB) descriptors, and with
  one descriptor per regroup fragment (8 KiB), as kvd would without a bounce buffer;
- the ratios. ``--json`` prints one JSON object instead of the table.

``--layout``, ``--ctx-gpus``, ``--gen-gpus`` or ``--concurrent`` run :mod:`kvd.bench.layouts`
instead: any ctx/gen layout, each rank's pool on its own GPU, requests in flight together.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvd.bench import latency
from kvd.demo.pair import GEOMETRY, Scenario, host_memory_available, positive_int, start_pair, too_large

MiB = 1 << 20


def _e2e(workdir: Path, blocks: int, repeat: int, mapped: bool, chunk_mb: int, bounce_mb: int) -> dict[str, Any]:
    sub = workdir / ("mapped" if mapped else "nixl")
    sub.mkdir()
    ctx_d, gen_d = start_pair(sub, gen_tp=4, blocks=blocks, bounce_mb=bounce_mb, chunk_mb=chunk_mb,
                              extra_transfer={"mapped": mapped})
    try:
        scenario = Scenario(ctx_d, gen_d, blocks)
        try:
            results, walls, ok = scenario.timed(repeat)
        finally:
            scenario.close()
    finally:
        ctx_d.stop()
        gen_d.stop()
    nbytes = results["ctx0"].bytes
    best = min(walls)
    return {
        "path": results["ctx0"].path,
        "bytes": nbytes,
        "chunks": results["ctx0"].chunks,
        "best_s": best,
        "median_s": statistics.median(walls),
        "gbps": nbytes / best / 1e9,
        "verified": ok,
    }


def _raw(nbytes: int, repeat: int) -> dict[str, Any]:
    from kvd.bench.rawnixl import RawBench

    frag = GEOMETRY["tokens_per_block"] * GEOMETRY["head_dim"] * 2 * 2  # 2 heads per gen rank, bf16
    with RawBench(nbytes) as bench:
        large = bench.run(min(64 * MiB, nbytes), repeat=repeat, label="64 MiB descriptors")
        per_fragment = bench.run(frag, repeat=repeat, label=f"{frag} B descriptors (per fragment)")
    return {
        "large": {"desc_bytes": large.desc_bytes, "ndescs": large.ndescs, "gbps": large.gbps},
        "per_fragment": {"desc_bytes": per_fragment.desc_bytes, "ndescs": per_fragment.ndescs,
                         "gbps": per_fragment.gbps},
    }


def block_counts(text: str) -> list[int]:
    """An argparse type: ``1,4,16`` -> ``[1, 4, 16]``, each at least 1 (a bad entry was a
    ValueError traceback)."""
    return [positive_int(part) for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The options of ``kvd bench transfer`` (``--device cuda`` and ``--layout`` have their own)."""
    parser = argparse.ArgumentParser(
        prog="kvd bench transfer",
        description="The demo's scenario sized up (two daemons, ctx TP1 -> gen TP4), next to raw NIXL writes of "
                    "the same bytes: latency per request size, then throughput end to end.",
        epilog="N-GPU layouts and concurrency: --layout KIND|FILE, --ctx-gpus, --gen-gpus, --concurrent N "
               "(kvd bench transfer --layout tp1-tp4 --help lists their options)")
    parser.add_argument("--blocks", type=positive_int, default=128, help="request size in blocks (2.25 MiB each; default 128 = 288 MiB)")
    parser.add_argument("--repeat", type=positive_int, default=5, help="timed runs of each measurement, the best shown (default 5)")
    parser.add_argument("--chunk-mb", type=positive_int, default=16, help="bounce chunk size in MiB (default 16)")
    parser.add_argument("--bounce-mb", type=positive_int, default=128, help="bounce buffer size in MiB (default 128)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="host pools (default) or GPU pools on two GPUs (its own options: --device cuda --help)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--sizes", type=block_counts, default="1,4,16,64", help="request sizes in blocks for the latency table (default 1,4,16,64)")
    parser.add_argument("--latency-repeat", type=positive_int, default=30, help="requests per size and order (default 30)")
    parser.add_argument("--latency-only", action="store_true", help="print the latency table only")
    parser.add_argument("--geometry", choices=sorted(latency.GEOMETRIES), default="gpt-oss-120b",
                        help="KV geometry of the latency table: gpt-oss-120b (default, 2.25 MiB a block) or tiny "
                             "(the same 36 layers and 8 heads, one token of head_dim 8: 9 KiB a block, so the copy "
                             "is microseconds and the latency is the control path's host work; implies "
                             "--latency-only)")
    parser.add_argument("--latency-paths", type=_paths, default="mapped,nixl",
                        help="paths of the latency table: mapped, nixl or both (default mapped,nixl)")
    return parser


def _paths(text: str) -> list[str]:
    """An argparse type: ``mapped,nixl`` -> ``["mapped", "nixl"]`` (each known, at least one)."""
    out = [part.strip() for part in text.split(",") if part.strip()]
    bad = [p for p in out if p not in ("mapped", "nixl")]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"paths are mapped and/or nixl, got {text!r}")
    return list(dict.fromkeys(out))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvd bench transfer``."""
    from kvd.bench.layout_spec import wanted

    if wanted(sys.argv[1:] if argv is None else argv):  # N-GPU layouts, concurrency: its own bench
        from kvd.bench import layouts

        return layouts.main(argv)
    parser = build_parser()
    args, _ = parser.parse_known_args(argv)
    if args.device == "cuda":  # the GPU bench has its own options (--plot, --sizes, --json-out)
        from kvd.bench.transfer_gpu import main as gpu_main

        return int(gpu_main(argv))
    args = parser.parse_args(argv)
    # before any daemon starts: a request larger than the host ran the whole latency table
    # first, then failed with the gen daemon's startup log ("lower num_blocks", not an option)
    available = host_memory_available()
    if args.geometry == "gpt-oss-120b" and (why := too_large(max(args.sizes), available, "--sizes")):
        parser.error(why)
    if not args.latency_only and args.geometry == "gpt-oss-120b" and (why := too_large(args.blocks, available)):
        parser.error(why)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    workdir = Path(tempfile.mkdtemp(prefix="kvd-bench-", dir="/tmp"))
    sizes = args.sizes
    try:
        geometry = latency.GEOMETRIES[args.geometry]
        lat = {name: latency.run(workdir, sizes, args.latency_repeat, mapped=name == "mapped", geometry=geometry)
               for name in args.latency_paths}
        if not args.json:
            for name, lat_rows in lat.items():
                latency.print_rows(f"kvd bench transfer: latency, {name} path, ctx TP1 -> gen TP4, host pools, "
                                   f"{args.geometry} geometry, {args.latency_repeat} requests per row", lat_rows)
        if args.latency_only or args.geometry != "gpt-oss-120b":
            if args.json:
                print(json.dumps({"geometry": geometry, "latency": lat}, indent=2))
            return 0
        mapped = _e2e(workdir, args.blocks, args.repeat, True, args.chunk_mb, args.bounce_mb)
        nixl = _e2e(workdir, args.blocks, args.repeat, False, args.chunk_mb, args.bounce_mb)
        raw = _raw(mapped["bytes"], args.repeat)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = {
        "scenario": {"geometry": GEOMETRY, "ctx_tp": 1, "gen_tp": 4, "blocks": args.blocks, "device": "cpu",
                     "bytes": mapped["bytes"], "chunk_mb": args.chunk_mb, "bounce_mb": args.bounce_mb},
        "latency": lat,
        "e2e_mapped": mapped,
        "e2e_nixl_bounce": nixl,
        "raw_nixl": raw,
        "ratios": {
            "mapped_vs_raw_large": mapped["gbps"] / raw["large"]["gbps"],
            "bounce_vs_raw_large": nixl["gbps"] / raw["large"]["gbps"],
            "mapped_vs_raw_per_fragment": mapped["gbps"] / raw["per_fragment"]["gbps"],
            "bounce_vs_raw_per_fragment": nixl["gbps"] / raw["per_fragment"]["gbps"],
        },
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if mapped["verified"] and nixl["verified"] else 1
    mib = mapped["bytes"] / MiB
    print(f"kvd bench transfer: GPT-OSS-120B KV, ctx TP1 -> gen TP4, {args.blocks} blocks = {mib:.0f} MiB, host pools,"
          f" two daemons on loopback (best of {args.repeat})")
    rows = [
        ("kvd end to end, same-node mapped path", mapped["gbps"], f"{mapped['path']}, verified={mapped['verified']}"),
        ("kvd end to end, NIXL bounce pipeline", nixl["gbps"],
         f"{nixl['path']}, {nixl['chunks']} chunks of <= {args.chunk_mb} MiB, verified={nixl['verified']}"),
        ("raw NIXL write, 64 MiB descriptors", raw["large"]["gbps"], f"{raw['large']['ndescs']} descriptors"),
        ("raw NIXL write, per-fragment descriptors", raw["per_fragment"]["gbps"],
         f"{raw['per_fragment']['ndescs']} x {raw['per_fragment']['desc_bytes']} B"),
    ]
    for name, gbps, note in rows:
        print(f"  {name:<44} {gbps:7.2f} GB/s   {note}")
    r = report["ratios"]
    print(f"  ratio mapped / raw large            {r['mapped_vs_raw_large']:.2f}")
    print(f"  ratio bounce / raw large            {r['bounce_vs_raw_large']:.2f}")
    print(f"  ratio mapped / raw per-fragment     {r['mapped_vs_raw_per_fragment']:.1f}x")
    print(f"  ratio bounce / raw per-fragment     {r['bounce_vs_raw_per_fragment']:.1f}x")
    return 0 if mapped["verified"] and nixl["verified"] else 1
