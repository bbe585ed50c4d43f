"""Shared fixtures: real daemons in subprocesses, short socket paths, loopback-only NIXL."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Tests talk to loopback only: UCX would otherwise also use the machine's other interfaces.
os.environ["UCX_NET_DEVICES"] = "lo"
# Every process that loads NIXL (each of the ~400 daemons the suite starts) has UCX patch mmap,
# munmap and six more functions for its memory events when libucs loads ("bistro" hooks), and
# wait a grace period after each for threads inside the function: 50 ms by default in this UCX,
# spent spinning on sched_yield, ~0.4 s of CPU per daemon before it can create its agent (a
# third of a daemon's start-up on a 2-core box). 5 ms (the grace UCX's bistro code once had
# hard-coded) installs the same hooks the same way in ~0.05 s.
os.environ.setdefault("UCX_MEM_BISTRO_GRACE_DURATION", "5ms")

from kvd.demo.launch import DaemonProcess, start_daemon, use_warm_interpreters


def cuda_gpus() -> int:
    """CUDA devices visible here (0 without a GPU or a CUDA torch)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def multigpu_skip_reason(need: int, have: int) -> str | None:
    """Why a ``multigpu(need)`` test cannot run with ``have`` GPUs, or None if it can."""
    return None if have >= need else f"needs {need} CUDA GPUs, {have} here"


def pytest_configure(config: pytest.Config) -> None:
    """Daemons start in interpreters that imported torch ahead (kvd.demo.launch.WarmInterpreters):
    READY=1 in ~0.8 s instead of ~1.7 s, over the few hundred daemons the suite starts.
    ``KVD_TEST_WARM=0`` starts each in a fresh ``python -m kvd`` (N: N kept ready; 4 by default:
    a ctx/gen pair to take and a pair warming behind it)."""
    use_warm_interpreters(int(os.environ.get("KVD_TEST_WARM", "4")))


def pytest_unconfigure(config: pytest.Config) -> None:
    use_warm_interpreters(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.multigpu(n)``: also a ``gpu`` test, skipped where fewer than n GPUs exist.

    The ``soak`` test (two minutes of its own) runs first: under the README's ``-n 2`` one
    worker runs it while the other runs the rest, where last it would end the run alone
    (``--no-loadscope-reorder`` keeps this order: by default xdist sends the files with the
    most tests first, and the soak's file has one)."""
    items.sort(key=lambda item: item.get_closest_marker("soak") is None)  # stable: the rest keep their order
    have: int | None = None
    for item in items:
        mark = item.get_closest_marker("multigpu")
        if mark is None:
            continue
        need = int(mark.args[0]) if mark.args else 2
        if have is None:
            have = cuda_gpus()
        item.add_marker(pytest.mark.gpu)
        reason = multigpu_skip_reason(need, have)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temp dir: AF_UNIX paths are limited to 107 bytes, pytest's tmp_path can exceed it."""
    path = Path(tempfile.mkdtemp(prefix="kvdt-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def host_pool(name: str = "host0", **overrides: Any) -> dict[str, Any]:
    """A small host pool config (GPT-OSS-shaped heads/head_dim, few layers)."""
    pool: dict[str, Any] = {
        "name": name,
        "memory": "host",
        "device": -1,
        "num_layers": 4,
        "num_kv_heads": 8,
        "head_dim": 64,
        "tokens_per_block": 32,
        "dtype": "bfloat16",
        "num_blocks": 64,
    }
    pool.update(overrides)
    return pool


@pytest.fixture
def daemon_factory(short_tmp: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """Start real kvd subprocesses; every one still running is stopped at teardown."""
    started: list[DaemonProcess] = []

    def factory(config: dict[str, Any] | None = None, *, name: str = "kvd", env: dict[str, str] | None = None) -> DaemonProcess:
        cfg: dict[str, Any] = {"pools": [host_pool()], "transfer": {"bounce_size_mb": 16, "chunk_mb": 2}}
        cfg.update(config or {})
        d = start_daemon(cfg, workdir=short_tmp, name=name, env=env)
        started.append(d)
        return d

    yield factory
    for d in started:
        d.kill()
