"""``kvd bench ipc``: round-trip latency and throughput of the executor ↔ daemon socket.

Starts a real daemon (``python -m kvd serve`` in a temporary directory, readiness by
``READY=1``), then measures ``Ping`` round trips with

- the blocking :class:`clients.Client` (one request at a time),
- the async client, one request at a time,
- the async client with many requests in flight on one session,
- many async sessions at once,

and prints p50/p99 latency, ops/s and the daemon's CPU time per request (from
``/proc/<pid>/stat``). The client and the daemon share the machine's cores, so the figures are
an upper bound on the protocol's cost, not a pure daemon measurement.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec
import trio

from kvd.demo.launch import DaemonProcess, start_daemon

_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class Row:
    client: str
    concurrency: int
    ops: int
    p50_us: float
    p99_us: float
    ops_per_s: float
    daemon_cpu_us_per_op: float


def _daemon_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (0 where /proc is unavailable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def _percentile(sorted_ns: list[int], q: float) -> float:
    if not sorted_ns:
        return 0.0
    i = min(len(sorted_ns) - 1, max(0, round(q * (len(sorted_ns) - 1))))
    return sorted_ns[i] / 1000


def _row(name: str, conc: int, lat_ns: list[int], wall_s: float, cpu_s: float) -> Row:
    lat_ns.sort()
    n = len(lat_ns)
    return Row(
        client=name,
        concurrency=conc,
        ops=n,
        p50_us=_percentile(lat_ns, 0.50),
        p99_us=_percentile(lat_ns, 0.99),
        ops_per_s=n / wall_s if wall_s > 0 else 0.0,
        daemon_cpu_us_per_op=cpu_s / n * 1e6 if n else 0.0,
    )


def bench_blocking(d: DaemonProcess, n: int, payload: bytes, warmup: int) -> Row:
    from clients.blocking import Client

    with Client(d.socket_path, client="bench-blocking") as kvd:
        for _ in range(warmup):
            kvd.ping(payload)
        lat: list[int] = []
        cpu0, t0 = _daemon_cpu_s(d.pid), time.perf_counter()
        for _ in range(n):
            s = time.perf_counter_ns()
            kvd.ping(payload)
            lat.append(time.perf_counter_ns() - s)
        wall, cpu = time.perf_counter() - t0, _daemon_cpu_s(d.pid) - cpu0
    return _row("blocking Client, sequential", 1, lat, wall, cpu)


async def bench_async(
    d: DaemonProcess, n: int, payload: bytes, warmup: int, *, sessions: int, in_flight: int
) -> Row:
    """``sessions`` async clients, each with ``in_flight`` tasks pinging in a loop."""
    from clients.client import open_client

    lat: list[int] = []
    per_task = max(1, n // (sessions * in_flight))
    go = trio.Event()
    ready = 0
    all_ready = trio.Event()

    async def task(kvd: object) -> None:
        ping = kvd.ping  # type: ignore[attr-defined]
        await go.wait()
        for _ in range(per_task):
            s = time.perf_counter_ns()
            await ping(payload)
            lat.append(time.perf_counter_ns() - s)

    async def session(i: int) -> None:
        nonlocal ready
        async with open_client(d.socket_path, client=f"bench-async-{i}") as kvd:
            for _ in range(max(1, warmup // sessions)):
                await kvd.ping(payload)
            ready += 1
            if ready == sessions:
                all_ready.set()
            async with trio.open_nursery() as nursery:
                for _ in range(in_flight):
                    nursery.start_soon(task, kvd)

    wall = cpu = 0.0
    async with trio.open_nursery() as nursery:
        for i in range(sessions):
            nursery.start_soon(session, i)
        await all_ready.wait()
        cpu0, t0 = _daemon_cpu_s(d.pid), time.perf_counter()
        go.set()
    wall, cpu = time.perf_counter() - t0, _daemon_cpu_s(d.pid) - cpu0
    if sessions == 1 and in_flight == 1:
        name = "async client, sequential"
    elif sessions == 1:
        name = f"async client, {in_flight} in flight"
    else:
        name = f"async clients, {sessions} sessions" + (f" x {in_flight} in flight" if in_flight > 1 else "")
    return _row(name, sessions * in_flight, lat, wall, cpu)


def format_table(rows: list[Row]) -> str:
    header = f"{'client':<36} {'conc':>5} {'ops':>7} {'p50 us':>9} {'p99 us':>9} {'ops/s':>10} {'daemon CPU us/op':>17}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.client:<36} {r.concurrency:>5} {r.ops:>7} {r.p50_us:>9.1f} {r.p99_us:>9.1f} "
            f"{r.ops_per_s:>10,.0f} {r.daemon_cpu_us_per_op:>17.1f}"
        )
    return "\n".join(lines)


#: A tiny host pool: the benchmark measures the socket, not the pool.
_SMALL_POOL = {
    "name": "host0",
    "memory": "host",
    "device": -1,
    "num_layers": 1,
    "num_kv_heads": 1,
    "head_dim": 64,
    "tokens_per_block": 16,
    "dtype": "bfloat16",
    "num_blocks": 16,
}


def build_parser() -> argparse.ArgumentParser:
    """The options of ``kvd bench ipc``."""
    parser = argparse.ArgumentParser(
        prog="kvd bench ipc",
        description="Round-trip latency and throughput of the executor <-> daemon socket: a real daemon, "
                    "pings from the blocking and the async client, one at a time, many in flight, many sessions.",
    )
    parser.add_argument("--pings", type=int, default=20000, help="round trips per measurement (default 20000)")
    parser.add_argument("--warmup", type=int, default=1000, help="round trips before each measurement (default 1000)")
    parser.add_argument("--payload", type=int, default=16, help="ping payload bytes (default 16)")
    parser.add_argument("--sessions", type=int, default=32, help="sessions of the concurrent run (default 32)")
    parser.add_argument("--in-flight", type=int, default=32, help="requests in flight on one session (default 32)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvd bench ipc``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.pings < 1 or args.sessions < 1 or args.in_flight < 1 or args.payload < 0:
        parser.error("--pings, --sessions and --in-flight must be positive, --payload non-negative")
    payload = os.urandom(args.payload)

    with tempfile.TemporaryDirectory(prefix="kvdb-", dir="/tmp") as workdir:
        cfg = {
            "log_level": "warning",
            "pools": [_SMALL_POOL],
            "transfer": {"bounce_size_mb": 4, "chunk_mb": 1},
        }
        d = start_daemon(cfg, workdir=workdir, name="bench")
        try:
            runs: list[Callable[[], Row]] = [
                lambda: bench_blocking(d, args.pings, payload, args.warmup),
                lambda: trio.run(
                    lambda: bench_async(d, args.pings, payload, args.warmup, sessions=1, in_flight=1)
                ),
                lambda: trio.run(
                    lambda: bench_async(
                        d, args.pings, payload, args.warmup, sessions=1, in_flight=args.in_flight
                    )
                ),
                lambda: trio.run(
                    lambda: bench_async(
                        d, args.pings, payload, args.warmup, sessions=args.sessions, in_flight=1
                    )
                ),
            ]
            rows = [run() for run in runs]
        finally:
            code = d.stop()
    if args.json:
        print(msgspec.json.encode([asdict(r) for r in rows]).decode())
    else:
        print(
            f"kvd bench ipc: Ping round trips over a Unix socket to a kvd subprocess; payload {args.payload} B; "
            f"{os.cpu_count()} CPUs shared by client and daemon; python {sys.version.split()[0]}"
        )
        print(format_table(rows))
    if code != 0:
        print(f"kvd bench ipc: the daemon exited with {code}", file=sys.stderr)
    return 0 if code == 0 else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
