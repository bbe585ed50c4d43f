"""GPU pool backends on a real GPU (H200 here): the fabric probe and its fallback, and device /
POSIX-fd / fabric pools shared with a second process that writes blocks the daemon reads.

Skipped cleanly where ``torch.cuda.is_available()`` is False.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
from structlog.testing import capture_logs

from clients.attach import map_pool
from kvd.config import PoolConfig
from kvd.pool import (
    DeviceMemory,
    FabricMemory,
    MemoryKind,
    Pool,
    PosixFdMemory,
    choose_and_create,
    probe_fabric,
)
from protocol.errors import FabricUnavailable
from protocol.messages import Attached

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 180
GRANULE = 2 << 20  # VMM granularity on H200


def cfg_for(memory: str, *, require_fabric: bool = False, name: str = "gpu0", blocks: int = 24) -> PoolConfig:
    # 3 layers x 2 (K,V) x 2 heads x 16 tokens x 64 dims x bf16 = 24 KiB a block
    return PoolConfig(
        name=name,
        memory=memory,  # type: ignore[arg-type]
        require_fabric=require_fabric,
        device=0,
        num_layers=3,
        num_kv_heads=2,
        head_dim=64,
        tokens_per_block=16,
        dtype="bfloat16",
        num_blocks=blocks,
    )


@pytest.fixture(scope="module")
def fabric_error() -> str | None:
    return probe_fabric(0)


def h200_like() -> bool:
    name = torch.cuda.get_device_name(0)
    return "H200" in name or "H100" in name


CHILD = r"""
import socket, sys
import msgspec, torch
from clients.attach import map_pool
from protocol.messages import Attached

mode, blocks, sock_fd = sys.argv[1], [int(b) for b in sys.argv[2].split(",")], int(sys.argv[3])
sock = socket.socket(fileno=sock_fd)
payload, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
attached = msgspec.msgpack.decode(payload, type=Attached)
pool = map_pool(attached, fds)
t = pool.tensor
assert t.device.type == "cuda", t.device
assert tuple(t.shape) == tuple(attached.pool.shape) and t.dtype == getattr(torch, attached.pool.dtype)

def pattern(b):
    n = t[b].numel()
    return ((torch.arange(n, device=t.device) * 7 + b * 13) % 251).reshape(t[b].shape).to(t.dtype)

if mode == "write":
    for b in blocks:
        t[b].copy_(pattern(b))
    torch.cuda.synchronize()
else:
    for b in blocks:
        if not torch.equal(t[b], pattern(b)):
            raise SystemExit(f"block {b} differs")
del t
pool.close()
pool.close()
print("ok", mode, attached.handle_kind, len(blocks))
"""


def pattern(t: torch.Tensor, b: int) -> torch.Tensor:
    n = t[b].numel()
    return ((torch.arange(n, device=t.device) * 7 + b * 13) % 251).reshape(t[b].shape).to(t.dtype)


def run_child(mode: str, blocks: list[int], reply: Attached, fds: list[int]) -> str:
    """A second process gets the reply + fds over SCM_RIGHTS (as from the daemon) and maps it."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with parent, child:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, mode, ",".join(map(str, blocks)), str(child.fileno())],
            pass_fds=[child.fileno()],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=env,
        )
        child.close()
        socket.send_fds(parent, [msgspec.msgpack.encode(reply)], fds)
        out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err.decode()[-4000:]
    return out.decode().strip().splitlines()[-1]


def make_pool(memory: str) -> Iterator[Pool]:
    with capture_logs():
        pool = Pool.create(cfg_for(memory), {})
    yield pool
    pool.close()


# --- fabric probe and policy ---------------------------------------------------------------


def test_fabric_probe(fabric_error: str | None) -> None:
    if fabric_error is None:
        assert not h200_like() or os.path.exists("/dev/nvidia-caps-imex-channels"), "fabric works here"
        return
    assert fabric_error.startswith("cuMemCreate: CUDA_ERROR_"), fabric_error
    if h200_like():
        # measured on H200 without IMEX: the attribute says supported, cuMemCreate says no
        assert "CUDA_ERROR_NOT_PERMITTED" in fabric_error


def test_auto_falls_back_to_device_with_warning(fabric_error: str | None) -> None:
    with capture_logs() as logs:
        pool = Pool.create(cfg_for("auto"), {})
    try:
        if fabric_error is None:
            assert pool.kind == "fabric" and pool.fallback_reason == ""
            return
        assert pool.kind == "device"
        assert pool.fallback_reason == f"fabric memory unavailable: {fabric_error}"
        (warn,) = [e for e in logs if e["event"] == "pool.fabric_unavailable"]
        assert warn["log_level"] == "warning"
        assert warn["error"] == fabric_error and warn["kind"] == "device"
        assert warn["pool"] == "gpu0" and warn["device"] == 0
        assert pool.info().fallback_reason == pool.fallback_reason
        t = pool.tensor()
        assert t.device == torch.device("cuda", 0) and t.dtype == torch.bfloat16
        assert not t.ne(0).any()  # zeroed
        del t
    finally:
        pool.close()


def test_env_zero_goes_straight_to_device() -> None:
    with capture_logs() as logs:
        mem, reason = choose_and_create(cfg_for("auto"), {"KVD_POOL_USE_FABRIC_MEMORY": "0"})
    try:
        assert mem.kind == "device" and reason == "fabric memory disabled by KVD_POOL_USE_FABRIC_MEMORY=0"
        assert not [e for e in logs if e["event"] == "pool.fabric_unavailable"]
    finally:
        mem.close()


def test_require_fabric_refuses(fabric_error: str | None) -> None:
    if fabric_error is None:
        pytest.skip("fabric memory works on this machine")
    with capture_logs(), pytest.raises(FabricUnavailable, match="require_fabric") as info:
        Pool.create(cfg_for("auto", require_fabric=True), {})
    assert fabric_error in info.value.message


# --- backends ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["device", "posix_fd"])
def test_backend_basics(kind: MemoryKind) -> None:
    nbytes = 3 * GRANULE + 12345
    mem = DeviceMemory(nbytes, 0) if kind == "device" else PosixFdMemory(nbytes, 0)
    assert mem.kind == kind and mem.device == 0 and mem.nbytes == nbytes
    if kind == "posix_fd":
        assert mem.map_bytes == 4 * GRANULE
        (fd,) = mem.export().fds
        assert fd >= 0
    else:
        assert mem.map_bytes == nbytes
        assert len(mem.export().handle) == 64
    t = mem.tensor()
    assert t.numel() == nbytes and t.data_ptr() == mem.ptr and t.device == torch.device("cuda", 0)
    t.fill_(7)
    assert int(t.sum()) == 7 * nbytes
    del t
    mem.close()
    mem.close()
    assert mem.closed


def test_views_alive_at_close_is_reported() -> None:
    mem = PosixFdMemory(GRANULE, 0, name="v")
    view = mem.tensor()[:8]
    with capture_logs() as logs:
        mem.close()
    assert [e["event"] for e in logs] == ["pool.views_alive_at_close"]
    del view


@pytest.fixture
def device_pool() -> Iterator[Pool]:
    yield from make_pool("device")


@pytest.fixture
def posix_fd_pool() -> Iterator[Pool]:
    yield from make_pool("posix_fd")


def _share_and_check(pool: Pool) -> None:
    reply, fds = pool.attach_reply(1)
    blocks = pool.blocks.alloc("executor", 5)
    line = run_child("write", blocks, reply, fds)
    assert line == f"ok write {reply.handle_kind} 5"
    t = pool.tensor()
    torch.cuda.synchronize()
    for b in blocks:
        assert torch.equal(t[b], pattern(t, b)), f"block {b}"
    others = sorted(set(range(pool.num_blocks)) - set(blocks))
    assert not t[others].ne(0).any()
    # a second executor reads what the first one wrote
    line = run_child("read", blocks, reply, fds)
    assert line == f"ok read {reply.handle_kind} 5"


def test_device_pool_shared_via_cuda_ipc(device_pool: Pool) -> None:
    assert device_pool.kind == "device"
    reply, fds = device_pool.attach_reply(9)
    assert reply.handle_kind == "cuda_ipc" and len(reply.handle) == 64 and fds == []
    _share_and_check(device_pool)


def test_posix_fd_pool_shared_via_fd(posix_fd_pool: Pool) -> None:
    assert posix_fd_pool.kind == "posix_fd"
    reply, fds = posix_fd_pool.attach_reply(9)
    assert reply.handle_kind == "posix_fd" and len(fds) == 1
    assert reply.map_bytes % GRANULE == 0 and reply.map_bytes >= posix_fd_pool.pool_bytes
    _share_and_check(posix_fd_pool)


def test_posix_fd_pool_warns_slow_target() -> None:
    with capture_logs() as logs:
        pool = Pool.create(cfg_for("posix_fd"), {})
    pool.close()
    assert "pool.posix_fd_slow_nixl_target" in [e["event"] for e in logs]


def test_posix_fd_import_in_same_process(posix_fd_pool: Pool) -> None:
    reply, fds = posix_fd_pool.attach_reply(3)
    mapped = map_pool(reply, [os.dup(fds[0])])
    try:
        assert mapped.ptr != posix_fd_pool.memory.ptr
        mapped.tensor[2].fill_(1.5)
        torch.cuda.synchronize()
        assert bool((posix_fd_pool.tensor()[2] == 1.5).all())
    finally:
        mapped.close()
    mapped.close()


def test_fabric_pool_shared(fabric_error: str | None) -> None:
    if fabric_error is not None:
        pytest.skip(f"no fabric memory here: {fabric_error}")
    mem = FabricMemory(GRANULE, 0)
    mem.close()
    with capture_logs():
        pool = Pool.create(cfg_for("fabric"), {})
    try:
        assert pool.kind == "fabric"
        _share_and_check(pool)
    finally:
        pool.close()
