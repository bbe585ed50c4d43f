"""Which mover the mapped path picks on GPUs: the copy engines for a few long contiguous runs
(equal layouts, consecutive blocks), the regroup kernel for everything else. Pure planning:
the GPU side runs in tests/gpu/test_transfer_gpu.py."""

from __future__ import annotations

import random

from kvd.regroup.plan import KVLayout, plan
from kvd.transfer.paths.mapped import COPY_ENGINE_MAX_RUNS, COPY_ENGINE_MIN_RUN, copy_engine_runs

GPT_OSS = {"num_layers": 36, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 32, "dtype": "bfloat16",
           "num_blocks": 4096}
BLOCK = 36 * 8 * 64 * 32 * 2 * 2  # 2.25 MiB at TP1


def test_consecutive_blocks_of_equal_layouts_are_one_run_per_pair() -> None:
    one = KVLayout(**GPT_OSS)  # type: ignore[arg-type]
    runs = copy_engine_runs(plan(one, one, {0: list(range(64))}, {0: list(range(100, 164))}))
    assert runs is not None and list(runs) == [(0, 0)]
    assert runs[0, 0].tolist() == [[0, 100 * BLOCK, 64 * BLOCK]]


def test_equal_tp2_is_one_run_per_rank() -> None:
    tp2 = KVLayout(**GPT_OSS, tp_size=2)  # type: ignore[arg-type]
    ids = {0: list(range(128)), 1: list(range(128))}
    runs = copy_engine_runs(plan(tp2, tp2, ids, ids))
    assert runs is not None and sorted(runs) == [(0, 0), (1, 1)]
    assert all(r[:, 2].tolist() == [128 * BLOCK // 2] for r in runs.values())


def test_the_kernel_keeps_regroups_short_runs_and_scattered_blocks() -> None:
    one = KVLayout(**GPT_OSS)  # type: ignore[arg-type]
    tp4 = KVLayout(**GPT_OSS, tp_size=4)  # type: ignore[arg-type]
    n = 64
    # a regroup (TP1 -> TP4): 8 KiB fragments, never a plain copy
    assert copy_engine_runs(plan(one, tp4, {0: list(range(n))}, {r: list(range(n)) for r in range(4)})) is None
    # equal layouts, shuffled blocks: one run per block (2.25 MiB, below the minimum)
    shuffled = list(range(n))
    random.Random(0).shuffle(shuffled)
    assert BLOCK < COPY_ENGINE_MIN_RUN
    assert copy_engine_runs(plan(one, one, {0: list(range(n))}, {0: shuffled})) is None
    # equal layouts, too short a request for a copy to pay off
    small = COPY_ENGINE_MIN_RUN // BLOCK
    assert copy_engine_runs(plan(one, one, {0: list(range(small))}, {0: list(range(small))})) is None
    # long runs, but too many of them: the copy engines' fixed cost per copy adds up
    per = COPY_ENGINE_MIN_RUN // BLOCK + 1
    parts = COPY_ENGINE_MAX_RUNS + 1
    src = list(range(per * parts))
    dst = [b + 2 * per * (b // per) for b in src]  # a gap after every run of `per` blocks
    assert copy_engine_runs(plan(one, one, {0: src}, {0: dst})) is None
    fewer = per * COPY_ENGINE_MAX_RUNS
    got = copy_engine_runs(plan(one, one, {0: src[:fewer]}, {0: dst[:fewer]}))
    assert got is not None and len(got[0, 0]) == COPY_ENGINE_MAX_RUNS
