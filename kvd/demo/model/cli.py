"""``kvd demo --model``: the command line and the printed report."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from kvd.demo.model.names import AXIS_ORDERS, LOGIT_TOLERANCE
from kvd.demo.pair import positive_int

if TYPE_CHECKING:
    from kvd.demo.model.run import DemoReport


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


def _tokens_or_zero(text: str) -> int:
    """An argparse type for ``--gen-tokens-per-block``: 0 (the ctx pool's) or at least 1."""
    try:
        if int(text) == 0:
            return 0
    except ValueError:
        pass  # positive_int says what is wrong with it
    return positive_int(text)


def build_parser() -> argparse.ArgumentParser:
    """The options of ``kvd demo --model``."""
    parser = argparse.ArgumentParser(
        prog="kvd demo --model",
        description="A small transformer served through kvd: ctx TP1 prefill -> gen TP2/TP4 decode from the KV "
                    "kvd delivered, compared token by token with the same model in one process.",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="host pools (default) or GPU pools")
    parser.add_argument("--gen-tp", type=int, choices=[2, 4], default=4, help="TP size of the gen side (default 4)")
    parser.add_argument("--order", choices=["gen-first", "ctx-first"], default="gen-first",
                        help="which side registers the requests with its daemon first (default gen-first)")
    parser.add_argument("--dtype", choices=sorted(LOGIT_TOLERANCE), default="float32",
                        help="weights and KV cache dtype (default float32; arithmetic is float32)")
    parser.add_argument("--prompts", default="5,16,37,90,130", help="prompt lengths, comma-separated (default 5,16,37,90,130)")
    parser.add_argument("--new-tokens", type=positive_int, default=24, help="tokens each gen decode produces (default 24)")
    parser.add_argument("--tokens-per-block", type=positive_int, default=16, help="tokens per block of the ctx pool (default 16)")
    parser.add_argument("--gen-tokens-per-block", type=_tokens_or_zero, default=0,
                        help="tokens per block of the gen pools (default: the ctx pool's; one must divide the other)")
    parser.add_argument("--no-mapped", dest="mapped", action="store_false",
                        help="move KV over NIXL instead of the same-node mapped path")
    parser.add_argument("--gen-axis-order", choices=sorted(AXIS_ORDERS), default="trtllm",
                        help="axis order of the gen pools (default trtllm; the ctx pool is TensorRT-LLM's)")
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                        help="torch.distributed backend of the gen TP group (default auto: nccl when each gen rank has a GPU of its own, else gloo)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads per executor (default 1)")
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
    if not lengths or min(lengths) < 1:
        parser.error("every prompt needs at least one token")
    ctx_tpb, gen_tpb = args.tokens_per_block, args.gen_tokens_per_block or args.tokens_per_block
    if max(ctx_tpb, gen_tpb) % min(ctx_tpb, gen_tpb):
        # the daemons would refuse every request with IncompatibleLayout, after starting five
        # executors: say it here, as the usage error it is
        parser.error(f"--gen-tokens-per-block {gen_tpb} and --tokens-per-block {ctx_tpb}: one must divide "
                     "the other")
    # the model (torch with it, ~1 s) once the options are known to be good: a usage error is told at once
    from kvd.demo.model.options import DemoOptions
    from kvd.demo.model.run import run_model_demo

    opts = DemoOptions(gen_tp=args.gen_tp, order=args.order, device=args.device, dtype=args.dtype,
                       prompt_lengths=lengths, new_tokens=args.new_tokens, tokens_per_block=args.tokens_per_block,
                       gen_tokens_per_block=args.gen_tokens_per_block,
                       mapped=args.mapped, gen_axis_order=args.gen_axis_order, backend=args.backend,
                       threads=args.threads)
    smallest = min(opts.tokens_per_block, opts.gen_tokens_per_block or opts.tokens_per_block)
    need = sum(-(-(n + opts.new_tokens) // smallest) for n in lengths)  # blocks a pool must hold at once
    opts = dataclasses.replace(opts, pool_blocks=max(opts.pool_blocks, need))
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
