"""A peer link that drops and comes back between two live daemons leaks nothing, and a peer
that restarts behind the same name is told apart from one that only lost its link.

The link runs through a TCP proxy in the test process, so the test can cut it at will: both
daemons see the connection end at once, the ctx daemon dials again. Every cycle waits for the
log lines of the link going down and coming back on both sides (no sleeps), then runs a real
regrouped transfer over NIXL (the bounce path: writes one way, credit notifications the other)
and counts each daemon's established TCP connections. NIXL/UCX leaves one connection behind
for every remote agent that is forgotten and loaded again while its process lives
(``docs/security.md``), so the daemons keep a peer's agent loaded across a link flap: the
counts must stay flat. When the peer restarts, its old agent is forgotten (the instance it
names is gone) and the new one is loaded.
"""

from __future__ import annotations

import ctypes
import os
import socket
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
import trio

from kvd.bench.ucx_reconnect import socket_counts
from kvd.demo.launch import DaemonProcess
from kvd.peer.links import NIXL_DISCONNECTED
from protocol.errors import KvdError
from protocol.layout import KVLayout
from tests.tcp_proxy import Proxy
from tests.transfer_harness import Pair, assert_exact, logged, pools_for, proxied_pair, run_transfer

Factory = Callable[..., DaemonProcess]
GEO: dict[str, Any] = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 16,
                       "dtype": "bfloat16"}
CTX = KVLayout(**GEO)
GEN = KVLayout(**GEO, tp_size=2)  # a regroup: chunks through the bounce slots, credits back by notification
TRANSFER = {"bounce_size_mb": 4, "chunk_mb": 1, "deadline_s": 30.0, "mapped": False,
            "reconnect_initial_s": 0.05, "reconnect_max_s": 0.2}
CYCLES = 3


def _established(d: DaemonProcess) -> int:
    return socket_counts(d.pid).get("tcp_established", 0)


async def _transfer(pair: Pair, rid: str) -> None:
    out = await run_transfer(pair, CTX, GEN, request_id=rid, blocks=4)
    assert_exact(out, GEN)
    assert {c.path for c in out.gen.values()} == {"bounce"}


_GEN_CONFIG: dict[str, Any] = {"pools": pools_for("gen", GEN, 16), "transfer": TRANSFER}


def _linked(factory: Factory, workdir: Path) -> AbstractAsyncContextManager[tuple[Pair, Proxy]]:
    """ctx (TP1) dialling gen (TP2) through a proxy, linked."""
    return proxied_pair(factory, workdir, {"pools": pools_for("ctx", CTX, 16), "transfer": TRANSFER},
                        _GEN_CONFIG)


async def test_link_flaps_between_live_daemons_leave_no_connections_behind(
        daemon_factory: Factory, short_tmp: Path) -> None:
    async with _linked(daemon_factory, short_tmp) as (pair, proxy):
        ctx, gen = pair.ctx, pair.gen
        (first,) = await logged(ctx, "peer.connected", 1, node="gen", dialled_by="ctx")
        await _transfer(pair, "flap-0")
        counts = [(_established(ctx), _established(gen))]
        for cycle in range(1, CYCLES + 1):
            assert proxy.cut() == 1
            for d, peer in ((ctx, "gen"), (gen, "ctx")):
                await logged(d, "peer.disconnected", cycle, node=peer)
                await logged(d, "peer.connected", cycle + 1, node=peer, dialled_by="ctx")  # link ready
            await _transfer(pair, f"flap-{cycle}")
            counts.append((_established(ctx), _established(gen)))
    assert counts == [counts[0]] * (CYCLES + 1), f"established TCP connections (ctx, gen) per cycle: {counts}"
    # the same peer instance came back every time: its agent was reloaded, never forgotten
    again = await logged(ctx, "peer.connected", CYCLES + 1, node="gen", dialled_by="ctx")
    assert {r["nixl_agent"] for r in again} == {first["nixl_agent"]}
    assert [r.get("nixl_agent_kept", False) for r in again] == [False] + [True] * CYCLES
    for d in (ctx, gen):
        assert "peer.agent_forgotten" not in d.log()


async def test_a_restarted_peer_replaces_the_kept_agent(daemon_factory: Factory, short_tmp: Path) -> None:
    async with _linked(daemon_factory, short_tmp) as (pair, proxy):
        ctx, gen = pair.ctx, pair.gen
        (first,) = await logged(ctx, "peer.connected", 1, node="gen", dialled_by="ctx")
        await _transfer(pair, "before")
        base = _established(ctx)
        await trio.to_thread.run_sync(gen.stop)
        await logged(ctx, "peer.disconnected", 1, node="gen")
        gen2 = daemon_factory({**_GEN_CONFIG, "peer_secret_file": str(short_tmp / "peer.secret")}, name="gen")
        proxy.target_port = gen2.peer_port
        (_, second) = await logged(ctx, "peer.connected", 2, node="gen", dialled_by="ctx")
        assert second["nixl_agent"] != first["nixl_agent"]
        assert not second.get("nixl_agent_kept", False)
        (forgotten,) = await logged(ctx, "peer.agent_forgotten", 1, node="gen")
        assert forgotten["nixl_agent"] == first["nixl_agent"]
        assert forgotten["reason"] == "a new instance of the peer"
        await _transfer(Pair(ctx, gen2), "after")
        assert _established(ctx) == base


def _reset_tcp_connections(pid: int, keep_port: int) -> int:
    """Reset (RST) every established TCP connection of process ``pid`` but those on
    ``keep_port`` (its peer link), as a network failure would: the process keeps its sockets,
    broken. Returns how many were reset."""
    established: dict[str, tuple[int, int]] = {}
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "01":
                established[f[9]] = (int(f[1].split(":")[1], 16), int(f[2].split(":")[1], 16))
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    reset = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            inode = target[len("socket:["):-1] if target.startswith("socket:[") else ""
            if inode not in established or keep_port in established[inode]:
                continue
            mine = libc.syscall(438, pidfd, int(fd), 0)  # pidfd_getfd: our copy of its socket
            assert mine >= 0, os.strerror(ctypes.get_errno())
            with socket.socket(fileno=mine) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                s.shutdown(socket.SHUT_RDWR)
            reset += 1
    finally:
        os.close(pidfd)
    return reset


async def _break_nixl_connections(gen: DaemonProcess) -> None:
    """Reset gen's UCX connections (not its peer link) and wait until its UCX saw them fail."""
    before = _established(gen)
    assert _reset_tcp_connections(gen.pid, gen.peer_port) >= 1
    with trio.fail_after(30):  # until gen's UCX saw its connections fail (and closed them)
        while _established(gen) >= before:
            await trio.sleep(0.01)  # polling the process's sockets; the condition is the sync point


async def test_a_flap_that_broke_the_nixl_connection_mends_it(daemon_factory: Factory, short_tmp: Path) -> None:
    """The network broke the UCX connections too, not only the link: a kept agent whose
    endpoint failed is forgotten and loaded afresh (reloading it over itself would leave every
    later write to that peer failing until a daemon restarts)."""
    async with _linked(daemon_factory, short_tmp) as (pair, proxy):
        ctx, gen = pair.ctx, pair.gen
        await _transfer(pair, "before")
        await _break_nixl_connections(gen)
        assert proxy.cut() == 1
        for d, peer in ((ctx, "gen"), (gen, "ctx")):
            await logged(d, "peer.connected", 2, node=peer, dialled_by="ctx")
        for i in range(3):
            await _transfer(pair, f"after-{i}")
    mended = [r for d in (ctx, gen) for r in await logged(d, "peer.agent_forgotten", 1)]
    assert {r["reason"] for r in mended} == {"its connection failed"}, mended


async def test_a_broken_nixl_connection_under_a_live_link_is_mended(daemon_factory: Factory,
                                                                    short_tmp: Path) -> None:
    """The UCX connections break while the peer link stays up: the link is closed (the NIXL
    connection to that peer is known to be broken), comes back with the agent loaded afresh,
    and transfers work again; only a transfer caught by the break may fail."""
    async with _linked(daemon_factory, short_tmp) as (pair, _proxy):
        ctx, gen = pair.ctx, pair.gen
        await _transfer(pair, "before")
        await _break_nixl_connections(gen)
        with pytest.raises(BaseExceptionGroup) as first:  # the next transfer finds the connection broken
            await _transfer(pair, "caught")
        assert first.group_contains(KvdError, depth=None), first.value
        # the daemon that saw it closes the link; it comes back with the agent loaded afresh
        (closed,) = await logged(ctx, "peer.disconnected", 1, node="gen")
        assert closed["reason"] == NIXL_DISCONNECTED, closed
        for d, peer in ((ctx, "gen"), (gen, "ctx")):
            await logged(d, "peer.connected", 2, node=peer, dialled_by="ctx")
        for i in range(2):
            await _transfer(pair, f"after-{i}")
