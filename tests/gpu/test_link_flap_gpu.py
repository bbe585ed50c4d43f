"""Peer link flaps between two live daemons with GPU pools: NIXL's CUDA-aware UCX transports
leave no connection behind either (the peer's agent is kept loaded across a flap, see
tests/test_peer_link_flap.py for host pools), and every transfer after a flap is byte-exact,
on the direct path (equal layouts) and the bounce path (a regroup through GPU staging)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvd.demo.launch import DaemonProcess
from protocol.layout import KVLayout
from tests.test_peer_link_flap import TRANSFER, _established
from tests.transfer_harness import assert_exact, logged, pools_for, proxied_pair, run_transfer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GEO = {"num_layers": 6, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 32, "dtype": "bfloat16"}
CYCLES = 3


@pytest.mark.parametrize("path", ["direct", "bounce"])
async def test_gpu_link_flaps_leave_no_connections_behind(daemon_factory: Callable[..., DaemonProcess],
                                                          short_tmp: Path, path: str) -> None:
    ctx_layout = KVLayout(**GEO)  # type: ignore[arg-type]
    gen_layout = ctx_layout if path == "direct" else KVLayout(**GEO, tp_size=2)  # type: ignore[arg-type]
    gen_device = 1 if torch.cuda.device_count() > 1 else 0
    ctx_config = {"pools": pools_for("ctx", ctx_layout, 32, memory="auto", device=0), "transfer": TRANSFER}
    gen_config = {"pools": pools_for("gen", gen_layout, 32, memory="auto", device=gen_device), "transfer": TRANSFER}
    async with proxied_pair(daemon_factory, short_tmp, ctx_config, gen_config) as (pair, proxy):
        ctx, gen = pair.ctx, pair.gen
        counts = []
        for cycle in range(CYCLES + 1):
            if cycle:
                assert proxy.cut() == 1
                for d, peer in ((ctx, "gen"), (gen, "ctx")):
                    await logged(d, "peer.disconnected", cycle, node=peer)
                    await logged(d, "peer.connected", cycle + 1, node=peer, dialled_by="ctx")
            out = await run_transfer(pair, ctx_layout, gen_layout, request_id=f"gpu-flap-{cycle}", blocks=8)
            assert_exact(out, gen_layout)
            assert {c.path for c in out.gen.values()} == {path}
            counts.append((_established(ctx), _established(gen)))
    assert counts == [counts[0]] * (CYCLES + 1), f"established TCP connections (ctx, gen) per cycle: {counts}"
