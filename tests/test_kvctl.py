"""Issue 7, kvctl: every subcommand run as a subprocess against a real daemon, for people
(tables) and for scripts (``--json``), with the exit codes scripts rely on: 0 ok, 1 the
daemon answered with an error, 2 usage error, 3 the daemon cannot be reached."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from clients import Client
from clients.kvctl import _bar, _transfer_rows
from kvd.demo.launch import DaemonProcess, start_daemon
from protocol import messages as m
from protocol.layout import KVLayout
from tests.conftest import host_pool

MAX_SESSIONS = 6


def kvctl(*args: str, socket: str | None = None, env: dict[str, str] | None = None,
          timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run the kvctl console script (``python -m clients.kvctl``) as a subprocess."""
    cmd = [sys.executable, "-m", "clients.kvctl"]
    if socket is not None:
        cmd += ["--socket", socket]
    full_env = {k: v for k, v in os.environ.items() if k != "KVD_SOCKET"}
    full_env.update({"COLUMNS": "200", **(env or {})})  # wide enough that rich does not wrap the tables
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, env=full_env)


def ok_json(*args: str, socket: str) -> Any:
    run = kvctl("--json", *args, socket=socket)
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert run.stderr == ""
    return json.loads(run.stdout)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[DaemonProcess, Client, KVLayout]]:
    """A daemon with an executor session holding 3 blocks and one registered request."""
    workdir = tempfile.mkdtemp(prefix="kvdc-", dir="/tmp")
    cfg = {
        "pools": [host_pool("host0"), host_pool("host1", num_blocks=16)],
        "transfer": {"bounce_size_mb": 16, "chunk_mb": 2},
        "limits": {"max_sessions": MAX_SESSIONS},
    }
    d = start_daemon(cfg, workdir=workdir, name="ctl")
    holder = Client(d.socket_path, client="holder", timeout=10)
    try:
        layout = holder.pools()[0].layout
        ids = holder.alloc("host0", 3)
        holder.expect("req-pending", "host0", layout, 0, ids[:2], deadline_s=600)
        yield d, holder, layout
    finally:
        holder.close()
        d.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def test_status_and_stats(served: Any) -> None:
    d, _holder, _layout = served
    st = ok_json("status", socket=d.socket_path)
    assert st["node"] == "ctl" and st["draining"] is False
    assert st["sessions"] == 2  # the holder and kvctl itself
    assert st["blocks_leased"] == 3 and st["requests_registered"] >= 1
    assert [p["name"] for p in st["pools"]] == ["host0", "host1"]
    assert ok_json("stats", socket=d.socket_path)["blocks_leased"] == 3

    run = kvctl("status", socket=d.socket_path)
    assert run.returncode == 0 and run.stderr == ""
    out = run.stdout
    assert "kvd " in out and "on node ctl" in out and "serving" in out
    assert "sessions 2, blocks leased 3" in out
    assert "host0" in out and "host1" in out and "pools" in out  # the pools table
    run = kvctl("stats", socket=d.socket_path)
    assert run.returncode == 0 and "bounce chunks in use 0/" in run.stdout and "host1" not in run.stdout


def test_ping_pools_sessions(served: Any) -> None:
    d, _holder, _layout = served
    pong = ok_json("ping", socket=d.socket_path)
    assert pong["ok"] is True and pong["rtt_us"] > 0
    run = kvctl("ping", socket=d.socket_path)
    assert run.returncode == 0 and run.stdout.startswith("pong from ctl in ")

    pools = {p["name"]: p for p in ok_json("pools", socket=d.socket_path)}
    assert pools["host0"]["kind"] == "host"
    assert pools["host0"]["blocks_used"] == 3 and pools["host0"]["blocks_free"] == 61
    assert pools["host1"]["blocks_used"] == 0 and pools["host1"]["num_blocks"] == 16
    run = kvctl("pools", socket=d.socket_path)
    assert run.returncode == 0
    row = next(line for line in run.stdout.splitlines() if "host0" in line)
    cells = [c.strip() for c in row.split("│")[1:-1]]
    assert cells[:6] == ["host0", "host", "-1", "-", "3", "61"]

    sessions = {s["client"]: s for s in ok_json("sessions", socket=d.socket_path)}
    assert sessions["holder"]["blocks_leased"] == 3 and sessions["holder"]["requests"] == 1
    assert sessions["holder"]["pid"] == os.getpid() and sessions["holder"]["uid"] == os.getuid()
    assert "kvctl" in sessions  # its own session
    run = kvctl("sessions", socket=d.socket_path)
    assert run.returncode == 0 and "holder" in run.stdout and "kvctl" in run.stdout


def test_transfers_once_and_watched(served: Any) -> None:
    d, _holder, _layout = served
    ts = ok_json("transfers", socket=d.socket_path)
    assert [(t["request_id"], t["role"]) for t in ts] == [("req-pending", "gen")]
    assert ts[0]["state"] != "done" and ts[0]["error"] == ""

    # --count N: N listings, one JSON array per line (for scripts)
    run = kvctl("transfers", "--json", "--count", "3", "--interval", "0.05", socket=d.socket_path)
    assert run.returncode == 0, run.stderr
    listings = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(listings) == 3 and all(lst[0]["request_id"] == "req-pending" for lst in listings)
    assert listings[2][0]["duration_s"] > listings[0][0]["duration_s"]  # live: it is re-read

    # --watch for people: refreshed tables until Ctrl-C, which ends it cleanly (exit 0)
    proc = subprocess.Popen(
        [sys.executable, "-m", "clients.kvctl", "-s", d.socket_path, "transfers", "--watch", "-n", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"},
    )
    try:
        lines: list[str] = []
        assert proc.stdout is not None
        while sum("transfers at" in line for line in lines) < 3:
            line = proc.stdout.readline()
            assert line, proc.stderr.read() if proc.stderr else ""
            lines.append(line)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert any("req-pending" in line and "gen" in line for line in lines)


def test_progress_column() -> None:
    running = m.TransferInfo(request_id="r", role="ctx", peer="gen", state="streaming", bytes_total=4 << 20,
                             bytes_done=1 << 20, chunks_total=4, chunks_done=1, path="bounce", duration_s=0.5)
    row = _transfer_rows([running])[0]
    assert row[:6] == ["r", "ctx", "gen", "streaming", "bounce", "1/4"]
    assert row[6] == "1.0 MiB / 4.0 MiB"
    assert row[7] == "[=====>              ]  25%"
    assert _bar(0, 0) == "-" and _bar(5, 5).endswith("] 100%")


def test_config(served: Any) -> None:
    d, _holder, _layout = served
    cfg = ok_json("config", socket=d.socket_path)
    assert cfg["node"] == "ctl" and cfg["socket_path"] == d.socket_path
    assert cfg["limits"]["max_sessions"] == MAX_SESSIONS
    assert [p["name"] for p in cfg["pools"]] == ["host0", "host1"]
    run = kvctl("config", socket=d.socket_path)
    assert run.returncode == 0 and json.loads(run.stdout) == cfg  # indented for people, same content
    assert run.stdout.count("\n") > 20
    # options after the command work too, and $KVD_SOCKET is the default socket
    run = kvctl("config", "--json", env={"KVD_SOCKET": d.socket_path})
    assert run.returncode == 0 and json.loads(run.stdout) == cfg


def test_exit_code_1_when_the_daemon_refuses(served: Any) -> None:
    d, _holder, _layout = served
    extra = [Client(d.socket_path, client=f"filler{i}", timeout=10) for i in range(MAX_SESSIONS - 1)]
    try:
        run = kvctl("status", socket=d.socket_path)
        assert run.returncode == 1, (run.stdout, run.stderr)
        assert run.stdout == ""
        assert run.stderr.strip() == f"kvctl: [limit_exceeded] max_sessions={MAX_SESSIONS} reached; try again later"
    finally:
        for c in extra:
            c.close()


@pytest.mark.parametrize(
    "args",
    [
        [],  # no command
        ["frobnicate"],
        ["status", "--bogus"],
        ["transfers", "--interval", "0"],
        ["transfers", "--count", "-1"],
        ["--timeout", "soon", "status"],
    ],
)
def test_exit_code_2_on_usage_errors(args: list[str]) -> None:
    run = kvctl(*args, socket="/nonexistent/kvd.sock")
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert "usage: kvctl" in run.stderr


def test_help_exits_0() -> None:
    run = kvctl("--help")
    assert run.returncode == 0 and "exit codes: 0 ok" in run.stdout


def test_exit_code_3_when_unreachable(short_tmp: Any) -> None:
    run = kvctl("status", socket=str(short_tmp / "nobody-listens.sock"))
    assert run.returncode == 3
    assert "cannot connect to kvd at" in run.stderr and "No such file or directory" in run.stderr
    # a stale socket file nobody listens on
    import socket as stdsocket

    stale = stdsocket.socket(stdsocket.AF_UNIX)
    stale.bind(str(short_tmp / "stale.sock"))
    stale.close()
    run = kvctl("--json", "pools", env={"KVD_SOCKET": str(short_tmp / "stale.sock")})
    assert run.returncode == 3 and "Connection refused" in run.stderr and run.stdout == ""


def test_drain(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory(name="drainme")
    run = kvctl("drain", socket=d.socket_path)
    assert run.returncode == 0, run.stderr
    assert "draining" in run.stdout
    assert d.proc.wait(20) == 0
    assert "drain requested by client" in d.log()
    run = kvctl("status", socket=d.socket_path)
    assert run.returncode == 3
