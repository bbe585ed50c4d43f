"""kvd.transport: real NIXL (UCX) between two real processes over loopback, host memory.

The writer agent lives in the test process; the target is a spawned :class:`PeerProcess`
that polls its agent continuously. ``UCX_NET_DEVICES=lo`` keeps everything on loopback.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from functools import partial

import numpy as np
import numpy.typing as npt
import pytest
import trio

from kvd.transport import NixlAgent, RegHandle, Region, ensure_loopback_ucx, poll_notifications
from kvd.transport.peerproc import PeerProcess
from protocol.errors import BadRequest, NixlError

MiB = 1 << 20
PEER_BYTES = 64 * MiB
SRC_BYTES = 64 * MiB


def _pattern(nbytes: int, seed: int) -> npt.NDArray[np.uint8]:
    """Deterministic, position-dependent bytes (fast: no RNG over 64 MiB)."""
    idx = np.arange(nbytes // 8, dtype=np.uint64)
    words = (idx * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)) >> np.uint64(13)
    return words.view(np.uint8).copy()


def _sha(a: npt.NDArray[np.uint8]) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


class Writer:
    """The test process's agent with a registered, patterned host buffer."""

    def __init__(self, name: str, nbytes: int, **kwargs: object) -> None:
        self.agent = NixlAgent(name, **kwargs)  # type: ignore[arg-type]
        self.buf = _pattern(nbytes, seed=7)
        self.reg: RegHandle = self.agent.register([Region(self.buf.ctypes.data, nbytes)])

    @property
    def addr(self) -> int:
        return int(self.buf.ctypes.data)


@pytest.fixture(scope="module")
def peer() -> Iterator[PeerProcess]:
    ensure_loopback_ucx()
    with PeerProcess("test-target", PEER_BYTES) as p:
        yield p


@pytest.fixture(scope="module")
def writer(peer: PeerProcess) -> Iterator[Writer]:
    w = Writer("test-writer", SRC_BYTES)
    assert w.agent.add_remote(peer.metadata) == "test-target"  # str, not NIXL's bytes
    assert peer.add_remote(w.agent.metadata()) == "test-writer"
    yield w
    w.agent.close()


@pytest.fixture
def clean_peer(peer: PeerProcess) -> PeerProcess:
    peer.fill(0)
    peer.notifications()  # drop leftovers of earlier tests
    return peer


async def test_large_write_in_four_descriptors(writer: Writer, clean_peer: PeerProcess) -> None:
    peer = clean_peer
    d = 16 * MiB
    # source chunks 0..3 land in reverse order on the peer
    local = [(writer.addr + i * d, d) for i in range(4)]
    remote = [(peer.addr + (3 - i) * d, d) for i in range(4)]
    handle = writer.agent.write(local, remote, "test-target", b"large-1")
    assert handle.nbytes == 64 * MiB and handle.ndescs == 4
    with trio.fail_after(30):
        await writer.agent.wait(handle)
    assert handle.released
    assert await trio.to_thread.run_sync(peer.wait_notifs, 1) == [("test-writer", b"large-1")]
    expected = writer.buf.reshape(4, d)[::-1].reshape(-1)
    assert await trio.to_thread.run_sync(peer.digest, 0, 64 * MiB) == _sha(expected)


async def test_many_small_descriptors_permuted(writer: Writer, clean_peer: PeerProcess) -> None:
    peer = clean_peer
    n, d = 4096, 16 * 1024
    perm = np.random.default_rng(1).permutation(n).astype(np.uint64)
    local = np.stack([writer.addr + np.arange(n, dtype=np.uint64) * d, np.full(n, d, np.uint64)], axis=1)
    remote = np.stack([peer.addr + perm * d, np.full(n, d, np.uint64)], axis=1)
    with trio.fail_after(30):
        handle = await writer.agent.write_async(local, remote, "test-target", b"small-4096")
    assert handle.ndescs == n and handle.released
    assert await trio.to_thread.run_sync(peer.wait_notifs, 1) == [("test-writer", b"small-4096")]
    expected = np.zeros((n, d), dtype=np.uint8)
    expected[perm.astype(np.int64)] = writer.buf[: n * d].reshape(n, d)
    assert await trio.to_thread.run_sync(peer.digest, 0, n * d) == _sha(expected.reshape(-1))


async def test_prepped_descriptors_write_chunk_slots(writer: Writer, clean_peer: PeerProcess) -> None:
    """Prepare the peer's slots once, then write chunks into slots by index (bounce-style)."""
    peer = clean_peer
    slot = 1 * MiB
    nslots = 8
    lp = writer.agent.prep_local([(writer.addr + i * slot, slot) for i in range(nslots)])
    rp = writer.agent.prep_remote("test-target", [(peer.addr + i * slot, slot) for i in range(nslots)])
    try:
        for k, dst in enumerate([5, 2, 7]):
            h = writer.agent.write_prepped(lp, [k], rp, [dst], b"chunk-%d" % k)
            await writer.agent.wait(h)
        with pytest.raises(BadRequest, match="out of range"):
            writer.agent.write_prepped(lp, [0], rp, [nslots], b"")
    finally:
        writer.agent.release_prepped(lp)
        writer.agent.release_prepped(rp)
    got = await trio.to_thread.run_sync(peer.wait_notifs, 3)
    assert [m for _a, m in got] == [b"chunk-0", b"chunk-1", b"chunk-2"]
    for k, dst in enumerate([5, 2, 7]):
        assert await trio.to_thread.run_sync(peer.digest, dst * slot, slot) == _sha(
            writer.buf[k * slot : (k + 1) * slot]
        )
    assert await trio.to_thread.run_sync(peer.digest, 0, slot) == _sha(np.zeros(slot, np.uint8))


async def test_slot_write_reposts_one_handle_per_slot_pair(writer: Writer, clean_peer: PeerProcess) -> None:
    """write_slot_async: the first write of a (local slot, remote slot) pair makes its handle,
    the next ones repost it with their own notification and the bytes there now."""
    peer = clean_peer
    slot, nslots = 1 * MiB, 8
    a = writer.agent
    lp = a.slot_descs("", writer.addr, slot, nslots, slot)
    rp = a.slot_descs("test-target", peer.addr, slot, nslots, slot)
    held = a.slot_writes_held("test-target")
    original = writer.buf[:slot].copy()
    try:
        with trio.fail_after(30):
            await a.write_slot_async(lp, 0, rp, 5, b"first")
            assert a.slot_writes_held("test-target") == held + 1
            assert await trio.to_thread.run_sync(peer.wait_notifs, 1) == [("test-writer", b"first")]
            assert await trio.to_thread.run_sync(peer.digest, 5 * slot, slot) == _sha(original)
            writer.buf[:slot] = 0x5A  # the repost moves the bytes of the slot as they are now
            await a.write_slot_async(lp, 0, rp, 5, b"second")
            assert a.slot_writes_held("test-target") == held + 1  # reposted, not made again
            assert await trio.to_thread.run_sync(peer.wait_notifs, 1) == [("test-writer", b"second")]
            assert await trio.to_thread.run_sync(peer.digest, 5 * slot, slot) == _sha(writer.buf[:slot])
            await a.write_slot_async(lp, 1, rp, 2, b"third")  # another pair: another handle
            assert a.slot_writes_held("test-target") == held + 2
            assert await trio.to_thread.run_sync(peer.wait_notifs, 1) == [("test-writer", b"third")]
            # a released list takes its handles with it; a list prepared again makes new ones
            a.release_prepped(lp)
            assert a.slot_writes_held("test-target") == held
            lp = a.slot_descs("", writer.addr, slot, nslots, slot)
            await a.write_slot_async(lp, 0, rp, 5, b"fourth")
            assert await trio.to_thread.run_sync(peer.wait_notifs, 1) == [("test-writer", b"fourth")]
            assert a.slot_writes_held("test-target") == held + 1
    finally:
        writer.buf[:slot] = original
        a.release_prepped(lp)
        a.release_prepped(rp)
    assert a.slot_writes_held("test-target") == held


async def test_slot_write_to_a_dead_peer_fails_and_keeps_no_handle() -> None:
    ensure_loopback_ucx()
    w = Writer("test-writer-3", 1 * MiB)
    try:
        with PeerProcess("test-doomed-3", 1 * MiB) as doomed:
            w.agent.add_remote(doomed.metadata)
            lp = w.agent.slot_descs("", w.addr, 256 << 10, 4, 4096)
            rp = w.agent.slot_descs("test-doomed-3", doomed.addr, 256 << 10, 4, 4096)
            with trio.fail_after(30):
                await w.agent.write_slot_async(lp, 0, rp, 1, b"ok")
                assert w.agent.slot_writes_held("test-doomed-3") == 1
                assert await trio.to_thread.run_sync(doomed.wait_notifs, 1) == [("test-writer-3", b"ok")]
                doomed.kill()
                # the kept handle is reposted to a peer that went away: a clear error, the
                # handle released (never reposted again), nothing left in flight
                with pytest.raises(NixlError, match="disconnected"):
                    await w.agent.write_slot_async(lp, 0, rp, 1, b"x")
            assert w.agent.slot_writes_held("test-doomed-3") == 0
    finally:
        w.agent.close()


@pytest.mark.parametrize("polite", [False, True], ids=["spin", "polite-spin"])
async def test_notification_from_peer_reaches_poller(writer: Writer, peer: PeerProcess, polite: bool) -> None:
    """Both spins deliver: the plain one, and the polite one of hosts with few cores (which
    yields the CPU every round)."""
    got: list[tuple[str, bytes]] = []
    arrived = trio.Event()

    def on_notif(remote: str, msg: bytes) -> None:
        got.append((remote, msg))
        if len(got) == 2:
            arrived.set()

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(poll_notifications, writer.agent, on_notif, hot=lambda: True, polite=polite))
            await trio.to_thread.run_sync(peer.send_notif, "test-writer", b"hello")
            await trio.to_thread.run_sync(peer.send_notif, "test-writer", b"again")
            await arrived.wait()
            nursery.cancel_scope.cancel()
    assert got == [("test-target", b"hello"), ("test-target", b"again")]


async def test_write_async_keeps_event_loop_running(writer: Writer, clean_peer: PeerProcess) -> None:
    """On host memory the post is the copy; write_async posts it from a worker thread."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.sleep(0)
        before = ticks
        with trio.fail_after(30):
            await writer.agent.write_async(
                [(writer.addr, SRC_BYTES)], [(clean_peer.addr, SRC_BYTES)], "test-target", b"a"
            )
        nursery.cancel_scope.cancel()
    assert ticks > before + 1
    assert await trio.to_thread.run_sync(clean_peer.digest, 0, SRC_BYTES) == _sha(writer.buf)


# --- errors ------------------------------------------------------------------------------------


def test_write_to_unknown_remote_agent(writer: Writer) -> None:
    with pytest.raises(NixlError, match="metadata of remote agent 'nobody' was never loaded") as info:
        writer.agent.write([(writer.addr, 4096)], [(writer.addr, 4096)], "nobody", b"x")
    assert "nixlNotFoundError" in str(info.value) and info.value.code == "nixl_error"


def test_write_beyond_registered_remote_region(writer: Writer, peer: PeerProcess) -> None:
    end = peer.addr + PEER_BYTES
    with pytest.raises(NixlError, match="outside the registered regions"):
        writer.agent.write([(writer.addr, 1 * MiB)], [(end - 4096, 1 * MiB)], "test-target", b"x")


def test_write_from_unregistered_local_memory(writer: Writer, peer: PeerProcess) -> None:
    other = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(NixlError, match="outside the registered regions"):
        writer.agent.write([(other.ctypes.data, 4096)], [(peer.addr, 4096)], "test-target", b"x")


def test_descriptor_validation(writer: Writer) -> None:
    with pytest.raises(BadRequest, match="equal lengths"):
        writer.agent.write([(writer.addr, 4096)], [(writer.addr, 8192)], "test-target")
    with pytest.raises(BadRequest, match="2 local descriptors but 1 remote"):
        writer.agent.write([(writer.addr, 1), (writer.addr + 1, 1)], [(writer.addr, 1)], "test-target")
    with pytest.raises(BadRequest, match="positive"):
        writer.agent.write([(writer.addr, 0)], [(writer.addr, 0)], "test-target")
    with pytest.raises(BadRequest, match="at least one descriptor"):
        writer.agent.write([], [], "test-target")
    with pytest.raises(BadRequest, match="shape"):
        writer.agent.write(np.zeros((2, 3), np.uint64), np.zeros((2, 3), np.uint64), "test-target")


def test_region_validation() -> None:
    with pytest.raises(BadRequest, match="positive"):
        Region(0, 10)
    with pytest.raises(BadRequest, match="mem='VRAM'"):
        Region(4096, 10, device=0)
    with pytest.raises(BadRequest, match="mem='DRAM'"):
        Region(4096, 10, device=-1, mem="VRAM")
    assert Region(4096, 10, device=1, mem="VRAM").device == 1


async def test_cancel_in_flight_write_releases_it(peer: PeerProcess) -> None:
    """Over UCX tcp the post returns PROC; cancelling the wait cancels the transfer.

    The target is paused (it does not progress its agent), so 64 MiB over tcp cannot finish:
    the write is certainly in flight when the wait is cancelled, whatever the machine's load.
    The cancelled write's notification does not arrive (unless it was already finishing when
    the target resumed); the next write works.
    """
    w = Writer("test-writer-tcp", SRC_BYTES, env={"UCX_TLS": "tcp"})
    try:
        w.agent.add_remote(peer.metadata)
        await trio.to_thread.run_sync(peer.add_remote, w.agent.metadata())
        await trio.to_thread.run_sync(peer.notifications)
        await trio.to_thread.run_sync(peer.pause)
        try:
            handle = w.agent.write([(w.addr, SRC_BYTES)], [(peer.addr, SRC_BYTES)], "test-target", b"cancelled")
            assert handle.posted == "PROC"
            waiting = trio.CancelScope()

            async def wait_for_it() -> None:
                with waiting:
                    await w.agent.wait(handle)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait_for_it)
                for _ in range(100):  # the wait task and these checks both drive UCX progress
                    await trio.sleep(0)
                    assert w.agent.state(handle) == "PROC"
                waiting.cancel()
            assert waiting.cancelled_caught
            assert handle.released and not handle.done
        finally:
            await trio.to_thread.run_sync(peer.resume)
        with trio.fail_after(30):
            await w.agent.write_async([(w.addr, 4096)], [(peer.addr, 4096)], "test-target", b"after")
        got: list[tuple[str, bytes]] = []
        while ("test-writer-tcp", b"after") not in got:  # wait_notifs raises after 30 s
            got += await trio.to_thread.run_sync(peer.wait_notifs, 1)
        assert [n for n in got if n != ("test-writer-tcp", b"after")] in ([], [("test-writer-tcp", b"cancelled")])
        # the target's buffer is usable again: a fresh write lands intact
        await trio.to_thread.run_sync(peer.fill, 0)
        with trio.fail_after(30):
            await w.agent.write_async([(w.addr, 1 * MiB)], [(peer.addr, 1 * MiB)], "test-target", b"check")
        assert await trio.to_thread.run_sync(peer.wait_notifs, 1) == [("test-writer-tcp", b"check")]
        assert await trio.to_thread.run_sync(peer.digest, 0, 1 * MiB) == _sha(w.buf[: 1 * MiB])
    finally:
        w.agent.close()


async def test_peer_process_death_is_a_clear_error() -> None:
    ensure_loopback_ucx()
    w = Writer("test-writer-2", 1 * MiB)
    with PeerProcess("test-doomed", 1 * MiB) as doomed:
        w.agent.add_remote(doomed.metadata)
        await w.agent.write_async([(w.addr, 4096)], [(doomed.addr, 4096)], "test-doomed", b"ok")
        doomed.kill()
        with pytest.raises(NixlError, match="disconnected"):
            await w.agent.write_async([(w.addr, 4096)], [(doomed.addr, 4096)], "test-doomed", b"x")
        with pytest.raises(NixlError, match="disconnected"):
            w.agent.send_notif("test-doomed", b"x")
    w.agent.close()
