"""``kvctl``: the operator's view of a running kvd.

Commands: ``status``, ``stats``, ``ping``, ``pools``, ``sessions``, ``transfers``
(``--watch`` for live progress; finished transfers stay listed with their outcome),
``peers``, ``drain``, ``config``. The daemon answers the two lists a page at a time;
``sessions`` and ``transfers`` follow the pages to the end (``--offset``/``--limit`` pick a
window, ``--page-size`` the entries per request), so nothing is cut silently. Tables for people (rich) on a terminal; when stdout is not
a terminal (a pipe, a file, ``watch``), plain space-aligned columns that are never cut;
``--json`` for scripts. Exit codes: 0 ok, 1 the daemon answered with an error,
2 usage error, 3 cannot reach the daemon.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from clients._wire import SocketUnreachable, default_socket_path, unreachable_hint
from clients.blocking import Client
from protocol import messages as m
from protocol.errors import ConnectionClosed, KvdError, NotFound

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
#: How a kvctl user gives the daemon's socket (in the hint when it cannot be reached).
KVCTL_GIVE = "--socket PATH or KVD_SOCKET"
#: Entries asked for per request when following the pages of a list (one frame holds them).
DEFAULT_PAGE_SIZE = 256
_T = TypeVar("_T")


def fetch_pages(fetch: Callable[[int, int], tuple[list[_T], int]], *, offset: int = 0, limit: int = 0,
                page_size: int = DEFAULT_PAGE_SIZE) -> tuple[list[_T], int]:
    """Entries ``offset`` .. ``offset + limit`` of a paged list (``limit`` 0: to the end),
    asking ``page_size`` at a time; returns them and the list's total.

    ``fetch(offset, limit)`` returns one page and the total. The list may change between two
    pages (a session ends, a transfer finishes): the pages are followed until one comes back
    empty or the total (as the latest page says) is reached, never further.
    """
    if offset < 0 or limit < 0 or page_size < 1:
        raise ValueError("need offset >= 0, limit >= 0 and page_size >= 1")
    got: list[_T] = []
    total = 0
    at = offset
    while True:
        want = page_size if not limit else min(page_size, limit - len(got))
        page, total = fetch(at, want)
        got.extend(page)
        at += len(page)
        if not page or at >= total or (limit and len(got) >= limit):
            return got, total


def _window_title(name: str, shown: int, total: int, offset: int) -> str:
    """``sessions`` when all are shown; ``sessions 3-4 of 9`` for a window."""
    if offset == 0 and shown == total:
        return name
    return f"{name} {offset + 1}-{offset + shown} of {total}" if shown else f"{name}: none at offset {offset} ({total} in all)"


def _size(n: int) -> str:
    """A byte count for people: GiB, MiB, KiB or bytes (a 24 KiB request read as 0.0 MiB)."""
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


def _chunks(done: int, total: int) -> str:
    """``done/total`` where the path plans its chunks (bounce); the writes that landed where it
    does not (direct, fragment: no total, which read as ``1/0``); ``-`` before any."""
    if total:
        return f"{done}/{total}"
    return str(done) if done else "-"


def _print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    """A rich table on a terminal; plain columns, at full width, anywhere else."""
    if not sys.stdout.isatty():
        print(title)
        print(plain_columns(columns, rows))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(str(v) for v in row))
    Console().print(table)


def plain_columns(columns: list[str], rows: list[list[Any]]) -> str:
    """Left-aligned columns separated by two spaces; no cell is ever cut or wrapped."""
    cells = [columns, *[[str(v) for v in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def _pools_rows(pools: list[m.PoolInfo]) -> list[list[Any]]:
    return [
        # a host pool has no GPU: "-" rather than its device -1 (JSON keeps the number)
        [p.name, p.kind, p.device if p.device >= 0 else "-", p.fallback_reason or "-", p.blocks_used, p.blocks_free,
         p.sessions, _size(p.pool_bytes)]
        for p in pools
    ]


POOL_COLUMNS = ["pool", "kind", "device", "fallback", "used", "free", "sessions", "size"]


def _bar(done: int, total: int, width: int = 20) -> str:
    """A text progress bar with the percentage, e.g. ``[=========>          ]  50%``."""
    if total <= 0:
        return "-"
    frac = min(1.0, max(0.0, done / total))
    filled = int(frac * width)
    body = "=" * filled + (">" if filled < width else "") + " " * (width - filled - 1)
    return f"[{body}] {100 * frac:3.0f}%"


TRANSFER_COLUMNS = ["request", "role", "peer", "state", "path", "chunks", "bytes", "progress", "time", "error"]


def _transfer_rows(transfers: list[m.TransferInfo]) -> list[list[Any]]:
    rows = []
    for t in transfers:
        total = f" / {_size(t.bytes_total)}" if t.bytes_total else ""
        rows.append([t.request_id, t.role, t.peer or "-", t.state, t.path or "-", _chunks(t.chunks_done, t.chunks_total),
                     f"{_size(t.bytes_done)}{total}", _bar(t.bytes_done, t.bytes_total), f"{t.duration_s:.2f}s",
                     t.error or ""])
    return rows


PEER_COLUMNS = ["peer", "state", "direction", "remote", "last heard", "retries", "transfers", "mapped", "error"]


def _peer_rows(peers: list[m.PeerInfo]) -> list[list[Any]]:
    return [[p.node, p.state, p.direction, p.remote or "-",
             f"{p.last_heard_s:.1f}s ago" if p.last_heard_s >= 0 else "never", p.attempts, p.transfers_active,
             "yes" if p.mapped else "no", p.error] for p in peers]


def _transfers(kvd: Client, args: argparse.Namespace) -> None:
    """List transfers once; with ``--watch``/``--count``, every ``--interval`` seconds until
    Ctrl-C or ``--count`` listings. ``--json`` prints one JSON array per listing (JSON lines);
    on a terminal the table is redrawn in place."""
    from rich.console import Console

    watching = args.watch or args.count > 0
    console = Console()
    redraw = watching and not args.json and console.is_terminal
    shown = 0
    try:
        while True:
            ts, total = _list_transfers(kvd, args)
            title = _window_title("transfers", len(ts), total, args.offset)
            title = f"{title} at {time.strftime('%H:%M:%S')}" if watching else title
            if redraw:
                console.clear()
            _out(args, ts, lambda ts=ts, title=title: _print_table(title, TRANSFER_COLUMNS, _transfer_rows(ts)))
            sys.stdout.flush()
            shown += 1
            if not watching or shown == args.count:
                return
            time.sleep(args.interval)
    except KeyboardInterrupt:
        if not watching:
            raise
        # Ctrl-C is how a watch ends: not an error


def _list_transfers(kvd: Client, args: argparse.Namespace) -> tuple[list[m.TransferInfo], int]:
    def page(offset: int, limit: int) -> tuple[list[m.TransferInfo], int]:
        reply = kvd.transfers_page(offset, limit)
        return reply.transfers, reply.total

    return fetch_pages(page, offset=args.offset, limit=args.limit, page_size=args.page_size)


def _list_sessions(kvd: Client, args: argparse.Namespace) -> tuple[list[m.SessionInfo], int]:
    def page(offset: int, limit: int) -> tuple[list[m.SessionInfo], int]:
        reply = kvd.sessions_page(offset, limit)
        return reply.sessions, reply.total

    return fetch_pages(page, offset=args.offset, limit=args.limit, page_size=args.page_size)


def run(args: argparse.Namespace) -> int:
    with Client(args.socket, client="kvctl", timeout=args.timeout) as kvd:
        cmd = args.command
        if cmd == "ping":
            if getattr(args, "pid", None) is not None:
                # `kvd serve ... & kvctl ping --wait 60 --pid $!` must not take another
                # daemon's answer for the new one's: a second daemon on a socket that an
                # older one still serves exits, and the older one answered the ping
                served_by = kvd.daemon_pid
                if served_by and not _descends_from(served_by, args.pid):
                    raise _AnotherDaemon(served_by)
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
                      f"sent {_size(st.bytes_sent)}, received {_size(st.bytes_received)}")
                print(f"bounce chunks in use {st.bounce_chunks_in_use}/{st.bounce_chunks_total}")
                if not st.pools:  # said in words; an empty pools table under it would add nothing
                    print("no pools configured: executors can allocate no blocks and register no requests "
                          "(add a [[pools]] table to the configuration)")
                elif cmd == "status":
                    _print_table("pools", POOL_COLUMNS, _pools_rows(st.pools))
            _out(args, st, human)
        elif cmd == "pools":
            pools = kvd.pools()
            _out(args, pools, lambda: _print_table("pools", POOL_COLUMNS, _pools_rows(pools)))
        elif cmd == "sessions":
            ss, total = _list_sessions(kvd, args)
            title = _window_title("sessions", len(ss), total, args.offset)
            _out(args, ss, lambda: _print_table(title, ["id", "client", "pid", "uid", "blocks", "requests", "age"],
                                               [[s.session_id, s.client, s.pid, s.uid, s.blocks_leased, s.requests,
                                                 f"{s.connected_s:.0f}s"] for s in ss]))
        elif cmd == "transfers":
            _transfers(kvd, args)
        elif cmd == "peers":
            peers = kvd.peers()
            _out(args, peers, lambda: _print_table("peers", PEER_COLUMNS, _peer_rows(peers)))
        elif cmd == "drain":
            kvd.drain()
            _out(args, {"ok": True}, lambda: print("draining: the daemon finishes in-flight transfers and exits"))
        elif cmd == "cancel":
            kvd.cancel(args.request_id, force=True)
            _out(args, {"ok": True, "request_id": args.request_id},
                 lambda: print(f"cancelled {args.request_id!r}: its sides here fail with transfer_cancelled once "
                               "no write into their blocks can land (kvctl transfers shows them)"))
        elif cmd == "config":
            cfg = kvd.config()
            print(cfg if args.json else msgspec.json.format(cfg.encode(), indent=2).decode())
    return EXIT_OK


class _AnotherDaemon(Exception):
    """``ping --pid PID`` reached a daemon that is neither PID nor a process PID started."""

    def __init__(self, pid: int) -> None:
        super().__init__(pid)
        self.pid = pid


def _ping_until_up(args: argparse.Namespace) -> int:
    """``ping --wait``: a daemon that is still starting (no socket yet, or not accepting) is
    retried every 0.1 s until it answers or the time is up (then the last error, exit 3).

    With ``--pid``, the wait ends as soon as that process has exited: a daemon that cannot start
    exits within a second with its reason on stderr, and without the pid the script sat out the
    whole ``--wait`` before it learnt anything."""
    deadline = time.monotonic() + args.wait
    socket = args.socket or default_socket_path()
    while True:
        try:
            return run(args)
        except ConnectionClosed:
            if args.pid is not None and not _running(args.pid):
                print(f"kvctl: kvd (pid {args.pid}) exited before it answered on {socket}: its stderr (or "
                      "log) ends with the one `kvd: error:` line that says why", file=sys.stderr)
                return EXIT_UNREACHABLE
            if time.monotonic() >= deadline:
                raise
        except _AnotherDaemon as other:
            # the daemon PID may still be starting (it checks the socket before it gives up):
            # wait for it to exit or to take the socket over, as for a daemon not up yet
            if not _running(args.pid):
                print(f"kvctl: kvd (pid {args.pid}) exited before it answered on {socket}, and another kvd "
                      f"(pid {other.pid}) serves that socket: pid {args.pid}'s stderr (or log) ends with the "
                      f"`kvd: error:` line that says why; stop the daemon of pid {other.pid} first, or give "
                      "the new one another socket_path", file=sys.stderr)
                return EXIT_UNREACHABLE
            if time.monotonic() >= deadline:
                print(f"kvctl: the kvd answering on {socket} is pid {other.pid}, not pid {args.pid} (nor a "
                      f"process it started), and pid {args.pid} did not answer within {args.wait:g} s",
                      file=sys.stderr)
                return EXIT_UNREACHABLE
        time.sleep(0.1)


def _descends_from(pid: int, ancestor: int) -> bool:
    """Whether process ``pid`` is ``ancestor`` or one it started (``sudo kvd serve &`` makes
    ``$!`` the sudo, whose child is the daemon). True where /proc cannot tell: the check
    must never turn a daemon that is up into one that is not."""
    for _ in range(64):  # a process tree deeper than this is no wrapper chain
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rpartition(b")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            return True
    return True


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie, exited but not yet reaped by
    the shell that started it in the background, counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:  # another user's process (EPERM): it exists
            return True
        return True  # no /proc (not Linux): os.kill found it
    return state not in (b"Z", b"X")


def _out(args: argparse.Namespace, obj: Any, human: Any) -> None:
    if args.json:
        print(msgspec.json.encode(obj).decode())
    else:
        human()


def _common_options(parser: argparse.ArgumentParser, *, with_defaults: bool) -> None:
    """--socket, --json, --timeout; without defaults on a command (so the top-level value stays)."""

    def default(value: object) -> object:
        return value if with_defaults else argparse.SUPPRESS

    parser.add_argument("--socket", "-s", default=default(None),
                        help="daemon socket (default $KVD_SOCKET or /run/kvd/kvd.sock)")
    parser.add_argument("--json", action="store_true", default=default(False), help="machine-readable output (JSON)")
    parser.add_argument("--timeout", type=_positive, default=default(10.0), help="seconds to wait for the daemon (default 10)")


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _paging_options(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--offset", type=_non_negative, default=0, metavar="N",
                        help=f"skip the first N {what} (default 0)")
    parser.add_argument("--limit", type=_non_negative, default=0, metavar="N",
                        help=f"show at most N {what} (default 0: all of them; the pages are followed to the end)")
    parser.add_argument("--page-size", type=_count, default=DEFAULT_PAGE_SIZE, metavar="N",
                        help=f"{what} asked of the daemon per request (default {DEFAULT_PAGE_SIZE})")


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _installed_version() -> str:
    """The installed kvd version ("dev" from a source tree that was never installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvd")
    except PackageNotFoundError:  # pragma: no cover - running from an uninstalled tree
        return "dev"


def build_parser() -> argparse.ArgumentParser:
    """The ``kvctl`` command line."""
    parser = argparse.ArgumentParser(
        prog="kvctl",
        description="inspect and control a running kvd",
        epilog="exit codes: 0 ok, 1 the daemon answered with an error, 2 usage error, 3 cannot reach the daemon",
    )
    parser.add_argument("--version", action="version", version=f"kvctl (kvd {_installed_version()})",
                        help="print the installed kvd version and exit (kvctl status shows the daemon's)")
    # the common options are accepted before or after the command (kvctl --json pools, kvctl pools --json)
    _common_options(parser, with_defaults=True)
    common = argparse.ArgumentParser(add_help=False)
    _common_options(common, with_defaults=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    helps = {
        "status": "daemon state, counters and pools",
        "stats": "daemon state and counters",
        "ping": "round trip to the daemon",
        "pools": "pools: memory kind, fallback, occupancy",
        "sessions": "connected executors",
        "peers": "peer daemons: link state, last heard from, transfers in flight",
        "drain": "finish in-flight transfers, take no new work, exit",
        "config": "the daemon's effective configuration",
    }
    for name, text in helps.items():
        if name not in ("ping", "sessions"):
            sub.add_parser(name, parents=[common], help=text, description=text)
    p_sessions = sub.add_parser(
        "sessions", parents=[common], help=helps["sessions"],
        description="connected executors; all of them unless --offset/--limit pick a window (the daemon's "
                    "pages are followed to the end)")
    _paging_options(p_sessions, "sessions")
    p_ping = sub.add_parser("ping", parents=[common], help=helps["ping"], description=helps["ping"])
    p_ping.add_argument("--wait", type=_positive, metavar="SECONDS",
                        help="retry until the daemon answers or SECONDS pass (scripts that start kvd)")
    p_ping.add_argument("--pid", type=_count, metavar="PID",
                        help="with --wait: the daemon's process id ($! after kvd serve ... &); stop waiting "
                             "as soon as it has exited (a daemon that cannot start exits at once); an answer from "
                             "another daemon on that socket does not count")
    cancel_help = "cancel a request of any executor (operators only: root, the daemon's user, [access] operator_gids)"
    p_cancel = sub.add_parser("cancel", parents=[common], help=cancel_help,
                              description=cancel_help + "; its executors' waits raise TransferCancelled and a "
                                          "transfer in flight stops once its writes have ended")
    p_cancel.add_argument("request_id", metavar="REQUEST_ID", help="the request id, as kvctl transfers shows it")
    p_tr = sub.add_parser("transfers", parents=[common], help="transfers in progress and recently finished",
                          description="transfers in progress and recently finished, with their progress; all of "
                                      "them unless --offset/--limit pick a window (the daemon's pages are "
                                      "followed to the end)")
    _paging_options(p_tr, "transfers")
    p_tr.add_argument("--watch", "-w", action="store_true", help="refresh until interrupted (Ctrl-C)")
    p_tr.add_argument("--interval", "-n", type=_positive, default=1.0, help="seconds between refreshes (default 1)")
    p_tr.add_argument("--count", "-c", type=_count, default=0, help="stop after this many refreshes (implies --watch; default 0: until interrupted)")
    for command in _commands(parser).values():
        command.set_defaults(usage=command.format_usage)  # an error names the command's usage, not kvctl's
    return parser


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``kvctl``'s commands and their parsers."""
    return {name: command for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name, command in action.choices.items()}


def _unrecognized(parser: argparse.ArgumentParser, command: str, extra: list[str]) -> str:
    """The error line for arguments ``command`` does not take; an option another command has
    (``kvctl peers --watch``) says which command that is."""
    line = f"kvctl {command}: error: unrecognized arguments: {' '.join(extra)}"
    options = [arg.partition("=")[0] for arg in extra if arg.startswith("-")]
    for option in options:
        owners = [name for name, sub in _commands(parser).items() if option in sub._option_string_actions]
        if owners:
            line += f" ({option} is an option of kvctl {' and '.join(owners)}, not of kvctl {command})"
            break
    return line


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvctl`` console script."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_OK
    if extra:
        sys.stderr.write(args.usage())
        print(_unrecognized(parser, args.command, extra), file=sys.stderr)
        return EXIT_USAGE
    if args.command == "ping" and args.pid is not None and not args.wait:
        sys.stderr.write(args.usage())  # ping's own usage line, not kvctl's
        print("kvctl ping: error: --pid needs --wait SECONDS (it ends the wait early)", file=sys.stderr)
        return EXIT_USAGE
    try:
        code = _ping_until_up(args) if args.command == "ping" and args.wait else run(args)
        sys.stdout.flush()  # here, not at exit: a reader that went away is handled below
        return code
    except BrokenPipeError:
        # The reader closed the pipe (kvctl transfers | grep -q req-1, | head): it has what it
        # wanted, so no traceback and exit 0 (a script with pipefail must not fail on it).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except SocketUnreachable as exc:
        # the client's hint names Client(path); kvctl's user gives the socket as an option
        print(f"kvctl: [{exc.code}] cannot connect to kvd at {exc.path}: {exc.reason}; "
              f"{unreachable_hint(exc.path, KVCTL_GIVE)}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except ConnectionClosed as exc:
        print(f"kvctl: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KvdError as exc:
        hint = ""
        if isinstance(exc, NotFound) and args.command == "cancel":
            # the daemon's "no request 'x'" does not say where to look: a typo, the other
            # daemon's socket, or a request that ended (and left) before the cancel
            hint = ("; kvctl transfers lists the requests this daemon holds (a request that has "
                    "ended cannot be cancelled; the other side's daemon has its own socket)")
        print(f"kvctl: {exc}{hint}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
