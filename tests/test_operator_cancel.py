"""An operator's ``cancel(force=True)`` cancels the live request of that id, not an ended one.

A daemon may hold several requests of one id at once: ids are unique per pair of daemons, so
one id may name a request with each peer, and an ended request stays held until its executors
collect it (a ctx executor need not wait). The operator's cancel by id took the first one it
found: here the local request that ended and was never waited for, which a cancel no longer
changes. The cancel answered Ok and the live request to the other peer went on.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from clients import open_client
from kvd.demo.launch import DaemonProcess
from protocol.errors import TransferCancelled
from protocol.layout import KVLayout
from tests.conftest import host_pool
from tests.transfer_harness import write_secret

Factory = Callable[..., DaemonProcess]
ONE = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, tokens_per_block=32, dtype="bfloat16")
RID = "r-twice"


async def test_operator_cancel_reaches_the_live_request_of_the_id(daemon_factory: Factory, short_tmp: Path) -> None:
    with socket.socket() as down:  # bound, never listening: the peer 'far' refuses every dial
        down.bind(("127.0.0.1", 0))
        d = daemon_factory({"pools": [host_pool("ctx0"), host_pool("gen0")],
                            "peer_secret_file": write_secret(short_tmp),
                            "peers": [{"name": "far", "host": "127.0.0.1", "port": down.getsockname()[1]}]})
        await _cancel_by_operator(d)


async def test_operator_cancel_looks_past_its_own_ended_request_of_the_id(
        daemon_factory: Factory, short_tmp: Path) -> None:
    """The operator's session itself registered the ended request of the id (and never waited
    for it): its forced cancel still reaches the live one (it used to stop at its own)."""
    with socket.socket() as down:
        down.bind(("127.0.0.1", 0))
        d = daemon_factory({"pools": [host_pool("ctx0"), host_pool("gen0")],
                            "peer_secret_file": write_secret(short_tmp),
                            "peers": [{"name": "far", "host": "127.0.0.1", "port": down.getsockname()[1]}]})
        await _cancel_by_operator(d, by_local=True)


async def _cancel_by_operator(d: DaemonProcess, *, by_local: bool = False) -> None:
    async with open_client(d.socket_path, client="local") as a, open_client(d.socket_path, client="to-far") as b, \
            open_client(d.socket_path, client="operator") as op:
        # R between this daemon's own pools: done, and its executor never waits for it
        src, dst = await a.alloc("ctx0", 2), await a.alloc("gen0", 2)
        await a.expect(RID, "gen0", ONE, 0, dst)
        await a.publish(RID, "ctx0", ONE, 0, src, peer="kvd")
        with trio.fail_after(30):
            while not any(t.request_id == RID and t.state == "done" for t in await a.transfers()):
                await trio.sleep(0.005)  # polling the daemon's reply; the condition is the sync point
        # R to the peer 'far' (down): live until its deadline
        await b.publish(RID, "ctx0", ONE, 0, await b.alloc("ctx0", 2), peer="far", deadline_s=120)

        await (a if by_local else op).cancel(RID, force=True)  # same uid as the daemon: an operator
        with trio.fail_after(30), pytest.raises(TransferCancelled, match="operator"):
            await b.wait(RID)
        assert (await a.wait(RID)).ok  # the ended one is left as it ended
