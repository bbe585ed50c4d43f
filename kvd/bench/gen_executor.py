"""One gen executor of the latency bench, in a process of its own (as a serving engine's TP
ranks are): it leases its blocks, then registers and waits for requests when the bench says
so, and reports its completion times over a pipe. Imports only the client library, so a
spawned worker starts quickly and shares no interpreter (no GIL) with the bench or the other
ranks.

Commands (a tuple per ``send``): ``("expect", rid, peer)`` registers, answers
``("registered", None)``, then waits and answers ``("done", t_done)``; ``("complete", rid,
peer, pipelined)`` is the registration that completes the request, timed here: answers
``("done", (t_start, t_done))``; ``("stop",)`` ends the worker. Any failure answers
``("error", text)``. Times are ``time.perf_counter()`` (CLOCK_MONOTONIC: one clock for every
process of the machine)."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any

from clients.blocking import Client
from protocol.layout import KVLayout


def serve(socket_path: str, rank: int, blocks: int, geometry: dict[str, Any], tp: int, conn: Connection,
          spin_s: float = 0.0, completion_page: bool = False) -> None:
    """The worker's body (the target of a spawned process); ``spin_s``, ``completion_page``:
    its Client's. ``("pages",)`` answers how many waits the completion page answered."""
    try:
        client = Client(socket_path, client=f"bench-gen{rank}", spin_s=spin_s, completion_page=completion_page)
        layout = KVLayout(**geometry, tp_size=tp)
        ids = client.alloc(f"gen{rank}", blocks)
    except BaseException as exc:
        conn.send(("error", f"gen rank {rank} could not start: {exc!r}"))
        return
    conn.send(("ready", None))
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                return
            try:
                if cmd[0] == "expect":
                    _, rid, peer = cmd
                    client.expect(rid, f"gen{rank}", layout, rank, ids, peer=peer)
                    conn.send(("registered", None))
                    client.wait(rid, timeout_s=60)
                    conn.send(("done", time.perf_counter()))
                elif cmd[0] == "complete":
                    _, rid, peer, pipelined = cmd
                    t0 = time.perf_counter()
                    if pipelined:
                        client.expect_and_wait(rid, f"gen{rank}", layout, rank, ids, peer=peer, timeout_s=60)
                    else:
                        client.expect(rid, f"gen{rank}", layout, rank, ids, peer=peer)
                        client.wait(rid, timeout_s=60)
                    conn.send(("done", (t0, time.perf_counter())))
                elif cmd[0] == "pages":
                    conn.send(("pages", client.page_completions))
                else:
                    conn.send(("error", f"unknown command {cmd[0]!r}"))
            except BaseException as exc:  # reported to the bench, which raises it there
                conn.send(("error", f"gen rank {rank}: {exc!r}"))
    finally:
        client.close()
        conn.close()
