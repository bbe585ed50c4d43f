"""kvd.regroup.gpu_copy on real GPUs: the copy-engine regroup equals Plan.apply byte for byte.

Small GPT-OSS-like geometry (8 KV heads, head_dim 64, bf16, 16 tokens a block, a few layers),
random block ids; TP1 -> TP4, TP4 -> TP1, PP2 -> PP1, equal layouts, vLLM order, mixed
tokens_per_block and replicated heads; every submission method the driver offers; through a
bounce buffer (gather_2d + scatter_2d, chunks small enough to cut blocks) and direct
(apply_pair_2d); on one GPU and, where two exist, from cuda:0 to cuda:1.

Skipped cleanly where ``torch.cuda.is_available()`` is False.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvd.regroup import gpu_copy as gc
from kvd.regroup.plan import KVLayout, Plan, plan
from kvd.regroup.stager import schedule
from protocol.errors import TransferError
from protocol.layout import VLLM_AXIS_ORDER

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
CASES = ["tp1_tp4", "tp4_tp1", "pp2_pp1", "equal", "vllm_tp2_tp4", "tpb_mix", "tp16_tp2"]
SENTINEL = 0xA5


def layouts(case: str, layers: int, nblk: int) -> tuple[KVLayout, KVLayout]:
    g: dict[str, Any] = {
        "num_layers": layers,
        "num_kv_heads": 8,
        "head_dim": 64,
        "tokens_per_block": 16,
        "dtype": "bfloat16",
        "num_blocks": nblk,
    }
    if case == "tp1_tp4":
        return KVLayout(**g), KVLayout(**g, tp_size=4)
    if case == "tp4_tp1":
        return KVLayout(**g, tp_size=4), KVLayout(**g)
    if case == "pp2_pp1":
        return KVLayout(**g, pp_size=2), KVLayout(**g)
    if case == "equal":
        return KVLayout(**g, tp_size=2), KVLayout(**g, tp_size=2)
    if case == "vllm_tp2_tp4":
        return KVLayout(**g, tp_size=2, axis_order=VLLM_AXIS_ORDER), KVLayout(**g, tp_size=4)
    if case == "tpb_mix":
        return KVLayout(**g), KVLayout(**dict(g, tokens_per_block=32), tp_size=2)
    if case == "tp16_tp2":
        return KVLayout(**g, tp_size=16), KVLayout(**g, tp_size=2)
    raise AssertionError(case)


def make_plan(case: str, seed: int) -> Plan:
    rng = np.random.default_rng(seed)
    layers = int(rng.choice([2, 4, 6]))
    nblk = 16
    ctx, gen = layouts(case, layers, nblk)
    n_c = int(rng.integers(3, 8))
    n_g = -(-n_c * ctx.tokens_per_block // gen.tokens_per_block)
    cb = {r: rng.choice(nblk, n_c, replace=False) for r in range(ctx.world_size)}
    gb = {r: rng.choice(nblk, n_g, replace=False) for r in range(gen.world_size)}
    return plan(ctx, gen, cb, gb)


def src_pools(p: Plan, device: torch.device, seed: int) -> dict[int, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return {
        r: torch.randint(0, 256, (p.ctx.pool_bytes(r),), dtype=torch.uint8, generator=gen).to(device)
        for r in p.ctx_blocks
    }


def fresh(p: Plan, device: torch.device) -> dict[int, torch.Tensor]:
    return {
        r: torch.full((p.gen.pool_bytes(r),), SENTINEL, dtype=torch.uint8, device=device)
        for r in p.gen_blocks
    }


def sync_all() -> None:
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)


@pytest.fixture(scope="module")
def methods() -> list[str]:
    with gc.CopyStream(0):
        return gc.methods_available()


@pytest.fixture
def stream0() -> Iterator[gc.CopyStream]:
    with gc.CopyStream(0) as s:
        yield s


def run_and_compare(
    case: str,
    method: str,
    seed: int,
    stream: gc.CopyStream,
    src_dev: torch.device,
    dst_dev: torch.device,
    chunk_bytes: int = 65536,
) -> None:
    p = make_plan(case, seed)
    src = src_pools(p, src_dev, seed)
    want = fresh(p, dst_dev)
    p.apply(src, want)  # the torch path is the reference

    # Through a bounce buffer on the source device.
    sched = schedule(p, chunk_bytes=chunk_bytes, bounce_size_mb=1)
    bounce = torch.empty(sched.bounce_bytes, dtype=torch.uint8, device=src_dev)
    got = fresh(p, dst_dev)
    sync_all()  # torch's writes are on its own stream; ours does not wait for them
    for ch in sched.all_chunks():
        region = bounce.data_ptr() + ch.bounce_offset
        gc.gather_2d(ch, src[ch.src].data_ptr(), region, stream, method=method)
        gc.scatter_2d(ch, region, got[ch.dst].data_ptr(), stream, method=method)
    stream.synchronize()
    for r in want:
        assert torch.equal(got[r], want[r]), f"{case} {method}: bounce path, gen rank {r}"

    # Direct, pair by pair.
    got = fresh(p, dst_dev)
    sync_all()
    for s, d in p.pairs():
        gc.apply_pair_2d(p, s, d, src[s].data_ptr(), got[d].data_ptr(), stream, method=method)
    stream.synchronize()
    for r in want:
        assert torch.equal(got[r], want[r]), f"{case} {method}: direct, gen rank {r}"


@pytest.mark.parametrize("method", ["auto", *gc.METHODS])
@pytest.mark.parametrize("case", CASES)
def test_same_device_equals_plan_apply(
    case: str, method: str, methods: list[str], stream0: gc.CopyStream
) -> None:
    if method != "auto" and method not in methods:
        pytest.skip(f"{method} not offered by this driver")
    dev = torch.device("cuda", 0)
    for seed in (0, 1):
        run_and_compare(case, method, seed, stream0, dev, dev)


@pytest.mark.skipif(not TWO_GPUS, reason="needs 2 GPUs")
@pytest.mark.parametrize("method", ["auto", *gc.METHODS])
@pytest.mark.parametrize("case", ["tp1_tp4", "tp4_tp1", "pp2_pp1", "equal"])
def test_cross_device_equals_plan_apply(case: str, method: str, methods: list[str]) -> None:
    if method != "auto" and method not in methods:
        pytest.skip(f"{method} not offered by this driver")
    assert gc.enable_peer_access(0, 1) and gc.enable_peer_access(1, 0)
    src_dev, dst_dev = torch.device("cuda", 0), torch.device("cuda", 1)
    with gc.CopyStream(0) as push:  # the source GPU's copy engines write over the link
        run_and_compare(case, method, 2, push, src_dev, dst_dev)
    with gc.CopyStream(1) as pull:  # the destination GPU's copy engines read over the link
        run_and_compare(case, method, 3, pull, src_dev, dst_dev)
    with gc.CopyStream(0, lanes=4, threads=True) as lanes:
        run_and_compare(case, method, 4, lanes, src_dev, dst_dev)


@pytest.mark.parametrize("threads", [False, True])
@pytest.mark.parametrize("method", ["auto", "memcpy2d", "memcpy2d_raw", "batch1d"])
@pytest.mark.parametrize("case", ["tp1_tp4", "tp4_tp1", "pp2_pp1", "tp16_tp2"])
def test_lanes_equal_plan_apply(case: str, method: str, threads: bool, methods: list[str]) -> None:
    if method != "auto" and method not in methods:
        pytest.skip(f"{method} not offered by this driver")
    dev = torch.device("cuda", 0)
    with gc.CopyStream(0, lanes=3, threads=threads) as s:
        run_and_compare(case, method, 4, s, dev, dev, chunk_bytes=1 << 20)


def test_lanes_keep_stream_order() -> None:
    # x -> y, then y -> z, each spread over 4 lanes: the second must see all of the first.
    n, rows = 64 << 20, 64
    w = n // rows
    table = np.array([[i * w, w, i * w, w, w, 1] for i in range(rows)], dtype=np.int64)
    first = gc.Copies2D(table[::-1].copy())  # lane 0 of the second copy needs lane 3 of the first
    second = gc.Copies2D(table)
    method = "batch3d" if "batch3d" in gc.methods_available() else "memcpy2d"
    x = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
    y = torch.zeros_like(x)
    z = torch.zeros_like(x)
    sync_all()
    with gc.CopyStream(0, lanes=4, threads=True) as s:
        for _ in range(3):
            first.submit(x.data_ptr(), y.data_ptr(), s, method)
            second.submit(y.data_ptr(), z.data_ptr(), s, "memcpy2d")
            ev = s.record()
            ev.synchronize()
            assert ev.query()
            ev.close()
            assert torch.equal(z, x)
            y.zero_()
            z.zero_()
            sync_all()


def test_gpt_oss_tp1_tp4_one_copy_per_block(stream0: gc.CopyStream) -> None:
    g: dict[str, Any] = {
        "num_layers": 36,
        "num_kv_heads": 8,
        "head_dim": 64,
        "tokens_per_block": 32,
        "dtype": "bfloat16",
    }
    ctx = KVLayout(**g, num_blocks=64)
    gen = KVLayout(**g, tp_size=4, num_blocks=64)
    rng = np.random.default_rng(5)
    p = plan(
        ctx,
        gen,
        {0: rng.choice(64, 16, replace=False)},
        {r: rng.choice(64, 16, replace=False) for r in range(4)},
    )
    dev = torch.device("cuda", 0)
    src = src_pools(p, dev, 5)
    want = fresh(p, dev)
    p.apply(src, want)
    got = fresh(p, dev)
    sync_all()
    for s, d in p.pairs():
        assert len(gc.pair_copies(p, s, d)) == 16
        gc.apply_pair_2d(p, s, d, src[s].data_ptr(), got[d].data_ptr(), stream0)
    stream0.synchronize()
    assert all(torch.equal(got[r], want[r]) for r in want)


def test_events_order_two_streams() -> None:
    dev = torch.device("cuda", 0)
    n = 64 << 20
    x = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
    y = torch.zeros_like(x)
    z = torch.zeros_like(x)
    sync_all()
    with gc.CopyStream(0) as a, gc.CopyStream(0) as b:
        gc.copy_contiguous(x.data_ptr(), y.data_ptr(), n, a)
        with a.record() as ev:
            b.wait(ev)
            gc.copy_contiguous(y.data_ptr(), z.data_ptr(), n, b)
            b.synchronize()
            assert ev.query()
            ev.synchronize()
        assert a.query() and b.query()
    assert torch.equal(z, x)


def test_errors_are_transfer_errors() -> None:
    assert gc.available(0)
    with pytest.raises(TransferError, match="does not exist"):
        gc.CopyStream(torch.cuda.device_count())
    s = gc.CopyStream(0)
    s.close()
    s.close()  # idempotent
    with pytest.raises(TransferError, match="closed"):
        s.synchronize()
    with pytest.raises(ValueError, match="lanes"):
        gc.CopyStream(0, lanes=0)
    table = np.array([[0, 8, 0, 8, 8, 1]], dtype=np.int64)
    buf = torch.zeros(64, dtype=torch.uint8, device="cuda:0")
    with gc.CopyStream(0) as live, pytest.raises(ValueError, match="unknown copy method"):
        gc.Copies2D(table).submit(buf.data_ptr(), buf.data_ptr() + 32, live, "nope")
