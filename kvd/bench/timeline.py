"""Where a request's time goes: both daemons' event-loop steps on one clock, request by request.

``python -m kvd.bench.timeline [--geometry tiny] [--blocks 1] [--requests 200] [--path mapped]``
starts two daemons (ctx TP1 -> gen TP4, the latency bench's executors: four gen ranks in
processes of their own) with ``KVD_TRACE_STEPS`` set, so each records every trio task step
and every :func:`kvd.ops.steptrace.mark` (``= feed ...``, ``= planned``, ``= session.replied
...``). It then runs ``--requests`` requests with the gen executors registered first (naming
their ctx peer) and prints:

- per daemon, the event-loop time per request by task (mean over the requests; waits for I/O
  as ``<io_wait``), and the share of requests in which the task ran;
- the timeline of the median request (and of the ``--show - 1`` fastest ones): every step and
  mark of both daemons, in microseconds since the ctx executor called ``publish_and_wait``,
  with the executors' completions in the header. Short poller and busy-poll steps and short
  I/O waits are left out of the timeline (they are in the totals).

``perf_counter`` is CLOCK_MONOTONIC, one clock for every process of the machine, so the
daemons' steps and the executors' times line up. A step's duration is wall time: on a busy
host it includes time the OS gave other processes. ``--memory auto --device 0 --gen-device
1`` runs it on GPU pools.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from kvd.bench.latency import GEOMETRIES, _Executors, _wait_for_link
from kvd.demo.pair import start_pair

#: Steps of these tasks, and I/O waits, shorter than :data:`SHORT_US` stay out of the timeline.
QUIET = ("<io_wait", "kvd.transport.poller.poll_notifications", "kvd.transfer.engine.Engine._busy_poll")
SHORT_US = 15.0


@dataclass
class Step:
    """One task step (``dur_us`` > 0, ``name`` the task) or mark (``dur_us`` 0, ``name`` "= ...")."""

    start: float
    dur_us: float
    name: str


@dataclass
class Request:
    """A request's start and its executors' completions (``perf_counter`` seconds)."""

    rid: str
    t0: float
    done: dict[str, float]

    @property
    def end(self) -> float:
        return max(self.done.values())


@dataclass
class Trace:
    """The requests and each daemon's steps (``ctx``, ``gen``)."""

    requests: list[Request]
    steps: dict[str, list[Step]] = field(default_factory=dict)


def read_steps(path: Path) -> list[Step]:
    """A ``KVD_TRACE_STEPS`` dump: one ``start_s dur_us name`` line per step or mark."""
    out = []
    for line in path.read_text().splitlines():
        start, dur, name = line.split(" ", 2)
        out.append(Step(float(start), float(dur), name))
    return out


def run(workdir: Path, *, geometry: str, blocks: int, requests: int, mapped: bool, memory: str = "host",
        device: int = -1, gen_device: int | None = None, warmup: int = 20, client_spin_s: float = 0.0,
        completion_page: bool = False) -> Trace:
    """Run ``requests`` traced requests (after ``warmup`` untraced-in-the-figures ones) on a
    fresh pair of daemons in ``workdir``; returns the trace. ``client_spin_s``,
    ``completion_page``: every executor's ``Client(spin_s=, completion_page=)``."""
    geo = GEOMETRIES[geometry]
    os.environ["KVD_TRACE_STEPS"] = str(workdir / "trace")  # read by the daemons at start
    try:
        ctx_d, gen_d = start_pair(workdir, gen_tp=4, blocks=max(4, blocks), bounce_mb=64, chunk_mb=16,
                                  memory=memory, device=device, gen_device=gen_device,
                                  extra_transfer={"mapped": mapped}, geometry=geo)
    finally:
        del os.environ["KVD_TRACE_STEPS"]
    done: list[Request] = []
    try:
        _wait_for_link(gen_d)
        ex = _Executors(ctx_d, gen_d, blocks, geo, client_spin_s, completion_page)
        try:
            for i in range(warmup):
                ex.once(f"warm-{i}", True)
            for i in range(requests):
                rid = f"t{i}"
                ex.once(rid, True)
                t0, at = ex.last_times
                done.append(Request(rid, t0, at))
        finally:
            ex.close()
    finally:
        ctx_d.stop()
        gen_d.stop()
    trace = Trace(done)
    for who, d in (("ctx", ctx_d), ("gen", gen_d)):
        trace.steps[who] = read_steps(workdir / f"trace.{d.pid}.steps")
    return trace


def per_request(trace: Trace) -> dict[str, list[tuple[str, float, float]]]:
    """Per daemon: (task, mean µs per request, share of requests it ran in), largest first.
    A step counts for the request whose span [start, last completion] holds its start."""
    out: dict[str, list[tuple[str, float, float]]] = {}
    n = len(trace.requests)
    for who, steps in trace.steps.items():
        total: dict[str, float] = defaultdict(float)
        seen: dict[str, int] = defaultdict(int)
        for r in trace.requests:
            here: dict[str, float] = defaultdict(float)
            for s in steps:
                if r.t0 <= s.start <= r.end and not s.name.startswith("= "):
                    here["<io_wait" if s.name.startswith("<io_wait") else s.name] += s.dur_us
            for k, v in here.items():
                total[k] += v
                seen[k] += 1
        out[who] = sorted(((k, v / n, seen[k] / n) for k, v in total.items()), key=lambda x: -x[1])
    return out


def timeline(trace: Trace, r: Request, lead_us: float = 50.0) -> list[tuple[float, str, float, str]]:
    """Steps and marks of both daemons around request ``r``: (µs since its start, daemon,
    duration µs, name), in time order, short quiet steps left out."""
    rows = []
    for who, steps in trace.steps.items():
        for s in steps:
            if r.t0 - lead_us * 1e-6 <= s.start <= r.end:
                if s.name.startswith(QUIET) and s.dur_us < SHORT_US:
                    continue
                rows.append(((s.start - r.t0) * 1e6, who, s.dur_us, s.name))
    return sorted(rows)


def report(trace: Trace, show: int) -> str:
    """The text ``main`` prints."""
    reqs = sorted(trace.requests, key=lambda r: r.end - r.t0)
    if not reqs:
        return "no requests"
    e2e = [(r.end - r.t0) * 1e3 for r in reqs]
    lines = [f"{len(reqs)} requests, end to end p50 {statistics.median(e2e):.3f} ms, best {e2e[0]:.3f} ms, "
             f"ctx executor p50 {statistics.median((r.done['ctx'] - r.t0) * 1e3 for r in reqs):.3f} ms"]
    for who, rows in per_request(trace).items():
        lines.append(f"{who} daemon: event-loop time per request (µs, mean; share of requests with the task)")
        lines += [f"  {us:9.1f}  {share:4.2f}  {name}" for name, us, share in rows[:20]]
    for r in [reqs[len(reqs) // 2], *reqs[: max(0, show - 1)]]:
        done = ", ".join(f"{k} {(v - r.t0) * 1e6:.0f}" for k, v in sorted(r.done.items()))
        lines.append(f"request {r.rid}: end to end {(r.end - r.t0) * 1e6:.0f} µs; completions (µs): {done}")
        lines += [f"  {t:9.1f} {who:3} {dur:8.1f}  {name[:120]}" for t, who, dur, name in timeline(trace, r)]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m kvd.bench.timeline``."""
    p = argparse.ArgumentParser(
        prog="python -m kvd.bench.timeline",
        description="Both daemons' event-loop steps around each request, on one clock.",
        epilog="Each timeline line: microseconds since the ctx executor's call, the daemon (ctx or gen), "
               "the step's length in microseconds (0.0 for a mark inside a step), and the step's task or, "
               "after '=', a mark: a request or reply, an event fed to the transfer state machine with "
               "the actions it returned, an action carried out, a data-path stage (a request completed from "
               "a landed event shows 'feed LandedSeen' on gen).")
    p.add_argument("--geometry", choices=sorted(GEOMETRIES), default="tiny",
                   help="KV geometry (default tiny: 9 KiB blocks, the copy is ~free, what is left is control work)")
    p.add_argument("--blocks", type=int, default=1, help="request size in blocks (default 1)")
    p.add_argument("--requests", type=int, default=200, help="traced requests (default 200)")
    p.add_argument("--path", choices=["mapped", "nixl"], default="mapped",
                   help="mapped (same-node mapping, the default) or nixl (the bounce path)")
    p.add_argument("--memory", choices=["host", "auto"], default="host", help="pool memory: host (the default) or auto (GPU when --device >= 0)")
    p.add_argument("--device", type=int, default=-1, help="ctx pool's GPU (default -1: host)")
    p.add_argument("--gen-device", type=int, default=None, help="gen pools' GPU (default: --device)")
    p.add_argument("--client-spin-us", type=float, default=0.0,
                   help="executors poll their socket this long before sleeping (Client(spin_s=); default 0)")
    p.add_argument("--completion-page", action="store_true",
                   help="with --client-spin-us: executors read the daemons' completion pages (Client(completion_page=True))")
    p.add_argument("--show", type=int, default=2, help="timelines printed in all: the median request's, then the fastest requests' (default 2: the median and the fastest)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m kvd.bench.timeline``."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.blocks < 1 or args.requests < 1 or args.show < 1:
        p.error("--blocks, --requests and --show must be positive")
    if args.completion_page and args.client_spin_us <= 0:
        p.error("--completion-page needs --client-spin-us > 0 (only a spinning client reads the page)")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    with tempfile.TemporaryDirectory(prefix="kvd-timeline-") as tmp:
        trace = run(Path(tmp), geometry=args.geometry, blocks=args.blocks, requests=args.requests,
                    mapped=args.path == "mapped", memory=args.memory, device=args.device, gen_device=args.gen_device,
                    client_spin_s=args.client_spin_us * 1e-6, completion_page=args.completion_page)
    print(report(trace, args.show))
    return 0


if __name__ == "__main__":
    sys.exit(main())
