"""The model demo on GPU pools: ctx TP1 on GPU 0, gen rank r on GPU r % count, executors on the
pools' GPUs (NCCL between gen ranks when each has a GPU of its own, else gloo on CUDA tensors),
token-identical with the single-process reference on GPU 0, in float32 and bfloat16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvd.demo.model.daemons import dist_backend
from kvd.demo.model.options import DemoOptions, Order
from kvd.demo.model.run import run_model_demo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize(
    ("gen_tp", "order", "mapped", "dtype"),
    [
        (2, "gen-first", True, "bfloat16"),
        (2, "ctx-first", False, "float32"),
        (4, "ctx-first", True, "float32"),
        (4, "gen-first", False, "bfloat16"),
    ],
    ids=["tp2-gen-first-mapped-bf16", "tp2-ctx-first-nixl-f32", "tp4-ctx-first-mapped-f32", "tp4-gen-first-nixl-bf16"],
)
def test_model_on_gpu_pools_decodes_token_identical(
    gen_tp: int, order: Order, mapped: bool, dtype: str, short_tmp: Path
) -> None:
    opts = DemoOptions(device="cuda", gen_tp=gen_tp, order=order, mapped=mapped, dtype=dtype,
                       prompt_lengths=(5, 16, 37, 90), new_tokens=8)
    report = run_model_demo(short_tmp, opts)
    assert report.token_identical, report.comparison.mismatches
    count = torch.cuda.device_count()
    for r in range(gen_tp):
        gen = report.gens[f"gen{r}"]
        assert gen.device == f"cuda:{r % count}"
        assert gen.backend == dist_backend(opts)
    for p in report.prompts:
        assert report.ctx_done.completions[p.request_id].path == ("mapped" if mapped else "bounce")
