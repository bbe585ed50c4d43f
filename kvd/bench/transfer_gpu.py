"""``kvd bench transfer --device cuda``: the GPT-OSS-120B ctx TP1 -> gen TP4 scenario on two GPUs.

Daemon ``ctx`` owns one pool on GPU 0 (with the ctx executor), daemon ``gen`` owns four gen-rank
pools on GPU 1; memory policy ``auto`` (fabric probe, device fallback). Measured in one run:

- the ceiling: a contiguous GPU0 -> GPU1 copy of the same bytes;
- end to end through the daemons (executor publish -> completion): the same-node ``mapped``
  path and the NIXL bounce pipeline (``mapped`` off); the gen executors expect first and name
  the ctx daemon, so bytes move with no peer round trip (the deployment's fast path);
- raw NIXL/UCX writes of the same bytes between two processes (GPU0 -> GPU1, cudaMalloc
  memory): 64 MiB descriptors, and one descriptor per 8 KiB regroup fragment;
- the ratios; ``--json`` for machines, ``--plot PNG`` for GB/s against request size.

``--gen-gpu 0`` runs the same on one GPU (a machine of one GPU): every pool on GPU 0, the ceiling
a copy within that GPU, NIXL's writes within it too; its ratios say how much of a local copy the
paths reach, not NVLink's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvd.bench import latency
from kvd.config import usable_cpus
from kvd.demo.pair import GEOMETRY, Scenario, start_pair

MiB = 1 << 20
BLOCK_BYTES = 36 * 2 * 8 * 32 * 64 * 2  # GPT-OSS-120B, TP1: 2.25 MiB


def _contiguous_copy(nbytes: int, repeat: int, gen_gpu: int = 1) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0").fill_(7)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{gen_gpu}")
    dst.copy_(src)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(gen_gpu)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(gen_gpu)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _kernel_alone(sizes: list[int], max_blocks: int, repeat: int, gen_gpu: int = 1) -> dict[int, float]:
    """GB/s of the regroup kernel alone per request size (blocks): ctx TP1 pool on GPU 0 ->
    four gen TP4 pools on GPU ``gen_gpu``, random block ids, one push launch, timed from launch to its
    event (best of ``repeat``). What the end-to-end path adds is everything around it."""
    import numpy as np

    from kvd.regroup import apply as regroup_apply
    from kvd.regroup.plan import plan
    from protocol.layout import KVLayout

    geo = {**GEOMETRY, "num_blocks": max_blocks}
    ctx, gen = KVLayout(**geo, tp_size=1), KVLayout(**geo, tp_size=4)
    src = torch.randint(0, 256, (ctx.pool_bytes(0),), dtype=torch.uint8, device="cuda:0")
    dst = {r: torch.zeros(gen.pool_bytes(r), dtype=torch.uint8, device=f"cuda:{gen_gpu}") for r in range(4)}
    rng = np.random.default_rng(3)
    out: dict[int, float] = {}
    for n in sizes:
        best = float("inf")
        for _ in range(repeat + 1):
            p = plan(ctx, gen, {0: rng.permutation(max_blocks)[:n]}, {r: rng.permutation(max_blocks)[:n] for r in range(4)})
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(gen_gpu)
            t0 = time.perf_counter()
            regroup_apply.regroup(p, 0, src, dst, launch_on="src").wait()
            best = min(best, time.perf_counter() - t0)
        out[n] = n * BLOCK_BYTES / best / 1e9
    return out


def _raw_target(path: str, nbytes: int, gen_gpu: int = 1) -> None:
    """Target process: cudaMalloc'd memory on GPU ``gen_gpu`` registered with NIXL; polls until told."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    from kvd.transport import NixlAgent, Region

    torch.cuda.set_device(gen_gpu)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{gen_gpu}")
    agent = NixlAgent("raw-target")
    agent.register([Region(dst.data_ptr(), nbytes, gen_gpu, "VRAM")])
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    md = agent.metadata()
    s.sendall(len(md).to_bytes(8, "big") + md + dst.data_ptr().to_bytes(8, "big"))
    s.setblocking(False)
    while True:
        agent.notifications()
        try:
            if s.recv(1) in (b"q", b""):
                break
        except BlockingIOError:
            pass
    agent.close()


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("raw bench target went away")
        buf += chunk
    return buf


def _raw_nixl(nbytes: int, frag: int, repeat: int, workdir: Path, gen_gpu: int = 1) -> dict[str, Any]:
    import numpy as np

    from kvd.transport import NixlAgent, Region

    path = str(workdir / "raw.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)
    proc = mp.get_context("spawn").Process(target=_raw_target, args=(path, nbytes, gen_gpu))
    proc.start()
    src = torch.full((nbytes,), 3, dtype=torch.uint8, device="cuda:0")
    agent = NixlAgent("raw-writer")
    out: dict[str, Any] = {}
    try:
        agent.register([Region(src.data_ptr(), nbytes, 0, "VRAM")])
        conn, _ = srv.accept()
        n = int.from_bytes(_recv_exact(conn, 8), "big")
        remote = agent.add_remote(_recv_exact(conn, n))
        dptr = int.from_bytes(_recv_exact(conn, 8), "big")
        for label, desc in (("large", 64 * MiB), ("per_fragment", frag)):
            count = nbytes // desc
            offs = np.arange(count, dtype=np.uint64) * np.uint64(desc)
            local = np.stack([offs + np.uint64(src.data_ptr()), np.full(count, desc, dtype=np.uint64)], axis=1)
            rem = np.stack([offs + np.uint64(dptr), np.full(count, desc, dtype=np.uint64)], axis=1)
            best = float("inf")
            for _ in range(repeat + 1):
                t0 = time.perf_counter()
                h = agent.write(local, rem, remote, b"raw", local_mem="VRAM", remote_mem="VRAM",
                                local_device=0, remote_device=gen_gpu)
                while agent.state(h) == "PROC":
                    pass
                best = min(best, time.perf_counter() - t0)
                agent.release(h)
            out[label] = {"desc_bytes": desc, "ndescs": count, "gbps": count * desc / best / 1e9}
        conn.sendall(b"q")
        conn.close()
    finally:
        agent.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        srv.close()
    return out


def _e2e(workdir: Path, max_blocks: int, sizes: list[int], repeat: int, mapped: bool, chunk_mb: int,
         bounce_mb: int, progress_thread: bool = False, busy_poll: str = "auto", gen_gpu: int = 1) -> dict[str, Any]:
    sub = workdir / ("mapped" if mapped else "nixl")
    sub.mkdir()
    ctx_d, gen_d = start_pair(sub, gen_tp=4, blocks=max_blocks, bounce_mb=bounce_mb, chunk_mb=chunk_mb,
                              memory="auto", device=0, gen_device=gen_gpu,
                              extra_transfer={"mapped": mapped, "nixl_progress_thread": progress_thread,
                                              "busy_poll": busy_poll})
    by_order: dict[bool, dict[int, dict[str, Any]]] = {True: {}, False: {}}
    try:
        for n in sizes:
            for shuffled in (True, False):
                by_order[shuffled][n] = _e2e_size(ctx_d, gen_d, n, repeat, shuffled)
        kinds = [line for line in ctx_d.log().splitlines() if '"pool.fabric_unavailable"' in line]
    finally:
        ctx_d.stop()
        gen_d.stop()
    # by_blocks: shuffled block ids (every block its own run: the general case the figures quote);
    # by_blocks_contiguous: a fresh pool's consecutive ids, the same requests otherwise
    return {"by_blocks": by_order[True], "by_blocks_contiguous": by_order[False],
            "fabric_warning": kinds[0] if kinds else ""}


def _e2e_size(ctx_d: Any, gen_d: Any, n: int, repeat: int, shuffled: bool) -> dict[str, Any]:
    """One request size end to end: a warm-up, then ``repeat`` timed requests (best and median)."""
    before = len(ctx_d.logged("transfer.done", 0))  # every earlier request's line is in (waited below)
    scenario = Scenario(ctx_d, gen_d, n, shuffle=shuffled)
    try:
        results, walls, ok = scenario.timed(repeat)
        contiguous = scenario.contiguous
    finally:
        scenario.close()
    c = results["ctx0"]
    # the last request's own line: the daemon logs it after its completion reply
    done_lines = ctx_d.logged("transfer.done", before + scenario.count)
    stages = done_lines[-1].get("stages") if done_lines else None
    rtt = done_lines[-1].get("round_trips") if done_lines else None
    return {"stages": stages, "round_trips": rtt, "bytes": c.bytes, "path": c.path, "chunks": c.chunks,
            "best_s": min(walls), "median_s": statistics.median(walls), "gbps": c.bytes / min(walls) / 1e9,
            "median_gbps": c.bytes / statistics.median(walls) / 1e9,
            "daemon_gbps": c.bytes / c.duration_s / 1e9 if c.duration_s else 0.0, "verified": ok,
            "contiguous_ids": contiguous}


def build_parser() -> argparse.ArgumentParser:
    """The options of ``kvd bench transfer --device cuda``."""
    parser = argparse.ArgumentParser(
        prog="kvd bench transfer --device cuda",
        description="The GPT-OSS-120B ctx TP1 -> gen TP4 scenario on two GPUs: the contiguous-copy ceiling, then "
                    "end to end through the daemons (mapped path and NIXL bounce pipeline), per request size.",
    )
    parser.add_argument("--device", default="cuda", help="cuda, the default (two GPUs, or one with --gen-gpu 0)")
    parser.add_argument("--blocks", type=int, default=256, help="request size in blocks (2.25 MiB each; default 256)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs of each measurement, the best shown (default 5)")
    parser.add_argument("--chunk-mb", type=int, default=160,
                        help="bounce slot size in MiB, the largest chunk (default 160: a 576 MiB TP1 -> TP4 "
                             "request goes as one chunk per pair, the fastest on GPUs)")
    parser.add_argument("--bounce-mb", type=int, default=1280, help="bounce buffer size in MiB (default 1280: 8 slots)")
    parser.add_argument("--sizes", default="1,4,16,64,256", help="block counts for the size sweep (default 1,4,16,64,256)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--plot", default="", help="write a PNG of GB/s against request size")
    parser.add_argument("--json-out", default="", help="also write the JSON report to this file")
    parser.add_argument("--latency-sizes", default="1,4,16,64",
                        help="request sizes (blocks) for the latency table, gen-first and ctx-first; '' = skip (default 1,4,16,64)")
    parser.add_argument("--latency-repeat", type=int, default=30, help="requests per latency row (default 30)")
    parser.add_argument("--nixl-progress-thread", action="store_true",
                        help="run both daemons' NIXL agents with their progress thread on (transfer.nixl_progress_thread; "
                             "default off)")
    parser.add_argument("--gen-gpu", type=int, default=1,
                        help="GPU of the four gen pools (default 1: ctx on GPU 0 -> gen on GPU 1 over NVLink; 0 runs "
                             "everything on one GPU, every ratio then against a copy within that GPU)")
    parser.add_argument("--busy-poll", choices=["auto", "on", "off"], default="auto",
                        help="both daemons' transfer.busy_poll (spin while requests are pending; default auto: "
                             "on with at least 8 usable cores)")
    parser.add_argument("--client-spin-us", type=float, default=0.0,
                        help="the latency table's executors poll their socket this long before sleeping "
                             "(Client(spin_s=); default 0: they sleep at once)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvd bench transfer --device cuda``."""
    args = build_parser().parse_args(argv)
    g = args.gen_gpu
    if g < 0 or torch.cuda.device_count() <= g:
        print(f"kvd bench transfer: error: --device cuda puts the gen pools on GPU {g}: this machine has "
              f"{torch.cuda.device_count()} GPU(s) (--gen-gpu 0 runs everything on one GPU)", file=sys.stderr)
        return 2
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    sizes = sorted({int(x) for x in args.sizes.split(",") if x} | {args.blocks})
    nbytes = args.blocks * BLOCK_BYTES
    workdir = Path(tempfile.mkdtemp(prefix="kvd-gbench-", dir="/tmp"))
    try:
        ceiling = _contiguous_copy(nbytes, args.repeat, g)
        lat_sizes = [int(x) for x in args.latency_sizes.split(",") if x]
        lat = {name: latency.run(workdir, lat_sizes, args.latency_repeat, mapped=on, memory="auto", device=0,
                                 gen_device=g, busy_poll=args.busy_poll, client_spin_s=args.client_spin_us * 1e-6)
               for name, on in (("mapped", True), ("nixl", False))} if lat_sizes else {}
        thread = args.nixl_progress_thread
        mapped = _e2e(workdir, max(sizes), sizes, args.repeat, True, args.chunk_mb, args.bounce_mb, thread,
                      args.busy_poll, g)
        nixl = _e2e(workdir, max(sizes), sizes, args.repeat, False, args.chunk_mb, args.bounce_mb, thread,
                    args.busy_poll, g)
        frag = GEOMETRY["tokens_per_block"] * GEOMETRY["head_dim"] * 2 * 2
        raw = _raw_nixl(nbytes, frag, args.repeat, workdir, g)
        kernel_alone = _kernel_alone(sizes, max(sizes), args.repeat, g)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    m, b = mapped["by_blocks"][args.blocks], nixl["by_blocks"][args.blocks]
    report: dict[str, Any] = {
        "scenario": {"geometry": GEOMETRY, "ctx_tp": 1, "gen_tp": 4, "blocks": args.blocks, "bytes": nbytes,
                     "gpus": [torch.cuda.get_device_name(i) for i in sorted({0, g})], "gen_gpu": g,
                     "chunk_mb": args.chunk_mb,
                     "bounce_mb": args.bounce_mb, "nixl_progress_thread": args.nixl_progress_thread,
                     "busy_poll": args.busy_poll, "usable_cpus": usable_cpus()},
        "contiguous_copy_gbps": ceiling,
        "latency": lat,
        "e2e_mapped": mapped,
        "e2e_nixl_bounce": nixl,
        "raw_nixl": raw,
        "kernel_alone_gbps": kernel_alone,
        "ratios": {
            "mapped_vs_contiguous": m["gbps"] / ceiling,
            "bounce_vs_contiguous": b["gbps"] / ceiling,
            "mapped_vs_per_fragment": m["gbps"] / raw["per_fragment"]["gbps"],
            "bounce_vs_per_fragment": b["gbps"] / raw["per_fragment"]["gbps"],
            "raw_large_vs_contiguous": raw["large"]["gbps"] / ceiling,
            "bounce_vs_raw_large": b["gbps"] / raw["large"]["gbps"],
            "kernel_alone_vs_contiguous": kernel_alone[args.blocks] / ceiling,
        },
    }
    if args.plot:
        from kvd.bench.plot import plot

        plot(report, args.plot)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"kvd bench transfer --device cuda: GPT-OSS-120B KV ctx TP1 (GPU0) -> gen TP4 (GPU{g}), "
              f"{args.blocks} blocks = {nbytes / MiB:.0f} MiB, best of {args.repeat}")
        print(f"  contiguous GPU0->GPU{g} copy (ceiling)       {ceiling:8.1f} GB/s")
        print(f"  kvd end to end, mapped path                {m['gbps']:8.1f} GB/s   path={m['path']} verified={m['verified']} "
              f"round_trips={m.get('round_trips')}")
        print(f"  kvd end to end, NIXL bounce pipeline       {b['gbps']:8.1f} GB/s   path={b['path']} "
              f"chunks={b['chunks']} verified={b['verified']} round_trips={b.get('round_trips')}")
        print(f"  raw NIXL write, 64 MiB descriptors         {raw['large']['gbps']:8.1f} GB/s")
        print(f"  raw NIXL write, per 8 KiB fragment         {raw['per_fragment']['gbps']:8.2f} GB/s")
        for k, v in report["ratios"].items():
            print(f"  ratio {k:<36} {v:8.2f}")
        print(f"  ctx-side stages, mapped (s since start): {m.get('stages')}")
        print(f"  ctx-side stages, bounce (s since start): {b.get('stages')}")
        print("  size sweep, GB/s (best; median in brackets); shuffled = block ids in random order, "
              "contiguous = consecutive ids:")
        print("    blocks   mapped shuffled   mapped contiguous   bounce shuffled   bounce contiguous   kernel alone")
        for n in sizes:
            cells = [f"{r[k][n]['gbps']:7.1f} ({r[k][n]['median_gbps']:6.1f})"
                     for r in (mapped, nixl) for k in ("by_blocks", "by_blocks_contiguous")]
            print(f"    {n:6d}   {cells[0]:>15}   {cells[1]:>17}   {cells[2]:>15}   {cells[3]:>17}   {kernel_alone[n]:12.1f}")
        for name, lat_rows in lat.items():
            latency.print_rows(f"  latency, {name} path, GPU pools, {args.latency_repeat} requests per row", lat_rows)
        if mapped["fabric_warning"]:
            print(f"  pool policy: {mapped['fabric_warning']}")
    ok = all(v["verified"] for r in (mapped, nixl) for k in ("by_blocks", "by_blocks_contiguous")
             for v in r[k].values())
    return 0 if ok else 1
