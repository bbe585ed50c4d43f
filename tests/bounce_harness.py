"""A bounce link in one process, for tests: ctx and gen NIXL agents (UCX over loopback),
their host pools and staging, linked both ways, and one request streamed
through :mod:`kvd.transfer.paths.bounce` as two daemons would (minus the peer link: an
``XferGrant`` goes straight into ctx's credit channel)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgspec
import numpy as np
import torch
import trio
from structlog.testing import capture_logs

from kvd.config import PoolConfig
from kvd.pool import Pool
from kvd.regroup.plan import Plan, plan
from kvd.transfer.paths import bounce
from kvd.transfer.paths.base import Job
from kvd.transport import NixlAgent, Region, ensure_loopback_ucx, poll_notifications
from kvd.transport.setup import StagingRegion, _staging
from kvd.transport.slots import SlotPool
from protocol import transfer as x
from protocol.errors import TransferCancelled
from protocol.layout import KVLayout

RID = "r-bp"
OWNER = "peer/r-bp"


def plan_of(ctx: KVLayout, gen: KVLayout, blocks: int) -> Plan:
    """The plan of a request of blocks ``0 .. blocks-1`` on every rank of both sides."""
    ids = list(range(blocks))
    gen_blocks = blocks * ctx.tokens_per_block // gen.tokens_per_block
    return plan(KVLayout(**{**_fields(ctx), "num_blocks": blocks}),
                KVLayout(**{**_fields(gen), "num_blocks": gen_blocks}),
                {r: ids for r in range(ctx.world_size)}, {r: list(range(gen_blocks)) for r in range(gen.world_size)})


def _fields(layout: KVLayout) -> dict[str, Any]:
    return msgspec.structs.asdict(layout)


def make_pools(prefix: str, layout: KVLayout, num_blocks: int) -> dict[int, Pool]:
    """One host pool per rank of ``layout``."""
    out = {}
    for r in range(layout.world_size):
        cfg = PoolConfig(name=f"{prefix}{r}", memory="host", rank=r,
                         num_blocks=num_blocks, num_layers=layout.num_layers,
                         num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                         tokens_per_block=layout.tokens_per_block, dtype=layout.dtype, tp_size=layout.tp_size)
        with capture_logs():
            out[r] = Pool.create(cfg, {})
    return out


@dataclass
class Counts:
    """A side's progress reports; ``stop`` refuses new writes as an aborting transfer does."""

    n_posted: int = 0
    n_ended: int = 0
    nbytes: int = 0
    stop: bool = False
    on_moved: Callable[[int], None] | None = None
    on_posted: Callable[[int], None] | None = None
    ended_event: trio.Event = field(default_factory=trio.Event)
    want_ended: int = -1
    chunks_planned: int = 0

    def posted(self, n: int = 1) -> None:
        self.check()
        self.n_posted += n
        if self.on_posted is not None:
            self.on_posted(self.n_posted)

    def planned(self, chunks: int) -> None:
        self.chunks_planned = chunks

    def check(self) -> None:
        if self.stop:
            raise TransferCancelled("aborting: no new write")

    def ended(self, n: int = 1) -> None:
        self.n_ended += n
        if self.n_ended == self.want_ended:
            self.ended_event.set()

    def moved(self, nbytes: int, chunks: int = 1) -> None:
        self.nbytes += nbytes
        if self.on_moved is not None:
            self.on_moved(self.nbytes)

    def mark(self, stage: str) -> None:
        pass


@dataclass
class BounceLink:
    """ctx and gen agents, pools and staging, linked both ways; pollers drive both agents."""

    ctx: NixlAgent
    gen: NixlAgent
    gen_name: str  # gen's agent as ctx knows it
    ctx_name: str
    src: dict[int, Pool]
    dst: dict[int, Pool]
    send_region: StagingRegion
    recv_region: StagingRegion
    send_slots: SlotPool
    recv_slots: SlotPool
    credits_tx: trio.MemorySendChannel[int]
    credits_rx: trio.MemoryReceiveChannel[int]
    notifs_tx: trio.MemorySendChannel[x.Notif]
    notifs_rx: trio.MemoryReceiveChannel[x.Notif]
    gen_counts: Counts = field(default_factory=Counts)
    credits_by_notif: int = 0

    def on_ctx_notif(self, remote: str, raw: bytes) -> None:
        n = x.decode_notif(raw)
        if isinstance(n, x.Credit):
            self.credits_by_notif += len(n.slots)
            for s in n.slots:
                self.credits_tx.send_nowait(s)

    def on_gen_notif(self, remote: str, raw: bytes) -> None:
        n = x.decode_notif(raw)
        if isinstance(n, x.Notif):
            self.notifs_tx.send_nowait(n)

    def fill(self, seed: int) -> tuple[Plan, dict[int, torch.Tensor]]:
        """Random source blocks, sentinel destinations; the plan and the expected gen pools."""
        g = torch.Generator().manual_seed(seed)
        for pool in self.src.values():
            t = pool.tensor_u8()
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
        for pool in self.dst.values():
            pool.tensor_u8().fill_(0xEE)
        n_ctx = next(iter(self.src.values())).layout.num_blocks
        n_gen = next(iter(self.dst.values())).layout.num_blocks
        ctx_layout = next(iter(self.src.values())).layout
        gen_layout = next(iter(self.dst.values())).layout
        rng = np.random.default_rng(seed)
        cb = {r: rng.permutation(n_ctx)[: n_ctx // 2].tolist() for r in self.src}
        gb = {r: rng.permutation(n_gen)[: n_gen // 2].tolist() for r in self.dst}
        p = plan(ctx_layout, gen_layout, cb, gb)
        expected = {r: pool.tensor_u8().clone() for r, pool in self.dst.items()}
        p.apply({r: pool.tensor_u8().clone() for r, pool in self.src.items()}, expected)
        return p, expected

    def check(self, expected: dict[int, torch.Tensor]) -> None:
        """Every gen pool equals the reference: the request's bytes, and the sentinel elsewhere."""
        for r, pool in self.dst.items():
            got = pool.tensor_u8()
            assert torch.equal(got, expected[r]), f"gen rank {r}: {(got != expected[r]).sum().item()} bytes differ"

    def job(self, p: Plan, counts: Counts, grants: Callable[[], Awaitable[int]]) -> Job:
        return Job(request_id=RID, owner=OWNER, plan=p, src=self.src, progress=counts, nixl=self.ctx,
                   remote_agent=self.gen_name, grants=grants, staging=self.send_region, slot_pool=self.send_slots,
                   remote_region=x.RemoteRegion(addr=self.recv_region.addr, nbytes=self.recv_region.nbytes,
                                                device=self.recv_region.device),
                   remote_slot_bytes=self.recv_region.slot_bytes)

    def receiver(self, p: Plan, chunks: list[Any], credits: bounce.Credits, granted: int) -> bounce.Receiver:
        return bounce.Receiver(RID, OWNER, p, chunks, self.dst, self.recv_region, self.recv_slots, self.gen_counts,
                               credits, granted=granted)


@asynccontextmanager
async def bounce_link(ctx_layout: KVLayout, gen_layout: KVLayout, *, blocks: int, slot_bytes: int,
                      slots: int) -> AsyncIterator[BounceLink]:
    """Pools of ``blocks`` blocks per rank, ``slots`` staging slots of ``slot_bytes`` per side."""
    ensure_loopback_ucx()
    src, dst = make_pools("ctx", ctx_layout, blocks), make_pools("gen", gen_layout, blocks)
    ctx, gen = NixlAgent("bp-ctx"), NixlAgent("bp-gen")
    try:
        send_region, recv_region = _staging(slot_bytes, slots, -1), _staging(slot_bytes, slots, -1)
        ctx.register([send_region.region()] + [pool_region(p) for p in src.values()])
        gen.register([recv_region.region()] + [pool_region(p) for p in dst.values()])
        gen_name, ctx_name = ctx.add_remote(gen.metadata()), gen.add_remote(ctx.metadata())
        credits_tx, credits_rx = trio.open_memory_channel[int](math.inf)
        notifs_tx, notifs_rx = trio.open_memory_channel[x.Notif](math.inf)
        link = BounceLink(ctx, gen, gen_name, ctx_name, src, dst, send_region, recv_region, SlotPool(slots),
                          SlotPool(slots), credits_tx, credits_rx, notifs_tx, notifs_rx)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(poll_notifications, ctx, link.on_ctx_notif, hot=lambda: True))
            nursery.start_soon(partial(poll_notifications, gen, link.on_gen_notif, hot=lambda: True))
            yield link
            nursery.cancel_scope.cancel()
    finally:
        ctx.close()
        gen.close()
        for pool in [*src.values(), *dst.values()]:
            pool.close()


def pool_region(pool: Pool) -> Region:
    """The NIXL registration of ``pool``."""
    return Region(pool.ptr, pool.nbytes, pool.device, "DRAM" if pool.device < 0 else "VRAM")


async def run_request(link: BounceLink, p: Plan, *, chunk_bytes: int, by_notif: bool,
               grants: Callable[[Callable[[], Awaitable[int]]], Callable[[], Awaitable[int]]] | None = None,
               ctx_counts: Counts | None = None) -> tuple[bounce.Credits, Counts, BaseException | None]:
    """One request through the link: gen pregrants one slot and runs its receiver; ctx sends.
    Returns the credits gen handed out, ctx's reports and what ``send`` raised (if anything)."""
    chunks = bounce.chunks(p, chunk_bytes)

    async def link_grant(msg: x.XferGrant) -> None:  # the peer link, as the transfer delivers XferGrant
        link.credits_tx.send_nowait(msg.slot)

    credits = bounce.Credits(RID, link.gen, link.ctx_name, link_grant, by_notif=by_notif)
    counts = ctx_counts or Counts()
    first = link.recv_slots.try_acquire(OWNER)
    assert first is not None
    link.gen_counts.want_ended = len(chunks)
    error: BaseException | None = None
    next_credit = grants(link.credits_rx.receive) if grants is not None else link.credits_rx.receive
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()

            async def receive() -> None:
                with scope:
                    await link.receiver(p, chunks, credits, granted=1).run(link.notifs_rx)

            nursery.start_soon(receive)
            try:
                await bounce.send(link.job(p, counts, next_credit), chunks, chunk_bytes, first)
            except (Exception, trio.Cancelled) as exc:  # inspected by the test (a cancel goes on below)
                error = exc
            if error is None:
                await link.gen_counts.ended_event.wait()
            scope.cancel()
    return credits, counts, error


def first_leaf(exc: BaseException | None) -> BaseException | None:
    """The exception itself, or the first leaf of a nursery's group."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


