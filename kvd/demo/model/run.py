"""``kvd demo --model``: disaggregated prefill → decode of a small transformer through kvd.

Two kvd daemons on loopback (``ctx`` with one pool, ``gen`` with one pool per gen rank), a ctx
executor process (TP1) that prefills a batch of prompts of different lengths into its pool and
publishes them, and ``--gen-tp`` gen executor processes (one pool each, a torch.distributed
group over loopback) that expect the requests and decode greedily from the K/V kvd delivered.
The result is compared with the same model run in one process without kvd: the run passes
when every token is identical and logits are within the dtype's tolerance.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Literal

import torch

from kvd.demo.launch import DaemonProcess, start_daemon
from kvd.demo.model import control as c
from kvd.demo.model.ctx import CtxSpec, ctx_main
from kvd.demo.model.gen import GenSpec, gen_main
from kvd.demo.model.reference import LOGIT_TOLERANCE, Comparison, compare, reference_run
from kvd.demo.model.transformer import ModelConfig, exact_float32
from kvd.demo.pair import write_secret
from protocol.layout import TRTLLM_AXIS_ORDER, VLLM_AXIS_ORDER

Order = Literal["gen-first", "ctx-first"]
AXIS_ORDERS = {"trtllm": TRTLLM_AXIS_ORDER, "vllm": VLLM_AXIS_ORDER}


@dataclass(frozen=True)
class DemoOptions:
    """One run of the model demo."""

    gen_tp: int = 4
    order: Order = "gen-first"
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: str = "float32"
    prompt_lengths: tuple[int, ...] = (5, 16, 37, 90, 130)
    new_tokens: int = 24
    tokens_per_block: int = 16  # the ctx pool's
    gen_tokens_per_block: int = 0  # the gen pools' (0 = the ctx pool's); one must divide the other
    pool_blocks: int = 64
    mapped: bool = True  # same-node mapped path; False = NIXL (bounce buffer, or direct)
    ctx_axis_order: str = "trtllm"
    gen_axis_order: str = "trtllm"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    model: ModelConfig = field(default_factory=ModelConfig)
    threads: int = 1
    timeout_s: float = 120.0
    request_prefix: str = "req"


@dataclass(frozen=True)
class DemoReport:
    """What a run measured and found."""

    options: DemoOptions
    prompts: tuple[c.Prompt, ...]
    published: c.Published
    ctx_done: c.CtxDone
    gens: dict[str, c.GenDone]
    comparison: Comparison
    tolerance: float

    @property
    def token_identical(self) -> bool:
        return self.comparison.token_identical


def make_prompts(lengths: tuple[int, ...], vocab: int, prefix: str = "req", seed: int = 1) -> tuple[c.Prompt, ...]:
    """Random prompts of the given lengths (fixed seed), ids ``<prefix>-0``, ``<prefix>-1``, ..."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        c.Prompt(f"{prefix}-{i}", tuple(int(t) for t in torch.randint(0, vocab, (n,), generator=gen)))
        for i, n in enumerate(lengths)
    )


def gen_devices(opts: DemoOptions, tp: int | None = None) -> list[int]:
    """CUDA ordinal of each gen rank's pool (round robin over the GPUs), or -1 on the CPU."""
    tp = opts.gen_tp if tp is None else tp
    if opts.device == "cpu":
        return [-1] * tp
    count = torch.cuda.device_count()
    if count < 1:
        raise SystemExit("kvd demo --model --device cuda: no CUDA device visible")
    return [r % count for r in range(tp)]


def dist_backend(opts: DemoOptions) -> str:
    """gloo on the CPU; NCCL when every gen rank has a GPU of its own (NCCL needs that), else gloo
    (which all-reduces CUDA tensors too)."""
    if opts.backend != "auto":
        return opts.backend
    devices = gen_devices(opts)
    return "nccl" if opts.device == "cuda" and len(set(devices)) == len(devices) else "gloo"


def gen_pool(tp: int, rank: int) -> str:
    """Name of gen rank ``rank``'s pool at TP ``tp`` (a gen daemon may serve several TP sizes)."""
    return f"tp{tp}-gen{rank}"


def start_daemons(
    workdir: Path, opts: DemoOptions, gen_layouts: Mapping[int, tuple[str, int]] | None = None
) -> tuple[DaemonProcess, DaemonProcess]:
    """The gen daemon, then the ctx daemon (pool ``ctx0``) with gen as its peer.

    The gen daemon gets one pool per rank for each TP size in ``gen_layouts`` (TP size → axis
    order name and tokens per block; default: ``opts.gen_tp`` with ``opts.gen_axis_order`` and
    ``opts.gen_tokens_per_block``).
    """
    cfg = opts.model
    memory = "host" if opts.device == "cpu" else "auto"
    geometry: dict[str, Any] = {
        "num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "dtype": opts.dtype, "num_blocks": opts.pool_blocks,
    }
    common: dict[str, Any] = {
        "peer_secret_file": write_secret(workdir),
        "transfer": {"bounce_size_mb": 16, "chunk_mb": 2, "deadline_s": opts.timeout_s, "mapped": opts.mapped},
    }
    layouts = gen_layouts or {opts.gen_tp: (opts.gen_axis_order, opts.gen_tokens_per_block or opts.tokens_per_block)}
    gen_pools = [
        {"name": gen_pool(tp, r), "memory": memory, "device": dev, **geometry, "tp_size": tp, "rank": r,
         "axis_order": list(AXIS_ORDERS[order]), "tokens_per_block": tpb}
        for tp, (order, tpb) in layouts.items()
        for r, dev in enumerate(gen_devices(opts, tp))
    ]
    ctx_pool = {"name": "ctx0", "memory": memory, "device": -1 if opts.device == "cpu" else 0, **geometry,
                "axis_order": list(AXIS_ORDERS[opts.ctx_axis_order]), "tokens_per_block": opts.tokens_per_block}
    gen = start_daemon({**common, "pools": gen_pools}, workdir=workdir, name="gen")
    try:
        ctx = start_daemon(
            {**common, "pools": [ctx_pool], "peers": [{"name": "gen", "host": "127.0.0.1", "port": gen.peer_port}]},
            workdir=workdir, name="ctx",
        )
    except BaseException:
        gen.stop()
        raise
    return ctx, gen


def run_model_demo(workdir: Path, opts: DemoOptions) -> DemoReport:
    """Start the daemons, run the requests through them (:func:`run_on_daemons`), stop them."""
    ctx_d, gen_d = start_daemons(workdir, opts)
    try:
        return run_on_daemons(workdir, opts, ctx_d, gen_d)
    finally:
        ctx_d.stop()
        gen_d.stop()


def run_on_daemons(workdir: Path, opts: DemoOptions, ctx_d: DaemonProcess, gen_d: DaemonProcess) -> DemoReport:
    """Run the executors against running daemons (see :func:`start_daemons`), then the reference,
    and compare. Raises :class:`~kvd.demo.model.control.WorkerFailed` if an executor fails."""
    opts.model.check_tp(opts.gen_tp)
    prompts = make_prompts(opts.prompt_lengths, opts.model.vocab_size, opts.request_prefix)
    published, ctx_done, gens = _run_executors(workdir, opts, prompts, ctx_d, gen_d)
    device = "cpu"
    if opts.device == "cuda":
        device = "cuda:0"
        exact_float32()
    ref = reference_run(opts.model, opts.dtype, device, prompts, opts.new_tokens)
    tolerance = LOGIT_TOLERANCE[opts.dtype]
    return DemoReport(opts, prompts, published, ctx_done, gens, compare(ref, published, gens, tolerance), tolerance)


def _run_executors(
    workdir: Path, opts: DemoOptions, prompts: tuple[c.Prompt, ...], ctx_d: DaemonProcess, gen_d: DaemonProcess
) -> tuple[c.Published, c.CtxDone, dict[str, c.GenDone]]:
    spawn = mp.get_context("spawn")  # fresh interpreters: no forked CUDA or trio state
    conns: dict[str, Connection] = {}
    procs: dict[str, BaseProcess] = {}

    def launch(name: str, target: Any, spec: Any) -> None:
        parent, child = spawn.Pipe()
        proc = spawn.Process(target=target, args=(child, spec), name=f"kvd-demo-{name}")
        proc.start()
        child.close()  # only the worker holds it: its exit reads as EOF here
        conns[name], procs[name] = parent, proc

    backend = dist_backend(opts)
    dist_file = str(workdir / f"tp-group-{uuid.uuid4().hex}")  # a fresh rendezvous per run
    try:
        launch("ctx0", ctx_main, CtxSpec(ctx_d.socket_path, "ctx0", "gen", opts.model, opts.dtype, prompts,
                                         opts.threads, opts.timeout_s))
        for r in range(opts.gen_tp):
            launch(f"gen{r}", gen_main, GenSpec(gen_d.socket_path, gen_pool(opts.gen_tp, r), r, opts.gen_tp,
                                                dist_file, backend, opts.model, opts.dtype,
                                                prompts, opts.new_tokens, opts.threads, opts.timeout_s))
        ctx = {"ctx0": conns["ctx0"]}
        gens = {n: conn for n, conn in conns.items() if n != "ctx0"}
        c.expect_msg(conns, procs, c.Ready, opts.timeout_s)
        if opts.order == "gen-first":
            _send(gens, c.Start())
            c.expect_msg(gens, procs, c.Expected, opts.timeout_s)
            _send(ctx, c.Start())
            published = c.expect_msg(ctx, procs, c.Published, opts.timeout_s)["ctx0"]
        else:
            _send(ctx, c.Start())
            published = c.expect_msg(ctx, procs, c.Published, opts.timeout_s)["ctx0"]
            _send(gens, c.Start())
            c.expect_msg(gens, procs, c.Expected, opts.timeout_s)
        _send(gens, c.FirstTokens(published.first_tokens))
        done = c.collect(conns, procs, {"ctx0": c.CtxDone, **{n: c.GenDone for n in gens}}, opts.timeout_s)
        for proc in procs.values():
            proc.join(opts.timeout_s)
        ctx_done = done.pop("ctx0")
        assert isinstance(ctx_done, c.CtxDone)
        return published, ctx_done, {n: m for n, m in done.items() if isinstance(m, c.GenDone)}
    finally:
        for proc in procs.values():  # a failed run: stop the executors this driver started
            if proc.is_alive():
                proc.terminate()
                proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in conns.values():
            conn.close()


def _send(conns: dict[str, Connection], msg: object) -> None:
    for conn in conns.values():
        conn.send(msg)


def print_report(report: DemoReport) -> None:
    """The per-request table and the verdict."""
    from rich.console import Console
    from rich.table import Table

    o = report.options
    gen0 = report.gens["gen0"]
    table = Table(title=f"kvd demo --model: ctx TP1 -> gen TP{o.gen_tp}, {o.device} pools ({o.dtype}), "
                        f"{o.order}, two daemons on loopback")
    table.caption = ("xfer ms: the transfer as the gen daemon timed it (slowest rank); ctx ms: the ctx side's "
                     "completion, from publish (so it includes waiting for gen to expect); 1st: the prefill's token")
    for col in ("request", "prompt", "prefill ms", "blocks", "path", "KiB", "xfer ms", "ctx ms", "1st"):
        table.add_column(col)
    for p in report.prompts:
        rid = p.request_id
        done = report.ctx_done.completions[rid]
        xfer_ms = max(g.completions[rid].duration_s for g in report.gens.values()) * 1e3
        path = done.path + (f" ({done.fallback})" if done.fallback else "")
        table.add_row(rid, str(len(p.tokens)), f"{report.published.prefill_s[rid] * 1e3:.1f}",
                      str(report.published.blocks[rid]), path, f"{done.bytes / 1024:.0f}", f"{xfer_ms:.2f}",
                      f"{done.duration_s * 1e3:.2f}", str(report.published.first_tokens[rid]))
    console = Console()
    console.print(table)
    tokens = len(report.prompts) * o.new_tokens
    rate = tokens / gen0.decode_s if gen0.decode_s else 0.0
    console.print(f"decode: {len(report.prompts)} requests x {o.new_tokens} tokens, batched, on gen TP{o.gen_tp} "
                  f"({gen0.backend}, {gen0.device}): {gen0.decode_s:.3f} s, {rate:.1f} tokens/s", soft_wrap=True)
    console.print(f"max |logit - reference| = {report.comparison.max_logit_diff:.3g} "
                  f"(tolerance {report.tolerance:g})", soft_wrap=True)
    if report.token_identical:
        console.print("[green]token-identical[/green] with the single-process reference")
    else:
        console.print("[red]MISMATCH[/red] with the single-process reference:")
        for line in report.comparison.mismatches:
            console.print(f"  {line}", soft_wrap=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvd demo --model",
        description="A small transformer served through kvd: ctx TP1 prefill -> gen TP2/TP4 decode from the KV "
                    "kvd delivered, compared token by token with the same model in one process.",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="host pools (default) or GPU pools")
    parser.add_argument("--gen-tp", type=int, choices=[2, 4], default=4)
    parser.add_argument("--order", choices=["gen-first", "ctx-first"], default="gen-first",
                        help="which side registers the requests with its daemon first")
    parser.add_argument("--dtype", choices=sorted(LOGIT_TOLERANCE), default="float32",
                        help="weights and KV cache dtype (arithmetic is float32)")
    parser.add_argument("--prompts", default="5,16,37,90,130", help="prompt lengths, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens each gen decode produces")
    parser.add_argument("--tokens-per-block", type=int, default=16, help="tokens per block of the ctx pool")
    parser.add_argument("--gen-tokens-per-block", type=int, default=0,
                        help="tokens per block of the gen pools (default: the ctx pool's; one must divide the other)")
    parser.add_argument("--no-mapped", dest="mapped", action="store_false",
                        help="move KV over NIXL instead of the same-node mapped path")
    parser.add_argument("--gen-axis-order", choices=sorted(AXIS_ORDERS), default="trtllm",
                        help="axis order of the gen pools (the ctx pool is TensorRT-LLM's)")
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                        help="torch.distributed backend of the gen TP group")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per executor")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (configs, logs)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``kvd demo --model``; exit code 0 when token-identical, 1 otherwise."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        lengths = tuple(int(x) for x in args.prompts.split(",") if x.strip())
    except ValueError:
        parser.error(f"--prompts: comma-separated token counts expected, got {args.prompts!r}")
    if not lengths or min(lengths) < 1 or args.new_tokens < 1:
        parser.error("every prompt needs at least one token, and --new-tokens at least 1")
    opts = DemoOptions(gen_tp=args.gen_tp, order=args.order, device=args.device, dtype=args.dtype,
                       prompt_lengths=lengths, new_tokens=args.new_tokens, tokens_per_block=args.tokens_per_block,
                       gen_tokens_per_block=args.gen_tokens_per_block,
                       mapped=args.mapped, gen_axis_order=args.gen_axis_order, backend=args.backend,
                       threads=args.threads)
    smallest = min(opts.tokens_per_block, opts.gen_tokens_per_block or opts.tokens_per_block)
    need = sum(-(-(n + opts.new_tokens) // smallest) for n in lengths)  # blocks a pool must hold at once
    opts = DemoOptions(**{**opts.__dict__, "pool_blocks": max(opts.pool_blocks, need)})
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    workdir = Path(tempfile.mkdtemp(prefix="kvd-model-", dir="/tmp"))
    try:
        report = run_model_demo(workdir, opts)
        print_report(report)
        return 0 if report.token_identical else 1
    finally:
        if args.keep:
            print(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
