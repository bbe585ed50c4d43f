"""Copy engines against the regroup kernel on the mapped path, for equal layouts.

``python -m kvd.bench.copy_engines [--blocks 256,16] [--repeat 7]`` starts two daemons per
configuration (ctx TP1 pool on GPU 0, gen TP1 pool on GPU 1, GPT-OSS-120B blocks, memory
``auto``), the gen executor naming its ctx peer, and moves requests of consecutive and of
shuffled gen blocks. It prints, per row, the median of the ctx daemon's ``gpu_wait_s`` stage
(the mover's time on the GPU), the copy-engine runs used (0: the kernel ran) and the best
publish -> completion time. Each row runs with the copy engines allowed and with
``KVD_COPY_ENGINE=0`` (every request on the kernel): the figures behind
:data:`kvd.transfer.paths.mapped.COPY_ENGINE_MIN_RUN`. Without CUDA GPUs, ``--device cpu``
runs the same requests on host pools (the local movers; a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from clients import Client
from kvd.demo.pair import GEOMETRY, start_pair, wait_for_link
from protocol.layout import KVLayout

BLOCK_BYTES = KVLayout(**GEOMETRY).block_bytes(0)


def run_row(blocks: int, shuffled: bool, repeat: int, copy_engine: bool, cpu: bool) -> dict[str, object]:
    """One configuration on fresh daemons; returns the row's figures."""
    os.environ["KVD_COPY_ENGINE"] = "1" if copy_engine else "0"  # read by the daemons at start
    layout = KVLayout(**GEOMETRY)
    with tempfile.TemporaryDirectory(prefix="kvd-ce-") as tmp:
        ctx_d, gen_d = start_pair(Path(tmp), gen_tp=1, blocks=2 * blocks, bounce_mb=64, chunk_mb=16,
                                  memory="host" if cpu else "auto", device=-1 if cpu else 0,
                                  gen_device=-1 if cpu else 1)
        try:
            with Client(ctx_d.socket_path, client="ce-ctx") as ctx, Client(gen_d.socket_path, client="ce-gen") as gen:
                wait_for_link(gen, "ctx")
                ctx_ids, gen_ids = ctx.alloc("ctx0", blocks), gen.alloc("gen0", blocks)
                if shuffled:
                    random.Random(0).shuffle(gen_ids)
                walls: list[float] = []
                path = ""
                for i in range(repeat + 1):  # the first: warm-up (kernel load, mappings)
                    rid = f"ce-{i}"
                    gen.expect(rid, "gen0", layout, 0, gen_ids, peer="ctx")
                    t0 = time.perf_counter()
                    ctx.publish(rid, "ctx0", layout, 0, ctx_ids, peer="gen")
                    c = ctx.wait(rid, timeout_s=120)
                    walls.append(time.perf_counter() - t0)
                    if not (c.ok and gen.wait(rid, timeout_s=120).ok):
                        raise RuntimeError(f"request {rid} failed: {c.error_message}")
                    path = c.path
            # the daemon logs transfer.done after its completion reply: wait for the last one
            done = ctx_d.logged("transfer.done", repeat + 1)[1:]
        finally:
            ctx_d.stop()
            gen_d.stop()
    waits = [float(d["stages"].get("gpu_wait_s", 0.0)) for d in done]
    best = min(walls[1:])
    return {"blocks": blocks, "mib": blocks * BLOCK_BYTES / 2**20, "shuffled": shuffled, "copy_engine": copy_engine,
            "path": path, "copy_runs": sorted({int(d["stages"].get("gpu_copy_runs", 0)) for d in done}),
            "gpu_wait_ms_median": statistics.median(waits) * 1e3, "e2e_best_ms": best * 1e3,
            "e2e_gbps": blocks * BLOCK_BYTES / best / 1e9}


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m kvd.bench.copy_engines``."""
    p = argparse.ArgumentParser(prog="python -m kvd.bench.copy_engines",
                                description="Copy engines against the regroup kernel on the mapped path, for "
                                            "equal layouts (TP1 -> TP1, GPU 0 -> GPU 1), consecutive and shuffled "
                                            "blocks; KVD_COPY_ENGINE=0 rows keep every request on the kernel.")
    p.add_argument("--blocks", default="256,16", help="request sizes in blocks, comma-separated (default 256,16)")
    p.add_argument("--repeat", type=int, default=7, help="timed requests per row after a warm-up (default 7)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cuda (default) or cpu (host pools)")
    p.add_argument("--json", action="store_true", help="print one JSON object per row")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m kvd.bench.copy_engines``."""
    p = build_parser()
    args = p.parse_args(argv)
    sizes = [int(b) for b in args.blocks.split(",") if b]
    if not sizes or min(sizes) < 1 or args.repeat < 1:
        p.error("--blocks needs positive sizes and --repeat at least 1")
    if args.device == "cuda":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < 2:
            p.error(f"--device cuda (the default) puts the ctx pool on GPU 0 and the gen pool on GPU 1: this "
                    f"machine has {count} CUDA GPU(s); --device cpu runs the same requests on host pools")
    for blocks in sizes:
        for shuffled in (False, True):
            for copy_engine in (True, False):
                row = run_row(blocks, shuffled, args.repeat, copy_engine, args.device == "cpu")
                if args.json:
                    print(json.dumps(row), flush=True)
                else:
                    print(f"{blocks:4d} blocks {row['mib']:6.0f} MiB {'shuffled   ' if shuffled else 'consecutive'} "
                          f"{'copy engines allowed' if copy_engine else 'kernel only         '} path={row['path']} "
                          f"copy_runs={row['copy_runs']} gpu_wait median {row['gpu_wait_ms_median']:.3f} ms  "
                          f"e2e best {row['e2e_best_ms']:.3f} ms ({row['e2e_gbps']:.1f} GB/s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
