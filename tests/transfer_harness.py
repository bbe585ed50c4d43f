"""Run real transfers between two real daemons and check them byte for byte.

The reference for "byte for byte" is ``Plan.apply`` on copies of the source pools, done in
the test process (the planner itself is checked against an independent reference in
tests/test_plan.py).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import trio

from clients import open_client
from clients.client import AsyncClient
from kvd.demo.launch import DaemonProcess
from kvd.regroup.plan import plan
from protocol.layout import KVLayout
from protocol.messages import Completion
from tests.tcp_proxy import Proxy


def write_secret(directory: Path, name: str = "peer.secret") -> str:
    path = directory / name
    path.write_bytes(secrets.token_hex(32).encode())
    os.chmod(path, 0o600)
    return str(path)


def pools_for(prefix: str, layout: KVLayout, num_blocks: int, ranks: list[int] | None = None, *,
              memory: str = "host", device: int = -1) -> list[dict[str, Any]]:
    """One pool per rank of ``layout`` (host memory unless told otherwise)."""
    out = []
    for r in ranks if ranks is not None else range(layout.world_size):
        out.append({
            "name": f"{prefix}{r}", "memory": memory, "device": device,
            "num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim,
            "tokens_per_block": layout.tokens_per_block, "dtype": layout.dtype, "tp_size": layout.tp_size,
            "pp_size": layout.pp_size, "attention_dp": layout.attention_dp,
            "layer_split": list(layout.layer_split) if layout.layer_split else None,
            "axis_order": list(layout.axis_order), "rank": r, "num_blocks": num_blocks,
        })
        if out[-1]["layer_split"] is None:
            del out[-1]["layer_split"]
    return out


@dataclass
class Pair:
    ctx: DaemonProcess
    gen: DaemonProcess


def start_pair(
    factory: Callable[..., DaemonProcess],
    workdir: Path,
    ctx_layout: KVLayout,
    gen_layout: KVLayout,
    *,
    num_blocks: int = 16,
    transfer: dict[str, Any] | None = None,
    ctx_extra: dict[str, Any] | None = None,
    gen_extra: dict[str, Any] | None = None,
    mapped: bool = False,
    memory: str = "host",
    ctx_device: int = -1,
    gen_device: int = -1,
) -> Pair:
    """gen daemon, then ctx daemon peered to it. ``mapped=False`` (default) forces the NIXL paths."""
    secret = write_secret(workdir)
    tcfg = {"bounce_size_mb": 4, "chunk_mb": 1, "deadline_s": 30.0, "mapped": mapped, **(transfer or {})}
    gen = factory({"pools": pools_for("gen", gen_layout, num_blocks, memory=memory, device=gen_device), "peer_secret_file": secret, "transfer": tcfg,
                   **(gen_extra or {})}, name="gen")
    ctx = factory({"pools": pools_for("ctx", ctx_layout, num_blocks, memory=memory, device=ctx_device), "peer_secret_file": secret, "transfer": tcfg,
                   "peers": [{"name": "gen", "host": "127.0.0.1", "port": gen.peer_port}], **(ctx_extra or {})},
                  name="ctx")
    return Pair(ctx, gen)


async def logged(d: DaemonProcess, event: str, count: int = 1, **fields: object) -> list[dict[str, Any]]:
    """:meth:`DaemonProcess.logged` (30 s) from trio, in a worker thread: the event loop (a
    :class:`Proxy` among its tasks) keeps running while the log is read."""
    return await trio.to_thread.run_sync(partial(d.logged, event, count, 30.0, **fields))


@asynccontextmanager
async def proxied_pair(factory: Callable[..., DaemonProcess], workdir: Path, ctx_config: dict[str, Any],
                       gen_config: dict[str, Any]) -> AsyncIterator[tuple[Pair, Proxy]]:
    """A gen daemon, then a ctx daemon that dials it through a :class:`Proxy` in this process
    (the test can cut the link), both with a fresh peer secret (``workdir/peer.secret``);
    yields once both logged the link up (``peer.connected``, ``dialled_by="ctx"``)."""
    secret = write_secret(workdir)
    gen = factory({**gen_config, "peer_secret_file": secret}, name="gen")
    proxy = Proxy(gen.peer_port)
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.serve)
        ctx = factory({**ctx_config, "peer_secret_file": secret,
                       "peers": [{"name": "gen", "host": "127.0.0.1", "port": proxy.port}]}, name="ctx")
        for d, peer in ((ctx, "gen"), (gen, "ctx")):
            await logged(d, "peer.connected", 1, node=peer, dialled_by="ctx")
        yield Pair(ctx, gen), proxy
        nursery.cancel_scope.cancel()


async def refill_and_watch(socket_path: str, pool: str, freed: list[int], pattern: int,
                           window_s: float = 2.0) -> None:
    """Another session takes every free block of ``pool`` (``freed``, a failed request's
    blocks, among them) and fills it with ``pattern``; each must keep it for ``window_s``:
    the window a failed sender's late write had to do harm in."""
    async with open_client(socket_path, client="next-tenant") as other:
        tensor = (await other.attach(pool)).tensor
        free = next(p for p in await other.pools() if p.name == pool).blocks_free
        mine = await other.alloc(pool, free)
        assert set(freed) <= set(mine)
        view = tensor.view(torch.int16)
        index = torch.tensor(mine)
        view[index] = pattern
        await trio.sleep(window_s)
        damaged = (view[index] != pattern).flatten(1).any(dim=1)
        assert not bool(damaged.any()), f"{int(damaged.sum())} of {len(mine)} blocks were overwritten"


async def gen_progress(client: AsyncClient, request_id: str) -> tuple[str, int]:
    """The gen side of ``request_id`` on the client's daemon: (state, chunks landed); ("", 0)
    while the daemon does not list it."""
    for t in await client.transfers():
        if t.request_id == request_id and t.role == "gen":
            return t.state, t.chunks_done
    return "", 0


async def until_landed(client: AsyncClient, request_id: str) -> None:
    """Until the gen side of ``request_id`` saw its first writes land (mid-transfer, for a
    fault to strike); fails if the transfer ended first."""
    with trio.fail_after(30):
        while True:
            state, chunks = await gen_progress(client, request_id)
            if chunks >= 1:
                return
            assert state not in ("done", "failed"), f"the transfer ended before any write landed ({state})"
            await trio.sleep(0.005)  # polling the daemon's reply; the condition is the sync point


async def wait_for_peer(client: AsyncClient, timeout: float = 20.0) -> None:
    """Wait until the daemon reports a connected peer."""
    with trio.fail_after(timeout):
        while (await client.stats()).peers_connected < 1:
            await trio.sleep(0.02)


@dataclass
class Outcome:
    ctx: dict[int, Completion]
    gen: dict[int, Completion]
    gen_data: dict[int, torch.Tensor]
    expected: dict[int, torch.Tensor]
    gen_blocks: dict[int, tuple[int, list[int]]] | None = None


async def run_transfer(
    pair: Pair,
    ctx_layout: KVLayout,
    gen_layout: KVLayout,
    *,
    request_id: str,
    blocks: int,
    ctx_ranks: list[int] | None = None,
    gen_ranks: list[int] | None = None,
    seed: int = 0,
    deadline_s: float | None = None,
    gen_peer: str = "",
) -> Outcome:
    """Register ``request_id`` on every participating rank of both sides, wait, verify inputs."""
    ctx_ranks = ctx_ranks if ctx_ranks is not None else list(range(ctx_layout.world_size))
    gen_ranks = gen_ranks if gen_ranks is not None else list(range(gen_layout.world_size))
    gen_tp_ratio = 1
    if ctx_layout.tokens_per_block != gen_layout.tokens_per_block:
        gen_tp_ratio = 0
    ctx_count = blocks
    gen_count = blocks if gen_tp_ratio else blocks * ctx_layout.tokens_per_block // gen_layout.tokens_per_block
    out = Outcome({}, {}, {}, {})
    gen_pools: dict[int, Any] = {}
    ctx_pools: dict[int, Any] = {}
    ctx_ids: dict[int, list[int]] = {}
    gen_ids: dict[int, list[int]] = {}
    gen_clients: dict[int, AsyncClient] = {}
    ctx_clients: dict[int, AsyncClient] = {}
    gen_ok = [trio.Event() for _ in gen_ranks]
    gen_before: dict[int, torch.Tensor] = {}
    g = torch.Generator().manual_seed(seed)

    async def gen_rank(i: int, r: int, task_status: trio.TaskStatus[None]) -> None:
        async with open_client(pair.gen.socket_path, client=f"gen{r}") as c:
            gen_clients[r] = c
            pool = await c.attach(f"gen{r}")
            ids = await c.alloc(f"gen{r}", gen_count)
            ax = gen_layout.axis_order.index("block")
            # sentinel in this request's blocks: bytes the plan does not write must keep it
            dev = pool.tensor.device
            pool.tensor.view(torch.int16).index_fill_(ax, torch.tensor(ids, device=dev), 0x0EEE)
            _sync(dev)
            gen_pools[r], gen_ids[r] = pool, ids
            gen_before[r] = pool.raw.to("cpu", copy=True)
            if gen_peer:
                await wait_for_peer(c)  # a named peer must be known: configured, or linked once
            await c.expect(request_id, f"gen{r}", gen_layout, r, ids, ranks=gen_ranks, deadline_s=deadline_s,
                           peer=gen_peer)
            task_status.started()
            out.gen[r] = await c.wait(request_id)
            await c.ping()  # the daemon's step that replied has ended: its transfer.done line is out
            out.gen_data[r] = pool.raw.to("cpu", copy=True)
            gen_ok[i].set()

    async def ctx_rank(r: int, task_status: trio.TaskStatus[None]) -> None:
        async with open_client(pair.ctx.socket_path, client=f"ctx{r}") as c:
            ctx_clients[r] = c
            await wait_for_peer(c)
            pool = await c.attach(f"ctx{r}")
            ids = await c.alloc(f"ctx{r}", ctx_count)
            ax = ctx_layout.axis_order.index("block")
            shape = list(pool.tensor.shape)
            shape[ax] = len(ids)
            noise = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g)
            dev = pool.tensor.device
            pool.tensor.view(torch.int16).index_copy_(ax, torch.tensor(ids, device=dev), noise.to(dev))
            _sync(dev)
            ctx_pools[r], ctx_ids[r] = pool, ids
            await c.publish(request_id, f"ctx{r}", ctx_layout, r, ids, peer="gen", ranks=ctx_ranks,
                            deadline_s=deadline_s)
            task_status.started()
            out.ctx[r] = await c.wait(request_id)
            await c.ping()  # the daemon's step that replied has ended: its transfer.done line is out
            for ev in gen_ok:
                await ev.wait()  # keep the ctx pool mapped until the gen side checked its copy

    async with trio.open_nursery() as nursery:
        for i, r in enumerate(gen_ranks):
            await nursery.start(gen_rank, i, r)
        for r in ctx_ranks:
            await nursery.start(ctx_rank, r)
        # reference, computed while the transfer runs (sources are not modified by it)
        p = plan(
            KVLayout(**{**_fields(ctx_layout), "num_blocks": ctx_pools[ctx_ranks[0]].info.layout.num_blocks}),
            KVLayout(**{**_fields(gen_layout), "num_blocks": gen_pools[gen_ranks[0]].info.layout.num_blocks}),
            ctx_ids, gen_ids,
        )
        expected = {r: gen_before[r].clone() for r in gen_ranks}
        p.apply({r: ctx_pools[r].raw.to("cpu", copy=True) for r in ctx_ranks}, expected)
        out.expected = expected
        out.gen_blocks = {r: (gen_layout.axis_order.index("block"), gen_ids[r]) for r in gen_ranks}
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fields(layout: KVLayout) -> dict[str, Any]:
    import msgspec

    return msgspec.structs.asdict(layout)


def assert_exact(out: Outcome, layout: KVLayout, *, whole_pool: bool = True) -> None:
    """Gen pools equal the reference: the whole pool, or (concurrent requests) the request's blocks."""
    for r, want in out.expected.items():
        got = out.gen_data[r]
        if not whole_pool:
            assert out.gen_blocks is not None
            ax, ids = out.gen_blocks[r]
            shape = list(layout.pool_shape(r))
            shape[ax] = -1  # the layout given to executors may leave num_blocks at 0
            index = torch.tensor(ids)
            got = got.view(torch.int16).view(shape).index_select(ax, index)
            want = want.view(torch.int16).view(shape).index_select(ax, index)
        assert torch.equal(got, want), f"gen rank {r}: {(got != want).sum().item()} elements differ"
