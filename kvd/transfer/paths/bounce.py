"""Gather into staging, NIXL write into a receive slot gen granted, gen scatters (path
``bounce``): chunk k+1 is gathered while chunk k is on the wire and gen scatters chunk k-1."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from kvd.transfer.movers import BouncePlan, gather, scatter
from kvd.transfer.paths.base import Job, Progress, Sent, mem
from protocol import transfer as x
from protocol.errors import TransferError

if TYPE_CHECKING:
    from kvd.pool import Pool
    from kvd.transport.slots import SlotPool


async def send(job: Job, bp: BouncePlan, first_slot: int) -> Sent:
    """Stream every chunk of ``bp``; ``first_slot`` is the receive slot already granted."""
    assert job.nixl is not None and job.grants is not None and job.remote_region is not None
    nixl, rid, owner, region = job.nixl, job.request_id, job.owner, job.remote_region
    staging, slots = job.staging, job.slot_pool
    pending: int | None = first_slot

    async def write(chunk: Any, seq: int, local_slot: int, remote_slot: int) -> None:
        local = [(staging.slot_addr(local_slot), chunk.nbytes)]
        remote = [(region.addr + remote_slot * job.remote_slot_bytes, chunk.nbytes)]
        notif = x.encode_notif(x.Notif(rid, seq, remote_slot))
        try:
            await nixl.write_async(local, remote, job.remote_agent, notif, local_mem=mem(staging.device),
                                   remote_mem=mem(region.device), local_device=staging.device,
                                   remote_device=region.device)
        finally:
            slots.release(owner, local_slot)
            job.progress.ended()
        job.progress.moved(chunk.nbytes)

    async with trio.open_nursery() as writers:
        for seq, chunk in enumerate(bp.chunks):
            if pending is None:
                remote_slot = await job.grants()
            else:
                remote_slot, pending = pending, None
            local_slot = await slots.acquire(owner)
            try:
                await trio.to_thread.run_sync(gather, bp, chunk, job.src[chunk.src], staging.slot_tensor(local_slot))
            except BaseException:
                slots.release(owner, local_slot)
                raise
            job.progress.posted()
            writers.start_soon(write, chunk, seq, local_slot, remote_slot)
    n = len(bp.chunks)
    return Sent(writes=n, chunks=n, nbytes=job.plan.total_bytes())


@dataclass
class Receiver:
    """gen side of the bounce path: grants receive slots and scatters what lands in them."""

    request_id: str
    owner: str  # slot lease owner
    bp: BouncePlan
    pools: dict[int, Pool]  # gen rank -> pool
    region: Any  # the receive staging region
    slots: SlotPool
    progress: Progress
    grant: Callable[[int], Awaitable[None]]  # sends XferGrant(slot)
    granted: int = 0  # slots already granted (with the announce)
    withhold: bool = False  # fault injection: never grant

    async def run(self, notifs: trio.MemoryReceiveChannel[x.Notif]) -> None:
        """Grant up to one slot per chunk and scatter each notified chunk; runs until cancelled
        (the transfer ends it once gen is done, failed, or ctx switched path)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._grants)
            async for n in notifs:
                await self._scatter(n)

    async def _grants(self) -> None:
        if self.withhold:
            return
        for _ in range(len(self.bp.chunks) - self.granted):
            slot = await self.slots.acquire(self.owner)
            await self.grant(slot)

    async def _scatter(self, n: x.Notif) -> None:
        try:
            if not 0 <= n.seq < len(self.bp.chunks):
                raise TransferError(f"request {self.request_id!r}: chunk {n.seq} beyond the "
                                    f"{len(self.bp.chunks)} planned")
            chunk = self.bp.chunks[n.seq]
            await trio.to_thread.run_sync(partial(scatter, self.bp, chunk, self.region.slot_tensor(n.slot),
                                                  self.pools[chunk.dst]))
            self.slots.release(self.owner, n.slot)
            self.progress.moved(chunk.nbytes)
        finally:
            self.progress.ended()
