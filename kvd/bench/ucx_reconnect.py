"""What a NIXL remote agent leaves open when it is removed and loaded again while its process lives.

``python -m kvd.bench.ucx_reconnect [--cycles N] [--side a|b|both]``: this process (agent A)
and a second one (agent B) load each other's metadata, exchange one notification each way (so
UCX connects), then forget each other (``remove_remote``) and progress both workers for a while,
``--cycles`` times; ``--side`` says which of the two forgets and reloads the other each cycle;
``--no-remove`` reloads (``add_remote`` again) without forgetting first.
Prints A's sockets by TCP state after every cycle and once more after B has exited.

This was the pattern of a peer link that goes down and comes back between two live daemons,
until kvd kept a peer's agent loaded across its link's flaps (:mod:`kvd.peer.kept_agents`,
which relies on the ``--no-remove`` case below). Measured with nixl-cu13
1.5.1 on loopback: every cycle leaves one more ESTABLISHED connection in A, whichever side
reloads, until B's process exits; when B exits instead of reconnecting nothing is left once
A's worker has progressed. Reloading without removing leaves nothing either. See ``docs/security.md`` ("UCX connections across peer link
reconnects").
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection

from kvd.transport.nixl_agent import NixlAgent, ensure_loopback_ucx

_TCP_STATES = {"01": "established", "06": "time_wait", "08": "close_wait", "0A": "listen"}


def socket_counts(pid: int | str = "self") -> dict[str, int]:
    """A process's open fds (this one's by default): TCP sockets by state, other sockets,
    everything else."""
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue  # the fd listdir itself used, closed by now
    sockets = {t[len("socket:[") : -1] for t in targets if t.startswith("socket:[")}
    counts: collections.Counter[str] = collections.Counter()
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[9] in sockets:
                    counts["tcp_" + _TCP_STATES.get(fields[3], fields[3])] += 1
                    sockets.discard(fields[9])
    counts["other_sockets"] = len(sockets)
    counts["fds"] = len(targets)
    return dict(sorted(counts.items()))


def _progress(agent: NixlAgent, rounds: int = 50) -> None:
    # UCX closes endpoints only while its worker is progressed; notifications() progresses it.
    for _ in range(rounds):
        agent.notifications()
        time.sleep(0.01)


def _wait_notification(agent: NixlAgent) -> None:
    deadline = time.monotonic() + 10
    while not agent.notifications():
        if time.monotonic() > deadline:
            raise SystemExit("error: no NIXL notification within 10 s")
        time.sleep(0.001)


def _peer(conn: Connection, reloads: bool, removes: bool) -> None:
    ensure_loopback_ucx()
    agent = NixlAgent("B")
    conn.send(agent.metadata())
    a_meta: bytes = conn.recv()
    name = agent.add_remote(a_meta)
    while (cmd := conn.recv()) != "quit":
        if cmd == "add" and reloads:
            name = agent.add_remote(a_meta)
        elif cmd == "echo":
            _wait_notification(agent)
            agent.send_notif(name, b"back")
        elif cmd == "remove" and reloads and removes:
            agent.remove_remote(name)
        elif cmd == "progress":
            _progress(agent)
        conn.send("ok")
    agent.close()
    conn.send("ok")


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m kvd.bench.ucx_reconnect``."""
    p = argparse.ArgumentParser(
        prog="python -m kvd.bench.ucx_reconnect", description=(__doc__ or "").split("\n\n")[0]
    )
    p.add_argument("--cycles", type=int, default=5, help="remove/reload cycles (default 5)")
    p.add_argument(
        "--side",
        choices=["a", "b", "both"],
        default="both",
        help="which agent reloads the other (default both)",
    )
    p.add_argument(
        "--no-remove",
        action="store_true",
        help="reload without removing first (default: remove, then reload)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    """Run the cycles and print the counts."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.cycles < 1:
        p.error("--cycles must be at least 1")
    ensure_loopback_ucx()
    agent = NixlAgent("A")
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(child_conn, args.side in ("b", "both"), not args.no_remove))
    proc.start()

    def ask(cmd: str) -> None:
        conn.send(cmd)
        if conn.recv() != "ok":
            raise SystemExit(f"error: peer did not answer {cmd!r}")

    try:
        b_meta: bytes = conn.recv()
        conn.send(agent.metadata())
        name = agent.add_remote(b_meta)
        print(f"start: {socket_counts()}")
        for cycle in range(args.cycles):
            if cycle and args.side in ("a", "both"):
                name = agent.add_remote(b_meta)
            ask("add" if cycle else "noop")
            conn.send("echo")
            agent.send_notif(name, b"hi")
            _wait_notification(agent)
            if conn.recv() != "ok":
                raise SystemExit("error: peer did not echo")
            connected = socket_counts()
            if args.side in ("a", "both") and not args.no_remove:
                agent.remove_remote(name)
            ask("remove")
            conn.send("progress")
            _progress(agent)
            if conn.recv() != "ok":
                raise SystemExit("error: peer did not progress")
            print(f"cycle {cycle + 1}: connected {connected} -> after {socket_counts()}")
        ask("quit")
        proc.join()
        _progress(agent)
        print(f"peer exited: {socket_counts()}")
    finally:
        if proc.is_alive():
            proc.kill()
        agent.close()


if __name__ == "__main__":
    main()
