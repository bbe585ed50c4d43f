"""The NVRTC regroup kernel on real GPUs, byte for byte against the planner's reference.

Every layout kind of tests/test_regroup_host.py (TP up/down, direct, both axis orders, mixed
tokens_per_block, attention DP, uneven PP, replicated heads, 1/2/4-byte elements, odd head
vectors, small NHD runs) through the kernel: pool -> pool, gather into staging and scatter out
of it with chunks that cut runs, narrow (unaligned) staging, tiles small enough to split runs
into segments and large enough to hold many runs; on one GPU and, where two exist, from cuda:0
into cuda:1 (the mapped path's push). Bytes outside the request keep their sentinel. Also the
fallback: with the kernel made unavailable, the same calls take the torch path, say so once, and
give the same bytes.

Skipped cleanly where ``torch.cuda.is_available()`` is False.
"""

from __future__ import annotations

from collections.abc import Iterator
from unittest.mock import patch

import numpy as np
import numpy.typing as npt
import pytest
import torch
from structlog.testing import capture_logs

from kvd.regroup import apply as rg
from kvd.regroup import kernel
from kvd.regroup.plan import KVLayout, Plan, plan
from kvd.regroup.table import chunk_ranges, pair_grid
from tests.layout_fields import Geometry
from tests.test_plan import SENTINEL
from tests.test_regroup_host import KINDS, build, check, sentinel_pools

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
TWO = pytest.mark.skipif(not TWO_GPUS, reason="needs 2 GPUs")
PLACES = ["cuda:0>cuda:0", pytest.param("cuda:0>cuda:1", marks=TWO)]
#: pool -> pool also pulled: launched on the destination GPU, loading from the source GPU
POOL_PLACES = [*PLACES, pytest.param("cuda:0>cuda:1>pull", marks=TWO)]


#: how a launch's table reaches the kernel: as its parameter (with kernel.PARAM_TABLES on: the
#: 4 KiB one up to kernel.SMALL_WORDS words, the 32 KiB one up to kernel.LARGE_WORDS) or
#: through device memory (every table, PARAM_TABLES off)
TABLE_PATHS = ["param", "device"]


def table_path(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    monkeypatch.setattr(kernel, "PARAM_TABLES", how == "param")


@pytest.fixture(autouse=True)
def kernel_cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    monkeypatch.setenv(kernel.ENV_CACHE, str(tmp_path_factory.getbasetemp() / "kvd-kernel-cache"))
    yield


def to_dev(pools: dict[int, np.ndarray], dev: str) -> dict[int, torch.Tensor]:
    return {r: torch.from_numpy(a.reshape(-1).copy()).to(dev) for r, a in pools.items()}


def back(pools: dict[int, torch.Tensor], p: Plan) -> dict[int, np.ndarray]:
    return {r: t.cpu().numpy().reshape(*p.gen.pool_shape(r), p.gen.itemsize) for r, t in pools.items()}


def test_kernel_compiles_and_loads_on_every_gpu() -> None:
    for dev in range(torch.cuda.device_count()):
        k = kernel.kernel_for(dev)
        assert k is not None, "regroup.kernel_unavailable on a CUDA machine"
        assert k.arch.startswith("sm_")


@pytest.mark.parametrize("how", TABLE_PATHS)
@pytest.mark.parametrize("place", POOL_PLACES)
@pytest.mark.parametrize("tile_bytes", [256, kernel.TILE_BYTES])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_kernel_pool_to_pool(kind: str, tile_bytes: int, place: str, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    table_path(monkeypatch, how)
    sdev, ddev, *pull = place.split(">")
    where: rg.LaunchOn = "dst" if pull else "src"
    p, src, want = build(kind, seed=2)
    src_t = to_dev(src, sdev)
    dst_t = to_dev(sentinel_pools(p), ddev)
    stream = torch.cuda.Stream(ddev if pull else sdev)  # type: ignore[no-untyped-call]
    for s in p.src_ranks():
        c = rg.regroup(p, s, src_t[s], dst_t, stream=stream, engine="kernel", tile_bytes=tile_bytes, launch_on=where)
        assert c.engine == "kernel" and c.nbytes == p.total_bytes(s=s)
        c.wait()
        assert c.done()
    check(back(dst_t, p), want, f"{kind} kernel {place} tile={tile_bytes}")
    for r, a in src.items():
        assert np.array_equal(src_t[r].cpu().numpy(), a.reshape(-1)), "source modified"


@pytest.mark.parametrize("how", TABLE_PATHS)
@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_kernel_gather_scatter_chunks(kind: str, place: str, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gather on the source GPU into staging on the destination GPU, scatter there; chunks cut
    runs; odd chunks and a staging pointer one byte off force narrow accesses."""
    table_path(monkeypatch, how)
    sdev, ddev = place.split(">")
    p, src, want = build(kind, seed=3)
    src_t = to_dev(src, sdev)
    run = min(g.run for g in (pair_grid(p, s, d) for s, d in p.pairs()) if g is not None)
    for chunk, skew in ((max(1, run * 3 // 2 + 1), 1), (4096, 0)):
        dst_t = to_dev(sentinel_pools(p), ddev)
        area = torch.full((chunk + 16,), 0x3C, dtype=torch.uint8, device=ddev)
        staging = area[skew : skew + chunk]
        for r in chunk_ranges(p, chunk):
            rg.gather_chunk(p, r.src, r.dst, src_t[r.src], staging, offset=r.offset, nbytes=r.nbytes,
                            engine="kernel", tile_bytes=512).wait()
            host = np.zeros(r.nbytes, dtype=np.uint8)
            rg.gather_chunk(p, r.src, r.dst, src[r.src], host, offset=r.offset, nbytes=r.nbytes, engine="host")
            assert np.array_equal(staging[: r.nbytes].cpu().numpy(), host), f"{kind} chunk {r}"
            rg.scatter_chunk(p, r.src, r.dst, staging, dst_t[r.dst], offset=r.offset, nbytes=r.nbytes,
                             engine="kernel").wait()
        assert (area[:skew] == 0x3C).all() and (area[skew + chunk :] == 0x3C).all(), "wrote outside staging"
        check(back(dst_t, p), want, f"{kind} gather/scatter {place} chunk={chunk}")


def test_kernel_orders_after_work_on_its_stream() -> None:
    """The launch is ordered after earlier work on the caller's stream (no host sync between)."""
    p, src, want = build("tp1_tp4", seed=4)
    stream = torch.cuda.Stream("cuda:0")  # type: ignore[no-untyped-call]
    src_t = {r: torch.zeros(a.size, dtype=torch.uint8, device="cuda:0") for r, a in src.items()}
    pinned = {r: torch.from_numpy(a.reshape(-1).copy()).pin_memory() for r, a in src.items()}
    dst_t = to_dev(sentinel_pools(p), "cuda:0")
    with torch.cuda.stream(stream):
        for r in src_t:
            src_t[r].copy_(pinned[r], non_blocking=True)
    c = rg.regroup(p, 0, src_t[0], dst_t, stream=stream)
    assert c.engine == "kernel"
    while not c.done():  # what the event loop does: poll, never block
        pass
    check(back(dst_t, p), want, "ordered on stream")


def test_gpt_oss_geometry_tp1_to_tp4() -> None:
    geo: Geometry = {"num_layers": 36, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 32, "dtype": "bfloat16"}
    ctx, gen = KVLayout(**geo, num_blocks=40), KVLayout(**geo, tp_size=4, num_blocks=40)
    rng = np.random.default_rng(5)
    p = plan(ctx, gen, {0: rng.permutation(40)[:24]}, {r: rng.permutation(40)[:24] for r in range(4)})
    dev = "cuda:1" if TWO_GPUS else "cuda:0"
    src = torch.randint(0, 256, (ctx.pool_bytes(0),), dtype=torch.uint8, device="cuda:0")
    got = {r: torch.full((gen.pool_bytes(r),), SENTINEL, dtype=torch.uint8, device=dev) for r in range(4)}
    ref = {r: t.clone() for r, t in got.items()}
    p.apply({0: src}, ref)  # the planner's own fragment copier
    rg.regroup(p, 0, src, got).wait()
    for r in got:
        assert torch.equal(got[r], ref[r]), r


def test_fallback_to_torch_when_the_kernel_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernel.ENV_ARCH, "sm_1")
    kernel.reset()
    try:
        p, src, want = build("vllm_tp2_to_trtllm_tp4", seed=6)
        src_t = to_dev(src, "cuda:0")
        dst_t = to_dev(sentinel_pools(p), "cuda:0")
        with capture_logs() as logs:
            assert not rg.kernel_available(0)
            for s in p.src_ranks():
                c = rg.regroup(p, s, src_t[s], dst_t)
                assert c.engine == "torch"
                c.wait()
        events = [e for e in logs if e["event"] == "regroup.kernel_unavailable"]
        assert len(events) == 1 and "sm_1" in str(events[0]["reason"])
        check(back(dst_t, p), want, "torch fallback")
        with pytest.raises(RuntimeError, match="unavailable"):
            rg.regroup(p, 0, src_t[0], dst_t, engine="kernel")
    finally:
        kernel.reset()


def test_engines_agree_on_narrow_elements() -> None:
    """uint8, 3-byte head vectors (1-byte accesses): kernel == torch == host."""
    p, src, want = build("uint8_odd_head_dim", seed=7)
    outs = {}
    for engine in ("kernel", "torch"):
        src_t = to_dev(src, "cuda:0")
        dst_t = to_dev(sentinel_pools(p), "cuda:0")
        for s in p.src_ranks():
            rg.regroup(p, s, src_t[s], dst_t, engine=engine).wait()
        outs[engine] = back(dst_t, p)
    check(outs["kernel"], want, "kernel")
    check(outs["torch"], want, "torch")


def test_launch_template_reused_across_requests_of_one_shape() -> None:
    """Requests of one layout pair and size reuse one launch template: each still lands its
    own blocks byte for byte, and a destination pool smaller than its layout is refused
    before anything is launched."""
    geo: Geometry = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 16, "dtype": "bfloat16"}
    ctx, gen = KVLayout(**geo, num_blocks=32), KVLayout(**geo, tp_size=4, num_blocks=32)
    src = torch.randint(0, 256, (ctx.pool_bytes(0),), dtype=torch.uint8, device="cuda:0")
    got = {r: torch.full((gen.pool_bytes(r),), SENTINEL, dtype=torch.uint8, device="cuda:0") for r in range(4)}
    rng = np.random.default_rng(11)
    rg._templates.clear()  # earlier tests may have filled the cache to its bound
    for _ in range(3):
        p = plan(ctx, gen, {0: rng.permutation(32)[:5]}, {r: rng.permutation(32)[:5] for r in range(4)})
        ref = {r: t.clone() for r, t in got.items()}
        p.apply({0: src}, ref)
        rg.regroup(p, 0, src, got).wait()
        for r in got:
            assert torch.equal(got[r], ref[r]), r
    assert len(rg._templates) == 1  # one template served the three requests
    small = {r: t[: t.numel() // 2] for r, t in got.items()}  # half the pool: block ids reach past it
    p = plan(ctx, gen, {0: np.arange(27, 32)}, {r: np.arange(27, 32) for r in range(4)})
    with pytest.raises(ValueError, match="outside"):
        rg.regroup(p, 0, src, small, engine="kernel")


def test_chunk_templates_serve_every_request_of_a_shape() -> None:
    """Bounce chunks of requests with one shape are gathered and scattered from cached launch
    templates: each request's bytes still arrive exactly, chunk cuts and all."""
    geo: Geometry = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 16, "dtype": "bfloat16"}
    ctx, gen = KVLayout(**geo, num_blocks=24), KVLayout(**geo, tp_size=2, num_blocks=24)
    src = torch.randint(0, 256, (ctx.pool_bytes(0),), dtype=torch.uint8, device="cuda:0")
    staging = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    rng = np.random.default_rng(13)
    for _ in range(3):
        p = plan(ctx, gen, {0: rng.permutation(24)[:6]}, {r: rng.permutation(24)[:6] for r in range(2)})
        got = {r: torch.full((gen.pool_bytes(r),), SENTINEL, dtype=torch.uint8, device="cuda:0") for r in range(2)}
        ref = {r: t.clone() for r, t in got.items()}
        p.apply({0: src}, ref)
        for c in chunk_ranges(p, 40_000):  # cuts runs
            rg.gather_chunk(p, c.src, c.dst, src, staging, offset=c.offset, nbytes=c.nbytes).wait()
            rg.scatter_chunk(p, c.src, c.dst, staging, got[c.dst], offset=c.offset, nbytes=c.nbytes).wait()
        for r in got:
            assert torch.equal(got[r], ref[r]), r


def _gpt_oss_launch(blocks: int) -> tuple[Plan, torch.Tensor, dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    geo: Geometry = {"num_layers": 36, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 32, "dtype": "bfloat16"}
    n = max(64, blocks)
    ctx, gen = KVLayout(**geo, num_blocks=n), KVLayout(**geo, tp_size=4, num_blocks=n)
    rng = np.random.default_rng(blocks)
    p = plan(ctx, gen, {0: rng.permutation(n)[:blocks]}, {r: rng.permutation(n)[:blocks] for r in range(4)})
    src = torch.randint(0, 256, (ctx.pool_bytes(0),), dtype=torch.uint8, device="cuda:0")
    got = {r: torch.full((gen.pool_bytes(r),), SENTINEL, dtype=torch.uint8, device="cuda:0") for r in range(4)}
    ref = {r: t.clone() for r, t in got.items()}
    p.apply({0: src}, ref)
    return p, src, got, ref


@pytest.mark.parametrize(("blocks", "path"), [(1, "small"), (60, "large"), (600, "device")])
def test_each_table_size_takes_its_parameter_or_device_memory(
    blocks: int, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With parameter tables on, a 1-block GPT-OSS-120B TP1 -> TP4 request's table fits the
    4 KiB kernel parameter, a 60-block one the 32 KiB one, a 600-block one neither (device
    memory): each lands byte for byte the way its size picks, and bytes outside stay."""
    monkeypatch.setattr(kernel, "PARAM_TABLES", True)
    p, src, got, ref = _gpt_oss_launch(blocks)
    rg._templates.clear()
    k = kernel.kernel_for(0)
    assert k is not None
    assert k.param_words() == kernel.LARGE_WORDS, "no 32 KiB parameter entry point on this GPU"
    seen: list[int] = []
    run = k.run

    def spy(table: npt.NDArray[np.int64], npairs: int, ntiles: int, stream: int, *,
            small: bool | None = None, event: object = None) -> kernel.DriverEvent:
        seen.append(table.size)
        return run(table, npairs, ntiles, stream, small=small, event=event)

    with patch.object(k, "run", spy):  # on exit the instance attribute is deleted: k.run is the method again
        rg.regroup(p, 0, src, got, engine="kernel").wait()
    assert len(seen) == 1 and k.table_path(seen[0]) == path, seen
    for r in got:
        assert torch.equal(got[r], ref[r]), r


def test_a_table_too_large_for_the_parameter_is_refused_when_forced() -> None:
    k = kernel.kernel_for(0)
    assert k is not None
    stream = torch.cuda.current_stream(0).cuda_stream
    with pytest.raises(kernel.KernelError, match="does not fit"):
        k.run(np.zeros(k.param_words() + 1, dtype=np.int64), 1, 1, stream, small=True)
    with pytest.raises(kernel.KernelError, match="contiguous int64"):
        k.run(np.zeros(8, dtype=np.int32), 1, 1, stream)


def test_a_driver_that_refuses_the_32_kib_parameter_falls_back_to_device_memory(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """A driver older than the compiler refuses a 32 KiB parameter at launch: nothing was
    enqueued, so the same launch goes through device memory, lands byte for byte, and later
    ones of that size go there at once; it is logged once. Provoked by making the launch of
    the large entry point fail as such a driver's would."""
    monkeypatch.setattr(kernel, "PARAM_TABLES", True)
    p, src, got, ref = _gpt_oss_launch(60)
    rg._templates.clear()
    k = kernel.kernel_for(0)
    assert k is not None and k.table_path(624) == "large"
    large = k._func_large
    real = k._enqueue_param

    def refusing(cu: object, table: npt.NDArray[np.int64], npairs: int, ntiles: int, hs: object, func: object,
                 buf: npt.NDArray[np.int64], ptrs_addr: int, event: object = None) -> kernel.DriverEvent:
        if func is large:
            raise kernel.KernelError("cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE")
        return real(cu, table, npairs, ntiles, hs, func, buf, ptrs_addr, event)

    monkeypatch.setattr(k, "_enqueue_param", refusing)
    try:
        with capture_logs() as logs:
            rg.regroup(p, 0, src, got, engine="kernel").wait()
            assert k.table_path(624) == "device"
            got2 = {r: torch.full_like(t, SENTINEL) for r, t in got.items()}
            rg.regroup(p, 0, src, got2, engine="kernel").wait()
    finally:
        k._func_large = large
    assert [e["event"] for e in logs].count("regroup.large_parameter_refused") == 1
    for r in got:
        assert torch.equal(got[r], ref[r]) and torch.equal(got2[r], ref[r]), r
