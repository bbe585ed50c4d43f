"""GPU transfers through the whole stack: daemons with CUDA pools (memory "auto": fabric probe,
device fallback), executors attached by CUDA IPC, NIXL/UCX between the daemons (and the
same-node mapped path), byte-exact for TP1->TP4, TP4->TP1, PP2->PP1 and equal layouts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvd.demo.launch import DaemonProcess
from protocol.layout import KVLayout
from tests.transfer_harness import assert_exact, run_transfer, start_pair

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GEO = {"num_layers": 6, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 32, "dtype": "bfloat16"}
CASES = {
    "tp1_to_tp4": ({}, {"tp_size": 4}),
    "tp4_to_tp1": ({"tp_size": 4}, {}),
    "pp2_to_pp1": ({"pp_size": 2}, {}),
    "equal_tp2": ({"tp_size": 2}, {"tp_size": 2}),
}


def _gen_device() -> int:
    return 1 if torch.cuda.device_count() > 1 else 0


@pytest.mark.parametrize("mapped", [False, True], ids=["nixl", "mapped"])
@pytest.mark.parametrize("case", sorted(CASES))
async def test_gpu_regrouped_transfer_is_byte_exact(
    case: str, mapped: bool, daemon_factory: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    c_kw, g_kw = CASES[case]
    ctx = KVLayout(**{**GEO, **c_kw})  # type: ignore[arg-type]
    gen = KVLayout(**{**GEO, **g_kw})  # type: ignore[arg-type]
    pair = start_pair(daemon_factory, short_tmp, ctx, gen, num_blocks=32, mapped=mapped, memory="auto",
                      ctx_device=0, gen_device=_gen_device(), transfer={"bounce_size_mb": 16, "chunk_mb": 4})
    out = await run_transfer(pair, ctx, gen, request_id=f"gpu-{case}", blocks=16)
    assert_exact(out, gen)
    want = "mapped" if mapped else ("direct" if case == "equal_tp2" else "bounce")
    for c in [*out.ctx.values(), *out.gen.values()]:
        assert c.ok and c.path == want, c
    # memory "auto" on an H200: the fabric probe fails and the pool falls back to device memory
    assert '"pool.fabric_unavailable"' in pair.ctx.log() or '"kind":"fabric"' in pair.ctx.log()


async def test_gpu_equal_layouts_in_long_runs_go_to_the_copy_engines(
    daemon_factory: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    """TP1 -> TP1 with consecutive blocks on both sides (GPT-OSS-120B blocks, 2.25 MiB each):
    the mapped path copies one 288 MiB run with the copy engines, byte-exact, bytes outside the
    request untouched (the harness's sentinels)."""
    import json

    layout = KVLayout(num_layers=36, num_kv_heads=8, head_dim=64, tokens_per_block=32, dtype="bfloat16")
    pair = start_pair(daemon_factory, short_tmp, layout, layout, num_blocks=160, mapped=True, memory="auto",
                      ctx_device=0, gen_device=_gen_device(), transfer={"bounce_size_mb": 16, "chunk_mb": 4})
    out = await run_transfer(pair, layout, layout, request_id="gpu-runs", blocks=128, gen_peer="ctx")
    assert_exact(out, layout)
    for c in [*out.ctx.values(), *out.gen.values()]:
        assert c.ok and c.path == "mapped", c
    done = [json.loads(line) for line in pair.ctx.log().splitlines()
            if '"transfer.done"' in line and '"gpu-runs"' in line]
    assert done and done[0]["stages"]["gpu_copy_runs"] == 1, done


@pytest.mark.parametrize("gen_on_other_gpu", [False, True], ids=["one_gpu", "two_gpus"])
async def test_gpu_local_path_runs_the_regroup_kernel(
    gen_on_other_gpu: bool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    """ctx TP1 and gen TP4 pools on one daemon (path ``local``): the regroup kernel moves the
    request (pushed on one GPU; pulled onto the gen GPU from device-memory sources when the
    gen pools sit on another GPU), byte-exact, and the bytes outside the request untouched."""
    import contextlib
    import json

    import numpy as np

    from clients import open_client
    from kvd.regroup.plan import plan
    from tests.transfer_harness import pools_for

    if gen_on_other_gpu and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    ctx, gen = KVLayout(**GEO), KVLayout(**{**GEO, "tp_size": 4})  # type: ignore[arg-type]
    gdev = 1 if gen_on_other_gpu else 0
    d = daemon_factory({"pools": pools_for("ctx", ctx, 32, memory="device", device=0)
                        + pools_for("gen", gen, 32, memory="device", device=gdev)})
    async with contextlib.AsyncExitStack() as stack:
        cc = await stack.enter_async_context(open_client(d.socket_path, client="ctx0"))
        gcs = [await stack.enter_async_context(open_client(d.socket_path, client=f"gen{r}")) for r in range(4)]
        cpool = await cc.attach("ctx0")
        gpools = [await gc.attach(f"gen{r}") for r, gc in enumerate(gcs)]
        # every block of each pool leased; the request takes 12 of them in random order
        c_ids = [int(i) for i in np.random.default_rng(1).permutation(await cc.alloc("ctx0", 32))[:12]]
        g_ids = {r: [int(i) for i in np.random.default_rng(2 + r).permutation(await gc.alloc(f"gen{r}", 32))[:12]]
                 for r, gc in enumerate(gcs)}
        cpool.raw.copy_(torch.randint(0, 256, cpool.raw.shape, dtype=torch.uint8, device=cpool.raw.device))
        for gp in gpools:
            gp.raw.fill_(0xEE)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(gdev)
        before = {r: gpools[r].raw.to("cpu", copy=True) for r in range(4)}
        for r, gc in enumerate(gcs):
            await gc.expect("r-local", f"gen{r}", gen, r, g_ids[r], peer="kvd")
        await cc.publish("r-local", "ctx0", ctx, 0, c_ids, peer="kvd")
        assert (await cc.wait("r-local")).path == "local"
        for gc in gcs:
            c = await gc.wait("r-local")
            assert c.ok and c.path == "local", c
        await cc.ping()  # the step that replied (and then logged transfer.done) has ended
        p = plan(KVLayout(**{**GEO, "num_blocks": 32}), KVLayout(**{**GEO, "tp_size": 4, "num_blocks": 32}),  # type: ignore[arg-type]
                 {0: c_ids}, g_ids)
        expected = {r: before[r].clone() for r in range(4)}
        p.apply({0: cpool.raw.to("cpu", copy=True)}, expected)
        for r in range(4):
            assert torch.equal(gpools[r].raw.to("cpu"), expected[r]), f"gen rank {r}"
    done = [json.loads(line) for line in d.log().splitlines() if '"transfer.done"' in line and '"ctx"' in line]
    assert done and done[-1]["stages"].get("gpu_kernel_launches", 0) >= 1, done
    assert done[-1]["stages"].get("gpu_kernel_pull", 0) == int(gen_on_other_gpu)


@pytest.mark.parametrize("announce", [True, False], ids=["announced", "offer_accept"])
async def test_gpu_mapped_request_launches_in_the_completing_step(
    announce: bool, daemon_factory: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    """The ctx daemon launches the regroup kernel in the step that completes the request (the
    publish when gen named its ctx daemon and announced its destination; the peer's accept
    with offer/accept) and a task only waits for it (``gpu_launch_inline`` in the stages);
    byte-exact either way, with 0 and 1 peer round trips."""
    import json

    ctx, gen = KVLayout(**GEO), KVLayout(**{**GEO, "tp_size": 4})  # type: ignore[arg-type]
    pair = start_pair(daemon_factory, short_tmp, ctx, gen, num_blocks=32, mapped=True, memory="auto",
                      ctx_device=0, gen_device=_gen_device())
    for i in range(2):  # the first request loads the kernel (in a worker thread): the second is the case
        out = await run_transfer(pair, ctx, gen, request_id=f"r-inline-{i}", blocks=12, seed=i,
                                 gen_peer="ctx" if announce else "")
        assert_exact(out, gen)
        assert all(c.ok and c.path == "mapped" for c in [*out.ctx.values(), *out.gen.values()])
    done = [json.loads(line) for line in pair.ctx.log().splitlines()
            if '"transfer.done"' in line and '"r-inline-1"' in line]
    assert len(done) == 1, done
    assert done[0]["stages"].get("gpu_launch_inline") == 1, done[0]
    assert done[0]["round_trips"] == (0 if announce else 1), done[0]
    assert done[0]["stages"]["gpu_kernel_launches"] == 1


def test_kernel_done_now_reports_a_launch_only_once_it_completed() -> None:
    """The publish step reports a small request's kernel itself when it has already finished
    (``movers.kernel_done_now``): never before the kernel's bytes landed. The launch queues
    behind ~0.5 s of matrix products, so the first look must say "not yet" and record nothing;
    after the stream drains it says done, records the GPU figures, and the bytes are exact."""
    from kvd.regroup.kernel import kernel_available
    from kvd.transfer.movers import kernel_done_now, launch_kernel
    from tests.bounce_harness import plan_of

    ctx, gen = KVLayout(**GEO), KVLayout(**{**GEO, "tp_size": 4})  # type: ignore[arg-type]
    p = plan_of(ctx, gen, 16)
    src = {0: torch.randint(0, 256, (p.ctx.pool_bytes(0),), dtype=torch.uint8, device="cuda:0")}
    dst = {r: torch.zeros(p.gen.pool_bytes(r), dtype=torch.uint8, device="cuda:0") for r in range(4)}
    assert kernel_available(0)  # loaded first: loading a module waits for an idle device
    stream = torch.cuda.Stream(0)  # type: ignore[no-untyped-call]
    busy = torch.randn(8192, 8192, device="cuda:0")
    torch.cuda.synchronize()
    timings: dict[str, float] = {}
    with torch.cuda.stream(stream):
        for _ in range(40):
            busy = busy @ busy.T / 8192
        launched = launch_kernel(p, src, dst, launch_on="src")  # on the current stream: behind them
    assert not kernel_done_now(launched, timings)
    assert timings == {}
    stream.synchronize()
    assert kernel_done_now(launched, timings)
    assert timings["gpu_kernel_launches"] == 1 and timings["gpu_wait_s"] > 0
    want = {r: torch.zeros(p.gen.pool_bytes(r), dtype=torch.uint8) for r in range(4)}
    p.apply({0: src[0].cpu()}, want)
    for r in range(4):
        assert torch.equal(dst[r].cpu(), want[r]), r
