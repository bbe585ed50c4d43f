"""End-to-end latency of one request through two daemons, per request size and registration order.

ctx TP1 -> gen TP4, GPT-OSS-120B KV geometry (2.25 MiB per block), host pools, two daemons on
loopback (or GPU pools: :func:`run`'s ``memory``/``device``). For each size it runs the request ``repeat`` times with the gen executors registering
first (naming their ctx peer: the destination is announced before ``publish``) and with the ctx
executor publishing first (offer/accept), and reports:

- end-to-end latency, p50 and p99: from the last registration call (the one that completes the
  request) until every executor has its completion, the other executors already waiting as a
  serving engine's would (each gen rank in a process of its own, its ``wait`` sent before the
  request completes) and the completing one sending its registration and its wait together
  (``publish_and_wait`` / ``expect_and_wait``); also until the ctx executor has its
  completion; GB/s at p50;
- the ctx side's stage timings (median seconds since its data path started: ``planned``,
  ``data_out``) from the daemon's ``transfer.done`` line;
- the peer round trips the ctx side waited for before data moved (0 when gen announced).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import statistics
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from clients.blocking import Client
from kvd.bench import gen_executor
from kvd.demo.launch import DaemonProcess
from kvd.demo.pair import GEOMETRY, start_pair
from protocol.layout import KVLayout

GEN_TP = 4
#: ``--geometry tiny``: the same layouts and block structure as :data:`GEOMETRY` (36 layers,
#: 8 KV heads: the same boxes and fragments per block, ctx TP1 -> gen TP4), with one token of
#: an 8-wide head per block (9 KiB a block at TP1 instead of 2.25 MiB): the copy is then a
#: few microseconds, and a request's latency is nearly all the host's control work.
TINY_GEOMETRY: dict[str, Any] = {**GEOMETRY, "head_dim": 8, "tokens_per_block": 1}
#: The geometries ``kvd bench transfer --geometry`` knows.
GEOMETRIES: dict[str, dict[str, Any]] = {"gpt-oss-120b": GEOMETRY, "tiny": TINY_GEOMETRY}
#: Pause between the executors' waits going out and the request completing: the waits then
#: wait, as in a serving engine (the figure is from the completing call on, not from the pause).
SETTLE_S = 0.002


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


class _Executors:
    """One ctx executor (here) and four gen executors, each gen rank in a process of its own
    (:mod:`kvd.bench.gen_executor`), as a serving engine's TP ranks are: their waits then wake
    in four interpreters, not four threads queueing for one GIL. Blocks are leased once per size."""

    def __init__(self, ctx_d: DaemonProcess, gen_d: DaemonProcess, blocks: int,
                 geometry: dict[str, Any] | None = None, spin_s: float = 0.0,
                 completion_page: bool = False) -> None:
        self.blocks = blocks
        #: the last request's start and every executor's completion (``perf_counter``):
        #: (t0, {"ctx": t, "gen0": t, ...})
        self.last_times: tuple[float, dict[str, float]] = (0.0, {})
        geometry = GEOMETRY if geometry is None else geometry
        self.ctx_layout = KVLayout(**geometry, tp_size=1)
        self.ctx = Client(ctx_d.socket_path, client="bench-ctx", spin_s=spin_s, completion_page=completion_page)
        self.ctx_ids = self.ctx.alloc("ctx0", blocks)
        spawn = mp.get_context("spawn")  # no fork of a process that may hold CUDA state
        self.pipes: list[Connection] = []
        self.procs: list[BaseProcess] = []
        try:
            for r in range(GEN_TP):
                here, there = spawn.Pipe()
                proc = spawn.Process(target=gen_executor.serve, name=f"bench-gen{r}", daemon=True,
                                     args=(str(gen_d.socket_path), r, blocks, geometry, GEN_TP, there, spin_s,
                                           completion_page))
                proc.start()
                there.close()
                self.pipes.append(here)
                self.procs.append(proc)
            for r in range(GEN_TP):
                self._expect(r, "ready")
        except BaseException:
            self.close()
            raise

    def _expect(self, r: int, what: str, timeout: float = 90.0) -> Any:
        if not self.pipes[r].poll(timeout):
            raise TimeoutError(f"gen executor {r} did not answer {what!r} within {timeout} s")
        kind, value = self.pipes[r].recv()
        if kind == "error":
            raise RuntimeError(value)
        if kind != what:
            raise RuntimeError(f"gen executor {r} answered {kind!r}, expected {what!r}")
        return value

    def once(self, rid: str, gen_first: bool, pipelined: bool = True) -> tuple[float, float, int]:
        """One request; returns (seconds from the completing registration to every executor's
        completion, to the ctx executor's, bytes). ``pipelined``: the completing executor sends
        its registration and its wait together (``publish_and_wait`` / ``expect_and_wait``);
        else it registers, then waits."""
        done_at: dict[str, float] = {}
        nbytes: list[int] = []
        errors: list[BaseException] = []
        waiter: threading.Thread | None = None
        if gen_first:
            for r in range(GEN_TP):
                self.pipes[r].send(("expect", rid, "ctx"))
            for r in range(GEN_TP):
                self._expect(r, "registered")
            time.sleep(SETTLE_S)  # let the waits reach the daemon (a benchmark, not a test)
            t0 = time.perf_counter()
            if pipelined:
                c = self.ctx.publish_and_wait(rid, "ctx0", self.ctx_layout, 0, self.ctx_ids, peer="gen", timeout_s=60)
            else:
                self.ctx.publish(rid, "ctx0", self.ctx_layout, 0, self.ctx_ids, peer="gen")
                c = self.ctx.wait(rid, timeout_s=60)
            done_at["ctx"] = time.perf_counter()
            nbytes.append(c.bytes)
            for r in range(GEN_TP):
                done_at[f"gen{r}"] = self._expect(r, "done")
        else:
            self.ctx.publish(rid, "ctx0", self.ctx_layout, 0, self.ctx_ids, peer="gen")

            def wait_ctx() -> None:
                try:
                    c = self.ctx.wait(rid, timeout_s=60)
                    done_at["ctx"] = time.perf_counter()
                    nbytes.append(c.bytes)
                except BaseException as exc:  # reported below, in the caller's thread
                    errors.append(exc)

            waiter = threading.Thread(target=wait_ctx, name="wait-ctx")
            waiter.start()
            last = GEN_TP - 1
            for r in range(last):
                self.pipes[r].send(("expect", rid, ""))
            for r in range(last):
                self._expect(r, "registered")
            time.sleep(SETTLE_S)
            self.pipes[last].send(("complete", rid, "", pipelined))
            t0, done_at[f"gen{last}"] = self._expect(last, "done")
            for r in range(last):
                done_at[f"gen{r}"] = self._expect(r, "done")
            waiter.join(90)
        if errors:
            raise errors[0]
        self.last_times = (t0, dict(done_at))
        return max(done_at.values()) - t0, done_at["ctx"] - t0, nbytes[0]

    def page_completions(self) -> dict[str, int]:
        """Per executor, the waits its completion page answered (``Client(completion_page=True)``)."""
        out = {"ctx": self.ctx.page_completions}
        for r in range(GEN_TP):
            self.pipes[r].send(("pages",))
            out[f"gen{r}"] = self._expect(r, "pages")
        return out

    def close(self) -> None:
        self.ctx.close()
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send(("stop",))
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for pipe in self.pipes:
            pipe.close()


def _wait_for_link(d: DaemonProcess, timeout: float = 30.0) -> None:
    with Client(d.socket_path, client="bench-probe") as c:
        t_end = time.monotonic() + timeout
        while c.stats().peers_connected < 1:
            if time.monotonic() > t_end:
                raise TimeoutError("the daemons never linked")
            time.sleep(0.01)


def _done_lines(d: DaemonProcess) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for line in Path(d.log_path).read_text(errors="replace").splitlines():
        if '"transfer.done"' in line:
            rec = json.loads(line)
            out[rec["request_id"]] = rec
    return out


def run(workdir: Path, sizes: list[int], repeat: int, *, mapped: bool, memory: str = "host", device: int = -1,
        gen_device: int | None = None, pipelined: bool = True, busy_poll: str = "auto",
        geometry: dict[str, Any] | None = None, client_spin_s: float = 0.0) -> list[dict[str, Any]]:
    """Measure every size and order on one pair of daemons; one row per (size, order).

    Host pools by default; ``memory="auto", device=0, gen_device=1`` puts the ctx pool on GPU 0
    and the four gen pools on GPU 1 (the GPU bench's placement). ``pipelined``: the completing
    executor sends its registration and wait together (see :meth:`_Executors.once`).
    ``busy_poll``: both daemons' ``transfer.busy_poll``. ``geometry``: the pools' and the
    requests' KV geometry (default :data:`GEOMETRY`; :data:`TINY_GEOMETRY` measures the
    control path alone). ``client_spin_s``: every executor's ``Client(spin_s=)``.
    """
    sub = workdir / ("lat-mapped" if mapped else "lat-nixl")
    sub.mkdir()
    ctx_d, gen_d = start_pair(sub, gen_tp=GEN_TP, blocks=max(sizes), bounce_mb=64, chunk_mb=16,
                              memory=memory, device=device, gen_device=gen_device,
                              extra_transfer={"mapped": mapped, "busy_poll": busy_poll}, geometry=geometry)
    rows: list[dict[str, Any]] = []
    try:
        _wait_for_link(gen_d)  # gen may name ctx only once ctx's link came up (a known peer)
        for blocks in sizes:
            ex = _Executors(ctx_d, gen_d, blocks, geometry, client_spin_s)
            try:
                ex.once(f"warm-{blocks}", True, pipelined)
                ex.once(f"warm2-{blocks}", False, pipelined)
                for gen_first in (True, False):
                    walls: list[float] = []
                    ctx_walls: list[float] = []
                    nbytes = 0
                    rids = []
                    for i in range(repeat):
                        rid = f"b{blocks}-{'g' if gen_first else 'c'}-{i}"
                        wall, ctx_wall, nbytes = ex.once(rid, gen_first, pipelined)
                        walls.append(wall)
                        ctx_walls.append(ctx_wall)
                        rids.append(rid)
                    rows.append({"blocks": blocks, "bytes": nbytes, "order": "gen-first" if gen_first else "ctx-first",
                                 "p50_s": _pct(walls, 0.5), "p99_s": _pct(walls, 0.99),
                                 "ctx_p50_s": _pct(ctx_walls, 0.5), "rids": rids})
            finally:
                ex.close()
        if rows and rows[-1]["rids"]:  # logged after its completion reply: wait for the last one
            ctx_d.logged("transfer.done", request_id=rows[-1]["rids"][-1])
        lines = _done_lines(ctx_d)
        for row in rows:
            recs = [lines[r] for r in row.pop("rids") if r in lines]
            row["path"] = recs[0]["path"] if recs else ""
            row["round_trips"] = sorted({rec.get("round_trips") for rec in recs} - {None})
            stages: dict[str, list[float]] = {}
            for rec in recs:
                for k, v in (rec.get("stages") or {}).items():
                    stages.setdefault(k, []).append(float(v))
            row["ctx_stages_s"] = {k: statistics.median(v) for k, v in stages.items()}
            row["gbps_p50"] = row["bytes"] / row["p50_s"] / 1e9
    finally:
        ctx_d.stop()
        gen_d.stop()
    return rows


def _is_time(stage: str) -> bool:
    return not stage.startswith(("gpu_kernel_", "gpu_launch_", "credits_")) and not stage.endswith("_bytes")


def print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    print(title)
    print(f"  {'blocks':>6} {'MiB':>7} {'order':<10} {'path':<7} {'p50 ms':>8} {'p99 ms':>8} {'ctx p50':>8}"
          f" {'GB/s':>7} {'rtt':>4}  ctx stages (ms since data path start; queued: before it)")
    for r in rows:
        # stage times print in ms; the GPU path's launch counts (gpu_kernel_*) are counts
        # times print in ms; counts (gpu_kernel_*, credits_*) and sizes (*_bytes) as they are
        stages = " ".join(f"{k}={v * 1e3:.2f}" if _is_time(k) else f"{k}={v:.0f}"
                          for k, v in r["ctx_stages_s"].items())
        rtt = ",".join(str(x) for x in r["round_trips"])
        print(f"  {r['blocks']:>6} {r['bytes'] / (1 << 20):>7.1f} {r['order']:<10} {r['path']:<7}"
              f" {r['p50_s'] * 1e3:>8.2f} {r['p99_s'] * 1e3:>8.2f} {r['ctx_p50_s'] * 1e3:>8.2f}"
              f" {r['gbps_p50']:>7.2f} {rtt:>4}  {stages}")
