"""A host pool shared with real executor processes through its memfd.

The daemon side (this process) creates a host ``Pool`` and its ``Attached`` reply; child
processes get the memfd (inherited with ``pass_fds``, or sent over a Unix socket with
SCM_RIGHTS as the daemon does), call :func:`clients.attach.map_pool`, and write or read blocks
through the typed tensor. The parent checks the bytes through its own tensor.
"""

from __future__ import annotations

import os
import signal
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
from kvd.pool import Pool
from protocol.errors import PoolError
from protocol.messages import Attached

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 120

CHILD = r"""
import os, signal, socket, sys
import msgspec, torch
from clients.attach import map_pool
from protocol.messages import Attached

mode, how, blocks = sys.argv[1], sys.argv[2], [int(b) for b in sys.argv[3].split(",")]
if how == "inherit":
    fds = [int(sys.argv[4])]
    payload = sys.stdin.buffer.read()
else:  # SCM_RIGHTS over a Unix socket, as the daemon sends it
    sock = socket.socket(fileno=int(sys.argv[4]))
    payload, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
attached = msgspec.msgpack.decode(payload, type=Attached)

def pattern(t, b):
    return ((torch.arange(t[b].numel()) * 7 + b * 13) % 251).reshape(t[b].shape).to(t.dtype)

pool = map_pool(attached, fds)
t = pool.tensor
raw = pool.raw
assert tuple(t.shape) == tuple(attached.pool.shape), (t.shape, attached.pool.shape)
assert t.dtype == getattr(torch, attached.pool.dtype) and t.device.type == "cpu"
for fd in fds:  # map_pool took ownership of the fds and closed them
    try:
        os.fstat(fd)
        raise SystemExit(f"fd {fd} still open")
    except OSError:
        pass
if mode in ("write", "write-and-die"):
    for b in blocks:
        t[b].copy_(pattern(t, b))
    if mode == "write-and-die":
        os.kill(os.getpid(), signal.SIGKILL)
else:
    for b in blocks:
        if not torch.equal(t[b], pattern(t, b)):
            raise SystemExit(f"block {b} differs")
    others = [b for b in range(t.shape[0]) if b not in blocks]
    if any(bool(t[b].ne(0).any()) for b in others):
        raise SystemExit("a block nobody wrote is not zero")
del t, raw  # no view left: close() unmaps at once
pool.close()
pool.close()
print("ok", mode, len(blocks))
"""


def pattern(t: torch.Tensor, b: int) -> torch.Tensor:
    return ((torch.arange(t[b].numel()) * 7 + b * 13) % 251).reshape(t[b].shape).to(t.dtype)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_inherit(mode: str, blocks: list[int], reply: Attached, fd: int) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-c", CHILD, mode, "inherit", ",".join(map(str, blocks)), str(fd)],
        input=msgspec.msgpack.encode(reply),
        pass_fds=[fd],
        capture_output=True,
        timeout=TIMEOUT,
        cwd=ROOT,
        env=child_env(),
    )


def run_scm_rights(
    mode: str, blocks: list[int], reply: Attached, fds: list[int]
) -> subprocess.CompletedProcess[bytes]:
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with parent, child:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, mode, "socket", ",".join(map(str, blocks)), str(child.fileno())],
            pass_fds=[child.fileno()],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=child_env(),
        )
        child.close()
        socket.send_fds(parent, [msgspec.msgpack.encode(reply)], fds)
        out, err = proc.communicate(timeout=TIMEOUT)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture
def pool() -> Iterator[Pool]:
    cfg = PoolConfig(
        name="cpu0",
        memory="host",
        num_layers=3,
        num_kv_heads=2,
        head_dim=16,
        tokens_per_block=8,
        dtype="bfloat16",
        num_blocks=12,
    )
    with capture_logs():
        p = Pool.create(cfg, {})
    yield p
    p.close()


def test_two_executors_share_blocks(pool: Pool) -> None:
    reply, fds = pool.attach_reply(1)
    assert reply.handle_kind == "fd" and len(fds) == 1
    blocks = pool.blocks.alloc("writer", 4)

    writer = run_inherit("write", blocks, reply, fds[0])
    assert writer.returncode == 0, writer.stderr.decode()
    assert writer.stdout.decode().split() == ["ok", "write", "4"]

    reader = run_scm_rights("read", blocks, reply, fds)
    assert reader.returncode == 0, reader.stderr.decode()
    assert reader.stdout.decode().split() == ["ok", "read", "4"]

    # the daemon's own view holds the same bytes; the children's fds did not take the pool's
    t = pool.tensor()
    for b in blocks:
        assert torch.equal(t[b], pattern(t, b))
    for b in set(range(pool.num_blocks)) - set(blocks):
        assert not t[b].ne(0).any()
    assert os.fstat(fds[0]).st_size == pool.pool_bytes


def test_executor_killed_after_writing(pool: Pool) -> None:
    reply, fds = pool.attach_reply(2)
    blocks = pool.blocks.alloc("victim", 2)
    proc = run_inherit("write-and-die", blocks, reply, fds[0])
    assert proc.returncode == -signal.SIGKILL
    # the memory is the daemon's: what the executor wrote before it died is still there
    t = pool.tensor()
    for b in blocks:
        assert torch.equal(t[b], pattern(t, b))
    # and its lease goes back when its session ends
    assert pool.blocks.release_session("victim") == 2
    assert pool.blocks.free_count == pool.num_blocks


def test_map_in_process_and_write_through(pool: Pool) -> None:
    reply, fds = pool.attach_reply(3)
    mapped = map_pool(reply, [os.dup(fds[0])])
    try:
        assert mapped.kind == "host" and mapped.device == -1
        assert mapped.nbytes == pool.pool_bytes
        assert mapped.ptr != pool.memory.ptr  # a second mapping of the same pages
        mapped.tensor[5].fill_(2.5)
        assert bool((pool.tensor()[5] == 2.5).all())
        assert mapped.raw.numel() == pool.pool_bytes
    finally:
        mapped.close()
    assert mapped.closed
    with pytest.raises(PoolError, match="no longer mapped"):
        _ = mapped.tensor
    mapped.close()


# --- client-side errors --------------------------------------------------------------------


def closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def test_map_pool_needs_one_fd(pool: Pool) -> None:
    reply, fds = pool.attach_reply(4)
    a, b = os.dup(fds[0]), os.dup(fds[0])
    with pytest.raises(PoolError, match="handle kind 'fd' needs exactly one fd, got 2"):
        map_pool(reply, [a, b])
    assert closed(a) and closed(b)  # map_pool owns the fds it was given, also on failure
    with pytest.raises(PoolError, match="needs exactly one fd, got 0"):
        map_pool(reply, [])


def test_map_pool_rejects_a_short_file(pool: Pool) -> None:
    reply, _ = pool.attach_reply(5)
    fd = os.memfd_create("short")
    os.ftruncate(fd, 100)
    with pytest.raises(PoolError, match=f"holds 100 bytes, expected at least {pool.pool_bytes}"):
        map_pool(reply, [fd])
    assert closed(fd)


def test_map_pool_unknown_handle_kind(pool: Pool) -> None:
    reply, _ = pool.attach_reply(6)
    bad = msgspec.structs.replace(reply, handle_kind="carrier-pigeon")
    with pytest.raises(PoolError, match="unknown handle kind 'carrier-pigeon'"):
        map_pool(bad, [])


@pytest.mark.parametrize("kind", ["cuda_ipc", "fabric", "posix_fd"])
def test_map_gpu_handle_without_driver(pool: Pool, kind: str) -> None:
    if torch.cuda.is_available():  # pragma: no cover
        pytest.skip("describes a machine without CUDA")
    reply, _ = pool.attach_reply(7)
    info = msgspec.structs.replace(reply.pool, kind="device", device=0)
    gpu = msgspec.structs.replace(reply, pool=info, handle_kind=kind, handle=b"\0" * 64)
    with pytest.raises(PoolError, match="no CUDA driver"):
        map_pool(gpu, [])
    host_only = msgspec.structs.replace(gpu, pool=reply.pool)
    with pytest.raises(PoolError, match=f"a {kind} handle needs a CUDA device, got -1"):
        map_pool(host_only, [])


def _mapped_memfds() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if "memfd:kvd-pool-unmap-check" in line]


def test_host_close_unmaps_when_no_view_is_left() -> None:
    from kvd.pool import HostMemory

    mem = HostMemory(1 << 16, name="unmap-check")
    mem.tensor()[0] = 1
    assert _mapped_memfds()
    mem.close()
    assert _mapped_memfds() == []
