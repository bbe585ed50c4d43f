"""Launch recipes on a GPU (``kvd.transfer.paths.mapped.Recipe``): a mapped request of a shape
and pools launched before takes the recipe that launch left, byte-exact whatever its block ids;
a new shape plans afresh; pools mapped anew after a link flap never take a recipe of the closed
mappings (a stale one would write into unmapped memory or the old addresses)."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import torch

from clients.client import open_client
from kvd.demo.launch import DaemonProcess
from protocol.layout import KVLayout
from tests.test_peer_link_flap import TRANSFER
from tests.transfer_harness import assert_exact, logged, pools_for, proxied_pair, run_transfer, start_pair

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GEO = {"num_layers": 6, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 32, "dtype": "bfloat16"}
CTX = KVLayout(**GEO)  # type: ignore[arg-type]
GEN = KVLayout(**{**GEO, "tp_size": 4})  # type: ignore[arg-type]


def _gen_device() -> int:
    return 1 if torch.cuda.device_count() > 1 else 0


def _ctx_stages(d: DaemonProcess, prefix: str) -> dict[str, dict[str, Any]]:
    out = {}
    for line in d.log().splitlines():
        if '"transfer.done"' in line and f'"{prefix}' in line:
            rec = json.loads(line)
            if rec.get("role") in (None, "ctx"):
                out[rec["request_id"]] = rec["stages"]
    return out


async def _hold(stack: AsyncExitStack, socket_path: str, pool: str, count: int) -> None:
    """Keep ``count`` more blocks of ``pool`` allocated (by a session of their own), so the next
    request's blocks are other ids than the last one's."""
    c = await stack.enter_async_context(open_client(socket_path, client=f"hold-{pool}"))
    await c.attach(pool)
    await c.alloc(pool, count)


def _exact_mapped(out: Any) -> None:
    assert_exact(out, GEN)
    for c in [*out.ctx.values(), *out.gen.values()]:
        assert c.ok and c.path == "mapped", c


async def test_gpu_later_requests_of_a_shape_launch_from_its_recipe(
    daemon_factory: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    """Once a request of a shape was launched in the publish step (the very first one loads the
    kernel in a worker thread instead), later ones launch from its recipe: byte-exact with other
    block ids each time; a request of another size does not take it, but leaves its own."""
    pair = start_pair(daemon_factory, short_tmp, CTX, GEN, num_blocks=64, mapped=True, memory="auto",
                      ctx_device=0, gen_device=_gen_device())
    # (blocks, extra blocks held on every pool before it): the ids move as the held ones grow
    plan = [(4, 0), (4, 0), (4, 3), (4, 5), (8, 0), (8, 0), (8, 2), (4, 1)]
    async with AsyncExitStack() as stack:
        for i, (blocks, hold) in enumerate(plan):
            if hold:
                await _hold(stack, pair.ctx.socket_path, "ctx0", hold)
                for r in range(GEN.world_size):
                    await _hold(stack, pair.gen.socket_path, f"gen{r}", hold)
            out = await run_transfer(pair, CTX, GEN, request_id=f"recipe-{i}", blocks=blocks, seed=i, gen_peer="ctx")
            _exact_mapped(out)
    stages = _ctx_stages(pair.ctx, "recipe-")
    used = [i for i in range(len(plan)) if stages[f"recipe-{i}"].get("gpu_recipe") == 1]
    # 0: the kernel is loaded in a worker thread; 1: the general launch leaves the recipe; 4: a
    # new shape (8 blocks), launched the general way (the kernel is loaded by then)
    assert used == [2, 3, 5, 6, 7], {k: v.get("gpu_recipe") for k, v in stages.items()}


async def test_gpu_a_link_flap_retires_the_recipes_of_its_mappings(
    daemon_factory: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    """A link flap closes ctx's mappings of gen's pools and maps them anew: the next request
    launches the general way (the old recipe names closed mappings), then from a new recipe;
    every request byte-exact."""
    tcfg = {**TRANSFER, "mapped": True}
    ctx_config = {"pools": pools_for("ctx", CTX, 32, memory="auto", device=0), "transfer": tcfg}
    gen_config = {"pools": pools_for("gen", GEN, 32, memory="auto", device=_gen_device()), "transfer": tcfg}
    async with proxied_pair(daemon_factory, short_tmp, ctx_config, gen_config) as (pair, proxy):
        for cycle in range(2):
            if cycle:
                assert proxy.cut() == 1
                for d, peer in ((pair.ctx, "gen"), (pair.gen, "ctx")):
                    await logged(d, "peer.disconnected", cycle, node=peer)
                    await logged(d, "peer.connected", cycle + 1, node=peer, dialled_by="ctx")
                await logged(pair.ctx, "peer.pools_mapped", cycle + 1, node="gen")
            for i in range(4):
                out = await run_transfer(pair, CTX, GEN, request_id=f"flap{cycle}-{i}", blocks=4, seed=i,
                                         gen_peer="ctx")
                _exact_mapped(out)
    before, after = _ctx_stages(pair.ctx, "flap0-"), _ctx_stages(pair.ctx, "flap1-")
    assert [before[f"flap0-{i}"].get("gpu_recipe") for i in range(4)] == [None, None, 1, 1], before
    # after the flap: the kernel is loaded, so the first request launches inline the general way
    assert [after[f"flap1-{i}"].get("gpu_recipe") for i in range(4)] == [None, 1, 1, 1], after
