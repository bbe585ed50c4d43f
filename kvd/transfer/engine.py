"""The transfer engine: matches requests across daemons and moves their KV.

For each request this daemon holds one or two :class:`~kvd.transfer.requests.Side` objects (ctx and/or
gen). Once a side is complete (every participating rank registered):

- ctx and gen on this same daemon (``peer`` = own node): the plan is applied locally
  (path ``local``);
- ctx: an ``XferOffer`` goes to the peer; on ``XferAccept`` both daemons plan the same
  regroup and the sender runs the direct path (equal layouts: whole blocks written straight
  into the peer's pool) or the bounce pipeline (gather chunk k+1 while chunk k is on the wire
  and the receiver scatters chunk k-1; credits = receive slots); no credit within
  ``bounce_wait_s`` → per-fragment writes straight into the blocks with a
  ``transfer.bounce_fallback`` warning;
- gen: waits for the offer (either order), accepts, grants receive slots and scatters.

Every side has a deadline; a dead peer, a stalled transfer, a cancel or an executor whose
session ends fails the request on both daemons, and every slot and lease is reclaimed.
"""

from __future__ import annotations

import contextlib
import math
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import structlog
import torch
import trio

from kvd.regroup import boxbounce
from kvd.regroup.boxcopy import copy_boxes, supports_box_copy
from kvd.regroup.plan import KVLayout, Plan, plan
from kvd.regroup.stager import Chunk, gather, scatter, schedule
from kvd.transfer.requests import Role, Side, add_registration
from kvd.transfer.slots import SlotPool
from protocol import messages as m
from protocol import transfer as x
from protocol.errors import (
    BadRequest,
    BlocksInUse,
    KvdError,
    NotFound,
    PeerUnavailable,
    TransferCancelled,
    TransferError,
    TransferTimeout,
    error_from_code,
)

if TYPE_CHECKING:
    from kvd.daemon import Daemon
    from kvd.executor.session import Session
    from kvd.peer.links import PeerLink, PeerLinks
    from kvd.pool import Pool
    from kvd.transport import NixlAgent

log = structlog.get_logger("kvd.transfer")

#: Descriptors per NIXL write on the direct/fallback paths (keeps one xfer's lists bounded).
MAX_DESCS_PER_WRITE = 8192


#: Up to this many request blocks (over all ranks) the planner runs on the event loop: it only
#: validates and computes boxes there (~0.2 ms for 256 blocks x 5 ranks; fragments are lazy),
#: less than a worker-thread round trip.
INLINE_PLAN_BLOCKS = 4096


async def _plan(ctx: KVLayout, gen: KVLayout, ctx_blocks: dict[int, list[int]], gen_blocks: dict[int, list[int]]) -> Plan:
    """Plan a request: inline when small, in a worker thread when large."""
    blocks = sum(map(len, ctx_blocks.values())) + sum(map(len, gen_blocks.values()))
    if blocks <= INLINE_PLAN_BLOCKS:
        return plan(ctx, gen, ctx_blocks, gen_blocks)
    return await trio.to_thread.run_sync(partial(plan, ctx, gen, ctx_blocks, gen_blocks))


def _mem(device: int) -> Literal["DRAM", "VRAM"]:
    return "DRAM" if device < 0 else "VRAM"


def _gather_synced(chunk: Chunk, src_pool: Any, staging: Any) -> None:
    """Gather, and on CUDA wait for it: NIXL must not read the slot before the copy landed."""
    gather(chunk, src_pool, staging)
    if staging.is_cuda:
        torch.cuda.current_stream(staging.device).synchronize()


def _scatter_synced(chunk: Chunk, bounce: Any, dst_pool: Any) -> None:
    """Scatter, and on CUDA wait for it: the slot is granted again right after."""
    scatter(chunk, bounce, dst_pool)
    if bounce.is_cuda:
        torch.cuda.current_stream(bounce.device).synchronize()


class _BouncePlan:
    """The chunk list both daemons derive from one plan, and how to stage each chunk."""

    def __init__(self, p: Plan, chunks: list[Any], *, boxes: bool) -> None:
        self.plan = p
        self.chunks = chunks
        self.boxes = boxes

    def gather(self, chunk: Any, pool: Pool, slot: torch.Tensor) -> None:
        if self.boxes:
            boxbounce.gather_box(self.plan, chunk, pool.tensor(), slot)
        else:
            _gather_synced(chunk, pool.tensor_u8(), slot)

    def scatter(self, chunk: Any, slot: torch.Tensor, pool: Pool) -> None:
        if self.boxes:
            boxbounce.scatter_box(self.plan, chunk, slot, pool.tensor())
        else:
            _scatter_synced(chunk, slot, pool.tensor_u8())


def _first_kvd_error(exc: BaseException) -> KvdError | None:
    """The KvdError inside ``exc`` (which may be a nursery's exception group), if any."""
    if isinstance(exc, KvdError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _first_kvd_error(inner)
            if found is not None:
                return found
    return None


class _Incoming:
    """gen-side state of a transfer in progress (bounce/direct receive)."""

    def __init__(self) -> None:
        # NIXL notifications of this transfer; None = "a control message arrived, re-check"
        self.notifs: trio.MemorySendChannel[x.Notif | None]
        self.notifs_rx: trio.MemoryReceiveChannel[x.Notif | None]
        self.notifs, self.notifs_rx = trio.open_memory_channel[x.Notif | None](math.inf)
        self.done_msg: x.XferDone | None = None
        self.fallback = trio.Event()  # the sender needs no receive slots (mapped / fragment path)
        self.path = ""
        self.path_set = trio.Event()  # the sender announced its path (XferPath)


class _Outgoing:
    """ctx-side state of a transfer in progress."""

    def __init__(self) -> None:
        self.accept: x.XferAccept | None = None
        self.accepted = trio.Event()
        self.grants_tx: trio.MemorySendChannel[int]
        self.grants_rx: trio.MemoryReceiveChannel[int]
        self.grants_tx, self.grants_rx = trio.open_memory_channel[int](math.inf)
        self.complete: x.XferComplete | None = None
        self.completed = trio.Event()


class Engine:
    """Owns NIXL, the peer links, the bounce regions and every transfer of this daemon."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.cfg = daemon.config.transfer
        self.sides: dict[tuple[str, Role], Side] = {}
        self.incoming: dict[str, _Incoming] = {}
        self.outgoing: dict[str, _Outgoing] = {}
        self.pending_offers: dict[str, tuple[PeerLink, x.XferOffer]] = {}
        self._offer_waiters: dict[str, trio.Event] = {}
        self.chunk_bytes = self.cfg.chunk_mb << 20
        slots = max(1, (self.cfg.bounce_size_mb << 20) // self.chunk_bytes)
        self.recv_slots = SlotPool(slots)
        self.send_slots = SlotPool(slots)
        self.nixl: NixlAgent | None = None
        self.links: PeerLinks | None = None
        self.peer_port = 0
        self._nursery: trio.Nursery | None = None
        self._tasks: dict[tuple[str, Role], trio.Event] = {}
        self._idle = trio.Event()
        self._idle.set()
        self.recv_region: Any = None
        self.send_region: Any = None

    # -- lifecycle --------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Bring up NIXL and the peer links; then serve transfers until cancelled."""
        from kvd.peer.links import PeerLinks
        from kvd.transport import poll_notifications
        from kvd.transport.setup import setup_transport

        transport = await trio.to_thread.run_sync(partial(setup_transport, self.daemon, self.chunk_bytes, self.recv_slots.count))
        self.nixl, self.recv_region, self.send_region = transport.agent, transport.recv, transport.send
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.links = PeerLinks(self, transport)
                self.peer_port = await nursery.start(self.links.run)
                # one poller for the agent's life: without NIXL's progress thread it also drives UCX
                nursery.start_soon(partial(poll_notifications, transport.agent, self._on_notif))
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(transport.close)

    async def drained(self) -> None:
        """Return once no transfer is running."""
        await self._idle.wait()

    # -- stats ------------------------------------------------------------------------------
    def active_count(self) -> int:
        return len(self._tasks)

    def bounce_chunks_total(self) -> int:
        return self.recv_slots.count + self.send_slots.count

    def bounce_chunks_in_use(self) -> int:
        return self.recv_slots.in_use + self.send_slots.in_use

    def peers_connected(self) -> int:
        return len(self.links.links) if self.links is not None else 0

    def transfer_infos(self) -> list[m.TransferInfo]:
        return [side.info() for side in self.sides.values()]

    # -- executor requests ------------------------------------------------------------------
    async def register(self, session: Session, msg: m.Expect | m.Publish) -> None:
        role: Role = "gen" if isinstance(msg, m.Expect) else "ctx"
        pool = self.daemon.pool(msg.pool)
        deadline_s = msg.deadline_s if msg.deadline_s is not None else self.cfg.deadline_s
        if deadline_s <= 0:
            raise BadRequest(f"request {msg.request_id!r}: deadline_s must be positive, got {deadline_s}")
        side = add_registration(self.sides, session, msg, pool, role, trio.current_time() + deadline_s)
        session.requests.add(msg.request_id)
        if side.complete:
            self._start(side)
        elif len(side.parts) == 1:  # first rank of a side: the deadline runs from now
            self._nursery_start(self._expire_incomplete, side)

    async def wait(self, session: Session, msg: m.Wait) -> m.Completion:
        sides = [s for (rid, _r), s in self.sides.items() if rid == msg.request_id and session.id in s.sessions()]
        if not sides:
            raise NotFound(f"request {msg.request_id!r} is not registered by this session")
        side = sides[0]
        if msg.timeout_s is None:
            await side.done.wait()
        else:
            with trio.move_on_after(msg.timeout_s):
                await side.done.wait()
            if side.completion is None:
                raise TransferTimeout(f"request {msg.request_id!r} still running after wait timeout {msg.timeout_s}s")
        assert side.completion is not None
        session.requests.discard(msg.request_id)
        self._forget_if_collected(side)
        return msgspec.structs.replace(side.completion, id=msg.id)

    async def cancel(self, request_id: str, reason: str) -> None:
        found = [s for (rid, _r), s in self.sides.items() if rid == request_id]
        if not found:
            raise NotFound(f"no request {request_id!r}")
        for side in found:
            await self._fail_side(side, TransferCancelled(f"request {request_id!r} {reason}"), notify_peer=True)

    def check_not_in_flight(self, session: Session, pool: str, block_ids: list[int]) -> None:
        """Refuse to free blocks that a registered, unfinished request still reads or writes."""
        wanted = set(block_ids)
        for side in self.sides.values():
            if side.completion is not None:
                continue
            for part in side.parts.values():
                if part.session is session and part.pool.name == pool:
                    busy = wanted.intersection(part.block_ids)
                    if busy:
                        raise BlocksInUse(
                            f"blocks {sorted(busy)[:8]} of pool {pool!r} belong to request "
                            f"{side.request_id!r} ({side.role}, {side.state}); wait for it or cancel it first"
                        )

    async def session_ended(self, session: Session) -> None:
        """Fail every request the session took part in and wait until none uses its blocks."""
        for side in [s for s in self.sides.values() if session.id in s.sessions()]:
            if side.completion is None:
                await self._fail_side(
                    side,
                    TransferCancelled(f"request {side.request_id!r}: executor session {session.id} ended"),
                    notify_peer=True,
                )
            key = (side.request_id, side.role)
            task_done = self._tasks.get(key)
            if task_done is not None:
                await task_done.wait()
            # a side whose executors are all gone is forgotten
            for rank, part in list(side.parts.items()):
                if part.session is session:
                    del side.parts[rank]
            if not side.parts:
                self.sides.pop(key, None)

    def _forget_if_collected(self, side: Side) -> None:
        """Drop finished sides once no session still has them registered."""
        if side.completion is None:
            return
        if not any(side.request_id in p.session.requests for p in side.parts.values()):
            self.sides.pop((side.request_id, side.role), None)

    # -- starting and failing ---------------------------------------------------------------
    def _start(self, side: Side) -> None:
        """A side just became complete: start its task (the gen task waits for its match)."""
        if side.role == "ctx":
            if side.peer == self.daemon.config.node:
                # local: the gen side's task moves the bytes; this one only keeps the deadline
                self._spawn(side, self._await_local, side)
                self._wake_receiver(side.request_id)
            else:
                self._spawn(side, self._run_sender, side)
        else:
            self._spawn(side, self._run_receiver, side)

    def _wake_receiver(self, request_id: str) -> None:
        waiter = self._offer_waiters.get(request_id)
        if waiter is not None:
            waiter.set()

    def _local_ctx(self, request_id: str) -> Side | None:
        ctx = self.sides.get((request_id, "ctx"))
        if ctx is not None and ctx.peer == self.daemon.config.node and ctx.complete and ctx.completion is None:
            return ctx
        return None

    async def _await_local(self, side: Side) -> None:
        side.state = "waiting for local gen side"
        await side.done.wait()

    def _spawn(self, side: Side, fn: Any, *args: Any) -> None:
        assert self._nursery is not None
        key = (side.request_id, side.role)
        done = trio.Event()
        self._tasks[key] = done
        self._idle = trio.Event()
        self._nursery.start_soon(self._supervise, side, done, fn, args)

    async def _supervise(self, side: Side, done: trio.Event, fn: Any, args: tuple[Any, ...]) -> None:
        key = (side.request_id, side.role)
        scope = trio.CancelScope(deadline=side.deadline)
        side.cancel_scope = scope
        side.started = time.monotonic()
        side.state = "running"
        bound = structlog.contextvars.bound_contextvars(request_id=side.request_id, role=side.role)
        try:
            with bound:
                try:
                    with scope:
                        await fn(*args)
                    if scope.cancelled_caught and side.completion is None:
                        await self._fail_side(
                            side,
                            TransferTimeout(
                                f"request {side.request_id!r} ({side.role}) missed its deadline "
                                f"after {time.monotonic() - side.created:.2f}s (stage: {side.state}, "
                                f"{side.chunks_done}/{side.chunks_total} chunks)"
                            ),
                            notify_peer=True,
                        )
                except Exception as exc:
                    kvd_exc = _first_kvd_error(exc)
                    if kvd_exc is not None:
                        await self._fail_side(side, kvd_exc, notify_peer=True)
                        return
                    log.exception("transfer.internal_error")
                    await self._fail_side(side, TransferError(f"internal error: {type(exc).__name__}: {exc}"), notify_peer=True)
        finally:
            with trio.CancelScope(shield=True):
                self._reclaim(side)
                self._tasks.pop(key, None)
                done.set()
                if not self._tasks:
                    self._idle.set()

    def _reclaim(self, side: Side) -> None:
        """Return every receive/send slot the request holds."""
        self.recv_slots.release_owner(side.request_id)
        self.send_slots.release_owner(side.request_id)
        self.incoming.pop(side.request_id, None) if side.role == "gen" else self.outgoing.pop(side.request_id, None)
        if side.role == "ctx":
            self.pending_offers.pop(side.request_id, None)

    async def _fail_side(self, side: Side, exc: KvdError, *, notify_peer: bool) -> None:
        if side.completion is not None:
            return
        side.fail(exc)
        self.daemon.counters.transfers_failed += 1
        self.daemon.metrics.transfer_failed(exc.code)
        log.warning(
            "transfer.failed",
            request_id=side.request_id,
            role=side.role,
            peer=side.peer,
            code=exc.code,
            error=exc.message,
            bytes=side.bytes_done,
            chunks=side.chunks_done,
        )
        if side.cancel_scope is not None:
            side.cancel_scope.cancel()
        if notify_peer and side.peer and side.peer != self.daemon.config.node and self.links is not None:
            link = self.links.links.get(side.peer)
            if link is not None:
                with trio.move_on_after(1.0) as _scope:
                    _scope.shield = True
                    with contextlib.suppress(KvdError):
                        await link.send(x.XferFail(request_id=side.request_id, code=exc.code, message=exc.message))

    def _succeed(self, side: Side, *, nbytes: int, path: str, chunks: int, fallback: str = "") -> None:
        duration = time.monotonic() - side.started
        completion = m.Completion(
            request_id=side.request_id,
            ok=True,
            bytes=nbytes,
            duration_s=duration,
            path=path,
            chunks=chunks,
            fallback=fallback,
            peer=side.peer,
        )
        if not side.finish(completion):
            return
        side.bytes_done = nbytes
        c = self.daemon.counters
        c.transfers_done += 1
        if side.role == "ctx":
            c.bytes_sent += nbytes
        else:
            c.bytes_received += nbytes
        self.daemon.metrics.transfer_done(side.role, path, nbytes, duration)
        # the one canonical line per transfer and side
        log.info(
            "transfer.done",
            request_id=side.request_id,
            role=side.role,
            peer=side.peer,
            bytes=nbytes,
            duration_s=round(duration, 6),
            gbps=round(nbytes / duration / 1e9, 3) if duration > 0 else 0.0,
            path=path,
            chunks=chunks,
            fallback=fallback or None,
            stages=side.stages or None,
        )

    # -- local path -------------------------------------------------------------------------
    async def _run_local(self, ctx: Side, gen: Side) -> None:
        """Both sides on this daemon: apply the plan pool to pool (path ``local``)."""
        ctx.started = gen.started = time.monotonic()
        ctx.state = gen.state = "copying"
        gen.peer = self.daemon.config.node
        p = await _plan(ctx.layout, gen.layout, ctx.blocks_by_rank(), gen.blocks_by_rank())
        ctx.path = gen.path = "local"
        ctx.bytes_total = gen.bytes_total = p.total_bytes()
        src = {r: part.pool.tensor_u8() for r, part in ctx.parts.items()}
        dst = {r: part.pool.tensor_u8() for r, part in gen.parts.items()}
        await trio.to_thread.run_sync(partial(p.apply, src, dst))
        nbytes = p.total_bytes()
        for side in (ctx, gen):
            side.chunks_done = side.chunks_total = len(p.pairs())
            self._succeed(side, nbytes=nbytes, path="local", chunks=len(p.pairs()))

    # -- ctx (sender) -----------------------------------------------------------------------
    async def _run_sender(self, side: Side) -> None:
        assert self.links is not None
        side.state = "waiting for peer link"
        links = self.links
        with trio.move_on_at(side.deadline - 0.05) as scope:
            link = await links.wait_for(side.peer)
        if scope.cancelled_caught:
            raise PeerUnavailable(f"request {side.request_id!r}: {links.describe_missing(side.peer)} before the deadline")
        out = _Outgoing()
        self.outgoing[side.request_id] = out
        side.state = "offered"
        await link.send(
            x.XferOffer(
                request_id=side.request_id,
                layout=side.layout,
                blocks=side.blocks_by_rank(),
                deadline_s=max(0.0, side.deadline - trio.current_time()),
            )
        )
        side.mark("offer_sent")
        await out.accepted.wait()
        side.mark("accepted")
        accept = out.accept
        assert accept is not None
        p = await _plan(side.layout, accept.layout, side.blocks_by_rank(), accept.blocks)
        side.mark("planned")
        side.bytes_total = p.total_bytes()
        mapped = {r: link.mapped.get(name) for r, name in accept.pool_names.items()}
        if mapped and all(m is not None for m in mapped.values()) and set(p.dst_ranks()) <= set(mapped):
            side.path = "mapped"
            await link.send(x.XferPath(request_id=side.request_id, path="mapped"))
            await self._copy_mapped(side, p, {r: m for r, m in mapped.items() if m is not None})
            writes, chunks, fallback = 0, len(p.pairs()), ""
        elif p.direct:
            side.path = "direct"
            await link.send(x.XferPath(request_id=side.request_id, path="direct"))
            writes = await self._send_fragments(side, link, p, accept)
            chunks = writes
            fallback = ""
        else:
            await link.send(x.XferPath(request_id=side.request_id, path="bounce"))
            sched = await trio.to_thread.run_sync(self._bounce_plan, p)
            side.chunks_total = len(sched.chunks)
            first = trio.move_on_after(self.cfg.bounce_wait_s)
            with first:
                first_slot = await out.grants_rx.receive()
            if first.cancelled_caught:
                reason = f"no receive credit from {side.peer} within bounce_wait_s={self.cfg.bounce_wait_s}"
                log.warning("transfer.bounce_fallback", request_id=side.request_id, peer=side.peer, reason=reason,
                            fragments=p.num_fragments())
                self.daemon.metrics.fallback("bounce")
                await link.send(x.XferPath(request_id=side.request_id, path="fragment-fallback", reason=reason))
                side.path = "fragment-fallback"
                writes = await self._send_fragments(side, link, p, accept, per_fragment=True)
                chunks, fallback = writes, "fragment"
            else:
                side.path = "bounce"
                writes = await self._send_bounce(side, link, sched, first_slot, out)
                chunks, fallback = writes, ""
        side.mark("data_sent")
        side.state = "finishing"
        await link.send(x.XferDone(request_id=side.request_id, writes=writes, bytes=side.bytes_total, chunks=chunks))
        await out.completed.wait()
        side.mark("confirmed")
        self._succeed(side, nbytes=side.bytes_total, path=side.path, chunks=chunks, fallback=fallback)

    async def _copy_mapped(self, side: Side, p: Plan, mapped: dict[int, Any]) -> None:
        """Regroup straight into the peer's pools, mapped here (same node): no NIXL, no bounce."""
        side.state = "copying"
        src_any = next(iter(side.parts.values())).pool
        if src_any.device >= 0 and boxbounce.fits(p, self.cfg.gpu_chunk_mb << 20):  # boxes: 3 kernels a chunk
            from kvd.regroup.gpu_pipeline import pipelined_box_regroup

            side.chunks_total = len(p.pairs())
            src_t = {r: part.pool.tensor() for r, part in side.parts.items()}
            dst_t = {r: m.tensor for r, m in mapped.items()}
            timings: dict[str, float] = {}
            side.bytes_done = await trio.to_thread.run_sync(
                partial(pipelined_box_regroup, p, src_t, dst_t, chunk_bytes=self.cfg.gpu_chunk_mb << 20,
                        timings=timings)
            )
            side.chunks_done = side.chunks_total
            side.stages.update({f"gpu_{k}": round(v, 6) for k, v in timings.items()})
            return
        if src_any.device >= 0:  # GPU pools: gather / NVLink copy / scatter on CUDA streams
            from kvd.regroup.gpu_pipeline import pipelined_regroup

            sched = await trio.to_thread.run_sync(partial(schedule, p, chunk_bytes=self.chunk_bytes))
            side.mark("scheduled")
            side.chunks_total = sched.num_chunks()
            src = {r: part.pool.tensor_u8() for r, part in side.parts.items()}
            dst = {r: m.raw for r, m in mapped.items()}
            side.bytes_done = await trio.to_thread.run_sync(partial(pipelined_regroup, sched, src, dst))
            side.chunks_done = side.chunks_total
            return
        side.chunks_total = len(p.pairs())
        if supports_box_copy(p):  # one strided copy per block, blocks spread over worker threads
            src_t = {r: part.pool.tensor() for r, part in side.parts.items()}
            dst_t = {r: m.tensor for r, m in mapped.items()}
            side.bytes_done = await trio.to_thread.run_sync(partial(copy_boxes, p, src_t, dst_t))
            side.chunks_done = side.chunks_total
            return
        for s, d in p.pairs():
            await trio.to_thread.run_sync(p.copier(s, d).copy, side.parts[s].pool.tensor_u8(), mapped[d].raw)
            side.bytes_done += p.total_bytes(s, d)
            side.chunks_done += 1

    async def _send_fragments(
        self, side: Side, link: PeerLink, p: Plan, accept: x.XferAccept, *, per_fragment: bool = False
    ) -> int:
        """Write the plan's fragments straight from our pools into the peer's pools."""
        assert self.nixl is not None
        import numpy as np

        seq = 0
        side.state = "writing"
        for s, d in p.pairs():
            frags = p.fragments(s, d)
            src_base = side.parts[s].pool.ptr
            dst = accept.pools[d]
            src_dev = side.parts[s].pool.device
            for lo in range(0, len(frags), MAX_DESCS_PER_WRITE):
                part = frags[lo : lo + MAX_DESCS_PER_WRITE]
                local = np.stack([part[:, 0] + src_base, part[:, 2]], axis=1)
                remote = np.stack([part[:, 1] + dst.addr, part[:, 2]], axis=1)
                notif = x.encode_notif(x.Notif(side.request_id, seq, -1))
                await self.nixl.write_async(
                    local, remote, link.agent, notif,
                    local_mem=_mem(src_dev), remote_mem=_mem(dst.device), local_device=src_dev, remote_device=dst.device,
                )
                seq += 1
                nbytes = int(part[:, 2].sum())
                side.bytes_done += nbytes
                side.chunks_done = seq
        return seq

    def _bounce_plan(self, p: Plan) -> _BouncePlan:
        """Chunks for the bounce pipeline: whole-block boxes when they apply, else fragments."""
        if boxbounce.fits(p, self.chunk_bytes):
            return _BouncePlan(p, boxbounce.box_chunks(p, self.chunk_bytes), boxes=True)
        return _BouncePlan(p, schedule(p, chunk_bytes=self.chunk_bytes).all_chunks(), boxes=False)

    async def _send_bounce(self, side: Side, link: PeerLink, sched: _BouncePlan, first_slot: int, out: _Outgoing) -> int:
        """The bounce pipeline: gather k+1 while k is on the wire (receiver scatters k-1)."""
        assert self.nixl is not None
        nixl = self.nixl
        chunks = sched.chunks
        rid = side.request_id
        side.state = "streaming"
        pending_slot: int | None = first_slot

        async def write_and_release(chunk: Any, seq: int, local_slot: int, remote_slot: int) -> None:
            local = [(self.send_region.slot_addr(local_slot), chunk.nbytes)]
            remote = [(link.bounce.addr + remote_slot * link.slot_bytes, chunk.nbytes)]
            notif = x.encode_notif(x.Notif(rid, seq, remote_slot))
            src_dev, dst_dev = self.send_region.device, link.bounce.device
            try:
                await nixl.write_async(local, remote, link.agent, notif, local_mem=_mem(src_dev),
                                       remote_mem=_mem(dst_dev), local_device=src_dev, remote_device=dst_dev)
            finally:
                self.send_slots.release(rid, local_slot)
            side.bytes_done += chunk.nbytes
            side.chunks_done += 1

        async with trio.open_nursery() as writers:
            for seq, chunk in enumerate(chunks):
                if pending_slot is None:
                    remote_slot = await out.grants_rx.receive()
                else:
                    remote_slot, pending_slot = pending_slot, None
                local_slot = await self.send_slots.acquire(rid)
                staging = self.send_region.slot_tensor(local_slot)
                await trio.to_thread.run_sync(sched.gather, chunk, side.parts[chunk.src].pool, staging)
                writers.start_soon(write_and_release, chunk, seq, local_slot, remote_slot)
        return len(chunks)

    # -- gen (receiver) ---------------------------------------------------------------------
    async def _run_receiver(self, side: Side) -> None:
        assert self.links is not None
        side.state = "waiting for offer"
        rid = side.request_id
        if rid not in self.pending_offers and self._local_ctx(rid) is None:
            matched = trio.Event()
            self._offer_waiters[rid] = matched
            try:
                await matched.wait()
            finally:
                self._offer_waiters.pop(rid, None)
        local = self._local_ctx(rid)
        if local is not None:
            await self._run_local(local, side)
            return
        link, offer = self.pending_offers.pop(rid)
        side.peer = link.node
        side.started = time.monotonic()
        inc = _Incoming()
        self.incoming[side.request_id] = inc
        regions = {
            r: x.RemoteRegion(addr=part.pool.ptr, nbytes=part.pool.nbytes, device=part.pool.device)
            for r, part in side.parts.items()
        }
        names = {r: part.pool.name for r, part in side.parts.items()}
        # accept first, plan second: the sender plans the same regroup meanwhile
        await link.send(x.XferAccept(request_id=side.request_id, layout=side.layout, blocks=side.blocks_by_rank(),
                                     pools=regions, pool_names=names))
        p = await _plan(offer.layout, side.layout, offer.blocks, side.blocks_by_rank())
        side.bytes_total = p.total_bytes()
        side.state = "receiving"
        await inc.path_set.wait()
        if inc.path in ("direct", "mapped"):
            side.path = inc.path
            writes = await self._receive_direct(side, inc)
            fallback = ""
        else:
            sched = await trio.to_thread.run_sync(self._bounce_plan, p)
            side.chunks_total = len(sched.chunks)
            side.path = "bounce"
            writes = await self._receive_bounce(side, link, sched, inc)
            fallback = "fragment" if inc.path == "fragment-fallback" else ""
            if inc.path:
                side.path = inc.path
        await link.send(x.XferComplete(request_id=side.request_id, bytes=side.bytes_total))
        chunks = inc.done_msg.chunks if inc.done_msg is not None else writes  # as the sender counted them
        self._succeed(side, nbytes=side.bytes_total, path=side.path, chunks=chunks, fallback=fallback)

    async def _receive_direct(self, side: Side, inc: _Incoming) -> int:
        """Count the sender's write notifications until XferDone says how many there were."""
        seen = 0
        while True:
            if inc.done_msg is not None and seen >= inc.done_msg.writes:
                side.bytes_done = side.bytes_total
                return seen
            if await inc.notifs_rx.receive() is not None:
                seen += 1
                side.chunks_done = seen

    async def _receive_bounce(self, side: Side, link: PeerLink, sched: _BouncePlan, inc: _Incoming) -> int:
        rid = side.request_id
        chunks = sched.chunks
        total = len(chunks)
        scattered = 0

        async def grant_slots(cancel: trio.CancelScope) -> None:
            if not self.cfg.grant_credits:  # fault injection: a receiver that never grants
                log.warning("transfer.credits_withheld", request_id=rid, reason="transfer.grant_credits = false")
                return
            with cancel:
                for _ in range(total):
                    slot = await self.recv_slots.acquire(rid)
                    await link.send(x.XferGrant(request_id=rid, slot=slot))

        async def scatter_one(n: x.Notif) -> None:
            nonlocal scattered
            chunk = chunks[n.seq]
            bounce = self.recv_region.slot_tensor(n.slot)
            await trio.to_thread.run_sync(sched.scatter, chunk, bounce, side.parts[chunk.dst].pool)
            self.recv_slots.release(rid, n.slot)
            scattered += 1
            side.chunks_done = scattered
            side.bytes_done += chunk.nbytes
            inc.notifs.send_nowait(None)  # wake the loop: the last scatter may end the transfer

        granting = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(grant_slots, granting)
            seen = 0
            while True:
                if inc.fallback.is_set():
                    granting.cancel()
                    self.recv_slots.release_owner(rid)
                    if inc.done_msg is not None and seen >= inc.done_msg.writes:
                        break
                elif scattered == total and seen == total:
                    break
                n = await inc.notifs_rx.receive()
                if n is not None:
                    seen += 1
                    if n.slot >= 0:
                        if n.seq >= total:
                            raise TransferError(f"request {rid!r}: chunk {n.seq} beyond the {total} planned")
                        nursery.start_soon(scatter_one, n)
                    else:
                        side.chunks_done = seen
            granting.cancel()
        if inc.fallback.is_set():
            side.bytes_done = side.bytes_total
            return seen
        return total

    # -- messages from peers ----------------------------------------------------------------
    async def on_peer_message(self, link: PeerLink, msg: x.XferMessage) -> None:
        """Route one transfer-control message from ``link``."""
        rid = msg.request_id
        if isinstance(msg, x.XferOffer):
            if rid in self.pending_offers or rid in self.incoming:
                await link.send(x.XferFail(request_id=rid, code="duplicate_request", message=f"request {rid!r} already offered"))
                return
            self.pending_offers[rid] = (link, msg)
            if rid in self._offer_waiters:
                self._wake_receiver(rid)
            else:
                # nobody expects it yet: keep it until the gen executors register, or its deadline
                self._nursery_start(self._expire_offer, rid, msg.deadline_s)
            return
        if isinstance(msg, x.XferAccept):
            out = self.outgoing.get(rid)
            if out is not None and out.accept is None:
                out.accept = msg
                out.accepted.set()
            return
        if isinstance(msg, x.XferGrant):
            out = self.outgoing.get(rid)
            if out is not None:
                out.grants_tx.send_nowait(msg.slot)
            return
        if isinstance(msg, x.XferPath):
            inc = self.incoming.get(rid)
            if inc is not None:
                inc.path = msg.path
                inc.path_set.set()
                if msg.path in ("mapped", "fragment-fallback"):
                    inc.fallback.set()
                inc.notifs.send_nowait(None)
            return
        if isinstance(msg, x.XferDone):
            inc = self.incoming.get(rid)
            if inc is not None:
                inc.done_msg = msg
                inc.notifs.send_nowait(None)
            return
        if isinstance(msg, x.XferComplete):
            out = self.outgoing.get(rid)
            if out is not None:
                out.complete = msg
                out.completed.set()
            return
        if isinstance(msg, x.XferFail):
            self.pending_offers.pop(rid, None)
            exc = error_from_code(msg.code, f"peer {link.node}: {msg.message}")
            roles: tuple[Role, ...] = ("ctx", "gen")
            for role in roles:
                side = self.sides.get((rid, role))
                if side is not None and side.completion is None and side.peer in (link.node, ""):
                    await self._fail_side(side, exc, notify_peer=False)
            return

    def _nursery_start(self, fn: Any, *args: Any) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(fn, *args)

    async def _expire_incomplete(self, side: Side) -> None:
        """Fail a side whose ranks did not all register before its deadline (no task runs it yet)."""
        while side.completion is None and not side.complete:
            if trio.current_time() >= side.deadline:
                missing = sorted(set(side.ranks) - set(side.parts))
                await self._fail_side(
                    side,
                    TransferTimeout(
                        f"request {side.request_id!r} ({side.role}): ranks {missing} never registered "
                        f"before the deadline ({len(side.parts)} of {len(side.ranks)} did)"
                    ),
                    notify_peer=False,
                )
                return
            with trio.move_on_at(side.deadline):
                await side.done.wait()  # a cancel or failure ends the wait early

    async def _expire_offer(self, rid: str, seconds: float) -> None:
        await trio.sleep(seconds)
        pending = self.pending_offers.pop(rid, None)
        if pending is not None:
            link, _offer = pending
            log.warning("transfer.offer_expired", request_id=rid, peer=link.node)
            with contextlib.suppress(KvdError):
                await link.send(x.XferFail(request_id=rid, code=TransferTimeout.code,
                                           message=f"no executor expected request {rid!r} before its deadline"))

    async def on_link_lost(self, node: str, reason: str) -> None:
        """The link to ``node`` broke: fail every transfer with it, on this side."""
        for rid in [r for r, (link, _o) in self.pending_offers.items() if link.node == node]:
            self.pending_offers.pop(rid, None)
        for side in list(self.sides.values()):
            if side.peer == node and side.completion is None:
                await self._fail_side(side, PeerUnavailable(f"peer {node} went away: {reason}"), notify_peer=False)

    # -- NIXL notifications -----------------------------------------------------------------
    def _on_notif(self, _remote: str, raw: bytes) -> None:
        """Route one NIXL notification to the transfer receiving it (never blocks)."""
        n = x.decode_notif(raw)
        if n is None:
            return
        inc = self.incoming.get(n.request_id)
        if inc is not None:
            inc.notifs.send_nowait(n)
