"""The driver of ``kvd demo --model``: it plays the router between the executors.

Two kvd daemons on loopback (:mod:`~kvd.demo.model.daemons`), a ctx executor process (TP1) that
prefills a batch of prompts of different lengths into its pool and publishes them, and
``gen_tp`` gen executor processes (one pool each, a torch.distributed group over loopback) that
expect the requests and decode greedily from the K/V kvd delivered. The result is compared with
the same model run in one process without kvd: the run passes when every token is identical and
logits are within the dtype's tolerance.
"""

from __future__ import annotations

import multiprocessing as mp
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from kvd.demo.launch import DaemonProcess
from kvd.demo.model import control as c
from kvd.demo.model.ctx import CtxSpec, ctx_main
from kvd.demo.model.daemons import dist_backend, gen_pool, start_daemons
from kvd.demo.model.gen import GenSpec, gen_main
from kvd.demo.model.names import LOGIT_TOLERANCE
from kvd.demo.model.options import DemoOptions, make_prompts
from kvd.demo.model.reference import Comparison, compare, reference_run
from kvd.demo.model.transformer import exact_float32


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
