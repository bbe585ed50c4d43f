"""What a newcomer hit walking the README, docs/getting-started.md and docs/integration.md
(eighth walk), each run for real: daemons in subprocesses on loopback, real sockets; the tests
synchronise on processes (their exit, the daemon's answer), never on time.

- ``kvd bench transfer --device cuda --help`` printed the host bench's options, whose
  ``--device`` help says "its own options: --device cuda --help": the GPU bench's options
  (``--gen-gpu``, which the README names) were nowhere to be seen;
- ``kvd --version`` and ``kvctl --version`` said "the following arguments are required:
  command";
- the first snippet of docs/integration.md used ``pool_layout``, ``PagedKV``, ``model_cfg`` and
  ``socket_path`` without saying where they come from: copied, it was a NameError;
- the getting-started scripts waited ``timeout_s=60``, the default deadline: a rank that never
  registered could surface as ``WaitTimeout`` ("it goes on") instead of the request's own
  ``TransferTimeout`` that says which ranks never came.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import pytest

from clients import Client
from kvd.config import TransferConfig
from kvd.demo.launch import DaemonProcess
from protocol.errors import TransferTimeout
from protocol.layout import KVLayout
from tests.conftest import host_pool
from tests.test_demo_cli import kvd
from tests.test_getting_started import DOC as GETTING_STARTED
from tests.test_getting_started import extract
from tests.test_kvctl import kvctl

ROOT = Path(__file__).resolve().parent.parent
INTEGRATION = ROOT / "docs" / "integration.md"


@pytest.mark.parametrize(
    "args", [("--device", "cuda", "--help"), ("--device=cuda", "-h"), ("--help", "--device", "cuda")]
)
def test_bench_transfer_device_cuda_help_lists_the_gpu_bench_options(args: tuple[str, ...]) -> None:
    run = kvd("bench", "transfer", *args, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: kvd bench transfer --device cuda"), run.stdout
    assert "--gen-gpu GEN_GPU" in run.stdout and "--geometry" not in run.stdout


def test_bench_transfer_help_without_cuda_is_still_the_host_bench_and_layouts_keep_theirs() -> None:
    host = kvd("bench", "transfer", "--help", timeout=120)
    assert host.returncode == 0, host.stderr
    assert "--geometry" in host.stdout and "--gen-gpu GEN_GPU" not in host.stdout
    assert "its own options: --device cuda --help" in " ".join(host.stdout.split())
    layouts = kvd("bench", "transfer", "--layout", "tp1-tp4", "--device", "cuda", "--help", timeout=120)
    assert layouts.returncode == 0, layouts.stderr
    assert "--ctx-gpus" in layouts.stdout and "--gen-gpu GEN_GPU" not in layouts.stdout


def test_version_flags_name_the_version_a_running_daemon_reports(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    installed = version("kvd")
    run = kvd("--version", timeout=60)
    assert (run.returncode, run.stdout) == (0, f"kvd {installed}\n"), run.stderr
    ctl = kvctl("--version")
    assert (ctl.returncode, ctl.stdout) == (0, f"kvctl (kvd {installed})\n"), ctl.stderr
    d = daemon_factory(name="version")
    status = kvctl("status", "--json", socket=d.socket_path)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["version"] == installed


def test_the_integration_attach_snippet_runs_as_written(
    daemon_factory: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    """The page's first snippet, copied verbatim (its socket path pointed at a test daemon whose
    ``ctx0`` pool has the demo model's geometry), runs: every name it uses is imported or set."""
    text = INTEGRATION.read_text()
    match = re.search(r"<!-- integration: attach snippet -->\n```python\n(.*?)```", text, re.S)
    assert match, "the marked snippet is gone from docs/integration.md"
    snippet = match.group(1)
    assert snippet.count('"/run/kvd/kvd.sock"') == 1
    d = daemon_factory({"pools": [host_pool("ctx0", tokens_per_block=16)]}, name="ctx")
    script = short_tmp / "attach.py"
    script.write_text(
        snippet.replace("/run/kvd/kvd.sock", d.socket_path)
        + "print(layout.tp_size, layout.tokens_per_block, list(cache.view.shape))\n"
    )
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=short_tmp
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == "1 16 [64, 4, 2, 8, 16, 64]\n"


def test_the_getting_started_waits_outlast_the_default_deadline() -> None:
    files, _ = extract(GETTING_STARTED.read_text())
    deadline = TransferConfig().deadline_s
    for name in ("ctx_executor.py", "gen_rank.py"):
        waits = [float(t) for t in re.findall(r"\.wait\(\"req-1\", timeout_s=(\d+(?:\.\d+)?)\)", files[name])]
        assert waits and all(t > deadline for t in waits), (name, waits, deadline)
    page = " ".join(GETTING_STARTED.read_text().split())
    assert f"longer than the request's deadline (`transfer.deadline_s`, {deadline:g} s)" in page


def test_a_wait_longer_than_the_deadline_gets_the_reason(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    """What the page promises for a wait that outlasts the deadline: a rank that never registers
    is named in the error the wait raises."""
    pool = host_pool("gen0", tokens_per_block=16, tp_size=2, rank=0)
    d = daemon_factory({"pools": [pool]}, name="gen")
    layout = KVLayout(
        num_layers=4, num_kv_heads=8, head_dim=64, tokens_per_block=16, dtype="bfloat16", tp_size=2
    )
    with Client(d.socket_path, client="gen-rank0") as client:
        ids = client.alloc("gen0", 2)
        client.expect("lonely", "gen0", layout, 0, ids, deadline_s=0.5)
        with pytest.raises(TransferTimeout, match=r"ranks \[1\] never registered \(1 of 2 did\)"):
            client.wait("lonely", timeout_s=30)
        client.free("gen0", ids)
