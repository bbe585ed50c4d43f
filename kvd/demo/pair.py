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
import random
import secrets
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from clients.blocking import Client
from kvd.demo.launch import DaemonProcess, start_daemon
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
    device: int = -1, gen_device: int | None = None, extra: dict[str, Any] | None = None,
    extra_transfer: dict[str, Any] | None = None, geometry: dict[str, Any] | None = None,
) -> tuple[DaemonProcess, DaemonProcess]:
    """Start the gen daemon, then the ctx daemon configured with gen as its peer (pools of
    ``geometry``, default :data:`GEOMETRY`)."""
    secret = write_secret(workdir)
    transfer = {"bounce_size_mb": bounce_mb, "chunk_mb": chunk_mb, "deadline_s": 120.0, **(extra_transfer or {})}
    common = {"peer_secret_file": secret, "transfer": transfer, **(extra or {})}

    geo = GEOMETRY if geometry is None else geometry

    def pools(prefix: str, tp: int, dev: int) -> list[dict[str, Any]]:
        return [
            {"name": f"{prefix}{r}", "memory": memory, "device": dev, **geo, "tp_size": tp, "rank": r,
             "num_blocks": blocks}
            for r in range(tp)
        ]

    gdev = device if gen_device is None else gen_device
    gen = start_daemon({**common, "pools": pools("gen", gen_tp, gdev)}, workdir=workdir, name="gen")
    try:
        ctx = start_daemon(
            {**common, "pools": pools("ctx", ctx_tp, device),
             "peers": [{"name": "gen", "host": "127.0.0.1", "port": gen.peer_port}]},
            workdir=workdir,
            name="ctx",
        )
    except BaseException:
        gen.stop()
        raise
    return ctx, gen


def pool_entry(name: str, layout: KVLayout, rank: int, *, memory: str, device: int, num_blocks: int) -> dict[str, Any]:
    """One ``[[pools]]`` entry of a daemon config: rank ``rank`` of ``layout``, ``num_blocks`` blocks."""
    entry: dict[str, Any] = {
        "name": name, "memory": memory, "device": device, "num_layers": layout.num_layers,
        "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim, "tokens_per_block": layout.tokens_per_block,
        "dtype": layout.dtype, "tp_size": layout.tp_size, "pp_size": layout.pp_size,
        "attention_dp": layout.attention_dp, "axis_order": list(layout.axis_order), "rank": rank,
        "num_blocks": num_blocks,
    }
    if layout.layer_split is not None:
        entry["layer_split"] = list(layout.layer_split)
    return entry


def start_pools_pair(
    workdir: Path, *, ctx_pools: list[dict[str, Any]], gen_pools: list[dict[str, Any]], bounce_mb: int,
    chunk_mb: int, extra_transfer: dict[str, Any] | None = None,
) -> tuple[DaemonProcess, DaemonProcess]:
    """Like :func:`start_pair` with the pools given (any layout, any GPU per pool): the gen
    daemon ``gen``, then the ctx daemon ``ctx`` configured with gen as its peer."""
    secret = write_secret(workdir)
    transfer = {"bounce_size_mb": bounce_mb, "chunk_mb": chunk_mb, "deadline_s": 120.0, **(extra_transfer or {})}
    common = {"peer_secret_file": secret, "transfer": transfer}
    gen = start_daemon({**common, "pools": gen_pools}, workdir=workdir, name="gen")
    try:
        ctx = start_daemon({**common, "pools": ctx_pools,
                            "peers": [{"name": "gen", "host": "127.0.0.1", "port": gen.peer_port}]},
                           workdir=workdir, name="ctx")
    except BaseException:
        gen.stop()
        raise
    return ctx, gen


def wait_for_link(client: Client, node: str, timeout_s: float = 60.0) -> None:
    """Wait until the daemon behind ``client`` has a link up to ``node`` (a gen ``expect``
    naming a peer that never connected is refused: the daemons start in any order)."""
    deadline = time.monotonic() + timeout_s
    while not any(p.node == node and p.state == "up" for p in client.peers()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no link to peer {node!r} after {timeout_s:.0f} s")
        time.sleep(0.02)


class Scenario:
    """ctx TP1 -> gen TP4 between two running daemons: executors attached, blocks leased once.

    ``transfer()`` runs one request (the four gen executors expect it, naming the ctx daemon
    unless ``gen_peer=""``; the ctx executor publishes; every executor waits, each in its own
    thread with its own blocking client); ``verify()`` checks every gen rank's blocks
    against the ctx data.
    """

    def __init__(self, ctx_d: DaemonProcess, gen_d: DaemonProcess, blocks: int, *, seed: int = 1234,
                 gen_peer: str = "ctx", shuffle: bool = False) -> None:
        self.blocks = blocks
        # gen naming its ctx peer (as a router would tell it) announces its destination: the
        # publish finds it and moves bytes with no peer round trip; "" is offer/accept (one)
        self.gen_peer = gen_peer
        self.ctx_layout = KVLayout(**GEOMETRY, tp_size=1)
        self.gen_layout = KVLayout(**GEOMETRY, tp_size=4)
        self.ctx = Client(ctx_d.socket_path, client="ctx-rank0")
        self.gens = [Client(gen_d.socket_path, client=f"gen-rank{r}") for r in range(4)]
        if gen_peer:
            wait_for_link(self.gens[0], gen_peer)
        self.ctx_pool = self.ctx.attach("ctx0")
        self.ctx_ids = self.ctx.alloc("ctx0", blocks)
        self.gen_pools = [c.attach(f"gen{r}") for r, c in enumerate(self.gens)]
        self.gen_ids = [c.alloc(f"gen{r}", blocks) for r, c in enumerate(self.gens)]
        if shuffle:  # the same blocks in random order on every rank: no two neighbours adjacent in a pool
            rng = random.Random(seed)
            for ids in (self.ctx_ids, *self.gen_ids):
                rng.shuffle(ids)
        #: whether every rank's request blocks are consecutive ids in order (a fresh pool's alloc)
        self.contiguous = all(ids == list(range(ids[0], ids[0] + len(ids))) for ids in (self.ctx_ids, *self.gen_ids))
        import torch  # here, not at the top: a usage error of kvd demo / bench is not held up by it

        t = self.ctx_pool.tensor
        gen = torch.Generator(device=t.device).manual_seed(seed)
        self.data = torch.randn((blocks, *t.shape[1:]), generator=gen, device=t.device).to(t.dtype)
        t[self.ctx_ids] = self.data
        if t.is_cuda:
            torch.cuda.synchronize(t.device)
        self.count = 0

    def transfer(self, timeout: float = 120.0) -> tuple[dict[str, Completion], float]:
        """One request end to end; returns the completions by executor and the wall time."""
        import torch

        self.count += 1
        request = f"req-{self.count}"
        for r, (c, pool) in enumerate(zip(self.gens, self.gen_pools, strict=True)):
            pool.tensor[self.gen_ids[r]] = 0
            if pool.tensor.is_cuda:
                torch.cuda.synchronize(pool.tensor.device)
            c.expect(request, f"gen{r}", self.gen_layout, r, self.gen_ids[r], peer=self.gen_peer)
        results: dict[str, Completion] = {}
        errors: list[BaseException] = []

        def wait_gen(r: int) -> None:
            try:
                results[f"gen{r}"] = self.gens[r].wait(request, timeout_s=timeout)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=wait_gen, args=(r,)) for r in range(4)]
        for th in threads:
            th.start()
        t0 = time.perf_counter()
        # registration and wait in one write, as a serving engine's executor would send them
        results["ctx0"] = self.ctx.publish_and_wait(request, "ctx0", self.ctx_layout, 0, self.ctx_ids, peer="gen",
                                                    timeout_s=timeout)
        wall = time.perf_counter() - t0
        for th in threads:
            th.join(timeout)
        if errors:
            raise errors[0]
        return results, wall

    def timed(self, repeat: int) -> tuple[dict[str, Completion], list[float], bool]:
        """A warm-up request (first touch of pools, index building, UCX lanes), then ``repeat``
        timed ones: the last completions, every wall time, and whether the gen ranks hold the
        data (checked once, after the last)."""
        self.transfer()
        walls: list[float] = []
        results: dict[str, Completion] = {}
        for _ in range(repeat):
            results, wall = self.transfer()
            walls.append(wall)
        return results, walls, self.verify()

    def verify(self) -> bool:
        """gen rank r holds heads [2r, 2r+2) of every layer of every block, in order."""
        import torch

        ok = True
        for r, pool in enumerate(self.gen_pools):
            got = pool.tensor[self.gen_ids[r]]
            want = self.data[:, :, :, 2 * r : 2 * r + 2]
            ok &= torch.equal(got.view(torch.int16), want.to(got.device).contiguous().view(torch.int16))
        return ok

    def close(self) -> None:
        for pool in [self.ctx_pool, *self.gen_pools]:
            pool.close()
        for c in [self.ctx, *self.gens]:
            c.close()


def run_demo(workdir: Path, blocks: int, bounce_mb: int, chunk_mb: int, mapped: bool) -> int:
    ctx_d, gen_d = start_pair(workdir, gen_tp=4, blocks=blocks, bounce_mb=bounce_mb, chunk_mb=chunk_mb,
                              extra_transfer={"mapped": mapped})
    try:
        scenario = Scenario(ctx_d, gen_d, blocks)
        try:
            results, wall = scenario.transfer()
            ok = scenario.verify()
        finally:
            scenario.close()
        print_summary(results, wall, ok)
        return 0 if ok else 1
    finally:
        ctx_d.stop()
        gen_d.stop()


def print_summary(results: dict[str, Completion], wall: float, ok: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    # every row shows the same bytes, which read as if each gen rank had received the whole request
    table = Table(title="kvd demo: GPT-OSS-120B KV, ctx TP1 -> gen TP4, host pools, two daemons on loopback",
                  caption="one row per executor's completion; bytes: the whole request, all ranks of that side "
                          "together (each gen rank holds a quarter of it, 2 of the 8 KV heads)")
    for col in ("executor", "bytes", "MiB", "GB/s", "path", "chunks", "fallback", "seconds"):
        table.add_column(col)
    for name, c in sorted(results.items()):
        gbps = c.bytes / c.duration_s / 1e9 if c.duration_s else 0.0
        table.add_row(name, str(c.bytes), f"{c.bytes / 2**20:.1f}", f"{gbps:.2f}", c.path, str(c.chunks),
                      c.fallback or "-", f"{c.duration_s:.3f}")
    # off a terminal (a pipe, CI's log) rich would cut the table at 80 columns: no width limit there
    console = Console() if sys.stdout.isatty() else Console(width=200, soft_wrap=True)
    console.print(table)
    console.print(f"publish -> completion wall time {wall:.3f}s; verification: "
                  + ("[green]byte-exact on all 4 gen ranks[/green]" if ok else "[red]MISMATCH[/red]"))


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1 (``--blocks 0`` used to reach the daemons,
    which then refused their own configuration)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


#: Host copies of the request the demo holds at once: the ctx pool, the four gen pools
#: together, and the executor's source tensor it writes and verifies against.
DEMO_COPIES = 3


def host_memory_available() -> int:
    """Bytes of memory the kernel says can be allocated without swapping (MemAvailable)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def too_large(blocks: int, available: int, option: str = "--blocks") -> str:
    """Why ``blocks`` cannot run in ``available`` bytes of host memory ("" when it can);
    ``option`` names the option that gave ``blocks``."""
    request = KVLayout(**GEOMETRY).block_bytes(0) * blocks
    need = DEMO_COPIES * request
    if need <= available:
        return ""
    return (f"{option} {blocks}: a request of {request / 2**30:.1f} GiB needs about {need / 2**30:.1f} GiB of "
            f"host memory (ctx pool, gen pools, the executor's copy) and {available / 2**30:.1f} GiB is "
            f"available; give fewer {option} (at most {available // DEMO_COPIES // (request // blocks)})")


def build_parser() -> argparse.ArgumentParser:
    """The options of ``kvd demo``."""
    parser = argparse.ArgumentParser(
        prog="kvd demo",
        description="A real regrouped transfer between two daemons, verified byte for byte: ctx TP1 (8 KV heads) "
                    "-> gen TP4 (2 heads each), GPT-OSS-120B-shaped blocks in host pools, over loopback.",
        epilog="kvd demo --model: a small transformer served through kvd, ctx TP1 prefill -> gen TP2/TP4 "
               "decode, compared with one process (kvd demo --model --help)",
    )
    parser.add_argument("--blocks", type=positive_int, default=32,
                        help="request size in blocks (2.25 MiB each; default 32)")
    parser.add_argument("--bounce-mb", type=positive_int, default=32,
                        help="bounce buffer of each daemon, in MiB (the NIXL path's staging; default 32)")
    parser.add_argument("--chunk-mb", type=positive_int, default=8,
                        help="one NIXL write per chunk of this many MiB on the bounce path (default 8)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (configs, logs)")
    parser.add_argument("--no-mapped", dest="mapped", action="store_false",
                        help="force NIXL (bounce pipeline) instead of the same-node mapped path")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvd demo``; exit code 0 when every gen rank's bytes match."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if why := too_large(args.blocks, host_memory_available()):
        parser.error(why)  # before any daemon starts: a torch allocation failure was all it said
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    workdir = Path(tempfile.mkdtemp(prefix="kvd-demo-", dir="/tmp"))
    try:
        return run_demo(workdir, args.blocks, args.bounce_mb, args.chunk_mb, args.mapped)
    finally:
        if args.keep:
            print(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
            print("(the daemons' configs and logs were in a temporary directory, now removed: "
                  "kvd demo --keep keeps them)")
