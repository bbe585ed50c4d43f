"""Blocks registered for an unfinished request cannot be freed (a later lease holder's data
would otherwise be overwritten by the transfer); after cancel they can."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from clients import open_client
from kvd.demo.launch import DaemonProcess
from protocol.errors import BlocksInUse, TransferCancelled
from protocol.layout import KVLayout
from tests.conftest import host_pool


async def test_free_of_blocks_in_flight_is_refused(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory({"pools": [host_pool("g0", tp_size=2, rank=0), host_pool("g1", tp_size=2, rank=1)]})
    layout = KVLayout(4, 8, 64, 32, "bfloat16", tp_size=2)
    async with open_client(d.socket_path) as c:
        ids = await c.alloc("g0", 4)
        spare = await c.alloc("g0", 2)
        await c.expect("r1", "g0", layout, 0, ids, deadline_s=30)
        before = await c.pools()
        with pytest.raises(BlocksInUse, match="request 'r1'"):
            await c.free("g0", [ids[0], spare[0]])
        assert await c.pools() == before  # all or nothing: the spare block is still leased
        assert await c.free("g0", spare) == 2
        await c.cancel("r1")
        with pytest.raises(TransferCancelled):
            await c.wait("r1")
        assert await c.free("g0", ids) == 4


async def test_side_with_a_missing_rank_fails_at_its_deadline(daemon_factory: Callable[..., DaemonProcess]) -> None:
    """TP2 gen, only rank 0 registers: its executor gets TransferTimeout naming rank 1."""
    from protocol.errors import TransferTimeout

    d = daemon_factory({"pools": [host_pool("g0", tp_size=2, rank=0), host_pool("g1", tp_size=2, rank=1)]})
    layout = KVLayout(4, 8, 64, 32, "bfloat16", tp_size=2)
    async with open_client(d.socket_path) as c:
        ids = await c.alloc("g0", 2)
        await c.expect("r-missing", "g0", layout, 0, ids, deadline_s=0.5)
        with pytest.raises(TransferTimeout, match=r"ranks \[1\] never registered"):
            await c.wait("r-missing", timeout_s=10)
        assert await c.free("g0", ids) == 2  # nothing in flight any more
