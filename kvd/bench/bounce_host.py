"""Host work per chunk of the NIXL bounce path, on host memory (no GPU needed).

``python -m kvd.bench.bounce_host [--blocks 32] [--repeat 10] [--rounds 5]`` starts two daemons
(ctx TP1 -> gen TP4, GPT-OSS-120B blocks, host pools, the mapped path off, NIXL over UCX on
loopback) twice: once with 1 MiB bounce slots (the request cut into many 1 MiB chunks) and
once with slots that hold each pair's whole stream (one chunk per pair). The same bytes move
both times, so the difference is what the extra chunks cost: per extra chunk, the added
request wall time (the best request) and the added CPU time of each daemon
(``/proc/PID/task/*/schedstat`` over all requests, per request: event loop, worker threads,
NIXL, UCX). A chunk's own copies are small (1 MiB gathered, written,
scattered) and are paid in both runs.

The figure is the median over ``--rounds`` rounds (each a fresh pair of daemons per chunk
size, ``--repeat`` requests after a warm-up, median per round). The gen daemon's notification
poller spins while a transfer is in progress, so its CPU time tracks the request's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvd.demo.launch import DaemonProcess
from kvd.demo.pair import GEOMETRY, Scenario, start_pair
from kvd.transfer.movers import INLINE_BYTES
from protocol.layout import KVLayout

BLOCK_BYTES = KVLayout(**GEOMETRY).block_bytes(0)
#: The chunk of the run with few chunks: the largest a daemon gathers, writes and scatters on
#: the event loop (:data:`kvd.transfer.movers.INLINE_BYTES`), as it does the 1 MiB ones.
FEW_MB = INLINE_BYTES >> 20
#: Figures per extra chunk: request wall time, daemon CPU, daemon event-loop work and steps.
KEYS = ("wall_s", "ctx_cpu_s", "gen_cpu_s", "ctx_loop_s", "gen_loop_s", "ctx_steps", "gen_steps")
GEN_TP = 4


def _cpu_s(pid: int) -> float:
    """CPU time the process's live threads used so far (``schedstat``: nanoseconds, where
    ``/proc/PID/stat`` counts 10 ms ticks; trio's idle worker threads live on for seconds)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def _round(blocks: int, repeat: int, chunk_mb: int) -> dict[str, Any]:
    """Fresh daemons with ``chunk_mb`` slots; medians of ``repeat`` requests after a warm-up."""
    bounce_mb = max(8 * chunk_mb, 8)
    with tempfile.TemporaryDirectory(prefix="kvd-bh-") as tmp:
        os.environ["KVD_TRACE_STEPS"] = f"{tmp}/trace"  # read by the daemons at start
        try:
            ctx_d, gen_d = start_pair(Path(tmp), gen_tp=GEN_TP, blocks=blocks, bounce_mb=bounce_mb,
                                      chunk_mb=chunk_mb, extra_transfer={"mapped": False})
        finally:
            del os.environ["KVD_TRACE_STEPS"]
        daemons: dict[str, DaemonProcess] = {"ctx": ctx_d, "gen": gen_d}
        try:
            scenario = Scenario(ctx_d, gen_d, blocks)
            try:
                results, _ = scenario.transfer()  # warm-up: first touch, UCX lanes, descriptor lists
                walls: list[float] = []
                before = {k: _cpu_s(d.pid) for k, d in daemons.items()}
                t0 = time.perf_counter()
                for _ in range(repeat):
                    results, wall = scenario.transfer()
                    walls.append(wall)
                t1 = time.perf_counter()
                cpu = {k: (_cpu_s(d.pid) - before[k]) / repeat for k, d in daemons.items()}
                if not scenario.verify():
                    raise RuntimeError("the gen pools do not hold the ctx data")
            finally:
                scenario.close()
        finally:
            ctx_d.stop()
            gen_d.stop()
        loop = {k: _loop_work(Path(f"{tmp}/trace.{d.pid}.steps"), t0, t1) for k, d in daemons.items()}
    c = results["ctx0"]
    if c.path != "bounce":
        raise RuntimeError(f"the request took path {c.path!r}, not bounce")
    # the best request: on a shared host the others carry other processes' time
    return {"chunks": c.chunks, "wall_s": min(walls),
            **{f"{k}_cpu_s": v for k, v in cpu.items()},
            **{f"{k}_loop_s": v[0] / repeat for k, v in loop.items()},
            **{f"{k}_steps": v[1] / repeat for k, v in loop.items()}}


def _loop_work(steps: Path, t0: float, t1: float) -> tuple[float, int]:
    """Event-loop time and task steps between ``t0`` and ``t1`` (``perf_counter``, one clock
    for every process) from a ``KVD_TRACE_STEPS`` dump, leaving out waits for I/O and the
    NIXL notification poller: its spin (a poll and a checkpoint, while a transfer is in
    progress) takes as many steps as the request takes wall time. Steps are timed by the
    clock on the wall: on a busy host they include time the OS gave other processes."""
    total, count = 0.0, 0
    for line in steps.read_text().splitlines():
        start, dur, name = line.split(" ", 2)
        if t0 <= float(start) <= t1 and not name.startswith(("<io_wait", "= ", "kvd.transport.nixl_agent.poll")):
            total += float(dur) / 1e6
            count += 1
    return total, count


def measure(blocks: int, repeat: int, rounds: int) -> dict[str, Any]:
    """Per-chunk figures: the medians over ``rounds`` of (many chunks - one per pair) / extra chunks."""
    per_round: list[dict[str, float]] = []
    many = one = {}
    for _ in range(rounds):
        many, one = _round(blocks, repeat, 1), _round(blocks, repeat, FEW_MB)
        extra = many["chunks"] - one["chunks"]
        per_round.append({k: (many[k] - one[k]) / extra * (1 if k.endswith("steps") else 1e6) for k in KEYS})
    return {
        "blocks": blocks, "mib": blocks * BLOCK_BYTES / (1 << 20), "chunks_many": many["chunks"],
        "chunks_one": one["chunks"], "rounds": rounds, "repeat": repeat,
        "wall_ms_many": many["wall_s"] * 1e3, "wall_ms_one": one["wall_s"] * 1e3,
        **{f"{k.removesuffix('_s')}_{'' if k.endswith('steps') else 'us_'}per_chunk":
           statistics.median(r[k] for r in per_round) for k in KEYS},
        "per_round_us": per_round,
    }


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m kvd.bench.bounce_host``."""
    p = argparse.ArgumentParser(prog="python -m kvd.bench.bounce_host",
                                description="Host work per chunk of the NIXL bounce path on host memory: the same "
                                            "request in 1 MiB chunks and in one chunk per pair, two daemons.")
    p.add_argument("--blocks", type=int, default=32, help="request size in blocks (2.25 MiB each; default 32)")
    p.add_argument("--repeat", type=int, default=10, help="timed requests per daemon pair after a warm-up (default 10)")
    p.add_argument("--rounds", type=int, default=5, help="rounds, each on fresh daemons (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m kvd.bench.bounce_host``."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.blocks < 1 or args.repeat < 1 or args.rounds < 1:
        p.error("--blocks, --repeat and --rounds must be positive")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    r = measure(args.blocks, args.repeat, args.rounds)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"{r['blocks']} blocks ({r['mib']:.0f} MiB), ctx TP1 -> gen TP4, host pools, bounce path: "
          f"{r['chunks_many']} chunks of 1 MiB {r['wall_ms_many']:.1f} ms, {r['chunks_one']} chunks "
          f"{r['wall_ms_one']:.1f} ms (best of the last round)")
    print(f"per extra chunk (median of {r['rounds']} rounds): wall {r['wall_us_per_chunk']:.0f} us, "
          f"ctx CPU {r['ctx_cpu_us_per_chunk']:.0f} us, gen CPU {r['gen_cpu_us_per_chunk']:.0f} us")
    print(f"event-loop work per extra chunk (task steps, poller and I/O waits left out): "
          f"ctx {r['ctx_loop_us_per_chunk']:.0f} us in {r['ctx_steps_per_chunk']:.1f} steps, "
          f"gen {r['gen_loop_us_per_chunk']:.0f} us in {r['gen_steps_per_chunk']:.1f} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
