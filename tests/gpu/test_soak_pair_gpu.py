"""The peer-link soak (tests/test_soak_pair.py) with GPU pools: the regroup kernel and the
copy engines on the mapped path, CUDA IPC under NIXL (direct and bounce), landed events and
completion tokens, under the same random faults; both daemons must be left as clean."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvd.demo.launch import DaemonProcess
from tests.conftest import cuda_gpus
from tests.test_soak_pair import pair_soak

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "nixl"])
async def test_gpu_pair_soak_leaves_nothing_behind(daemon_factory: Callable[..., DaemonProcess], short_tmp: Path,
                                                   mapped: bool) -> None:
    gen_device = 1 if cuda_gpus() >= 2 else 0  # two GPUs: the pulled launch and cross-GPU NIXL
    await pair_soak(daemon_factory, short_tmp, mapped=mapped, memory="auto", ctx_device=0,
                    gen_device=gen_device)
