"""Soak across the peer link: executors on two real daemons (ctx and gen) run requests at
random for ``KVD_PAIR_SOAK_SECONDS`` (30 by default) — either side first, gen naming its peer
or not, equal layouts (the direct path) or a regroup (the bounce path: gen with twice the
tokens per block, or gen TP2 with two gen executors), or both daemons on the same-node mapped
path — and strike faults at random points: gen or ctx cancels, a side's executor (or one gen
rank's) hangs up, a side (or one gen rank) never registers and the deadline expires; in the third
case the peer link is also cut now and then (ctx dials gen through a relay in the test
process), in the fourth the gen daemon is killed (SIGKILL) now and then and another started in
its place, as systemd would. A request id is reused once both sides of its request ended ok.

Every request must end on both sides with an outcome a caller can act on (ok, or one of the
expected errors; ok on both sides when no fault struck it and no cut or restart came while
it ran), a completed one byte for byte, and gen's blocks must be free to free as soon
as its wait returned. Afterwards nothing may be left on either daemon: no lease, no running
transfer, no bounce slot; each daemon logged exactly one ``transfer.done`` or
``transfer.failed`` per request side it accepted, no error-level line, and a last transfer on
every path still goes through byte for byte.

The random pauses below only vary the interleaving; no assertion depends on them.
"""

from __future__ import annotations

import collections
import json
import os
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from clients import open_client
from clients.client import AsyncClient
from kvd.demo.launch import DaemonProcess
from protocol.errors import (
    KvdError,
    NotFound,
    PeerUnavailable,
    TransferCancelled,
    TransferError,
    TransferTimeout,
)
from protocol.layout import KVLayout
from tests.tcp_proxy import Proxy
from tests.transfer_harness import pools_for, proxied_pair, wait_for_peer

Factory = Callable[..., DaemonProcess]
SECONDS = float(os.environ.get("KVD_PAIR_SOAK_SECONDS", "30"))
WORKERS = 6
GEO: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 32, "tokens_per_block": 8,
                       "dtype": "bfloat16"}  # 4 KiB blocks
SAME = KVLayout(**GEO)
#: gen with twice the tokens per block: gen block j holds ctx blocks 2j and 2j+1 (a regroup)
DOUBLE = KVLayout(**{**GEO, "tokens_per_block": 16})
NUM_BLOCKS = 512
#: gen TP2: each gen rank holds half of the heads (a regroup, two gen executors)
TP2 = KVLayout(**GEO, tp_size=2)
#: ctx pool, gen pools' prefix (then the rank) and gen layout of each kind of request
KINDS = {"same": ("ctx0", "gsame", SAME), "double": ("ctx0", "gdouble", DOUBLE), "tp2": ("ctx0", "gtp", TP2)}
#: a one-rank fault (hangs up, cancels, never comes) strikes one gen rank of the request
FAULTS = ("none", "none", "none", "none", "gen_cancel", "ctx_cancel", "ctx_hangs_up", "gen_hangs_up",
          "ctx_never", "gen_never", "gen_rank_never")
#: what a side's wait may end with when the other side (or its own executor) struck a fault
FAILED = (TransferCancelled, TransferTimeout, PeerUnavailable, TransferError)


def _events(d: DaemonProcess) -> collections.Counter[str]:
    """Every logged event name, counted, and the error-level lines under ``"!error"``."""
    counts: collections.Counter[str] = collections.Counter()
    for line in d.log().splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            counts[rec["event"]] += 1
            if rec.get("level") in ("error", "critical"):
                counts["!error"] += 1
                counts[f"!error {rec['event']}"] += 1
    return counts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _expected_gen(src: torch.Tensor, layout: KVLayout, rank: int) -> torch.Tensor:
    """What gen rank ``rank``'s blocks must hold, from the ctx blocks ``src`` ([n, layer, kv,
    head, token, dim], TP1): its share of the heads, two ctx blocks a gen block where gen's
    blocks hold twice the tokens."""
    heads = src.shape[3] // layout.tp_size
    src = src[:, :, :, rank * heads:(rank + 1) * heads]
    if layout.tokens_per_block == SAME.tokens_per_block:
        return src
    n, layers, kv, heads, tokens, dim = src.shape
    pairs = src.reshape(n // 2, 2, layers, kv, heads, tokens, dim).permute(0, 2, 3, 4, 1, 5, 6)
    return pairs.reshape(n // 2, layers, kv, heads, 2 * tokens, dim)


@dataclass
class Live:
    """The daemons now running: gen is replaced when the soak restarts it."""

    ctx: DaemonProcess
    gen: DaemonProcess


#: what an executor of a gen daemon that was killed under it runs into
GONE = (KvdError, OSError, trio.BrokenResourceError, trio.ClosedResourceError)


class Worker:
    """One pair of executors (a ctx one and a gen one) running requests back to back."""

    def __init__(self, index: int, live: Live, until: float, tally: collections.Counter[str]) -> None:
        self.index, self.live, self.until = index, live, until
        self.tally = tally
        self.rng = random.Random(1000 + index)
        self.serial = 0
        self.generation = [0, 0, 0]  # ids come back after a request that ended ok (see one_request)
        self.history: list[tuple[str, ...]] = []  # (request id, kind, fault, order, outcome): for failure messages

    async def run(self) -> None:
        while trio.current_time() < self.until:
            with trio.fail_after(60):  # a request that hangs fails the test here
                await self.one_request()

    @asynccontextmanager
    async def _session(self, path: str, who: str) -> AsyncIterator[AsyncClient]:
        async with open_client(path, client=f"{who}{self.index}") as c:
            yield c

    def explain(self, rid: str) -> str:
        """This worker's last requests, and what both daemons logged about ``rid``."""
        lines = [f"{Path(d.config_path).stem}: {line}" for d in (self.live.ctx, self.live.gen)
                 for line in d.log().splitlines() if f'"{rid}"' in line]
        return "\n".join(["last requests (id, kind, fault, order, outcome):", *map(str, self.history[-6:]),
                          f"logged about {rid}:", *lines])

    async def _pause(self) -> None:
        await trio.sleep(self.rng.random() * 0.003)

    async def one_request(self, kind: str = "", fault: str = "") -> None:
        """One request; ``kind`` and ``fault`` at random unless given."""
        self.serial += 1
        slot = self.serial % 3
        rid = f"w{self.index}-{slot}.{self.generation[slot]}"
        kind = kind or self.rng.choice(sorted(KINDS))
        ctx_pool, gen_prefix, gen_layout = KINDS[kind]
        fault = fault or self.rng.choice(FAULTS)
        cuts_before, restarts_before = self.tally["link cuts"], self.tally["gen restarts"]
        # a gen restart under way (killed, or not linked to ctx again yet) strikes this request too
        mid_restart = restarts_before != self.tally["gen restarts done"]

        def struck_by_restart() -> bool:
            return mid_restart or self.tally["gen restarts"] != restarts_before
        order = self.rng.choice(("gen_peer", "gen", "ctx"))
        n = 2 * self.rng.randint(1, 8)  # ctx blocks: even, so a doubled gen block is whole
        deadline = 1.0 if fault in ("ctx_never", "gen_never", "gen_rank_never") else 30.0
        outcome: dict[str, str] = {}
        registered: dict[str, trio.Event] = {"ctx": trio.Event(), "gen": trio.Event()}
        gen_data: dict[int, torch.Tensor] = {}  # gen rank -> its blocks, once ok
        gen_accepted = [False]
        ctx_view: dict[str, Any] = {}

        world = gen_layout.world_size
        one_rank = self.rng.randrange(world)  # the rank a one-rank fault strikes
        gen_said: dict[int, str] = {}
        attempted = [0]

        def gen_attempted() -> None:
            attempted[0] += 1
            if attempted[0] == world:
                registered["gen"].set()

        async def gen_rank(r: int) -> None:
            if fault == "gen_never" or (fault == "gen_rank_never" and r == one_rank):
                gen_attempted()  # the other side (and the other ranks) go ahead without it
                return
            tried = [False]
            try:
                await gen_rank_session(r, tried)
            except GONE:
                if not struck_by_restart():
                    raise
                gen_said[r] = "gone"  # its daemon was killed under it
            finally:
                if not tried[0]:
                    gen_attempted()

        async def gen_rank_session(r: int, tried: list[bool]) -> None:
            name = f"{gen_prefix}{r}"
            async with self._session(self.live.gen.socket_path, "gen") as g:
                pool = await g.attach(name)
                ids = await g.alloc(name, n if gen_layout.tokens_per_block == SAME.tokens_per_block else n // 2)
                index = torch.tensor(ids, device=pool.tensor.device)
                pool.tensor.view(torch.int16)[index] = 0x0EEE
                _sync(pool.tensor.device)
                if order == "ctx":
                    await registered["ctx"].wait()
                try:
                    await g.expect(rid, name, gen_layout, r, ids, deadline_s=deadline,
                                   peer="ctx" if order == "gen_peer" else "")
                except FAILED as exc:  # the other side (or this one) failed already, and said so
                    gen_said[r] = f"refused {type(exc).__name__}"
                    assert await g.free(name, ids) == len(ids)
                    return
                finally:
                    tried[0] = True
                    gen_attempted()
                gen_accepted[0] = True
                if fault == "gen_hangs_up" and r == one_rank:
                    await self._pause()
                    gen_said[r] = "hung_up"
                    return  # the session ends with the request registered and its blocks leased
                if fault == "gen_cancel" and r == one_rank:
                    await self._pause()
                    with suppress(NotFound):  # it had ended already
                        await g.cancel(rid)
                try:
                    await g.wait(rid)
                    gen_said[r] = "ok"
                    gen_data[r] = pool.tensor[index].cpu()
                except FAILED as exc:
                    gen_said[r] = type(exc).__name__
                # the wait returned: no write of this request can land any more, the blocks are free to go
                assert await g.free(name, ids) == len(ids)

        async def gen_side() -> None:
            async with trio.open_nursery() as ranks:
                for r in range(world):
                    ranks.start_soon(gen_rank, r)
            if gen_accepted[0]:
                self.tally["gen sides accepted"] += 1
            if gen_said:
                outcome["gen"] = "/".join(sorted(set(gen_said.values())))

        async def ctx_side() -> None:
            if fault == "ctx_never":
                registered["ctx"].set()  # the other side goes ahead alone
                return
            async with self._session(self.live.ctx.socket_path, "ctx") as c:
                pool = await c.attach(ctx_pool)
                ids = await c.alloc(ctx_pool, n)
                data = torch.randint(-(2**15), 2**15, (n, *pool.tensor.shape[1:]), dtype=torch.int16,
                                     generator=torch.Generator().manual_seed(self.rng.randrange(2**31)))
                pool.tensor.view(torch.int16)[torch.tensor(ids, device=pool.tensor.device)] = data.to(pool.tensor.device)
                _sync(pool.tensor.device)  # the executor's writes are in memory before it publishes
                ctx_view["data"] = data
                if order != "ctx":
                    await registered["gen"].wait()
                try:
                    await c.publish(rid, ctx_pool, SAME, 0, ids, peer="gen", deadline_s=deadline)
                except FAILED as exc:  # the other side failed already, and said so
                    outcome["ctx"] = f"refused {type(exc).__name__}"
                    assert await c.free(ctx_pool, ids) == len(ids)
                    return
                finally:
                    registered["ctx"].set()
                self.tally["ctx sides accepted"] += 1
                if fault == "ctx_hangs_up":
                    await self._pause()
                    outcome["ctx"] = "hung_up"
                    return
                if fault == "ctx_cancel":
                    await self._pause()
                    with suppress(NotFound):
                        await c.cancel(rid)
                try:
                    await c.wait(rid)
                    outcome["ctx"] = "ok"
                except FAILED as exc:
                    outcome["ctx"] = type(exc).__name__
                assert await c.free(ctx_pool, ids) == n

        async with trio.open_nursery() as nursery:
            nursery.start_soon(gen_side)
            nursery.start_soon(ctx_side)

        if outcome != {"ctx": "ok", "gen": "ok"}:
            # a failed request is remembered until its deadline (and remember_ended_s) where a
            # side of it may still have ranks to come, which registering its id are refused
            # with how it ended (docs/design.md, "A transfer"): the next request takes a new id.
            # A retry under the same id is tests/test_id_retry.py's
            self.generation[slot] += 1
        said = f"ctx {outcome.get('ctx', '-')}, gen {outcome.get('gen', '-')}"
        self.tally[f"{kind} {fault}: {said}"] += 1
        self.history.append((rid, kind, fault, order, said))
        if fault == "none" and self.tally["link cuts"] == cuts_before and not struck_by_restart():
            assert outcome == {"ctx": "ok", "gen": "ok"}, self.explain(rid)
        for r in range(world):
            if gen_said.get(r) == "ok":
                want = _expected_gen(ctx_view["data"], gen_layout, r)
                assert torch.equal(gen_data[r].view(torch.int16), want), (rid, kind, order, fault, r)
                self.tally["checked byte for byte"] += 1


async def _settled(path: str) -> None:
    """Until the daemon has nothing left: no lease, no running transfer, no bounce slot."""
    async with open_client(path, client="check") as c:
        with trio.fail_after(30):
            while True:
                st = await c.stats()
                if st.blocks_leased == 0 and st.transfers_active == 0 and st.bounce_chunks_in_use == 0 \
                        and st.sessions == 1:
                    break
                await trio.sleep(0.05)  # polling the daemon's counters; the condition is the sync point
        assert all(p.blocks_used == 0 and p.blocks_free == p.num_blocks for p in st.pools), st.pools
        assert all(t.state in ("done", "failed") for t in await c.transfers())


@pytest.mark.soak
@pytest.mark.parametrize(("mapped", "strike"), [(False, ""), (True, ""), (False, "cuts"), (False, "restarts")],
                         ids=["nixl", "mapped", "nixl-link-cuts", "nixl-gen-restarts"])
async def test_pair_soak_leaves_nothing_behind(daemon_factory: Factory, short_tmp: Path, mapped: bool,
                                               strike: str) -> None:
    await pair_soak(daemon_factory, short_tmp, mapped=mapped, strike=strike)


async def pair_soak(daemon_factory: Factory, workdir: Path, *, mapped: bool, strike: str = "", memory: str = "host",
                    ctx_device: int = -1, gen_device: int = -1) -> None:
    """The soak on a fresh pair of daemons (host pools, or GPU pools with ``memory="auto"``);
    ``strike``: "cuts" cuts the peer link now and then, "restarts" kills the gen daemon
    (SIGKILL) now and then and starts a new one in its place."""
    """The soak on a fresh pair of daemons (host pools, or GPU pools with ``memory="auto"``)."""
    # a short bounce wait would let the fragment fallback take over now and then; this soak is
    # about the bounce path's slots, so the wait is long
    transfer = {"bounce_size_mb": 2, "chunk_mb": 1, "mapped": mapped, "deadline_s": 30.0,
                "bounce_wait_s": 30.0, "heartbeat_interval_s": 0.5}
    gen_pools = [pool for prefix, layout in (("gsame", SAME), ("gdouble", DOUBLE), ("gtp", TP2))
                 for pool in pools_for(prefix, layout, NUM_BLOCKS, memory=memory, device=gen_device)]
    gen_config = {"pools": gen_pools, "transfer": transfer, "log_level": "debug", "node": "gen"}
    ctx_config = {"pools": pools_for("ctx", SAME, NUM_BLOCKS, memory=memory, device=ctx_device),
                  "transfer": transfer, "log_level": "debug"}
    # ctx dials gen through a relay in this process, which cuts the link when told
    async with proxied_pair(daemon_factory, workdir, ctx_config, gen_config) as (pair, proxy):
        live = Live(pair.ctx, pair.gen)

        def restart() -> None:
            """SIGKILL gen, and start another in its place (new socket, peer port and log)."""
            live.gen.kill()
            live.gen = daemon_factory({**gen_config, "peer_secret_file": str(workdir / "peer.secret")},
                                      name=f"gen{restarts.count}")
            proxy.target_port = live.gen.peer_port  # ctx dials the relay, which now reaches it

        restarts = _Restarts(live, restart)
        await _soak(live, proxy if strike == "cuts" else None, restarts if strike == "restarts" else None)


@dataclass
class _Restarts:
    live: Live
    restart: Callable[[], None]
    count: int = 0


async def _restart_now_and_then(restarts: _Restarts, until: float, rng: random.Random,
                                tally: collections.Counter[str]) -> None:
    """Kill the gen daemon and start a new one every 1.5-3.5 s until ``until``."""
    while trio.current_time() < until - 3.0:
        await trio.sleep(1.5 + 2 * rng.random())
        restarts.count += 1
        tally["gen restarts"] += 1  # before the kill: a request that sees it knows to expect it
        await trio.to_thread.run_sync(restarts.restart)
        async with open_client(restarts.live.gen.socket_path, client="probe") as probe:
            await wait_for_peer(probe, timeout=30)  # ctx dialled the new gen
        tally["gen restarts done"] += 1


async def _cut_now_and_then(proxy: Proxy, until: float, rng: random.Random, tally: collections.Counter[str]) -> None:
    """Cut the peer link at random moments until ``until`` (ctx dials again at once)."""
    while trio.current_time() < until - 1.0:
        await trio.sleep(0.3 + rng.random())
        tally["link cuts"] += proxy.cut() > 0


async def _soak(live: Live, proxy: Proxy | None, restarts: _Restarts | None) -> None:
    tally: collections.Counter[str] = collections.Counter()
    until = trio.current_time() + SECONDS
    async with trio.open_nursery() as nursery:
        for i in range(WORKERS):
            nursery.start_soon(Worker(i, live, until, tally).run)
        if proxy is not None:
            nursery.start_soon(_cut_now_and_then, proxy, until, random.Random(7), tally)
        if restarts is not None:
            nursery.start_soon(_restart_now_and_then, restarts, until, random.Random(8), tally)
    ctx, gen = live.ctx, live.gen
    if restarts is not None:  # the last gen is linked before the last requests
        async with open_client(ctx.socket_path, client="probe") as probe:
            await wait_for_peer(probe, timeout=30)
    print(f"\npair soak ({SECONDS:.0f}s):")
    for key, count in sorted(tally.items()):
        print(f"  {count:5d}  {key}")

    for d in (ctx, gen):
        await _settled(d.socket_path)
    # after all that, one clean request on each kind still goes through byte for byte
    last = Worker(WORKERS, live, 0.0, tally)
    for kind in KINDS:
        before = tally["checked byte for byte"]
        with trio.fail_after(60):
            await last.one_request(kind, "none")
        assert tally["checked byte for byte"] == before + KINDS[kind][2].world_size  # one per gen rank
    for d in (ctx, gen):
        await _settled(d.socket_path)

    for d, role in ((ctx, "ctx"), (gen, "gen")):
        assert d.proc.poll() is None, f"the {role} daemon died"
        events = _events(d)
        assert events["!error"] == 0, {k: v for k, v in events.items() if k.startswith("!error")}
        if role == "gen" and restarts is not None:
            continue  # a killed gen logged no end for the sides it had (nor was asked to)
        # one line per request side the daemon accepted, never both: the sides whose executors
        # waited, hung up, or whose peer never came alike
        ended = events["transfer.done"] + events["transfer.failed"]
        assert ended == tally[f"{role} sides accepted"], (role, ended, dict(tally))
    assert tally["checked byte for byte"] >= 10, dict(tally)
    assert sum(v for k, v in tally.items() if ": ctx ok, gen ok" in k) > 0
    assert sum(v for k, v in tally.items() if "Cancelled" in k or "Timeout" in k) > 0
