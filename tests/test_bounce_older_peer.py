"""A daemon and an older kvd peer: the bounce chunk layout is negotiated per request.

The older peer is played on the wire by the test (a raw peer-link connection with a real NIXL
agent and registered memory), speaking the transfer protocol as daemons did before gen named
its chunk layout (``XferAnnounce.chunking``) and ctx its chunk size (``XferPath.chunk_bytes``):

- a ctx daemon whose gen peer does not announce the layout writes per fragment instead of
  bouncing (``transfer.bounce_fallback``), byte-exact;
- a gen daemon whose ctx peer bounces without naming a chunk size fails the request with a
  clear error, and tells the peer.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import trio

from clients import open_client
from kvd.demo.launch import DaemonProcess
from kvd.regroup.plan import plan
from kvd.transport import NixlAgent, Region, ensure_loopback_ucx, poll_notifications
from protocol import transfer as x
from protocol.errors import KvdError
from protocol.layout import KVLayout
from protocol.peer import PeerWelcome, RegionDesc, encode_peer, register_peer_messages
from tests.conftest import host_pool
from tests.hostile import RawPeer, events
from tests.transfer_harness import wait_for_peer, write_secret

Factory = Callable[..., DaemonProcess]
GEO = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 32, "dtype": "bfloat16"}
BLOCKS = 8  # pool blocks per rank
CTX = KVLayout(**GEO, num_blocks=BLOCKS)  # type: ignore[arg-type]
GEN = KVLayout(**GEO, tp_size=2, num_blocks=BLOCKS)  # type: ignore[arg-type]
SLOT = 1 << 20

register_peer_messages(*x.XFER_MESSAGES)


class OlderPeer:
    """The older daemon: a raw, authenticated peer link, a NIXL agent, pools and a receive region."""

    def __init__(self, daemon: DaemonProcess, secret: bytes, node: str, layout: KVLayout) -> None:
        ensure_loopback_ucx()
        self.node = node
        self.agent = NixlAgent(f"{node}-agent")
        self.pools = {r: np.zeros(layout.pool_bytes(r), dtype=np.uint8) for r in range(layout.world_size)}
        self.recv = np.zeros(4 * SLOT, dtype=np.uint8)
        self.agent.register([Region(a.ctypes.data, a.nbytes) for a in [*self.pools.values(), self.recv]])
        self.link = RawPeer(daemon.peer_port)
        self.link.authenticate(secret, node=node)
        self.link.send(encode_peer(PeerWelcome(
            node=node, software="kvd older", nixl_agent=self.agent.name, nixl_metadata=self.agent.metadata(),
            bounce=[RegionDesc(name="recv", addr=self.recv.ctypes.data, nbytes=self.recv.nbytes, slot_bytes=SLOT,
                               slots=4)],
        )))

    def send(self, msg: x.XferMessage) -> None:
        self.link.send(encode_peer(msg))

    async def until(self, kind: type[x.XferMessage]) -> x.XferMessage:
        """The next transfer message of ``kind`` (heartbeats and others are skipped)."""
        while True:
            msg = await trio.to_thread.run_sync(self.link.receive)
            assert msg is not None, "the daemon closed the link"
            if isinstance(msg, kind):
                return msg

    def close(self) -> None:
        self.link.close()
        self.agent.close()


def _regions(peer: OlderPeer) -> dict[int, x.RemoteRegion]:
    return {r: x.RemoteRegion(addr=a.ctypes.data, nbytes=a.nbytes, device=-1) for r, a in peer.pools.items()}


def ctx_with_played_gen(factory: Factory, tmp: Path, node: str) -> tuple[DaemonProcess, OlderPeer]:
    """A ctx daemon (one host pool, NIXL paths only) and a gen peer ``node`` played on the wire."""
    secret = write_secret(tmp)
    d = factory({"pools": [host_pool("ctx0", num_blocks=BLOCKS)], "peer_secret_file": secret,
                 "transfer": {"bounce_size_mb": 4, "chunk_mb": 1, "mapped": False,
                              "heartbeat_timeout_s": 600.0}}, name="ctx")
    return d, OlderPeer(d, Path(secret).read_bytes(), node, GEN)


async def test_ctx_writes_per_fragment_to_a_gen_that_names_no_chunk_layout(
        daemon_factory: Factory, short_tmp: Path) -> None:
    d, gen = ctx_with_played_gen(daemon_factory, short_tmp, "oldgen")
    try:
        gen_ids = {0: [5, 1, 6, 2], 1: [3, 7, 0, 4]}
        async with open_client(d.socket_path) as c, trio.open_nursery() as nursery:
            nursery.start_soon(partial(poll_notifications, gen.agent, lambda _a, _m: None, hot=lambda: True))
            await wait_for_peer(c)
            # announced as an older gen does: no chunking
            gen.send(x.XferAnnounce(request_id="r-old", layout=GEN, blocks=gen_ids, pools=_regions(gen),
                                    pool_names={0: "g0", 1: "g1"}, slots=[0, 1], deadline_s=60.0))
            pool = await c.attach("ctx0")
            ids = await c.alloc("ctx0", 4)
            noise = torch.randint(-(2**15), 2**15, pool.tensor.shape, dtype=torch.int16)
            pool.tensor.view(torch.int16).copy_(noise)
            await c.publish("r-old", "ctx0", CTX, 0, ids, peer="oldgen", deadline_s=60.0)
            path = await gen.until(x.XferPath)
            assert isinstance(path, x.XferPath) and path.path == "fragment" and path.chunk_bytes == 0
            with trio.fail_after(30):
                done = await c.wait("r-old")
            assert done.ok and done.path == "fragment", done
            assert isinstance(await gen.until(x.XferDone), x.XferDone)
            ctx_copy = pool.raw.to("cpu", copy=True)
            nursery.cancel_scope.cancel()
        p = plan(CTX, GEN, {0: ids}, gen_ids)
        expected = {r: torch.zeros(a.nbytes, dtype=torch.uint8) for r, a in gen.pools.items()}
        p.apply({0: ctx_copy}, expected)
        for r, a in gen.pools.items():
            assert torch.equal(torch.from_numpy(a), expected[r]), f"gen rank {r} differs"
        (fallback,) = events(d, "transfer.bounce_fallback")
        assert "older kvd" in fallback["reason"] and fallback["peer"] == "oldgen"
    finally:
        gen.close()


async def test_gen_refuses_a_ctx_that_bounces_without_a_chunk_size(daemon_factory: Factory, short_tmp: Path) -> None:
    secret = write_secret(short_tmp)
    d = gen_daemon(daemon_factory, secret)
    ctx = OlderPeer(d, Path(secret).read_bytes(), "oldctx", CTX)
    try:
        async with open_client(d.socket_path) as g0, open_client(d.socket_path) as g1:
            await wait_for_peer(g0)
            for r, g in enumerate((g0, g1)):
                ids = await g.alloc(f"gen{r}", 4)
                await g.expect("r-old", f"gen{r}", GEN, r, ids, deadline_s=60.0)
            ctx.send(x.XferOffer(request_id="r-old", layout=CTX, blocks={0: [0, 1, 2, 3]}, deadline_s=60.0))
            accept = await ctx.until(x.XferAccept)
            assert isinstance(accept, x.XferAccept) and accept.chunking == x.CHUNKING_RANGES
            ctx.send(x.XferPath(request_id="r-old", path="bounce"))  # as older daemons: no chunk size
            fail = await ctx.until(x.XferFail)
            assert isinstance(fail, x.XferFail) and "chunk size" in fail.message
            # gen reports once no write of ours can land: say so, as a failing ctx does
            ctx.send(x.XferFail(request_id="r-old", code=fail.code, message="stopped", sender="ctx"))
            for g in (g0, g1):
                with trio.fail_after(30), pytest.raises(KvdError, match="chunk size"):
                    await g.wait("r-old")
            st = await g0.stats()
            assert st.bounce_chunks_in_use == 0
    finally:
        ctx.close()


def gen_daemon(daemon_factory: Factory, secret: str, **config: object) -> DaemonProcess:
    """A gen daemon of two TP ranks (pools gen0, gen1) with the bounce path on, for a raw peer
    to talk to; ``config``: more top-level configuration (``limits=...``)."""
    return daemon_factory({"pools": [host_pool("gen0", tp_size=2, rank=0, num_blocks=BLOCKS),
                                     host_pool("gen1", tp_size=2, rank=1, num_blocks=BLOCKS)],
                           "peer_secret_file": secret,
                           "transfer": {"bounce_size_mb": 4, "chunk_mb": 1, "mapped": False,
                                        "heartbeat_timeout_s": 600.0}, **config}, name="gen")


def test_older_messages_decode_with_the_new_fields_defaulted() -> None:
    old_path = msgspec.msgpack.encode({"type": "xfer_path", "request_id": "r", "path": "bounce"})
    dec = msgspec.msgpack.Decoder(x.XferPath)
    assert dec.decode(old_path) == x.XferPath(request_id="r", path="bounce", chunk_bytes=0, credits="")
