"""The executors of a layout bench run: one session per rank on a running daemon pair, every
pool mapped into this process; requests leased, filled, published together, timed and verified.

:mod:`kvd.bench.layouts` drives it. Verification is byte for byte: each gen rank's blocks hold
its layers and heads of the request's data, and every other byte of every gen pool keeps the
sentinel :meth:`Rig.reset` wrote.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from clients import open_client
from clients.attach import MappedPool
from clients.client import AsyncClient
from kvd.bench.layout_spec import LayoutSpec, Placement
from kvd.demo.launch import DaemonProcess
from protocol.layout import KVLayout
from protocol.messages import Completion

SENTINEL = 0xEE  # every gen-pool byte no request writes keeps it
WAIT_S = 120.0


@dataclass
class Request:
    """One request of a section: its ranks, blocks, data and completions."""

    index: int  # in its section: picks the ctx instance and attention-DP ranks, names the request
    instance: int
    ctx_ranks: list[int]
    gen_ranks: list[int]
    blocks: int
    rid: str = ""
    ctx_ids: dict[int, list[int]] = field(default_factory=dict)
    gen_ids: dict[int, list[int]] = field(default_factory=dict)
    #: the request's KV bytes, all layers and heads: (blocks, layers, 2, heads, tokens, head bytes)
    data: torch.Tensor | None = None
    done: dict[str, float] = field(default_factory=dict)  # executor -> perf_counter at completion
    completions: dict[str, Completion] = field(default_factory=dict)


class Rig:
    """A running daemon pair and its executors: one session per rank, every pool mapped here."""

    def __init__(self, ctx_d: DaemonProcess, gen_d: DaemonProcess, spec: LayoutSpec, placement: Placement) -> None:
        self.ctx_d, self.gen_d = ctx_d, gen_d
        self.ctx_layout, self.gen_layout = spec.layouts()
        self.spec, self.placement = spec, placement
        self.ctx: dict[tuple[int, int], AsyncClient] = {}
        self.gen: dict[int, AsyncClient] = {}
        self.ctx_pools: dict[tuple[int, int], MappedPool] = {}
        self.gen_pools: dict[int, MappedPool] = {}

    async def open(self, stack: contextlib.AsyncExitStack) -> None:
        """Connect every rank's session and map its pool (closed with ``stack``)."""
        for k in range(self.placement.instances):
            for r in range(self.placement.ctx_world):
                c = await stack.enter_async_context(open_client(self.ctx_d.socket_path, client=f"bench-ctx{k}r{r}"))
                self.ctx[k, r] = c
                self.ctx_pools[k, r] = stack.enter_context(await c.attach(ctx_pool_name(k, r)))
        for g in range(self.placement.gen_world):
            c = await stack.enter_async_context(open_client(self.gen_d.socket_path, client=f"bench-gen{g}"))
            self.gen[g] = c
            self.gen_pools[g] = stack.enter_context(await c.attach(f"gen{g}"))
        with trio.fail_after(30):  # gen may name its ctx peer once ctx's link is up (a known peer)
            while (await self.gen[0].stats()).peers_connected < 1:
                await trio.sleep(0.01)

    # -- block views ------------------------------------------------------------------------
    @staticmethod
    def _blocks(pool: MappedPool, layout: KVLayout, rank: int) -> torch.Tensor:
        """The pool's bytes as (block, layer, kv, head, token, head bytes) uint8."""
        s = layout.local_shape(rank)
        held = pool.info.layout  # the daemon's word on the block count (the mapping may be rounded up)
        nb = held.num_blocks if held is not None else pool.nbytes // layout.block_bytes(rank)
        return pool.raw[: nb * layout.block_bytes(rank)].view(
            nb, s["layer"], 2, s["head"], s["token"], s["dim"] * layout.itemsize)

    def _slice(self, layout: KVLayout, rank: int, data: torch.Tensor) -> torch.Tensor:
        lo, hi = layout.layer_range(rank // layout.tp_size)
        h0, h1 = layout.head_range(rank % layout.tp_size)
        return data[:, lo:hi, :, h0:h1]

    # -- a section's life -------------------------------------------------------------------
    async def prepare(self, reqs: list[Request], seed: int) -> None:
        """Lease every request's blocks and write its random KV into the ctx pools."""
        g = self.gen_layout
        for i, req in enumerate(reqs):
            for r in req.ctx_ranks:
                req.ctx_ids[r] = await self.ctx[req.instance, r].alloc(ctx_pool_name(req.instance, r), req.blocks)
            for rank in req.gen_ranks:
                req.gen_ids[rank] = await self.gen[rank].alloc(f"gen{rank}", req.blocks)
            home = self.ctx_pools[req.instance, req.ctx_ranks[0]].raw.device
            gen = torch.Generator(device=home).manual_seed(seed + i)
            shape = (req.blocks, g.num_layers, 2, g.num_kv_heads, g.tokens_per_block, g.head_dim * g.itemsize)
            req.data = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8, device=home)
            for r in req.ctx_ranks:
                pool = self.ctx_pools[req.instance, r]
                view = self._blocks(pool, self.ctx_layout, r)
                idx = torch.tensor(req.ctx_ids[r], device=view.device)
                view[idx] = self._slice(self.ctx_layout, r, req.data).to(view.device)
        _sync(list(self.ctx_pools.values()))

    async def release(self, reqs: list[Request]) -> None:
        for req in reqs:
            for r, ids in req.ctx_ids.items():
                await self.ctx[req.instance, r].free(ctx_pool_name(req.instance, r), ids)
            for rank, ids in req.gen_ids.items():
                await self.gen[rank].free(f"gen{rank}", ids)

    def reset(self) -> None:
        """Every gen-pool byte to the sentinel (so a request that writes nothing is seen)."""
        for pool in self.gen_pools.values():
            pool.raw.fill_(SENTINEL)
        _sync(list(self.gen_pools.values()))

    async def run(self, reqs: list[Request], tag: str) -> float:
        """Register every request on gen, then publish them all at once; returns the wall time
        from the first publish to the last completion (ctx and gen executors alike)."""
        for req in reqs:
            req.rid = f"{tag}-{req.index}"
            req.done.clear()
            req.completions.clear()
            for rank in req.gen_ranks:
                await self.gen[rank].expect(req.rid, f"gen{rank}", self.gen_layout, rank, req.gen_ids[rank],
                                            ranks=req.gen_ranks, peer="ctx")

        async def wait(c: AsyncClient, req: Request, who: str) -> None:
            req.completions[who] = await c.wait(req.rid, timeout_s=WAIT_S)
            req.done[who] = time.perf_counter()

        async def publish(req: Request, r: int) -> None:
            c = self.ctx[req.instance, r]
            await c.publish(req.rid, ctx_pool_name(req.instance, r), self.ctx_layout, r, req.ctx_ids[r],
                            peer="gen", ranks=req.ctx_ranks)
            await wait(c, req, f"ctx{r}")

        async with trio.open_nursery() as nursery:
            for req in reqs:
                for rank in req.gen_ranks:
                    nursery.start_soon(wait, self.gen[rank], req, f"gen{rank}")
            t0 = time.perf_counter()
            for req in reqs:
                for r in req.ctx_ranks:
                    nursery.start_soon(publish, req, r)
        for req in reqs:
            for who in req.done:
                req.done[who] -= t0
        return max(t for req in reqs for t in req.done.values())

    def verify(self, reqs: list[Request]) -> dict[str, bool]:
        """``exact``: every request's gen blocks hold their slice of its data; ``untouched``:
        every other gen-pool byte still holds the sentinel."""
        exact, untouched = True, True
        leased: dict[int, list[int]] = {}
        for req in reqs:
            assert req.data is not None
            for rank, ids in req.gen_ids.items():
                leased.setdefault(rank, []).extend(ids)
                view = self._blocks(self.gen_pools[rank], self.gen_layout, rank)
                got = view[torch.tensor(ids, device=view.device)]
                exact &= torch.equal(got, self._slice(self.gen_layout, rank, req.data).to(view.device))
        for rank, pool in self.gen_pools.items():
            view = self._blocks(pool, self.gen_layout, rank)
            keep = torch.ones(view.shape[0], dtype=torch.bool, device=view.device)
            if leased.get(rank):
                keep[torch.tensor(leased[rank], device=view.device)] = False
            untouched &= bool((view[keep] == SENTINEL).all())
            tail = pool.raw[view.numel():]  # bytes past the last whole block, if any
            untouched &= bool((tail == SENTINEL).all())
        return {"exact": exact, "untouched": untouched}

    def figures(self, reqs: list[Request], wall: float) -> dict[str, Any]:
        """Bytes landed, aggregate and per-gen-GPU GB/s of one run of ``reqs``."""
        per_gpu_bytes: dict[int, int] = {}
        per_gpu_t: dict[int, float] = {}
        for req in reqs:
            for rank in req.gen_ranks:
                gpu = self.placement.gen_gpu(rank)
                per_gpu_bytes[gpu] = per_gpu_bytes.get(gpu, 0) + req.blocks * self.gen_layout.block_bytes(rank)
                per_gpu_t[gpu] = max(per_gpu_t.get(gpu, 0.0), req.done[f"gen{rank}"])
        total = sum(per_gpu_bytes.values())
        paths = sorted({c.path for req in reqs for c in req.completions.values()})
        return {
            "bytes": total,
            "wall_s": wall,
            "gbps": total / wall / 1e9,
            "per_gen_gpu": {str(d): {"bytes": n, "gbps": n / per_gpu_t[d] / 1e9} for d, n in sorted(per_gpu_bytes.items())},
            "path": ",".join(paths),
            # what the daemons reported moving (each ctx rank's completion counts the whole request)
            "daemon_bytes": sum(req.completions[f"ctx{req.ctx_ranks[0]}"].bytes for req in reqs),
        }


def ctx_pool_name(instance: int, rank: int) -> str:
    return f"ctx{instance}r{rank}"


def _sync(pools: list[MappedPool]) -> None:
    """Wait for this process's writes to the pools' GPUs (the daemons read them next)."""
    for dev in sorted({p.raw.device.index for p in pools if p.raw.is_cuda}):
        torch.cuda.synchronize(dev)
