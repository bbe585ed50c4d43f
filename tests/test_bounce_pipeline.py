"""The bounce path in one process: real NIXL (two UCX agents over loopback), real host pools,
registered staging and slot pools, the regroup kernel's host twin. Chunk sizing, prepared
descriptor lists, credits by NIXL notification and by ``XferGrant``, and the failure paths: a
NIXL error mid-stream, a cancel mid-stream, notifications a receiver must refuse."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch
import trio

from kvd.transfer.paths import bounce
from kvd.transport.setup import _staging
from kvd.transport.slots import SlotPool
from protocol import transfer as x
from protocol.errors import NixlError, TransferCancelled, TransferError
from protocol.layout import KVLayout
from tests.bounce_harness import OWNER, RID, Counts, bounce_link, first_leaf, make_pools, plan_of, run_request

MiB = 1 << 20
GEO = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 16, "dtype": "bfloat16"}
CTX = KVLayout(**GEO)  # type: ignore[arg-type]
GEN = KVLayout(**{**GEO, "tp_size": 2})  # type: ignore[arg-type]


def L(**kw: Any) -> KVLayout:
    return KVLayout(**{**GEO, **kw})


# -- chunk sizing -----------------------------------------------------------------------------------


def test_chunk_size_of_a_big_request_fills_slots_evenly() -> None:
    # 64 layers: a block is 2 MiB, 512 KiB per gen rank of 4; 288 blocks = 576 MiB, 144 MiB per pair
    p = plan_of(L(num_layers=64), L(num_layers=64, tp_size=4), 288)
    c = bounce.chunk_size(p, 64 * MiB)
    assert c == 48 * MiB  # 144 MiB through 64 MiB slots: 3 chunks a pair, no short tail
    chunks = bounce.chunks(p, c)
    assert len(chunks) == 12 and {ch.nbytes for ch in chunks} == {48 * MiB}
    # two pairs of 96 MiB: the pipeline wants 2 chunks a pair, as the slots allow
    assert bounce.chunk_size(plan_of(L(num_layers=64), L(num_layers=64, tp_size=2), 96), 64 * MiB) == 48 * MiB
    # one pair of 96 MiB: 4 chunks, smaller than the slots allow
    assert bounce.chunk_size(plan_of(L(num_layers=64), L(num_layers=64), 48), 64 * MiB) == 24 * MiB


def test_chunk_size_keeps_a_pipeline_and_a_floor() -> None:
    p = plan_of(L(num_layers=64), L(num_layers=64, tp_size=2), 16)  # 16 MiB per pair
    c = bounce.chunk_size(p, 64 * MiB)
    assert c == 8 * MiB and len(bounce.chunks(p, c)) == bounce.PIPELINE_CHUNKS  # 2 chunks a pair, 4 in all
    small = plan_of(CTX, GEN, 2)  # 128 KiB per pair: one chunk per pair, never below the floor
    assert bounce.chunk_size(small, 64 * MiB) == bounce.MIN_CHUNK
    assert [ch.nbytes for ch in bounce.chunks(small, bounce.MIN_CHUNK)] == [128 << 10] * 2
    assert bounce.chunk_size(small, 96 << 10) == 96 << 10  # never above a slot
    assert bounce.chunk_size(p, 64 * MiB, pipeline=1) == 16 * MiB  # host memory: one chunk per pair
    with pytest.raises(ValueError):
        bounce.chunk_size(small, 0)


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 65_537, 3 * MiB + 128, 48 * MiB])
def test_write_bytes_rounds_up_a_little_within_the_slot(nbytes: int) -> None:
    n = bounce.write_bytes(nbytes, 64 * MiB)
    assert nbytes <= n <= max(4096, nbytes + nbytes // 8)
    assert bounce.write_bytes(nbytes, nbytes) == nbytes  # the slot caps it


def test_credit_notification_wire_format() -> None:
    c = x.Credit(RID, [3, 0, 7])
    raw = x.encode_notif(c)
    assert x.decode_notif(raw) == c
    n = x.Notif(RID, 5, 2)
    assert x.decode_notif(x.encode_notif(n)) == n
    assert x.decode_notif(x.encode_notif(x.Notif("credit", 1, 2))) == x.Notif("credit", 1, 2)
    assert x.decode_notif(b"rawbench") is None


@pytest.mark.parametrize("by_notif", [True, False], ids=["credit_notif", "xfer_grant"])
async def test_bounce_streams_byte_exact_with_either_credit(by_notif: bool) -> None:
    # per pair: 32 blocks x (4 layers x 2 x 4 heads x 16 x 64 x 2 B) = 2 MiB through 4 slots of 256 KiB
    async with bounce_link(CTX, GEN, blocks=64, slot_bytes=256 << 10, slots=4) as link:
        p, expected = link.fill(seed=1)
        chunk = bounce.chunk_size(p, link.recv_region.slot_bytes)
        chunks = bounce.chunks(p, chunk)
        assert chunk == 256 << 10 and len(chunks) == 16  # every slot reused 4 times
        credits, counts, error = await run_request(link, p, chunk_bytes=chunk, by_notif=by_notif)
        assert error is None
        link.check(expected)
        assert counts.n_posted == counts.n_ended == 2 * len(chunks) and counts.nbytes == p.total_bytes()
        assert link.gen_counts.n_ended == len(chunks) and link.gen_counts.nbytes == p.total_bytes()
        assert link.send_slots.in_use == 0 and link.recv_slots.in_use == 0
        granted = len(chunks) - 1  # one came up front
        if by_notif:
            assert credits.stages == {"credits_notif": granted} and link.credits_by_notif == granted
        else:
            assert credits.stages == {"credits_link": granted} and link.credits_by_notif == 0
        # one prepared list per side and write length, reused by every write
        assert link.ctx.slot_descs_held("") == link.ctx.slot_descs_held(link.gen_name) == 1
        # one write handle per (send slot, receive slot) pair used, reposted by later chunks
        assert 0 < link.ctx.slot_writes_held(link.gen_name) <= 4 * 4


async def test_write_handles_are_reused_across_requests() -> None:
    async with bounce_link(CTX, GEN, blocks=64, slot_bytes=256 << 10, slots=2) as link:
        chunk = 256 << 10
        held: list[int] = []
        for seed in (5, 6, 7):  # other bytes every request: a reposted handle moves what is there now
            p, expected = link.fill(seed=seed)
            _, counts, error = await run_request(link, p, chunk_bytes=chunk, by_notif=True)
            assert error is None
            link.check(expected)
            assert counts.n_posted == counts.n_ended and link.send_slots.in_use == link.recv_slots.in_use == 0
            held.append(link.ctx.slot_writes_held(link.gen_name))
            link.gen_counts = type(link.gen_counts)()
        # 2 send slots x 2 receive slots: at most 4 handles whatever the number of chunks and requests
        assert 0 < held[0] <= held[-1] <= 4
        link.ctx.remove_remote(link.gen_name)  # the link went away: its write handles go with it
        assert link.ctx.slot_writes_held(link.gen_name) == 0


async def test_slot_descs_are_prepared_once_and_released_with_the_link() -> None:
    async with bounce_link(CTX, GEN, blocks=8, slot_bytes=256 << 10, slots=4) as link:
        a, r = link.ctx, link.recv_region
        first = a.slot_descs(link.gen_name, r.addr, r.slot_bytes, r.slot_count, 4096)
        assert a.slot_descs(link.gen_name, r.addr, r.slot_bytes, r.slot_count, 4096) is first
        assert len(first) == r.slot_count and set(first.lengths.tolist()) == {4096}
        # the oldest length beyond the kept ones is released
        lists = [a.slot_descs(link.gen_name, r.addr, r.slot_bytes, r.slot_count, 4096 * (i + 2))
                 for i in range(32)]
        assert first.released and not any(p.released for p in lists)
        assert a.slot_descs_held(link.gen_name) == 32
        local = a.slot_descs("", link.send_region.addr, link.send_region.slot_bytes, link.send_region.slot_count, 4096)
        a.remove_remote(link.gen_name)  # the link went away: its lists go with it, local ones stay
        assert a.slot_descs_held(link.gen_name) == 0 and all(p.released for p in lists)
        assert not local.released and a.slot_descs_held("") == 1
        with pytest.raises(NixlError):  # the peer's regions are unknown now
            a.slot_descs(link.gen_name, r.addr, r.slot_bytes, r.slot_count, 4096)
        with pytest.raises(Exception, match="nbytes <= slot_bytes"):
            a.slot_descs("", r.addr, r.slot_bytes, r.slot_count, r.slot_bytes + 1)


async def test_nixl_error_mid_stream_releases_every_slot_and_fails() -> None:
    async with bounce_link(CTX, GEN, blocks=64, slot_bytes=256 << 10, slots=4) as link:
        p, _ = link.fill(seed=2)
        given = 0
        landed = trio.Event()

        def drop_after_two(receive: Callable[[], Awaitable[int]]) -> Callable[[], Awaitable[int]]:
            async def next_credit() -> int:
                nonlocal given
                slot = await receive()
                given += 1
                if given == 2:  # once a write landed, the peer's agent goes away (its link dropped)
                    await landed.wait()
                    link.ctx.remove_remote(link.gen_name)
                return slot

            return next_credit

        counts = Counts(on_moved=lambda _n: landed.set())
        _, counts, error = await run_request(link, p, chunk_bytes=256 << 10, by_notif=True, grants=drop_after_two,
                                      ctx_counts=counts)
        assert isinstance(first_leaf(error), NixlError), error
        assert link.send_slots.in_use == 0  # every staging slot back, on every path
        assert counts.n_posted == counts.n_ended  # every write announced reached a final state
        assert 0 < counts.nbytes < p.total_bytes()
        assert link.ctx.slot_descs_held(link.gen_name) == 0
        assert link.ctx.slot_writes_held(link.gen_name) == 0  # none kept for an agent gone, none in flight


async def test_cancel_mid_stream_waits_for_launched_work_and_releases_slots() -> None:
    # 8 MiB chunks: gathers above the inline size run in a worker thread
    geo = {"num_layers": 32, "head_dim": 128}
    async with bounce_link(L(**geo), L(**geo, tp_size=2), blocks=32, slot_bytes=8 * MiB, slots=2) as link:
        p, _ = link.fill(seed=3)
        assert p.total_bytes(0, 0) == 16 * MiB  # 16 blocks x 1 MiB per gen rank: 2 chunks per pair
        cancel = trio.CancelScope()
        counts = Counts(on_moved=lambda _n: cancel.cancel())
        outcome: list[BaseException | None] = []

        async def sender() -> None:
            with cancel:
                outcome.append((await run_request(link, p, chunk_bytes=8 * MiB, by_notif=True, ctx_counts=counts))[2])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender)
        assert cancel.cancelled_caught or isinstance(first_leaf(outcome[0] if outcome else None), trio.Cancelled)
        assert link.send_slots.in_use == 0 and counts.n_posted == counts.n_ended >= 1


async def test_gathers_are_launched_before_their_receive_slots_are_granted() -> None:
    """With 4 send slots, ctx gathers 3 chunks (count - 1 taken ahead) while gen has granted
    only the first receive slot; the rest go out as the grants come, byte for byte, and every
    slot is back at the end."""
    async with bounce_link(CTX, GEN, blocks=64, slot_bytes=256 << 10, slots=4) as link:
        p, expected = link.fill(seed=5)
        assert len(bounce.chunks(p, 256 << 10)) >= 6
        three_gathered = trio.Event()
        ahead: list[int] = []

        def on_posted(n: int) -> None:
            if n == 2 * 3:  # posted(2) per chunk: gather and write
                ahead.append(link.send_slots.ahead)
                three_gathered.set()

        def held_back(receive: Callable[[], Awaitable[int]]) -> Callable[[], Awaitable[int]]:
            async def next_credit() -> int:
                await three_gathered.wait()  # no second grant before three gathers were launched
                return await receive()

            return next_credit

        counts = Counts(on_posted=on_posted)
        _, counts, error = await run_request(link, p, chunk_bytes=256 << 10, by_notif=True, grants=held_back,
                                             ctx_counts=counts)
        assert error is None, error
        assert ahead == [3]  # the three gathers held their send slots ahead of any later grant
        link.check(expected)
        assert link.send_slots.in_use == 0 and link.send_slots.ahead == 0
        assert counts.n_posted == counts.n_ended


async def test_aborting_transfer_posts_no_write() -> None:
    async with bounce_link(CTX, GEN, blocks=64, slot_bytes=256 << 10, slots=4) as link:
        p, _ = link.fill(seed=4)
        counts = Counts(stop=True)
        _, counts, error = await run_request(link, p, chunk_bytes=256 << 10, by_notif=True, ctx_counts=counts)
        assert isinstance(first_leaf(error), TransferCancelled)
        assert counts.n_posted == counts.n_ended == 0 and link.send_slots.in_use == 0  # not even a gather
        assert link.gen_counts.n_ended == 0  # nothing landed, nothing scattered


# -- the receiver refuses what it did not grant --------------------------------------------------


@pytest.mark.parametrize("notif", [x.Notif(RID, 99, 0), x.Notif(RID, 0, 7)], ids=["seq_beyond", "slot_not_granted"])
async def test_receiver_refuses_a_chunk_it_did_not_grant(notif: x.Notif) -> None:
    dst = make_pools("gen", GEN, 8)
    try:
        recv_region, slots = _staging(256 << 10, 4, -1), SlotPool(4)
        p = plan_of(CTX, GEN, 8)
        chunks = bounce.chunks(p, 256 << 10)
        granted: list[int] = []

        async def link_grant(msg: x.XferGrant) -> None:
            granted.append(msg.slot)

        counts = Counts()
        receiver = bounce.Receiver(RID, OWNER, p, chunks, dst, recv_region, slots, counts,
                                   bounce.Credits(RID, None, "ctx", link_grant, by_notif=False))
        tx, rx = trio.open_memory_channel[x.Notif](1)
        tx.send_nowait(notif)
        before = dst[0].tensor_u8().clone()
        with pytest.raises(BaseExceptionGroup) as info, trio.fail_after(10):
            await receiver.run(rx)
        assert isinstance(first_leaf(info.value), TransferError)
        assert counts.n_ended == 1 and torch.equal(dst[0].tensor_u8(), before)
        assert notif.slot in granted or notif.slot not in range(4)
    finally:
        for pool in dst.values():
            pool.close()
