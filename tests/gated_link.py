"""Two daemons whose peer link runs through a relay in the test process, each direction of
which the test can hold (bytes kept, in order) and let go: messages cross in the order a test
chooses, every time, with no timing window."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from clients.client import AsyncClient
from kvd.demo.launch import DaemonProcess
from protocol.errors import TransferCancelled
from protocol.layout import KVLayout
from tests.tcp_proxy import Proxy
from tests.transfer_harness import Pair, logged, pools_for, write_secret

Factory = Callable[..., DaemonProcess]
GEO: dict[str, Any] = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 16,
                       "dtype": "bfloat16"}
LAYOUT = KVLayout(**GEO)
BLOCKS = 8
TRANSFER: dict[str, Any] = {
    "bounce_size_mb": 4, "chunk_mb": 1, "deadline_s": 60.0, "mapped": False,
    "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 60.0,  # holding a direction is no fault
    "remember_ended_s": 0.0,
}


class GatedProxy(Proxy):
    """:class:`Proxy` whose two directions can each be held (bytes kept, in order) and let go."""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self._open = {"to_gen": trio.Event(), "to_ctx": trio.Event()}
        for gate in self._open.values():
            gate.set()

    def hold_dir(self, direction: str) -> None:
        """Keep what one daemon sends the other (``to_gen``: ctx's messages) until :meth:`let_go`."""
        self._open[direction] = trio.Event()

    def let_go(self, direction: str) -> None:
        self._open[direction].set()

    async def _relay(self, inbound: trio.SocketStream) -> None:  # the dialler (ctx) is ``inbound``
        with trio.CancelScope() as scope:
            self._live.add(scope)
            try:
                outbound = await trio.open_tcp_stream("127.0.0.1", self.target_port)
                async with inbound, outbound, trio.open_nursery() as n:
                    n.start_soon(self._gated, inbound, outbound, "to_gen", n.cancel_scope)
                    n.start_soon(self._gated, outbound, inbound, "to_ctx", n.cancel_scope)
            except OSError:
                pass
            finally:
                self._live.discard(scope)

    async def _gated(self, src: trio.SocketStream, dst: trio.SocketStream, direction: str,
                     done: trio.CancelScope) -> None:
        try:
            while data := await src.receive_some(65536):
                await self._open[direction].wait()
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        done.cancel()


@asynccontextmanager
async def gated_pair(factory: Factory, workdir: Path) -> AsyncIterator[tuple[Pair, GatedProxy]]:
    secret = write_secret(workdir)
    gen = factory({"pools": pools_for("gen", LAYOUT, 2 * BLOCKS), "transfer": TRANSFER,
                   "peer_secret_file": secret}, name="gen")
    proxy = GatedProxy(gen.peer_port)
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.serve)
        ctx = factory({"pools": pools_for("ctx", LAYOUT, 2 * BLOCKS), "transfer": TRANSFER,
                       "peer_secret_file": secret,
                       "peers": [{"name": "gen", "host": "127.0.0.1", "port": proxy.port}]}, name="ctx")
        for d, peer in ((ctx, "gen"), (gen, "ctx")):
            await logged(d, "peer.connected", 1, node=peer, dialled_by="ctx")
        yield Pair(ctx, gen), proxy
        nursery.cancel_scope.cancel()


async def until_idle(client: AsyncClient) -> None:
    """Until the daemon runs no transfer: an ended request is forgotten with it."""
    with trio.fail_after(30):
        while (await client.stats()).transfers_active:
            await trio.sleep(0.005)  # polling the daemon's reply; the condition is the sync point


async def until_active(client: AsyncClient) -> None:
    """Until the daemon runs a transfer (a peer's announce starts one before any rank registers)."""
    with trio.fail_after(30):
        while not (await client.stats()).transfers_active:
            await trio.sleep(0.005)  # polling the daemon's reply; the condition is the sync point


async def filled_blocks(c: AsyncClient, g: AsyncClient, fill: int) -> tuple[list[int], list[int]]:
    """:data:`BLOCKS` blocks on each side: ctx's filled with ``fill`` (int16 words), gen's as allocated."""
    ctx_pool = (await c.attach("ctx0")).tensor.view(torch.int16)
    ctx_ids = await c.alloc("ctx0", BLOCKS)
    ctx_pool[torch.tensor(ctx_ids)] = fill
    return ctx_ids, await g.alloc("gen0", BLOCKS)


async def cancel_across_data_done(proxy: GatedProxy, g: AsyncClient, rid: str) -> None:
    """With ctx's path and data-done messages held (``to_gen``): gen cancels ``rid`` and its
    notice is held in turn (``to_ctx``, left held); then ctx's messages go, so gen reports the
    request failed (no ctx write can land any more) and forgets it."""
    proxy.hold_dir("to_ctx")
    await g.cancel(rid)
    proxy.let_go("to_gen")
    with trio.fail_after(30), pytest.raises(TransferCancelled):
        await g.wait(rid)
    await until_idle(g)
