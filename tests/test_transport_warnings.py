"""The daemon says at startup when UCX would move device memory slowly (never a silent slow path)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvd.transport.setup import device_transport_warnings


def _daemon(*pools: tuple[str, int, str]) -> Any:
    return SimpleNamespace(pools={n: SimpleNamespace(name=n, device=dev, kind=kind) for n, dev, kind in pools})


def test_host_pools_never_warn() -> None:
    assert device_transport_warnings(_daemon(("h", -1, "host")), {"UCX_TLS": "tcp"}) == []


def test_ucx_tls_without_cuda_ipc_warns_for_gpu_pools() -> None:
    (w,) = device_transport_warnings(_daemon(("g", 0, "device")), {"UCX_TLS": "tcp,cuda_copy"})
    assert w["setting"] == "UCX_TLS" and "cuda_ipc" in w["reason"]
    (w,) = device_transport_warnings(_daemon(("g", 0, "device")), {"UCX_TLS": "^cuda_ipc"})
    assert w["setting"] == "UCX_TLS"


def test_ucx_tls_with_cuda_ipc_or_unset_is_quiet() -> None:
    for env in ({}, {"UCX_TLS": "all"}, {"UCX_TLS": "cuda_ipc,cuda_copy,tcp"}, {"UCX_TLS": "^ib"}):
        assert device_transport_warnings(_daemon(("g", 0, "device")), env) == [], env


def test_posix_fd_pool_is_named_as_a_slow_nixl_target() -> None:
    (w,) = device_transport_warnings(_daemon(("g", 1, "posix_fd")), {})
    assert w["setting"] == "pools.g.memory" and "0.5 GB/s" in w["reason"]
