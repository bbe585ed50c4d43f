"""Pools at the daemon level: executor processes attach to a real daemon's host pool.

Executors are real processes that map the pool with ``Client.attach()`` (memfd passed by
SCM_RIGHTS) and are driven over stdin/stdout with one JSON command per line. Misuse (double
free, a block of another session, too many blocks, Expect with blocks not leased) is refused
with a clear error and changes nothing; ``kvctl pools --json`` shows what an operator needs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clients import Client
from kvd.demo.launch import DaemonProcess, start_daemon
from protocol import messages as m
from protocol.errors import BadRequest, BlockNotLeased, LimitExceeded, OutOfBlocks

FABRIC_REASON = r"fabric memory does not apply to host memory \(KVD_POOL_USE_FABRIC_MEMORY.* ignored\)"


def _pool(name: str, num_blocks: int, **extra: Any) -> dict[str, Any]:
    pool = {
        "name": name, "memory": "host", "device": -1, "num_layers": 4, "num_kv_heads": 8,
        "head_dim": 64, "tokens_per_block": 32, "dtype": "bfloat16", "num_blocks": num_blocks,
    }  # fmt: skip
    pool.update(extra)
    return pool


@pytest.fixture(scope="module")
def pool_daemon() -> Iterator[DaemonProcess]:
    """Two host pools; KVD_POOL_USE_FABRIC_MEMORY=1 gives them a fallback reason to show."""
    workdir = tempfile.mkdtemp(prefix="kvdp-", dir="/tmp")
    cfg = {
        "pools": [_pool("host0", 64), _pool("host1", 16, tp_size=2, rank=1)],
        "transfer": {"bounce_size_mb": 16, "chunk_mb": 2},
    }
    env = {**os.environ, "KVD_POOL_USE_FABRIC_MEMORY": "1"}
    d = start_daemon(cfg, workdir=workdir, name="pools", env=env)
    try:
        yield d
    finally:
        d.kill()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def kvd(pool_daemon: DaemonProcess) -> Iterator[Client]:
    with Client(pool_daemon.socket_path, client="test", timeout=10) as c:
        yield c
    _wait_until(lambda: c_stats(pool_daemon).blocks_leased == 0, "every lease returned")


def c_stats(d: DaemonProcess) -> m.DaemonStats:
    with Client(d.socket_path, timeout=10) as c:
        return c.stats()


def _wait_until(cond: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.02)


# --- executor processes ----------------------------------------------------------------------

_EXECUTOR = textwrap.dedent(
    """
    import json, sys
    import torch
    from clients import Client

    path, pool_name, name = sys.argv[1:4]

    def pattern(block, seed, nbytes):
        g = torch.Generator().manual_seed(seed * 100003 + block)
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)

    with Client(path, client=name, timeout=30) as kvd:
        pool = kvd.attach(pool_name)
        bb = pool.info.block_bytes
        raw, typed = pool.raw, pool.tensor
        print(json.dumps({"ready": True, "kind": pool.kind, "shape": list(typed.shape),
                          "block_bytes": bb, "pid": __import__("os").getpid()}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "alloc":
                out = {"blocks": kvd.alloc(pool_name, cmd["n"])}
            elif op == "write":  # raw bytes of whole blocks
                for b in cmd["blocks"]:
                    raw[b * bb:(b + 1) * bb].copy_(pattern(b, cmd["seed"], bb))
                out = {"ok": True}
            elif op == "check":
                bad = [b for b in cmd["blocks"] if not torch.equal(raw[b * bb:(b + 1) * bb], pattern(b, cmd["seed"], bb))]
                out = {"bad": bad}
            elif op == "fill":  # typed writes through the shaped view
                typed[cmd["block"]].fill_(cmd["value"])
                out = {"ok": True}
            elif op == "typed":
                t = typed[cmd["block"]]
                out = {"min": float(t.min()), "max": float(t.max()), "shape": list(t.shape), "dtype": str(t.dtype)}
            elif op == "exit":
                pool.close()
                print(json.dumps({"bye": True}), flush=True)
                break
            else:
                out = {"error": op}
            print(json.dumps(out), flush=True)
    """
)


class Executor:
    """An executor process attached to a pool, driven line by line."""

    def __init__(self, d: DaemonProcess, pool: str, name: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _EXECUTOR, d.socket_path, pool, name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.hello: dict[str, Any] | None = None

    def ready(self) -> dict[str, Any]:
        if self.hello is None:
            self.hello = self._read()
            assert self.hello.get("ready"), self.hello
        return self.hello

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"executor exited with {self.proc.poll()}"
        reply: dict[str, Any] = json.loads(line)
        return reply

    def __call__(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


@pytest.fixture
def executors(pool_daemon: DaemonProcess) -> Iterator[list[Executor]]:
    started: list[Executor] = []
    yield started
    for e in started:
        e.kill()


def test_two_executor_processes_share_pool_bytes(
    pool_daemon: DaemonProcess, executors: list[Executor]
) -> None:
    a = Executor(pool_daemon, "host0", "ctx-rank0")
    b = Executor(pool_daemon, "host0", "gen-rank0")
    executors += [a, b]
    for e in (a, b):
        hello = e.ready()
        assert hello["kind"] == "host"
        assert hello["shape"] == [64, 4, 2, 8, 32, 64]
        assert hello["block_bytes"] == 4 * 2 * 8 * 32 * 64 * 2

    # a writes whole blocks of raw bytes, b reads them
    blocks_a = a("alloc", n=6)["blocks"]
    assert len(blocks_a) == 6
    assert a("write", blocks=blocks_a, seed=1) == {"ok": True}
    assert b("check", blocks=blocks_a, seed=1) == {"bad": []}
    assert b("check", blocks=blocks_a, seed=2)["bad"] == blocks_a  # a real comparison

    # and the other way round, through the typed (bfloat16, shaped) view
    blocks_b = b("alloc", n=2)["blocks"]
    assert not set(blocks_a) & set(blocks_b)
    assert b("fill", block=blocks_b[0], value=3.5) == {"ok": True}
    seen = a("typed", block=blocks_b[0])
    assert seen == {"min": 3.5, "max": 3.5, "shape": [4, 2, 8, 32, 64], "dtype": "torch.bfloat16"}
    assert b("write", blocks=[blocks_b[1]], seed=7) == {"ok": True}
    assert a("check", blocks=[blocks_b[1]], seed=7) == {"bad": []}

    with Client(pool_daemon.socket_path, timeout=10) as c:
        (host0,) = [p for p in c.pools() if p.name == "host0"]
        assert host0.blocks_used == 8
        assert host0.sessions == 2
        clients = sorted(s.client for s in c.sessions() if s.blocks_leased)
        assert clients == ["ctx-rank0", "gen-rank0"]

    assert a("exit") == {"bye": True}
    assert a.proc.wait(10) == 0
    _wait_until(lambda: _pool_info(pool_daemon, "host0").blocks_used == 2, "a's blocks returned")
    assert b("exit") == {"bye": True}
    assert b.proc.wait(10) == 0
    _wait_until(lambda: _pool_info(pool_daemon, "host0").blocks_used == 0, "b's blocks returned")


def _pool_info(d: DaemonProcess, name: str) -> m.PoolInfo:
    with Client(d.socket_path, timeout=10) as c:
        (info,) = [p for p in c.pools() if p.name == name]
        return info


def test_sigkilled_executor_returns_all_blocks(pool_daemon: DaemonProcess, executors: list[Executor]) -> None:
    e = Executor(pool_daemon, "host0", "doomed")
    executors.append(e)
    e.ready()
    blocks = e("alloc", n=40)["blocks"] + e("alloc", n=9)["blocks"]
    assert len(set(blocks)) == 49
    assert e("write", blocks=blocks[:3], seed=3) == {"ok": True}
    info = _pool_info(pool_daemon, "host0")
    assert (info.blocks_used, info.blocks_free, info.sessions) == (49, 15, 1)
    assert c_stats(pool_daemon).blocks_leased == 49
    e.kill()
    assert e.proc.returncode == -signal.SIGKILL
    _wait_until(
        lambda: _pool_info(pool_daemon, "host0").blocks_used == 0, "the dead executor's blocks returned"
    )
    info = _pool_info(pool_daemon, "host0")
    assert (info.blocks_used, info.blocks_free, info.sessions) == (0, 64, 0)
    st = c_stats(pool_daemon)
    assert st.blocks_leased == 0
    # the returned blocks can be leased again, all of them
    with Client(pool_daemon.socket_path, timeout=10) as c:
        assert len(c.alloc("host0", 64)) == 64
    # the next test allocates at once: wait until the daemon ended that session (it does when
    # it reads the hang-up, not when the Client's close returns)
    _wait_until(lambda: c_stats(pool_daemon).blocks_leased == 0, "the 64 blocks returned")


# --- misuse: a clear error, and nothing changes ------------------------------------------------


def test_double_free(kvd: Client) -> None:
    blocks = kvd.alloc("host0", 4)
    assert kvd.free("host0", blocks[:2]) == 2
    before = kvd.pools()
    with pytest.raises(BlockNotLeased, match=rf"block {blocks[0]} is not leased to session \d+: it is free"):
        kvd.free("host0", blocks[:2])
    # all or nothing: a list with one bad id frees none of the good ones
    with pytest.raises(BlockNotLeased, match="it is free"):
        kvd.free("host0", [blocks[2], blocks[0]])
    # an id listed twice is a malformed request, not a lease problem
    with pytest.raises(BadRequest, match=rf"block {blocks[2]} is listed twice \(positions 0 and 1 of block_ids\)"):
        kvd.free("host0", [blocks[2], blocks[2]])
    assert kvd.pools() == before
    assert kvd.free("host0", blocks[2:]) == 2


def test_foreign_block(pool_daemon: DaemonProcess, kvd: Client) -> None:
    with Client(pool_daemon.socket_path, client="other", timeout=10) as other:
        theirs = other.alloc("host0", 3)
        mine = kvd.alloc("host0", 1)
        before = kvd.pools()
        with pytest.raises(
            BlockNotLeased,
            match=rf"block {theirs[1]} is not leased to session \d+: it is leased to another session",
        ):
            kvd.free("host0", [theirs[1]])
        with pytest.raises(BlockNotLeased, match="leased to another session"):
            kvd.free("host0", [mine[0], theirs[0]])
        with pytest.raises(BlockNotLeased, match="out of range"):
            kvd.free("host0", [64])
        with pytest.raises(BlockNotLeased, match="out of range"):
            kvd.free("host0", [-1])
        # a block id of host0 is not a block of host1
        with pytest.raises(BlockNotLeased, match="'host1'"):
            kvd.free("host1", mine)
        assert kvd.pools() == before
        # the owner still holds them and can free them
        assert other.free("host0", theirs) == 3
        assert kvd.free("host0", mine) == 1


def test_over_capacity_alloc(kvd: Client) -> None:
    held = kvd.alloc("host0", 60)
    before = kvd.pools()
    with pytest.raises(
        OutOfBlocks, match=r"pool 'host0': asked for 5 blocks, only 4 free \(60 of 64 in use\)"
    ):
        kvd.alloc("host0", 5)
    with pytest.raises(OutOfBlocks, match="asked for 17 blocks, only 16 free"):
        kvd.alloc("host1", 17)
    with pytest.raises(BadRequest, match="positive integer"):
        kvd.alloc("host0", -3)
    assert kvd.pools() == before
    assert len(kvd.alloc("host0", 4)) == 4  # exactly what is left still works
    assert kvd.free("host0", held) == 60


def test_per_session_block_limit(daemon_factory: Any) -> None:
    d = daemon_factory({"limits": {"max_blocks_per_session": 10}}, name="limited")
    with Client(d.socket_path, timeout=10) as c:
        c.alloc("host0", 8)
        before = c.pools()
        with pytest.raises(
            LimitExceeded, match="max_blocks_per_session=10: session holds 8, asked for 3 more"
        ):
            c.alloc("host0", 3)
        assert c.pools() == before
        assert len(c.alloc("host0", 2)) == 2


def test_expect_with_blocks_not_leased(pool_daemon: DaemonProcess, kvd: Client) -> None:
    (host0,) = [p for p in kvd.pools() if p.name == "host0"]
    layout = host0.layout
    assert layout is not None
    with Client(pool_daemon.socket_path, client="other", timeout=10) as other:
        theirs = other.alloc("host0", 2)
        mine = kvd.alloc("host0", 2)
        before_pools, before_stats = kvd.pools(), kvd.stats()
        with pytest.raises(
            BlockNotLeased,
            match=rf"block {theirs[0]} is not leased to session \d+: it is leased to another session",
        ):
            kvd.expect("req-foreign", "host0", layout, 0, [mine[0], theirs[0]])
        free_block = next(i for i in range(64) if i not in set(mine) | set(theirs))
        with pytest.raises(BlockNotLeased, match=f"block {free_block} is not leased .*: it is free"):
            kvd.expect("req-free", "host0", layout, 0, [free_block])
        with pytest.raises(BlockNotLeased, match="leased to another session"):
            kvd.publish("req-pub", "host0", layout, 0, theirs, peer="elsewhere")
        after_stats = kvd.stats()
        assert kvd.pools() == before_pools
        assert after_stats.requests_registered == before_stats.requests_registered
        assert kvd.transfers() == []
        # with its own blocks the same Expect is accepted
        kvd.expect("req-ok", "host0", layout, 0, mine)
        assert kvd.stats().requests_registered == before_stats.requests_registered + 1
        kvd.cancel("req-ok")


# --- kvctl ------------------------------------------------------------------------------------


def _kvctl(d: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("kvctl")
    return subprocess.run(
        [str(exe), "--socket", d.socket_path, *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_kvctl_pools_json(pool_daemon: DaemonProcess, kvd: Client) -> None:
    kvd.alloc("host0", 5)
    kvd.alloc("host1", 3)
    with Client(pool_daemon.socket_path, client="second", timeout=10) as other:
        other.alloc("host0", 2)
        result = _kvctl(pool_daemon, "--json", "pools")
    assert result.returncode == 0, result.stderr
    pools = {p["name"]: p for p in json.loads(result.stdout)}
    assert sorted(pools) == ["host0", "host1"]
    h0, h1 = pools["host0"], pools["host1"]
    assert h0["kind"] == "host" and h1["kind"] == "host"
    assert h0["device"] == -1
    assert re.fullmatch(FABRIC_REASON, h0["fallback_reason"]), h0["fallback_reason"]
    assert re.fullmatch(FABRIC_REASON, h1["fallback_reason"]), h1["fallback_reason"]
    assert (h0["blocks_used"], h0["blocks_free"], h0["sessions"]) == (7, 57, 2)
    assert (h1["blocks_used"], h1["blocks_free"], h1["sessions"]) == (3, 13, 1)
    assert h0["num_blocks"] == 64 and h1["num_blocks"] == 16
    assert h0["block_bytes"] == 4 * 2 * 8 * 32 * 64 * 2
    assert h1["block_bytes"] == h0["block_bytes"] // 2  # TP2: half the heads
    assert h1["layout"]["tp_size"] == 2 and h1["rank"] == 1
    assert h0["pool_bytes"] == 64 * h0["block_bytes"]


def test_kvctl_pools_table_and_unreachable(pool_daemon: DaemonProcess, short_tmp: Path) -> None:
    result = _kvctl(pool_daemon, "pools")
    assert result.returncode == 0, result.stderr
    for text in ("host0", "host1", "host", "used", "free", "sessions"):
        assert text in result.stdout
    gone = subprocess.run(
        [str(Path(sys.executable).with_name("kvctl")), "--socket", str(short_tmp / "none.sock"), "pools"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert gone.returncode == 3
    assert "cannot connect" in gone.stderr
