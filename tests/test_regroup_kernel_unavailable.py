"""The regroup kernel's availability verdict, its one warning, and the NVRTC build with its cache.

Runs without a GPU: a bad ``KVD_KERNEL_ARCH`` fails at the compile step (before any driver call),
``KVD_KERNEL=0`` before anything. NVRTC-only tests (compile a cubin, cache it) run where the
NVRTC library loads and skip cleanly elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs
from structlog.typing import EventDict

from kvd.regroup import kernel


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setenv(kernel.ENV_CACHE, str(tmp_path / "cache"))
    kernel.reset()
    yield
    kernel.reset()


def _nvrtc_loads() -> bool:
    try:
        kernel.nvrtc_version()
    except kernel.KernelError:
        return False
    return True


def unavailable(logs: list[EventDict]) -> list[EventDict]:
    return [e for e in logs if e["event"] == "regroup.kernel_unavailable"]


def test_bad_arch_logs_once_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernel.ENV_ARCH, "sm_1")
    with capture_logs() as logs:
        assert kernel.kernel_available(0) is False
        assert kernel.kernel_for(0) is None
        assert kernel.kernel_available(0) is False
    (event,) = unavailable(logs)
    assert event["log_level"] == "warning" and event["device"] == 0 and event["fallback"] == "torch"
    reason = str(event["reason"])
    # With NVRTC: its compile error; without: the missing library. Either names NVRTC.
    assert "NVRTC" in reason, reason
    if _nvrtc_loads():
        assert "sm_1" in reason and "gpu-architecture" in reason


def test_switched_off_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernel.ENV_SWITCH, "0")
    with capture_logs() as logs:
        assert kernel.kernel_available(3) is False
    (event,) = unavailable(logs)
    assert event["reason"] == "turned off by KVD_KERNEL=0"


def test_verdict_is_per_device_and_reset_forgets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernel.ENV_SWITCH, "off")
    with capture_logs() as logs:
        kernel.kernel_available(0)
        kernel.kernel_available(1)
        kernel.kernel_available(0)
        kernel.reset()
        kernel.kernel_available(0)
    assert [e["device"] for e in unavailable(logs)] == [0, 1, 0]


@pytest.mark.skipif(not _nvrtc_loads(), reason="NVRTC library not installed")
def test_compiles_without_a_gpu_and_caches_the_cubin(tmp_path: Path) -> None:
    data = kernel.cubin("sm_90")
    assert data[:4] == b"\x7fELF"
    (cached,) = (tmp_path / "cache").iterdir()
    assert cached.name.startswith("regroup-") and cached.name.endswith("-sm_90.cubin")
    assert cached.read_bytes() == data
    cached.write_bytes(b"from the cache")  # a hit is read back, not recompiled
    assert kernel.cubin("sm_90") == b"from the cache"


@pytest.mark.skipif(not _nvrtc_loads(), reason="NVRTC library not installed")
def test_compile_error_carries_the_nvrtc_log() -> None:
    with pytest.raises(kernel.KernelError, match="NVRTC compile for sm_1 failed"):
        kernel.compile_cubin("sm_1")


def test_unwritable_cache_still_compiles_or_reports(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    monkeypatch.setenv(kernel.ENV_CACHE, str(blocker / "sub"))  # a file where a folder must go
    assert kernel.cache_dir() == blocker / "sub"
    if _nvrtc_loads():
        assert kernel.cubin("sm_90")[:4] == b"\x7fELF"
    else:
        with pytest.raises(kernel.KernelError, match="NVRTC library not found"):
            kernel.cubin("sm_90")


def test_cache_dir_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(kernel.ENV_CACHE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernel.cache_dir() == tmp_path / "kvd"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert kernel.cache_dir() == Path.home() / ".cache" / "kvd"


def test_the_small_table_parameter_is_the_size_the_host_packs() -> None:
    """The CUDA source and the host agree on the small launch's table: SMALL_WORDS int64 words
    after the pair count, 4096 bytes in all (the kernel-parameter limit every driver takes)."""
    import re

    m = re.search(r"#define SMALL_WORDS (\d+)", kernel.SOURCE)
    assert m is not None and int(m.group(1)) == kernel.SMALL_WORDS
    assert (kernel.SMALL_WORDS + 1) * 8 == 4096


def test_the_large_table_parameter_fits_the_32_kib_limit_and_is_compiled() -> None:
    """The 32 KiB entry point's table matches the host's LARGE_WORDS, stays within the 32764
    bytes CUDA 12.1 allows a kernel's parameters, and NVRTC builds it for sm_90 (beside the
    4 KiB one): the host finds both functions in the cubin it loads."""
    import re

    m = re.search(r"#define LARGE_WORDS (\d+)", kernel.SOURCE)
    assert m is not None and int(m.group(1)) == kernel.LARGE_WORDS
    assert kernel.SMALL_WORDS < kernel.LARGE_WORDS and (kernel.LARGE_WORDS + 1) * 8 <= 32764
    if _nvrtc_loads():
        image = kernel.cubin("sm_90")
        assert b"kvd_regroup_large" in image and b"kvd_regroup_small" in image

