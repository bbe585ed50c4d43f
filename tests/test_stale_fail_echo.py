"""ctx's answer to an old request's failure notice does not fail a new request of the same id.

gen cancels request R just as ctx's data is out: gen's failure notice (``XferFail``) and ctx's
data-done message (``XferDone``) cross on the link. gen reports R failed on the data-done
message (no ctx write can land any more); its executor, told so, registers R again: the id
was forgotten with the outcome, so it names a new request. ctx, which had ended and forgotten
R, answers the old notice that none of its writes can land (``XferFail`` from ctx,
``not_found``, ``writes_stopped``): an answer to gen's notice about the old request.

Before the fix gen took that answer for the new request: it failed R at once, told its
executor so (with the old request's "no request here") and told ctx nothing, since ctx's
side read as failed. ctx then published R against the new request's announced destination
and wrote every block into gen's pool: into blocks gen had handed back as failed, which
another session had taken meanwhile, and ctx reported the request done.

The link runs through a relay in this process whose two directions the test holds and lets go,
so the crossing happens in this order every time (no timing window).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from clients import open_client
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
RID = "r-echo"
CTX_FILL = 0x5A5A
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


async def _until_idle(client: AsyncClient) -> None:
    """Until the daemon runs no transfer: an ended request is forgotten with it."""
    with trio.fail_after(30):
        while (await client.stats()).transfers_active:
            await trio.sleep(0.005)  # polling the daemon's reply; the condition is the sync point


async def _until_active(client: AsyncClient) -> None:
    """Until the daemon runs a transfer (a peer's announce starts one before any rank registers)."""
    with trio.fail_after(30):
        while not (await client.stats()).transfers_active:
            await trio.sleep(0.005)  # polling the daemon's reply; the condition is the sync point


async def test_an_answer_to_an_old_failure_notice_does_not_fail_a_new_request(daemon_factory: Factory,
                                                                            short_tmp: Path) -> None:
    async with gated_pair(daemon_factory, short_tmp) as (pair, proxy), \
            open_client(pair.gen.socket_path, client="gen-exec") as g, \
            open_client(pair.ctx.socket_path, client="ctx-exec") as c:
        ctx_pool = (await c.attach("ctx0")).tensor.view(torch.int16)
        ctx_ids = await c.alloc("ctx0", BLOCKS)
        ctx_pool[torch.tensor(ctx_ids)] = CTX_FILL
        gen_ids = await g.alloc("gen0", BLOCKS)

        # R: ctx's data goes out (NIXL), its path and data-done messages are held
        proxy.hold_dir("to_gen")
        await g.expect(RID, "gen0", LAYOUT, 0, gen_ids, peer="ctx")
        await c.publish(RID, "ctx0", LAYOUT, 0, ctx_ids, peer="gen")
        assert (await c.wait(RID)).ok
        await _until_idle(c)  # ctx ended R and forgot it

        # gen cancels R before ctx's data-done message reached it; its notice is held
        proxy.hold_dir("to_ctx")
        await g.cancel(RID)
        proxy.let_go("to_gen")  # path and data-done: no ctx write can land, gen reports
        with trio.fail_after(30), pytest.raises(TransferCancelled):
            await g.wait(RID)
        await _until_idle(g)

        # the executor registers R again (a new request: the old one is forgotten); then ctx
        # reads gen's notice about the old R, answers it, and reads the new announce
        await g.expect(RID, "gen0", LAYOUT, 0, gen_ids, peer="ctx")
        gen_pool = (await g.attach("gen0")).tensor.view(torch.int16)
        gen_pool[torch.tensor(gen_ids)] = 0  # what the new request must overwrite
        proxy.let_go("to_ctx")
        # ctx read the old notice (and answered it) before the new announce, which starts a
        # transfer there; its answer reaches gen before anything ctx sends about the new
        # request (one link, in order). Before the fix gen failed the new request on it, told
        # its executor so ("no request 'r-echo' here"), and ctx went on to write every block
        await _until_active(c)
        await c.publish(RID, "ctx0", LAYOUT, 0, ctx_ids, peer="gen")
        with trio.fail_after(30):
            assert (await c.wait(RID)).ok
            assert (await g.wait(RID)).ok
        assert bool((gen_pool[torch.tensor(gen_ids)] == CTX_FILL).all())
        await g.ping()  # the step that replied has ended: its transfer.done line is out

    # one line per request and side: the old request failed, the new one done
    (failed,) = await logged(pair.gen, "transfer.failed", 1, request_id=RID)
    assert failed["code"] == TransferCancelled.code
    (done,) = await logged(pair.gen, "transfer.done", 1, request_id=RID)
    assert done["role"] == "gen"
