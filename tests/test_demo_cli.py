"""``kvd demo``, as the README's quick start runs it, and the sizes it and ``kvd bench transfer``
refuse before anything starts: a usage error (exit 2, one ``error:`` line), never a daemon that
refuses its own configuration or a traceback from a torch allocation."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvd.demo.pair import DEMO_COPIES, GEOMETRY, host_memory_available, too_large
from protocol.layout import KVLayout

ROOT = Path(__file__).resolve().parent.parent
BLOCK_BYTES = KVLayout(**GEOMETRY).block_bytes(0)  # 2.25 MiB


def readme_demo_command() -> list[str]:
    """The ``kvd ...`` part of the README's demo command (the part before it builds the venv)."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- demo-command -->\n```sh\n(.*?)```", readme, re.S)
    assert block is not None, "the README lost its demo-command block"
    last = block.group(1).strip().split("&&")[-1]
    argv = shlex.split(last)
    assert argv[0] == ".venv/bin/kvd", argv  # the venv the same line built
    return argv[1:]


def kvd(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    return subprocess.run([sys.executable, "-m", "kvd", *args], capture_output=True, text=True, timeout=timeout,
                          env={**env, "UCX_NET_DEVICES": "lo"}, stdin=subprocess.DEVNULL)


def test_the_readme_demo_command_runs() -> None:
    args = readme_demo_command()
    assert args == ["demo", "--no-mapped"]
    run = kvd(*args)
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert "verification: byte-exact on all 4 gen ranks" in run.stdout
    # table cells: executor, bytes, MiB, GB/s, path, ... (the box characters dropped)
    rows = [[cell for cell in line.split() if cell.isascii()] for line in run.stdout.splitlines()
            if re.match(r"\W*(ctx0|gen[0-3]) ", line)]
    assert sorted(row[0] for row in rows) == ["ctx0", "gen0", "gen1", "gen2", "gen3"], run.stdout
    assert {row[4] for row in rows} == {"bounce"}, run.stdout  # --no-mapped: the NIXL path
    # every row shows the whole request's bytes (32 blocks by default), which the caption explains
    assert {row[1] for row in rows} == {str(32 * BLOCK_BYTES)}, run.stdout
    assert "bytes: the whole request, all ranks of that side together" in run.stdout


def test_demo_keep_keeps_the_configs_and_logs_only() -> None:
    """``--keep`` prints the directory; it holds what a user reads or reruns (the two configs, their
    logs, the peer secret), not the notify sockets the demo stood in for systemd with."""
    run = kvd("demo", "--blocks", "1", "--keep")
    assert run.returncode == 0, (run.stdout, run.stderr)
    kept = re.search(r"^work directory kept: (.+)$", run.stdout, re.M)
    assert kept is not None, run.stdout
    workdir = Path(kept.group(1))
    try:
        names = sorted(p.name for p in workdir.iterdir())
        assert names == ["ctx.log", "ctx.toml", "gen.log", "gen.toml", "peer.secret"], names
    finally:
        shutil.rmtree(workdir)


def usage_error(run: subprocess.CompletedProcess[str], prog: str, says: str) -> None:
    assert run.returncode == 2, (run.returncode, run.stdout, run.stderr)
    assert "Traceback" not in run.stderr and run.stdout == ""
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert errors == [f"{prog}: error: {says}"], run.stderr


@pytest.mark.parametrize(("args", "says"), [
    (["--blocks", "0"], "argument --blocks: must be at least 1, got 0"),
    (["--blocks", "many"], "argument --blocks: not an integer: 'many'"),
    (["--chunk-mb", "-8"], "argument --chunk-mb: must be at least 1, got -8"),
])
def test_demo_refuses_a_bad_size(args: list[str], says: str) -> None:
    usage_error(kvd("demo", *args, timeout=60), "kvd demo", says)


def test_demo_refuses_a_request_larger_than_memory() -> None:
    """As many blocks as the available memory holds once: the demo needs three copies."""
    blocks = host_memory_available() // BLOCK_BYTES
    run = kvd("demo", "--blocks", str(blocks), timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    line = run.stderr.splitlines()[-1]
    assert line.startswith(f"kvd demo: error: --blocks {blocks}: a request of "), line
    assert "GiB of host memory (ctx pool, gen pools, the executor's copy)" in line
    assert re.search(r"give fewer --blocks \(at most \d+\)$", line), line


def test_too_large_is_exact_at_the_bound() -> None:
    request = BLOCK_BYTES * 32
    assert too_large(32, DEMO_COPIES * request) == ""  # the default demo fits in exactly this
    why = too_large(32, DEMO_COPIES * request - 1)
    assert why.startswith("--blocks 32: a request of 0.1 GiB needs about 0.2 GiB") and why.endswith("(at most 31)")


@pytest.mark.parametrize(("args", "says"), [
    (["--blocks", "0"], "argument --blocks: must be at least 1, got 0"),
    (["--sizes", "1,x"], "argument --sizes: not an integer: 'x'"),
    (["--sizes", "4,0"], "argument --sizes: must be at least 1, got 0"),
    (["--repeat", "0"], "argument --repeat: must be at least 1, got 0"),
])
def test_bench_transfer_refuses_a_bad_size(args: list[str], says: str) -> None:
    usage_error(kvd("bench", "transfer", *args, timeout=60), "kvd bench transfer", says)


@pytest.mark.parametrize("option", ["--blocks", "--sizes"])
def test_bench_transfer_refuses_a_request_larger_than_memory(option: str) -> None:
    """It checked nothing: ``--blocks 20000`` ran the whole latency table, then failed with the gen
    daemon's startup log, twice over and saying to lower ``num_blocks`` (no option of the bench)."""
    blocks = host_memory_available() // BLOCK_BYTES
    args = ["--blocks", str(blocks)] if option == "--blocks" else ["--sizes", f"1,{blocks}", "--latency-only"]
    run = kvd("bench", "transfer", *args, timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr and run.stdout == "", (run.stdout, run.stderr)
    line = run.stderr.splitlines()[-1]
    assert line.startswith(f"kvd bench transfer: error: {option} {blocks}: a request of "), line
    assert re.search(rf"give fewer {option} \(at most \d+\)$", line), line


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="the refusal of a machine without GPU 1")
def test_bench_transfer_on_cuda_without_the_gpu_is_one_error_line() -> None:
    """``--device cuda`` on a machine without GPU 1 (the gen pools' default): one error line on
    stderr, as every other refusal of the bench, exit 2 (it printed to stdout, without 'error:')."""
    run = kvd("bench", "transfer", "--device", "cuda", timeout=60)
    assert run.returncode == 2 and run.stdout == "" and "Traceback" not in run.stderr, (run.stdout, run.stderr)
    assert run.stderr.splitlines()[-1].startswith(
        "kvd bench transfer: error: --device cuda puts the gen pools on GPU 1: this machine has "), run.stderr
