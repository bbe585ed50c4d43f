"""kvd.demo.connector, the connector step loop docs/integration.md describes, run for real:
two daemons, a ctx TP1 worker and two gen TP2 ranks as separate processes over NIXL, many
requests in flight, aborts from both sides, every byte checked by the workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvd.demo.connector import main, schedule
from kvd.demo.launch import DaemonProcess
from protocol.layout import KVLayout
from tests.layout_fields import Geometry
from tests.transfer_harness import start_pair

GEOMETRY: Geometry = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 32, "tokens_per_block": 16, "dtype": "bfloat16"}
CTX = KVLayout(**GEOMETRY, tp_size=1)
GEN = KVLayout(**GEOMETRY, tp_size=2, axis_order=("layer", "kv", "block", "head", "token", "dim"))
ROOT = Path(__file__).resolve().parent.parent


def worker(socket_path: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-m", "kvd.demo.connector", "--socket", socket_path, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def finish(proc: subprocess.Popen[str]) -> tuple[int, dict[str, object], str]:
    out, err = proc.communicate(timeout=300)  # a hang guard, not a timing assertion
    lines = out.strip().splitlines()
    return proc.returncode, json.loads(lines[-1]) if lines else {}, err


def test_step_loop_workers_move_every_request_and_abort_from_both_sides(
    daemon_factory: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    pair = start_pair(daemon_factory, short_tmp, CTX, GEN, num_blocks=320)
    requests = 48
    run = ["--requests", str(requests), "--seed", "5"]
    gens = [worker(pair.gen.socket_path, "--role", "gen", "--pool", f"gen{r}", "--peer", "ctx", "--window", "48",
                   *run) for r in (0, 1)]
    # ctx starts at once: its offers cross gen's unasked destinations (both sides must agree
    # on every request; a data-done once overtook its path message on the link there)
    ctx = worker(pair.ctx.socket_path, "--role", "ctx", "--pool", "ctx0", "--peer", "gen", "--window", "24", *run)
    results = [finish(p) for p in (ctx, *gens)]
    aborted = sum(1 for r in schedule(requests, 5) if r.aborted_by)
    for rc, summary, err in results:
        assert rc == 0, (summary["outcomes"], summary["unexpected"], err[-2000:])
        outcomes = summary["outcomes"]
        assert isinstance(outcomes, dict)
        assert set(outcomes) <= {"ok", "transfer_cancelled"}, summary
        assert sum(outcomes.values()) == requests, summary
        assert outcomes.get("ok", 0) >= requests - aborted, summary
        assert summary["mismatch"] == 0


def test_step_loop_reports_a_request_that_fails_for_another_reason(
    daemon_factory: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    """A gen rank alone (its ctx never publishes, its other rank never registers) sees each request
    end at its deadline: the worker names it and exits 1 instead of counting it as an abort."""
    pair = start_pair(daemon_factory, short_tmp, CTX, GEN, num_blocks=16)
    gen = worker(pair.gen.socket_path, "--role", "gen", "--pool", "gen0", "--requests", "2", "--seed", "9",
                 "--deadline", "1")
    rc, summary, err = finish(gen)
    assert rc == 1, (summary, err[-2000:])
    assert summary["outcomes"] == {"transfer_timeout": 2}
    unexpected = summary["unexpected"]
    assert isinstance(unexpected, list) and "missed its deadline" in unexpected[0]


def test_a_ctx_worker_must_name_the_gen_node() -> None:
    with pytest.raises(SystemExit, match="--peer"):
        main(["--socket", "/nonexistent.sock", "--role", "ctx", "--pool", "ctx0"])
