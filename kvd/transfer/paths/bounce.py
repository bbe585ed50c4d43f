"""Gather into staging, NIXL write into a receive slot gen granted, gen scatters (path
``bounce``), several chunks in flight: chunk k+1 is gathered while chunk k is on the wire and
gen scatters chunk k-1.

Both daemons cut every (ctx rank, gen rank) pair's byte stream into the same chunks:
:func:`chunks` (:func:`kvd.regroup.table.chunk_ranges`) of the chunk size ctx chose from the
request (:func:`chunk_size`) and named in its path message.

ctx (:func:`send`), per chunk: a receive slot credit from gen and a send staging slot here;
the gather is *launched* (the regroup kernel on the source GPU, on a stream of our own; the
host twin on host memory, inline when small, else in a worker thread), its completion is
polled from the event loop (a CUDA event query: no worker thread, no blocking wait), then one
NIXL write from descriptor lists prepared once per slot and length
(:meth:`~kvd.transport.NixlAgent.slot_descs`), through a transfer handle made once per (send
slot, receive slot, length) and reposted (:meth:`~kvd.transport.NixlAgent.write_slot_async`),
with notification (request, seq, slot).

gen (:class:`Receiver`), per notification: the scatter kernel from the receive slot on the
destination GPU, completion polled the same way; the slot then goes back to ctx as a credit
(:class:`Credits`: a NIXL notification when ctx asked for them, else an ``XferGrant`` message).

Every write is announced (``posted``) with its chunk's gather, checked again right before it
is posted (an aborting transfer starts no write), and ends (``ended``) once NIXL confirmed or
aborted it; gathers and scatters are counted the same way, and one already
launched is waited for even when the transfer is cancelled (a launched kernel cannot be
stopped: a slot goes back, and a side reports, only once the kernel writing it is done).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import structlog
import trio

from kvd.regroup import apply as regroup_apply
from kvd.regroup.table import ChunkRange, chunk_ranges
from kvd.transfer.movers import INLINE_BYTES, until_done
from kvd.transfer.paths.base import Job, Progress, Sent, mem
from kvd.transport.slots import SlotsReclaimed
from protocol import transfer as x
from protocol.errors import KvdError, NixlError, TransferError

if TYPE_CHECKING:
    from kvd.pool import Pool
    from kvd.regroup.plan import Plan
    from kvd.transport import NixlAgent, PreppedDescs
    from kvd.transport.setup import StagingRegion
    from kvd.transport.slots import SlotPool

log = structlog.get_logger("kvd.transfer")

__all__ = ["Credits", "Receiver", "await_completion", "chunk_size", "chunks", "send", "write_bytes"]

#: Chunk sizes are multiples of this (16-byte kernel accesses, whole host-twin rows).
CHUNK_GRANULE = 64 << 10
#: Smaller chunks cost more per byte (a launch, a write, a notification, a credit each) than
#: their overlap saves: a request below this per pair goes as one chunk per pair.
MIN_CHUNK = 1 << 20
#: Chunks a request on GPUs is cut into at least (over all pairs) when large enough: the first
#: gather and the last scatter are then a quarter of the request, the rest overlaps the writes.
#: Each chunk costs both daemons ~0.3 ms of host work (a gather or scatter launch, a write,
#: a notification, a credit), while the GPU gathers 144 MiB in ~0.1 ms: measured on one H200
#: (`kvd bench transfer --device cuda --gen-gpu 0`, 160 MiB slots, ctx TP1 -> gen TP4) the
#: 576 MiB request moved 151 GB/s in 8 chunks and 190 GB/s in 4 (87.5 in 12 chunks of the
#: 64 MiB slots), 36 MiB 12.6 -> 16.7 GB/s. On host memory every chunk costs worker-thread hops
#: on a few cores that overlap little: there one chunk per pair and slot (measured on 2 cores:
#: 36 MiB in 8 chunks took 1.6x as long as in 4).
PIPELINE_CHUNKS = 4
#: A gather or scatter kernel's speed (local HBM on one side, ~1.5 TB/s measured on H200),
#: used to time the first poll of its completion event.
STAGE_BPS = 1.5e12


def chunk_size(p: Plan, slot_bytes: int, pipeline: int = PIPELINE_CHUNKS) -> int:
    """The chunk size for request ``p`` through slots of ``slot_bytes`` (the smaller of the
    sender's staging slot and the receiver's receive slot): the largest pair's stream cut into
    at least ``pipeline`` chunks over all pairs, never below ``MIN_CHUNK``, rounded up to
    ``CHUNK_GRANULE`` and at most one slot. Fewer, larger chunks for big requests."""
    if slot_bytes < 1:
        raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
    sizes = [n for n in (p.total_bytes(s, d) for s, d in p.pairs()) if n > 0]
    if not sizes:
        return min(MIN_CHUNK, slot_bytes)
    biggest = max(sizes)
    per_pair = max(-(-biggest // slot_bytes), -(-max(1, pipeline) // len(sizes)))
    c = -(-biggest // per_pair)
    c = max(MIN_CHUNK, -(-c // CHUNK_GRANULE) * CHUNK_GRANULE)
    return min(c, slot_bytes)


def chunks(p: Plan, chunk_bytes: int) -> list[ChunkRange]:
    """The chunk list both daemons stream: chunk ``seq`` of the notifications is ``[seq]``."""
    return chunk_ranges(p, chunk_bytes)


def write_bytes(nbytes: int, cap: int) -> int:
    """Bytes the NIXL write of an ``nbytes`` chunk moves: rounded up to a sixteenth of its
    power of two (at least 4 KiB), at most ``cap`` (the slot). The tail past the chunk is
    stale staging the receiver never reads; the rounding keeps the distinct write lengths, and
    so the prepared descriptor lists, few."""
    g = max(4096, 1 << max(0, nbytes.bit_length() - 4))
    return min(-(-nbytes // g) * g, cap)


# -- completion of launched work ------------------------------------------------------------------

_streams: dict[int, Any] = {}


def _stream(device: int) -> Any:
    """This process's stream for bounce gathers and scatters on ``device`` (created once):
    they queue behind each other there, never behind unrelated work on the default stream."""
    s = _streams.get(device)
    if s is None:
        import torch

        s = _streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return s


async def _kernels_ready(devices: set[int]) -> None:
    """Compile or load the regroup kernel for ``devices`` in a worker thread on first use (the
    launches after it pick it without a compile on the event loop)."""
    from kvd.regroup import kernel

    for dev in sorted(d for d in devices if d >= 0):
        if kernel.kernel_ready(dev) is None:
            await trio.to_thread.run_sync(kernel.kernel_available, dev)


async def await_completion(c: regroup_apply.Completion) -> None:
    """Return once ``c``'s work finished, polling from the event loop; raise its error (a
    failed launch). Cancelled, wait for it anyway (shielded): the slot or blocks it writes must
    not be reused, nor reported, before it is done."""
    if c.done():  # host work (done when launched), or a kernel already over: no polling task
        return
    await until_done([(c.done, c.nbytes)], STAGE_BPS)


async def await_completion_settled(c: regroup_apply.Completion) -> None:
    """Return once ``c``'s work is over, whether it succeeded or failed (its error was raised
    to whoever awaited it first)."""
    with contextlib.suppress(Exception):
        await await_completion(c)


async def _stage(fn: Callable[..., regroup_apply.Completion], p: Plan, ch: ChunkRange, src: Any, dst: Any, *,
                 device: int | None) -> regroup_apply.Completion:
    """Gather (``fn`` = ``gather_chunk``) or scatter (``scatter_chunk``) chunk ``ch``: launched
    on ``device``'s bounce stream (returns at once), or on host memory (``device`` None) inline
    when small, else in a worker thread."""
    call = partial(fn, p, ch.src, ch.dst, src, dst, offset=ch.offset, nbytes=ch.nbytes,
                   stream=_stream(device) if device is not None else None)
    if device is not None or ch.nbytes <= INLINE_BYTES:
        return call()
    return await trio.to_thread.run_sync(call)


# -- ctx ---------------------------------------------------------------------------------------------


async def send(job: Job, chs: list[ChunkRange], chunk_bytes: int, first_slot: int) -> Sent:
    """Stream every chunk of ``chs`` (cut every ``chunk_bytes``); ``first_slot`` is the receive
    slot already granted, ``job.grants()`` yields the next ones."""
    assert job.nixl is not None and job.grants is not None and job.remote_region is not None
    nixl, rid, owner, region, p = job.nixl, job.request_id, job.owner, job.remote_region, job.plan
    grants = job.grants
    staging: StagingRegion = job.staging
    slots: SlotPool = job.slot_pool
    cap = min(staging.slot_bytes, job.remote_slot_bytes)
    remote_slots = region.nbytes // job.remote_slot_bytes if job.remote_slot_bytes > 0 else 0
    if not 0 < chunk_bytes <= cap:
        raise TransferError(f"request {rid!r}: bounce chunks of {chunk_bytes} bytes do not fit {cap}-byte slots")
    gpu = staging.device >= 0 and all(pool.device >= 0 for pool in job.src.values())
    if gpu:
        await _kernels_ready({pool.device for pool in job.src.values()})
    local_mem, remote_mem = mem(staging.device), mem(region.device)
    job.stages["bounce_chunk_bytes"] = chunk_bytes
    pending: int | None = first_slot
    descs: dict[int, tuple[PreppedDescs, PreppedDescs]] = {}  # write length -> (local, remote) lists

    def lists(n: int) -> tuple[PreppedDescs, PreppedDescs]:
        """The prepared slot lists for writes of ``n`` bytes: looked up once per request."""
        found = descs.get(n)
        if found is None or found[0].released or found[1].released:
            found = descs[n] = (
                nixl.slot_descs("", staging.addr, staging.slot_bytes, staging.slot_count, n,
                                mem=local_mem, device=staging.device),
                nixl.slot_descs(job.remote_agent, region.addr, job.remote_slot_bytes, remote_slots, n,
                                mem=remote_mem, device=region.device))
        return found

    async def take_grant() -> int:
        """The next chunk's receive slot: the one granted up front for chunk 0, then gen's
        grants in the order they come."""
        nonlocal pending
        if pending is not None:
            remote_slot, pending = pending, None
        else:
            remote_slot = await grants()
        if not 0 <= remote_slot < remote_slots:
            raise TransferError(f"request {rid!r}: the peer granted receive slot {remote_slot}, "
                                f"its region has {remote_slots}")
        return remote_slot

    async def write(seq: int, ch: ChunkRange, local_slot: int, remote_slot: int | None,
                    gathered: regroup_apply.Completion, turn: trio.Event, next_turn: trio.Event) -> None:
        # the gather and its write were announced together (posted(2)) and end together, in
        # one report: the gather has ended by then, the write too, or it never started
        try:
            if remote_slot is None:
                # gathered ahead of its grant: grants go to chunks in order, so this chunk
                # takes the next one once the chunk before it has taken its own
                await turn.wait()
                remote_slot = await take_grant()
                slots.settle(local_slot)
                next_turn.set()
            await await_completion(gathered)
            n = write_bytes(ch.nbytes, cap)
            local, remote = lists(n)
            notif = x.encode_notif(x.Notif(rid, seq, remote_slot, job.peer_ref))
            job.progress.check()  # raises once the transfer is aborting: no write after failure
            # a handle per (send slot, receive slot, length), reposted: no make/release per
            # chunk. A small host write is posted inline: there the post is the copy, and a
            # copy of a few MiB costs less than a worker-thread hop (as the gathers do)
            await nixl.write_slot_async(local, local_slot, remote, remote_slot, notif,
                                        post_in_thread=local_mem == "DRAM" and n > INLINE_BYTES)
            job.progress.moved(ch.nbytes)
        finally:
            # a gather launched but never written (cancelled while it waited for its grant)
            # is waited for first: its slot is reused only once the kernel filling it is done
            with trio.CancelScope(shield=True):
                await await_completion_settled(gathered)
            slots.release(owner, local_slot)
            job.progress.ended(2)

    async with trio.open_nursery() as writers:
        # A chunk's gather is launched before gen granted its receive slot when a send slot
        # can be taken ahead (SlotPool.try_acquire_ahead): on GPUs a request's gathers then
        # queue back to back on one stream, and each write goes out once its gather is done
        # and its grant came. Otherwise the chunk waits for its grant first, then for a send
        # slot: a chunk that waits for a send slot always holds its receive slot, so the
        # transfers sharing these regions cannot wait on each other in a circle.
        turn = trio.Event()
        turn.set()
        for seq, ch in enumerate(chs):
            remote_slot: int | None = None
            local_slot = slots.try_acquire_ahead(owner)
            if local_slot is None:
                await turn.wait()
                remote_slot = await take_grant()
                local_slot = await slots.acquire(owner)
            pool = job.src[ch.src]
            try:
                # a gather is counted as a write: the transfer reports (and its staging slots go
                # to other transfers) only once every launched gather has ended. The chunk's
                # NIXL write is announced with it (one report to the transfer per chunk, not two)
                job.progress.posted(2)
                try:
                    gathered = await _stage(regroup_apply.gather_chunk, p, ch, pool.tensor_u8(),
                                            staging.slot_tensor(local_slot), device=pool.device if gpu else None)
                except BaseException:
                    job.progress.ended(2)
                    raise
            except BaseException:
                slots.release(owner, local_slot)
                raise
            next_turn = trio.Event()
            if remote_slot is not None:
                next_turn.set()
            writers.start_soon(write, seq, ch, local_slot, remote_slot, gathered, turn, next_turn)
            turn = next_turn
    return Sent(writes=len(chs), chunks=len(chs), nbytes=p.total_bytes())


# -- gen ---------------------------------------------------------------------------------------------


@dataclass
class Credits:
    """How gen hands receive slots to ctx: one :class:`~protocol.transfer.Credit` NIXL
    notification per batch when ctx asked for them (``by_notif``), else (older daemons, or
    after a notification failed) one ``XferGrant`` message per slot over the peer link.
    Counts what it sent in ``stages`` (``credits_notif``, ``credits_link``)."""

    request_id: str
    nixl: NixlAgent | None
    agent: str  # ctx's NIXL agent
    send_grant: Callable[[x.XferGrant], Awaitable[None]]
    by_notif: bool
    stages: dict[str, float] = field(default_factory=dict)
    ref: int = 0  # ctx's number for the request, named in each credit (0: not known)

    async def __call__(self, slots: list[int]) -> None:
        if self.by_notif and self.nixl is not None:
            # a host-memory post holds the agent in a worker thread: wait, never block the loop
            while self.nixl.busy:
                await trio.sleep(0.001)
            try:
                for i in range(0, len(slots), x.MAX_CREDITS):
                    batch = slots[i : i + x.MAX_CREDITS]
                    self.nixl.send_notif(self.agent, x.encode_notif(x.Credit(self.request_id, batch, self.ref)))
                    self._count("credits_notif", len(batch))
                return
            except NixlError as exc:
                log.warning("transfer.credit_notif_failed", error=exc.message, fallback="xfer_grant")
                self.by_notif = False
                slots = slots[i:]
        for slot in slots:
            await self.send_grant(x.XferGrant(request_id=self.request_id, slot=slot))
            self._count("credits_link", 1)

    def _count(self, key: str, n: int) -> None:
        self.stages[key] = self.stages.get(key, 0) + n


@dataclass
class Receiver:
    """gen side of the bounce path: grants receive slots and scatters what lands in them."""

    request_id: str
    owner: str  # slot lease owner
    plan: Plan
    chunks: list[ChunkRange]
    pools: dict[int, Pool]  # gen rank -> pool
    region: StagingRegion  # the receive staging region
    slots: SlotPool
    progress: Progress
    grant: Callable[[list[int]], Awaitable[None]]  # hands slots to ctx (a Credits)
    granted: int = 0  # slots already granted (with the announce)
    withhold: bool = False  # fault injection: never grant
    _busy: set[int] = field(default_factory=set)  # slots being scattered

    async def run(self, notifs: trio.MemoryReceiveChannel[x.Notif]) -> None:
        """Grant up to one slot per chunk and scatter each notified chunk; runs until cancelled
        (the transfer ends it once gen is done, failed, or ctx switched path)."""
        gpu = self.region.device >= 0 and all(pool.device >= 0 for pool in self.pools.values())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._grants)
            if gpu:
                await _kernels_ready({pool.device for pool in self.pools.values()})
            async for n in notifs:
                await self._scatter(n, gpu, nursery)

    async def _grants(self) -> None:
        """Grant a receive slot to every chunk not granted yet, as slots come free. Only while
        the side receives: a loop still running after its side began aborting or reported
        (its cancellation comes at its next checkpoint, and taking a free slot is none) would
        take slots that nothing gives back, the side's having been given back already."""
        if self.withhold:
            return
        left = len(self.chunks) - self.granted
        while left > 0:
            try:
                first = await self.slots.acquire(self.owner)
            except SlotsReclaimed:
                return  # handed a slot as the side reported: taken back with the others
            if not self._receiving():
                self.slots.release(self.owner, first)  # never granted: ctx cannot write into it
                return
            batch = [first]
            while len(batch) < left:  # every slot free now goes in the same credit
                slot = self.slots.try_acquire(self.owner)
                if slot is None:
                    break
                batch.append(slot)
            left -= len(batch)
            await self.grant(batch)

    def _receiving(self) -> bool:
        """Whether the side still receives (a credit invites a write: none once it aborts)."""
        try:
            self.progress.check()
        except KvdError:
            return False
        return True

    async def _scatter(self, n: x.Notif, gpu: bool, nursery: trio.Nursery) -> None:
        """Launch chunk ``n.seq``'s scatter; on a GPU its completion is awaited in a task of
        ``nursery`` (the next chunk's scatter is launched meanwhile)."""
        launched = False
        try:
            if not 0 <= n.seq < len(self.chunks):
                raise TransferError(f"request {self.request_id!r}: chunk {n.seq} beyond the "
                                    f"{len(self.chunks)} planned")
            if n.slot in self._busy or not self.slots.owns(self.owner, n.slot):
                raise TransferError(f"request {self.request_id!r}: chunk {n.seq} landed in receive slot "
                                    f"{n.slot}, which is not granted to it (or still being scattered)")
            ch = self.chunks[n.seq]
            pool = self.pools[ch.dst]
            self._busy.add(n.slot)
            c = await _stage(regroup_apply.scatter_chunk, self.plan, ch, self.region.slot_tensor(n.slot),
                             pool.tensor_u8(), device=pool.device if gpu else None)
            launched = True
            if gpu:
                nursery.start_soon(self._scattered, ch, n.slot, c)
            else:
                await self._scattered(ch, n.slot, c)
        finally:
            if not launched:
                self.progress.ended()

    async def _scattered(self, ch: ChunkRange, slot: int, c: regroup_apply.Completion) -> None:
        try:
            await await_completion(c)
            self._busy.discard(slot)
            self.slots.release(self.owner, slot)  # back to the grant loop: ctx's next credit
            self.progress.moved(ch.nbytes)
        finally:
            self.progress.ended()
