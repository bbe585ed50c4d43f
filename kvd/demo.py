"""``kvd demo``: a real regrouped transfer between two daemons, verified byte for byte.

Two kvd daemons run as separate processes on loopback with host pools: ``ctx`` owns one pool
(context TP1: all 8 KV heads), ``gen`` owns four (generation TP4: 2 heads each). One ctx
executor writes a GPT-OSS-120B-shaped request (36 layers, 8 KV heads, head_dim 64, bf16,
32 tokens/block; the block count scaled to run in seconds) into its kvd-owned pool and
publishes it; four gen executors expect it. The daemons match the request over their
authenticated peer link, plan the head regroup and stream it through the bounce buffer over
NIXL (UCX, loopback). Each gen rank's blocks are then checked against the ctx pool.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from clients.blocking import Client
from kvd.launch import DaemonProcess, start_daemon
from protocol.layout import KVLayout
from protocol.messages import Completion

GEOMETRY: dict[str, Any] = {
    "num_layers": 36,
    "num_kv_heads": 8,
    "head_dim": 64,
    "tokens_per_block": 32,
    "dtype": "bfloat16",
}


def write_secret(directory: Path) -> str:
    """A fresh shared secret, readable by its owner only (the peer link refuses anything else)."""
    path = directory / "peer.secret"
    path.write_bytes(secrets.token_hex(32).encode())
    os.chmod(path, 0o600)
    return str(path)


def start_pair(
    workdir: Path, *, gen_tp: int, ctx_tp: int = 1, blocks: int, bounce_mb: int, chunk_mb: int, memory: str = "host",
    device: int = -1, extra: dict[str, Any] | None = None,
) -> tuple[DaemonProcess, DaemonProcess]:
    """Start the gen daemon, then the ctx daemon configured with gen as its peer."""
    secret = write_secret(workdir)
    transfer = {"bounce_size_mb": bounce_mb, "chunk_mb": chunk_mb, "deadline_s": 120.0}
    common = {"peer_secret_file": secret, "transfer": transfer, **(extra or {})}

    def pools(prefix: str, tp: int) -> list[dict[str, Any]]:
        return [
            {"name": f"{prefix}{r}", "memory": memory, "device": device, **GEOMETRY, "tp_size": tp, "rank": r,
             "num_blocks": blocks}
            for r in range(tp)
        ]

    gen = start_daemon({**common, "pools": pools("gen", gen_tp)}, workdir=workdir, name="gen")
    try:
        ctx = start_daemon(
            {**common, "pools": pools("ctx", ctx_tp), "peers": [{"name": "gen", "host": "127.0.0.1", "port": gen.peer_port}]},
            workdir=workdir,
            name="ctx",
        )
    except BaseException:
        gen.stop()
        raise
    return ctx, gen


def run_demo(workdir: Path, blocks: int, bounce_mb: int, chunk_mb: int) -> int:
    ctx_d, gen_d = start_pair(workdir, gen_tp=4, blocks=blocks, bounce_mb=bounce_mb, chunk_mb=chunk_mb)
    try:
        ctx_layout = KVLayout(**GEOMETRY, tp_size=1)
        gen_layout = KVLayout(**GEOMETRY, tp_size=4)
        request = "demo-request-1"
        results: dict[str, Completion] = {}
        errors: list[BaseException] = []
        gen_views: dict[int, torch.Tensor] = {}
        gen_blocks: dict[int, list[int]] = {}
        expected_ready = threading.Barrier(5)

        def gen_executor(rank: int) -> None:
            try:
                with Client(gen_d.socket_path, client=f"gen-rank{rank}") as kvd:
                    pool = kvd.attach(f"gen{rank}")
                    ids = kvd.alloc(f"gen{rank}", blocks)
                    pool.tensor[ids] = 0
                    kvd.expect(request, f"gen{rank}", gen_layout, rank, ids)
                    expected_ready.wait(30)
                    results[f"gen{rank}"] = kvd.wait(request, timeout_s=120)
                    gen_views[rank] = pool.tensor[ids].clone()
                    gen_blocks[rank] = ids
                    pool.close()
            except BaseException as exc:
                errors.append(exc)
                expected_ready.abort()

        threads = [threading.Thread(target=gen_executor, args=(r,)) for r in range(4)]
        for t in threads:
            t.start()
        with Client(ctx_d.socket_path, client="ctx-rank0") as kvd:
            pool = kvd.attach("ctx0")
            ids = kvd.alloc("ctx0", blocks)
            gen = torch.Generator().manual_seed(1234)
            data = torch.randn((blocks, *pool.tensor.shape[1:]), generator=gen).to(torch.bfloat16)
            pool.tensor[ids] = data
            try:
                expected_ready.wait(30)
            except threading.BrokenBarrierError:
                pass
            t0 = time.perf_counter()
            kvd.publish(request, "ctx0", ctx_layout, 0, ids, peer="gen")
            results["ctx0"] = kvd.wait(request, timeout_s=120)
            wall = time.perf_counter() - t0
            pool.close()
        for t in threads:
            t.join(60)
        if errors:
            raise errors[0]
        # verify: gen rank r holds heads [2r, 2r+2) of every layer of every block, in order
        ok = True
        for r in range(4):
            want = data[:, :, :, 2 * r : 2 * r + 2]
            same = torch.equal(gen_views[r].view(torch.int16), want.contiguous().view(torch.int16))
            ok &= same
        print_summary(results, wall, ok)
        return 0 if ok else 1
    finally:
        ctx_d.stop()
        gen_d.stop()


def print_summary(results: dict[str, Completion], wall: float, ok: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvd demo: GPT-OSS-120B KV, ctx TP1 -> gen TP4, host pools, NIXL over loopback")
    for col in ("executor", "bytes", "MiB", "GB/s", "path", "chunks", "fallback", "seconds"):
        table.add_column(col)
    for name, c in sorted(results.items()):
        gbps = c.bytes / c.duration_s / 1e9 if c.duration_s else 0.0
        table.add_row(name, str(c.bytes), f"{c.bytes / 2**20:.1f}", f"{gbps:.2f}", c.path, str(c.chunks),
                      c.fallback or "-", f"{c.duration_s:.3f}")
    console = Console()
    console.print(table)
    console.print(f"publish -> completion wall time {wall:.3f}s; verification: "
                  + ("[green]byte-exact on all 4 gen ranks[/green]" if ok else "[red]MISMATCH[/red]"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvd demo", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--blocks", type=int, default=32, help="request size in blocks (2.25 MiB each)")
    parser.add_argument("--bounce-mb", type=int, default=32)
    parser.add_argument("--chunk-mb", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (configs, logs)")
    args = parser.parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    workdir = Path(tempfile.mkdtemp(prefix="kvd-demo-", dir="/tmp"))
    try:
        return run_demo(workdir, args.blocks, args.bounce_mb, args.chunk_mb)
    finally:
        if args.keep:
            print(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
