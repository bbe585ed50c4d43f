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
    ``KVD_TEST_WARM=0`` starts each in a fresh ``python -m kvd`` (N: N kept ready; 2 by default,
    a ctx/gen pair)."""
    use_warm_interpreters(int(os.environ.get("KVD_TEST_WARM", "2")))


def pytest_unconfigure(config: pytest.Config) -> None:
    use_warm_interpreters(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.multigpu(n)``: also a ``gpu`` test, skipped where fewer than n GPUs exist."""
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
