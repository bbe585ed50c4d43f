"""The NIXL bounce path on GPUs: gathers and scatters by the regroup kernel, completion polled
from the event loop, credits by NIXL notification (or XferGrant), between two real daemons
with CUDA pools (gen on the second GPU where there is one). Byte for byte over the whole gen
pools (bytes outside the request keep their sentinel), with receive slots reused and chunks
that cut runs. And: a cancelled wait for a launched gather still waits for the kernel.

Skipped cleanly where ``torch.cuda.is_available()`` is False.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import trio

from kvd.demo.launch import DaemonProcess
from protocol.layout import VLLM_AXIS_ORDER, KVLayout
from tests.layout_fields import Geometry, LayoutFields
from tests.transfer_harness import assert_exact, run_transfer, start_pair

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MiB = 1 << 20
#: a block is 6 x 2 x 8 x 32 x 128 x 2 B = 768 KiB
GEO: Geometry = {"num_layers": 6, "num_kv_heads": 8, "head_dim": 128, "tokens_per_block": 32, "dtype": "bfloat16"}
CASES: dict[str, tuple[LayoutFields, LayoutFields]] = {
    "tp1_to_tp4": ({}, {"tp_size": 4}),
    "vllm_tp2_to_tp4": ({"tp_size": 2, "axis_order": VLLM_AXIS_ORDER}, {"tp_size": 4}),
    "tpb32_to_tpb16_tp2": ({}, {"tokens_per_block": 16, "tp_size": 2}),
    "pp2_to_pp1": ({"pp_size": 2}, {}),
}


def _gen_device() -> int:
    return 1 if torch.cuda.device_count() > 1 else 0


def _done(d: DaemonProcess, rid: str) -> dict[str, object]:
    lines: list[dict[str, object]] = [json.loads(line) for line in d.log().splitlines() if '"transfer.done"' in line]
    (done,) = [e for e in lines if e["request_id"] == rid]
    return done


@pytest.mark.parametrize("notifs", [True, False], ids=["credit_notif", "xfer_grant"])
@pytest.mark.parametrize("case", sorted(CASES))
async def test_gpu_bounce_is_byte_exact(case: str, notifs: bool, daemon_factory: Callable[..., DaemonProcess],
                                        short_tmp: Path) -> None:
    c_kw, g_kw = CASES[case]
    ctx_kw: LayoutFields = {**GEO, **c_kw}
    gen_kw: LayoutFields = {**GEO, **g_kw}
    ctx, gen = KVLayout(**ctx_kw), KVLayout(**gen_kw)
    # 32 blocks = 24 MiB through 4 receive slots of 4 MiB: slots are reused, chunks cut runs
    pair = start_pair(daemon_factory, short_tmp, ctx, gen, num_blocks=64, memory="auto", ctx_device=0,
                      gen_device=_gen_device(),
                      transfer={"bounce_size_mb": 16, "chunk_mb": 4, "credit_notifs": notifs})
    rid = f"gpu-bounce-{case}-{notifs}"
    out = await run_transfer(pair, ctx, gen, request_id=rid, blocks=32, gen_peer="ctx")
    assert_exact(out, gen)
    for c in [*out.ctx.values(), *out.gen.values()]:
        assert c.ok and c.path == "bounce", c
    done = _done(pair.ctx, rid)
    stages = done["stages"]
    assert isinstance(stages, dict) and 0 < stages["bounce_chunk_bytes"] <= 4 * MiB
    assert isinstance(done["chunks"], int) and done["chunks"] > 4  # more chunks than slots
    assert stages.get("credits_notif" if notifs else "credits_link", 0) > 0
    for d in (pair.ctx, pair.gen):  # gathers and scatters ran on the regroup kernel
        assert '"regroup.kernel_unavailable"' not in d.log()


async def test_gpu_bounce_reposts_write_handles_across_requests(daemon_factory: Callable[..., DaemonProcess],
                                                                 short_tmp: Path) -> None:
    # GPU staging: every request's writes repost the handles the earlier ones made (one per
    # send slot, receive slot and length); each request's bytes land exact all the same
    ctx, gen = KVLayout(**GEO), KVLayout(**GEO, tp_size=4)
    pair = start_pair(daemon_factory, short_tmp, ctx, gen, num_blocks=64, memory="auto", ctx_device=0,
                      gen_device=_gen_device(), transfer={"bounce_size_mb": 16, "chunk_mb": 4})
    for i in range(3):
        rid = f"gpu-bounce-repost-{i}"
        out = await run_transfer(pair, ctx, gen, request_id=rid, blocks=32, seed=i, gen_peer="ctx")
        assert_exact(out, gen)
        assert all(c.ok and c.path == "bounce" for c in [*out.ctx.values(), *out.gen.values()])
        done = _done(pair.ctx, rid)
        assert isinstance(done["chunks"], int) and done["chunks"] > 4  # more chunks than slots


async def test_cancelled_wait_for_a_launched_gather_waits_for_the_kernel() -> None:
    from kvd.regroup import apply as rg
    from kvd.transfer.paths import bounce
    from tests.bounce_harness import plan_of

    # 64 layers x 2 x 8 x 32 x 128 x 2 B = 8 MiB a block, 2 MiB per gen rank of 4; 128 blocks
    big: Geometry = {**GEO, "num_layers": 64}
    ctx, gen = KVLayout(**big), KVLayout(**big, tp_size=4)
    p = plan_of(ctx, gen, 128)
    nbytes = p.total_bytes(0, 0)
    assert nbytes == 256 * MiB
    src = torch.randint(0, 256, (KVLayout(**big, num_blocks=128).pool_bytes(0),), dtype=torch.uint8,
                        device="cuda:0")
    staging = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    from kvd.regroup.kernel import kernel_available

    # load the kernel first: loading a module waits for the device to be idle, which would let
    # the work queued below finish before the gather is even launched
    assert kernel_available(0)
    stream = torch.cuda.Stream(0)  # type: ignore[no-untyped-call]
    busy = torch.randn(8192, 8192, device="cuda:0")
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        # the gather queues behind ~0.5 s of matrix products: it is still running when the wait
        # starts (a 256 MiB gather alone finishes in ~0.15 ms, before the first poll on a slow
        # host; torch.cuda._sleep did not hold the stream on one H200 machine)
        for _ in range(40):
            busy = busy @ busy.T / 8192
    c = rg.gather_chunk(p, 0, 0, src, staging, offset=0, nbytes=nbytes, stream=stream, engine="kernel")
    assert not c.done(), "the gather was meant to wait behind the matrix products"
    with trio.CancelScope() as scope:
        scope.cancel()
        await bounce.await_completion(c)
    assert scope.cancelled_caught
    assert c.done()  # returned only once the kernel had finished
    want = torch.zeros(nbytes, dtype=torch.uint8)
    rg.gather_chunk(p, 0, 0, src.cpu(), want, offset=0, nbytes=nbytes, engine="host")
    assert torch.equal(staging.cpu(), want)
