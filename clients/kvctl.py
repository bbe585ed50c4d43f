"""``kvctl``: the operator's view of a running kvd.

Commands: ``status``, ``stats``, ``ping``, ``pools``, ``sessions``, ``transfers``
(``--watch`` for live progress), ``drain``, ``config``. Tables for people (rich),
``--json`` for scripts. Exit codes: 0 ok, 1 the daemon answered with an error,
2 usage error, 3 cannot reach the daemon.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import msgspec

from clients.blocking import Client
from protocol import messages as m
from protocol.errors import ConnectionClosed, KvdError

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(str(v) for v in row))
    Console().print(table)


def _pools_rows(pools: list[m.PoolInfo]) -> list[list[Any]]:
    return [
        [p.name, p.kind, p.device, p.fallback_reason or "-", p.blocks_used, p.blocks_free, p.sessions, _gb(p.pool_bytes)]
        for p in pools
    ]


POOL_COLUMNS = ["pool", "kind", "device", "fallback", "used", "free", "sessions", "size"]


def _transfer_rows(transfers: list[m.TransferInfo]) -> list[list[Any]]:
    rows = []
    for t in transfers:
        pct = f"{100 * t.bytes_done / t.bytes_total:.0f}%" if t.bytes_total else "-"
        rows.append([t.request_id, t.role, t.peer, t.state, t.path or "-", f"{t.chunks_done}/{t.chunks_total}",
                     f"{_gb(t.bytes_done)} ({pct})", f"{t.duration_s:.2f}s", t.error or ""])
    return rows


def run(args: argparse.Namespace) -> int:
    with Client(args.socket, client="kvctl", timeout=args.timeout) as kvd:
        cmd = args.command
        if cmd == "ping":
            t0 = time.perf_counter()
            kvd.ping(b"kvctl")
            rtt = (time.perf_counter() - t0) * 1e6
            _out(args, {"ok": True, "rtt_us": round(rtt, 1)}, lambda: print(f"pong from {kvd.welcome.node} in {rtt:.0f} us"))
        elif cmd in ("status", "stats"):
            st = kvd.stats()
            def human() -> None:
                print(f"kvd {st.version} on node {st.node}: up {st.uptime_s:.0f}s, "
                      f"{'DRAINING' if st.draining else 'serving'}")
                print(f"sessions {st.sessions}, blocks leased {st.blocks_leased}, peers {st.peers_connected}")
                print(f"transfers: {st.transfers_active} active, {st.transfers_done} done, {st.transfers_failed} failed; "
                      f"sent {_gb(st.bytes_sent)}, received {_gb(st.bytes_received)}")
                print(f"bounce chunks in use {st.bounce_chunks_in_use}/{st.bounce_chunks_total}")
                if cmd == "status":
                    _print_table("pools", POOL_COLUMNS, _pools_rows(st.pools))
            _out(args, st, human)
        elif cmd == "pools":
            pools = kvd.pools()
            _out(args, pools, lambda: _print_table("pools", POOL_COLUMNS, _pools_rows(pools)))
        elif cmd == "sessions":
            ss = kvd.sessions()
            _out(args, ss, lambda: _print_table("sessions", ["id", "client", "pid", "uid", "blocks", "requests", "age"],
                                               [[s.session_id, s.client, s.pid, s.uid, s.blocks_leased, s.requests,
                                                 f"{s.connected_s:.0f}s"] for s in ss]))
        elif cmd == "transfers":
            cols = ["request", "role", "peer", "state", "path", "chunks", "bytes", "time", "error"]
            while True:
                ts = kvd.transfers()
                _out(args, ts, lambda ts=ts: _print_table("transfers", cols, _transfer_rows(ts)))
                if not args.watch:
                    break
                time.sleep(args.interval)
        elif cmd == "drain":
            kvd.drain()
            _out(args, {"ok": True}, lambda: print("draining: the daemon finishes in-flight transfers and exits"))
        elif cmd == "config":
            cfg = kvd.config()
            print(cfg if args.json else msgspec.json.format(cfg.encode(), indent=2).decode())
    return EXIT_OK


def _out(args: argparse.Namespace, obj: Any, human: Any) -> None:
    if args.json:
        print(msgspec.json.encode(obj).decode())
    else:
        human()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvctl`` console script."""
    parser = argparse.ArgumentParser(prog="kvctl", description="inspect and control a running kvd")
    parser.add_argument("--socket", "-s", default=None, help="daemon socket (default $KVD_SOCKET or /run/kvd/kvd.sock)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("status", "stats", "ping", "pools", "sessions", "drain", "config"):
        sub.add_parser(name)
    p_tr = sub.add_parser("transfers")
    p_tr.add_argument("--watch", action="store_true", help="refresh until interrupted")
    p_tr.add_argument("--interval", type=float, default=1.0)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_OK
    try:
        return run(args)
    except ConnectionClosed as exc:
        print(f"kvctl: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KvdError as exc:
        print(f"kvctl: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
