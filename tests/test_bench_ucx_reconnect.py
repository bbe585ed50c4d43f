"""``python -m kvd.bench.ucx_reconnect``: the diagnostic of what a removed and reloaded NIXL remote
agent leaves open runs with real NIXL agents in two processes, and refuses a bad cycle count.

Its figures (one ESTABLISHED connection more per cycle while the peer lives, with nixl-cu13
1.5.1) are in docs/security.md; this test checks what must hold whatever NIXL version is
installed: every cycle is reported, and once the peer process has exited this process holds no
more TCP connections than it did at the start.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, UCX_NET_DEVICES="lo")
    return subprocess.run([sys.executable, "-m", "kvd.bench.ucx_reconnect", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def _counts(line: str) -> dict[str, int]:
    counts = ast.literal_eval(line[line.rindex("{"):])
    assert isinstance(counts, dict)
    return counts


def test_cycles_are_reported_and_nothing_is_left_once_the_peer_exits() -> None:
    result = _run("--cycles", "2", "--side", "both")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["start", "cycle 1", "cycle 2", "peer exited"]
    start, end = _counts(lines[0]), _counts(lines[-1])
    assert end.get("tcp_established", 0) <= start.get("tcp_established", 0)
    assert end["fds"] <= start["fds"]


def test_no_cycles_is_refused() -> None:
    result = _run("--cycles", "0")
    assert result.returncode == 2
    assert "--cycles must be at least 1" in result.stderr


def test_reloading_a_live_peer_without_removing_it_adds_no_connections() -> None:
    """What a kvd-side mitigation would rest on (docs/security.md): loading a live peer's agent
    again without removing it first leaves no connection behind, cycle after cycle."""
    result = _run("--cycles", "3", "--no-remove")
    assert result.returncode == 0, result.stderr
    afters = [_counts(line) for line in result.stdout.splitlines() if line.startswith("cycle")]
    assert len(afters) == 3
    assert afters[-1].get("tcp_established", 0) <= afters[0].get("tcp_established", 0)
