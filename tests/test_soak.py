"""Soak: 50 executors hammer one daemon at random for ``KVD_SOAK_SECONDS`` (120 by
default) — connect, allocate, register requests (some run as local transfers, some expire,
some are cancelled, most are simply dropped with the session), free, wait, and disconnect,
sometimes with a Wait still pending. Afterwards nothing may be left: no lease, no session,
no registration, no bounce chunk, no extra fd, and the daemon's RSS grew by less than 10%
after warm-up.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import trio

from clients import open_client
from clients.client import AsyncClient
from kvd.demo.launch import DaemonProcess, start_daemon
from kvd.ops.history import HISTORY_SIZE
from protocol.errors import NotFound, OutOfBlocks, TransferCancelled, TransferTimeout, WaitTimeout
from protocol.layout import KVLayout
from tests.conftest import host_pool

CLIENTS = 50
SECONDS = float(os.environ.get("KVD_SOAK_SECONDS", "120"))
NODE = "soak"
GEOMETRY: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "tokens_per_block": 4,
                            "dtype": "bfloat16"}  # 1 KiB blocks
LAYOUT = KVLayout(**GEOMETRY)
POOLS = ("ctx0", "gen0")
#: Errors a random client is expected to run into; anything else fails the test.
EXPECTED = (OutOfBlocks, NotFound, TransferTimeout, TransferCancelled, WaitTimeout)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")  # pragma: no cover


def _logged(d: DaemonProcess, event: str) -> int:
    """How many ``event`` lines the daemon wrote."""
    return sum(json.loads(line)["event"] == event for line in d.log().splitlines() if line.startswith("{"))


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Executor:
    """One random client; counts what it did in ``done``."""

    def __init__(self, index: int, path: str, until: float, done: collections.Counter[str]) -> None:
        self.index = index
        self.path = path
        self.until = until
        self.done = done
        self.rng = random.Random(index)
        self.serial = 0

    def rid(self) -> str:
        self.serial += 1
        return f"soak-{self.index}-{self.serial}"

    async def run(self) -> None:
        while trio.current_time() < self.until:
            async with open_client(self.path, client=f"soak{self.index}") as kvd:
                self.done["sessions"] += 1
                await self.session(kvd)
            # leaving the block: the socket closes with whatever is still leased or registered

    async def session(self, kvd: AsyncClient) -> None:
        held: dict[str, list[int]] = {p: [] for p in POOLS}
        registered: list[str] = []
        for _ in range(self.rng.randint(1, 25)):
            op = self.rng.random()
            try:
                if op < 0.35:
                    pool = self.rng.choice(POOLS)
                    held[pool] += await kvd.alloc(pool, self.rng.randint(1, 16))
                    self.done["alloc"] += 1
                elif op < 0.55:
                    pool = self.rng.choice(POOLS)
                    if held[pool]:
                        some = self.rng.sample(held[pool], self.rng.randint(1, len(held[pool])))
                        await kvd.free(pool, some)
                        held[pool] = [b for b in held[pool] if b not in some]
                        self.done["free"] += 1
                elif op < 0.72:
                    if held["gen0"]:  # registered, then usually just dropped with the session
                        blocks = [held["gen0"].pop() for _ in range(min(len(held["gen0"]), self.rng.randint(1, 4)))]
                        rid = self.rid()
                        await kvd.expect(rid, "gen0", LAYOUT, 0, blocks, deadline_s=self.rng.choice([0.2, 2.0, 30.0]))
                        registered.append(rid)
                        self.done["expect"] += 1
                elif op < 0.82:
                    await self.local_transfer(kvd, held)
                elif op < 0.87:
                    if registered:
                        await kvd.cancel(registered.pop(self.rng.randrange(len(registered))))
                        self.done["cancel"] += 1
                elif op < 0.92:
                    if registered:  # mostly ends by the wait timeout or the request's deadline
                        await kvd.wait(self.rng.choice(registered), timeout_s=0.05)
                elif op < 0.95:
                    if registered:  # hang up with a Wait in flight
                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(self.wait_quietly, kvd, self.rng.choice(registered))
                            await trio.sleep(0.005)
                            nursery.cancel_scope.cancel()
                        self.done["dropped_wait"] += 1
                        return
                else:
                    st = await kvd.stats()
                    assert st.sessions >= 1
            except EXPECTED as exc:
                self.done[type(exc).__name__] += 1
            await trio.sleep(self.rng.random() * 0.004)

    async def local_transfer(self, kvd: AsyncClient, held: dict[str, list[int]]) -> None:
        """ctx0 → gen0 on this daemon (peer = its own node): path "local"."""
        n = self.rng.randint(1, 4)
        src = await kvd.alloc("ctx0", n)
        dst = await kvd.alloc("gen0", n)
        rid = self.rid()
        await kvd.expect(rid, "gen0", LAYOUT, 0, dst, deadline_s=30)
        await kvd.publish(rid, "ctx0", LAYOUT, 0, src, peer=NODE, deadline_s=30)
        done = await kvd.wait(rid, timeout_s=30)
        assert done.ok and done.path == "local" and done.bytes == n * 1024
        self.done["transfer"] += 1
        held["ctx0"] += src
        held["gen0"] += dst

    async def wait_quietly(self, kvd: AsyncClient, rid: str) -> None:
        with contextlib.suppress(*EXPECTED):
            await kvd.wait(rid)


@pytest.mark.soak
async def test_soak_50_clients_leave_nothing_behind() -> None:
    workdir = tempfile.mkdtemp(prefix="kvds-", dir="/tmp")
    pools = [host_pool(name, **GEOMETRY, num_blocks=4096) for name in POOLS]
    d = start_daemon({"pools": pools, "transfer": {"bounce_size_mb": 16, "chunk_mb": 2}}, workdir=workdir, name=NODE)
    try:
        done: collections.Counter[str] = collections.Counter()
        start = trio.current_time()
        warmup = min(20.0, SECONDS / 5)
        fds_before = _fds(d.pid)
        rss: dict[str, int] = {}

        async def measure_after_warmup() -> None:
            await trio.sleep(warmup)
            rss["warm"] = _rss_kib(d.pid)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(measure_after_warmup)
            for i in range(CLIENTS):
                nursery.start_soon(Executor(i, d.socket_path, start + SECONDS, done).run)

        # every session is gone and took everything with it
        async with open_client(d.socket_path, client="check") as kvd:
            with trio.fail_after(20):
                while True:
                    st = await kvd.stats()
                    # finished transfers stay listed (the last HISTORY_SIZE); a finished side the
                    # engine failed to forget would show up beyond them, or as still running
                    listed = await kvd.transfers()
                    settled = all(t.state in ("done", "failed") for t in listed) and len(listed) <= HISTORY_SIZE
                    # a transfer whose sides reported is active until its actor has ended (a
                    # few scheduler passes later): wait for that too; one that never ends times out
                    if st.sessions == 1 and st.blocks_leased == 0 and settled and st.transfers_active == 0:
                        break
                    await trio.sleep(0.05)
            assert st.bounce_chunks_in_use == 0
            assert st.transfers_active == 0
            assert all(p.blocks_used == 0 and p.blocks_free == 4096 for p in st.pools)
            assert st.transfers_done == 2 * done["transfer"]
        # the check session has hung up as well; the daemon ends a session (logs session.closed,
        # closes its descriptor) when it reads the hang-up: wait for that before counting
        with trio.fail_after(20):
            while _logged(d, "session.closed") < done["sessions"] + 1:
                await trio.sleep(0.02)
        rss["end"] = _rss_kib(d.pid)
        fds_after = _fds(d.pid)

        assert d.proc.poll() is None
        print(f"\nsoak {SECONDS:.0f}s: {dict(done)}; RSS warm {rss['warm']} KiB, end {rss['end']} KiB; "
              f"fds {fds_before} -> {fds_after}")
        assert done["sessions"] >= CLIENTS and done["transfer"] > 0 and done["expect"] > 0
        assert rss["end"] < 1.10 * rss["warm"], rss
        assert fds_after <= fds_before + 2, (fds_before, fds_after)
        events = collections.Counter(json.loads(line)["event"] for line in d.log().splitlines() if line.startswith("{"))
        assert events["session.crashed"] == 0 and events["session.internal_error"] == 0
        assert events["transfer.internal_error"] == 0
        assert events["session.opened"] == events["session.closed"] == done["sessions"] + 1
    finally:
        d.stop()
        shutil.rmtree(workdir, ignore_errors=True)
