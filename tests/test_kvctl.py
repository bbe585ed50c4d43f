"""kvctl: every subcommand run as a subprocess against a real daemon, for people
(tables) and for scripts (``--json``), with the exit codes scripts rely on: 0 ok, 1 the
daemon answered with an error, 2 usage error, 3 the daemon cannot be reached."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from clients import Client
from clients.kvctl import _bar, _size, _transfer_rows, fetch_pages
from kvd.demo.launch import DaemonProcess, start_daemon
from protocol import messages as m
from protocol.errors import TransferCancelled
from protocol.layout import KVLayout
from tests.conftest import host_pool
from tests.ports import unused_port

MAX_SESSIONS = 6


def kvctl(*args: str, socket: str | None = None, env: dict[str, str] | None = None,
          timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run the kvctl console script (``python -m clients.kvctl``) as a subprocess."""
    cmd = [sys.executable, "-m", "clients.kvctl"]
    if socket is not None:
        cmd += ["--socket", socket]
    full_env = {k: v for k, v in os.environ.items() if k != "KVD_SOCKET"}
    full_env.update(env or {})
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
        "limits": {"max_sessions": MAX_SESSIONS, "operator_reserve": 0},  # root (tests) is an operator
    }
    d = start_daemon(cfg, workdir=workdir, name="ctl")
    holder = Client(d.socket_path, client="holder", timeout=10)
    try:
        layout = holder.pools()[0].layout
        assert layout is not None
        ids = holder.alloc("host0", 3)
        holder.expect("req-pending", "host0", layout, 0, ids[:2], deadline_s=600)
        yield d, holder, layout
    finally:
        holder.close()
        d.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def _only_holder(holder: Client) -> None:
    """Wait until the holder's session is the daemon's only one: an earlier kvctl run has
    exited, but the daemon ends its session when it reads the hang-up, a moment later."""
    _until(lambda: holder.stats().sessions == 1, "the sessions of earlier kvctl runs to end")


def test_status_and_stats(served: Any) -> None:
    d, holder, _layout = served
    _only_holder(holder)
    st = ok_json("status", socket=d.socket_path)
    assert st["node"] == "ctl" and st["draining"] is False
    assert st["sessions"] == 2  # the holder and kvctl itself
    assert st["blocks_leased"] == 3 and st["requests_registered"] >= 1
    assert [p["name"] for p in st["pools"]] == ["host0", "host1"]
    assert ok_json("stats", socket=d.socket_path)["blocks_leased"] == 3

    _only_holder(holder)
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
    assert row.split()[:6] == ["host0", "host", "-", "-", "3", "61"]  # plain columns; a host pool has no GPU
    assert pools["host0"]["device"] == -1  # JSON keeps the number

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
        # Ctrl-C as at a terminal: a suite started in the background (nohup ... &) hands its
        # children SIGINT ignored, and kvctl rightly leaves an ignored SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
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


def test_chunks_and_sizes_of_small_and_unchunked_transfers() -> None:
    """A direct transfer plans no chunks (chunks_total 0) but counts the writes that landed: it
    read ``1/0``; a 24 KiB request read ``0.0 MiB / 0.0 MiB``; one not started, ``0/0``."""
    direct = m.TransferInfo(request_id="d", role="ctx", peer="gen", state="done", bytes_total=24576,
                            bytes_done=24576, chunks_total=0, chunks_done=1, path="direct", duration_s=0.03)
    waiting = m.TransferInfo(request_id="w", role="gen", peer="ctx", state="dest_out")
    assert _transfer_rows([direct])[0][5:7] == ["1", "24.0 KiB / 24.0 KiB"]
    assert _transfer_rows([waiting])[0][5:7] == ["-", "0 B"]
    assert [_size(n) for n in (0, 1023, 1024, 917504, 1 << 20, 3 << 30)] == [
        "0 B", "1023 B", "1.0 KiB", "896.0 KiB", "1.0 MiB", "3.00 GiB"]


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
    d, holder, _layout = served
    _only_holder(holder)  # else a slot still held by an earlier kvctl's session refuses a filler
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
        ["sessions", "--limit", "-1"],
        ["sessions", "--offset", "many"],
        ["transfers", "--page-size", "0"],
        ["transfers", "--offset", "-3"],
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
    assert "is kvd running with this socket_path? Give its socket with --socket PATH or KVD_SOCKET" in run.stderr
    # a stale socket file nobody listens on
    import socket as stdsocket

    stale = stdsocket.socket(stdsocket.AF_UNIX)
    stale.bind(str(short_tmp / "stale.sock"))
    stale.close()
    run = kvctl("--json", "pools", env={"KVD_SOCKET": str(short_tmp / "stale.sock")})
    assert run.returncode == 3 and "Connection refused" in run.stderr and run.stdout == ""
    assert "a socket file is there but no daemon answers: a killed daemon leaves it behind" in run.stderr
    assert len(run.stderr.splitlines()) == 1  # one line, the hint included


@pytest.mark.parametrize("given", ["kvd.toml", "a-directory"])
def test_unreachable_because_the_path_is_no_socket(short_tmp: Path, given: str) -> None:
    """``--socket kvd.toml`` (the configuration for the socket) or a directory: connect() says
    "Connection refused" there too, which must not read as a dead daemon."""
    path = short_tmp / given
    if given == "a-directory":
        path.mkdir()
        what = "is a directory"
    else:
        path.write_text('socket_path = "kvd.sock"\n')
        what = "is not a socket"
    run = kvctl("status", socket=str(path))
    assert run.returncode == 3 and run.stdout == "", (run.returncode, run.stdout, run.stderr)
    assert run.stderr.splitlines() == [run.stderr.rstrip("\n")]  # one line
    assert f"cannot connect to kvd at {path}: Connection refused; {path} {what}: give the daemon's socket_path" in run.stderr
    assert "not its configuration file, with --socket PATH or KVD_SOCKET" in run.stderr
    assert "no daemon answers" not in run.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run kvctl as another user")
def test_unreachable_for_lack_of_permission_says_why(daemon_factory: Callable[..., DaemonProcess],
                                                     short_tmp: Path) -> None:
    d = daemon_factory(name="private")  # socket mode 0660, owner and group root
    os.chmod(short_tmp, 0o755)
    cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
           sys.executable, "-m", "clients.kvctl", "-s", d.socket_path, "status"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert run.returncode == 3, (run.stdout, run.stderr)
    assert "Permission denied" in run.stderr
    assert "this user may not open the socket: kvd lets in root, its own user and members of its group" in run.stderr


def test_a_reader_that_closes_the_pipe_is_not_an_error(served: Any) -> None:
    """kvctl transfers | grep -q req-1: grep exits at its first match and closes the pipe; kvctl
    must end quietly with 0 (no BrokenPipeError traceback, no failure under pipefail)."""
    d, _holder, _layout = served
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before kvctl writes a byte: every write gets EPIPE
    try:
        run = subprocess.run([sys.executable, "-m", "clients.kvctl", "-s", d.socket_path, "config"],
                             stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""


def test_drain(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory(name="drainme")
    run = kvctl("drain", socket=d.socket_path)
    assert run.returncode == 0, run.stderr
    assert "draining" in run.stdout
    assert d.proc.wait(20) == 0
    assert "drain requested by client" in d.log()
    run = kvctl("status", socket=d.socket_path)
    assert run.returncode == 3


# --- output off a terminal, finished transfers, peers ------------------------------------------


def test_tables_are_plain_and_whole_off_a_terminal(served: Any) -> None:
    """A pipe gets plain columns at full width whatever COLUMNS says; a terminal gets rich tables."""
    d, _holder, _layout = served
    run = kvctl("pools", socket=d.socket_path, env={"COLUMNS": "20"})
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "pools"
    assert lines[1].split() == ["pool", "kind", "device", "fallback", "used", "free", "sessions", "size"]
    assert lines[2].split() == ["host0", "host", "-", "-", "3", "61", "1", "16.0", "MiB"]
    assert lines[3].split() == ["host1", "host", "-", "-", "0", "16", "0", "4.0", "MiB"]
    assert "│" not in run.stdout and "…" not in run.stdout

    import pty

    leader, follower = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "clients.kvctl", "-s", d.socket_path, "pools"],
                              stdout=follower, stderr=subprocess.PIPE, timeout=30,
                              env={**os.environ, "COLUMNS": "120", "TERM": "dumb"})
        os.close(follower)
        follower = -1
        out = b""
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's other end is closed and drained
                break
            if not data:
                break
            out += data
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    assert proc.returncode == 0, proc.stderr
    text = out.decode()
    assert "│" in text and "host0" in text  # rich's table on a terminal


def test_plain_columns_never_cut() -> None:
    from clients.kvctl import plain_columns

    long_error = "[transfer_timeout] request 'r' (gen) missed its deadline after 60.00s " * 3
    out = plain_columns(["request", "error"], [["r", long_error.strip()], ["a-much-longer-request-id", ""]])
    lines = out.splitlines()
    assert lines[0] == "request                   error"
    assert lines[1] == "r                         " + long_error.strip()
    assert lines[2] == "a-much-longer-request-id"


def test_finished_transfers_stay_listed_with_their_outcome(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory(name="hist")
    ctx = Client(d.socket_path, client="ctx", timeout=10)
    gen = Client(d.socket_path, client="gen", timeout=10)
    try:
        layout = ctx.pools()[0].layout
        assert layout is not None
        src, dst = ctx.alloc("host0", 2), gen.alloc("host0", 2)
        gen.expect("ok-1", "host0", layout, 0, dst)
        ctx.publish("ok-1", "host0", layout, 0, src, peer="hist")  # own node: a local transfer
        done = [ctx.wait("ok-1", timeout_s=30), gen.wait("ok-1", timeout_s=30)]
        assert all(c.ok and c.path == "local" for c in done)
        gen.expect("cancelled-1", "host0", layout, 0, dst)
        gen.cancel("cancelled-1")
        # both executors collected "ok-1": the engine forgot it, the listing keeps it
        listing = ok_json("transfers", socket=d.socket_path)
        by_key = {(t["request_id"], t["role"]): t for t in listing}
        assert set(by_key) == {("ok-1", "ctx"), ("ok-1", "gen"), ("cancelled-1", "gen")}
        for role, c in zip(("ctx", "gen"), done, strict=True):
            t = by_key[("ok-1", role)]
            assert t["state"] == "done" and t["path"] == "local" and t["error"] == ""
            assert t["bytes_done"] == c.bytes > 0 and t["duration_s"] == pytest.approx(c.duration_s)
        failed = by_key[("cancelled-1", "gen")]
        assert failed["state"] == "failed"
        assert failed["error"] == "[transfer_cancelled] request 'cancelled-1' cancelled by client"
        run = kvctl("transfers", socket=d.socket_path)
        assert run.returncode == 0, run.stderr
        rows = [line for line in run.stdout.splitlines() if line.startswith(("ok-1", "cancelled-1"))]
        assert len(rows) == 3
        assert rows[-1].split()[:4] == ["cancelled-1", "gen", "-", "failed"]  # no peer: it never matched
        assert rows[-1].endswith("[transfer_cancelled] request 'cancelled-1' cancelled by client")
    finally:
        ctx.close()
        gen.close()


def test_history_is_a_bounded_ring() -> None:
    from kvd.ops.history import HISTORY_SIZE, TransferHistory

    ring = TransferHistory()
    for i in range(HISTORY_SIZE + 44):
        info = m.TransferInfo(request_id=f"r{i}", role="gen", peer="p", state="receiving", started_s=float(i))
        ring.record(info, m.Completion(request_id=f"r{i}", ok=i % 2 == 0, bytes=i, duration_s=0.5, path="bounce",
                                       error_code="" if i % 2 == 0 else "peer_unavailable",
                                       error_message="" if i % 2 == 0 else "link lost"))
    assert len(ring) == HISTORY_SIZE == 256
    live = [m.TransferInfo(request_id="running", role="ctx", peer="p", state="streaming", started_s=1e6)]
    merged = ring.merged(live)
    assert merged[0].request_id == "running"
    assert [t.request_id for t in merged[1:]] == [f"r{i}" for i in range(44, HISTORY_SIZE + 44)]
    assert merged[-1].state == "failed" and merged[-1].error == "[peer_unavailable] link lost"
    assert merged[-2].state == "done" and merged[-2].bytes_done == HISTORY_SIZE + 42
    # a finished side the engine still holds is listed once, as recorded (whatever its live
    # started_s or duration say); one still running with a recorded id is listed as well
    still_held = msgspec.structs.replace(merged[-1], state="failed", duration_s=99.0, started_s=5.0)
    assert ring.merged([still_held]) == merged[1:]
    rerun = msgspec.structs.replace(merged[-1], state="streaming")
    assert ring.merged([rerun]) == [rerun, *merged[1:]]


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    """ctx and gen daemons linked over loopback (ctx lists gen in [[peers]])."""
    from kvd.demo.pair import start_pair

    workdir = Path(tempfile.mkdtemp(prefix="kvdp-", dir="/tmp"))
    ctx_d, gen_d = start_pair(workdir, gen_tp=1, blocks=4, bounce_mb=8, chunk_mb=2,
                              extra_transfer={"mapped": False})
    try:
        yield ctx_d, gen_d
    finally:
        ctx_d.stop()
        gen_d.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _until(predicate: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll a daemon-side condition (each probe is a round trip to the daemon)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_peers_and_ctx_duration_from_the_match(pair: tuple[DaemonProcess, DaemonProcess]) -> None:
    ctx_d, gen_d = pair
    ctx = Client(ctx_d.socket_path, client="ctx", timeout=10)
    gen = Client(gen_d.socket_path, client="gen", timeout=10)
    try:
        peers = _until(lambda: [p for p in ctx.peers() if p.state == "up"], "the link ctx -> gen")
        assert [(p.node, p.direction, p.remote) for p in peers] == [("gen", "outgoing", f"127.0.0.1:{gen_d.peer_port}")]
        back = _until(lambda: [p for p in gen.peers() if p.state == "up"], "the link on the gen side")
        assert [(p.node, p.direction) for p in back] == [("ctx", "incoming")]

        layout = ctx.pools()[0].layout
        gen_layout = gen.pools()[0].layout
        assert layout is not None and gen_layout is not None
        src, dst = ctx.alloc("ctx0", 2), gen.alloc("gen0", 2)
        ctx.publish("late-gen", "ctx0", layout, 0, src, peer="gen")
        # the ctx side is registered and offered; gen has not expected yet
        _until(lambda: [t for t in ctx.transfers() if t.request_id == "late-gen" and t.state == "offered"], "the offer")
        (up,) = ctx.peers()
        assert up.transfers_active == 1 and up.last_heard_s >= 0 and up.error == "" and not up.mapped
        run = kvctl("peers", socket=ctx_d.socket_path)
        assert run.returncode == 0, run.stderr
        row = run.stdout.splitlines()[2].split()
        assert row[:4] == ["gen", "up", "outgoing", f"127.0.0.1:{gen_d.peer_port}"] and row[-2:] == ["1", "no"]

        t0 = time.monotonic()
        gen.expect("late-gen", "gen0", gen_layout, 0, dst)
        done = ctx.wait("late-gen", timeout_s=60)
        elapsed = time.monotonic() - t0
        assert done.ok and done.path == "direct"
        # the ctx side waited for gen before t0; its duration counts from the match only
        assert done.duration_s <= elapsed, (done.duration_s, elapsed)
        assert gen.wait("late-gen", timeout_s=60).duration_s <= time.monotonic() - t0
        ctx.ping()  # the ctx daemon's step that replied (and then logged transfer.done) has ended
        line = next(json.loads(raw) for raw in ctx_d.log().splitlines()
                    if '"transfer.done"' in raw and '"late-gen"' in raw)
        assert line["duration_s"] == pytest.approx(done.duration_s, abs=1e-5)
        assert line["round_trips"] == 1 and "planned" in line["stages"]  # the offer waited for gen's accept
        assert [p.transfers_active for p in ctx.peers()] == [0]
        # gen's expect named no peer: its row names the daemon that matched it
        (row_gen,) = [t for t in gen.transfers() if t.request_id == "late-gen"]
        assert row_gen.peer == "ctx" and row_gen.state == "done"
        # the direct path plans no chunks: its chunks cell counts the writes that landed (it read "1/0")
        run = kvctl("transfers", socket=ctx_d.socket_path)
        row = next(line for line in run.stdout.splitlines() if line.startswith("late-gen")).split()
        assert row[3:5] == ["done", "direct"] and re.fullmatch(r"([1-9]\d*)/\1", row[5]), row  # writes done/planned
    finally:
        ctx.close()
        gen.close()


def test_peer_not_connected_shows_why(daemon_factory: Callable[..., DaemonProcess], short_tmp: Path) -> None:
    from kvd.demo.pair import write_secret

    port = unused_port()  # nobody listens there
    d = daemon_factory({"peer_secret_file": write_secret(short_tmp),
                        "peers": [{"name": "ghost", "host": "127.0.0.1", "port": port}]}, name="lonely")
    _until(lambda: ok_json("peers", socket=d.socket_path)[0]["error"], "a failed connection attempt")
    (ghost,) = ok_json("peers", socket=d.socket_path)
    assert ghost["node"] == "ghost" and ghost["state"] == "connecting" and ghost["direction"] == "outgoing"
    assert ghost["remote"] == f"127.0.0.1:{port}" and ghost["last_heard_s"] == -1.0
    assert "refused" in ghost["error"].lower(), ghost
    run = kvctl("peers", socket=d.socket_path)
    assert run.returncode == 0 and run.stdout.splitlines()[2].split()[:5] == [
        "ghost", "connecting", "outgoing", f"127.0.0.1:{port}", "never"]


def test_kvd_bench_help_exits_0() -> None:
    run = subprocess.run([sys.executable, "-m", "kvd", "bench", "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: kvd bench {ipc,regroup,transfer}")
    for name in ("ipc", "regroup", "transfer"):
        assert f"\n  {name} " in run.stdout
    run = subprocess.run([sys.executable, "-m", "kvd", "bench"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "which benchmark?" in run.stderr
    run = subprocess.run([sys.executable, "-m", "kvd", "bench", "transfer", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0 and "--blocks" in run.stdout  # the benchmark's own options


def test_ping_wait_retries_until_the_daemon_is_up(daemon_factory: Callable[..., DaemonProcess],
                                                   short_tmp: Path) -> None:
    path = str(short_tmp / "later.sock")
    waiter = subprocess.Popen([sys.executable, "-m", "clients.kvctl", "-s", path, "ping", "--wait", "120"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        daemon_factory({"socket_path": path}, name="later")  # kvctl is already retrying, or finds it up
        out, err = waiter.communicate(timeout=120)
    finally:
        waiter.kill()
    assert waiter.returncode == 0, err
    assert out.startswith("pong from later in ")
    run = kvctl("ping", "--wait", "0.3", socket=str(short_tmp / "never.sock"))
    assert run.returncode == 3 and "cannot connect to kvd at" in run.stderr


# --- paged lists ---------------------------------------------------------------------------------


def test_lists_follow_the_pages_to_the_end(daemon_factory: Callable[..., DaemonProcess]) -> None:
    """More sessions and transfers than one page: kvctl shows all of them (in the daemon's order),
    ``--offset``/``--limit`` pick a window of the same order, across page boundaries."""
    d = daemon_factory(name="paged")
    holders = [Client(d.socket_path, client=f"holder-{i}", timeout=10) for i in range(4)]
    try:
        layout = holders[0].pools()[0].layout
        assert layout is not None
        ids = holders[0].alloc("host0", 7)
        for i, b in enumerate(ids):
            holders[0].expect(f"req-{i}", "host0", layout, 0, [b], deadline_s=600)
        whole = [t.request_id for t in holders[1].transfers()]  # one reply: the daemon's order
        assert sorted(whole) == sorted(f"req-{i}" for i in range(7))
        assert holders[1].transfers_page(0, 3).total == 7

        listed = [t["request_id"] for t in ok_json("transfers", "--page-size", "2", socket=d.socket_path)]
        assert listed == whole  # 4 pages of 2, 2, 2, 1
        window = ok_json("transfers", "--offset", "1", "--limit", "5", "--page-size", "2", socket=d.socket_path)
        assert [t["request_id"] for t in window] == whole[1:6]
        assert ok_json("transfers", "--offset", "7", socket=d.socket_path) == []
        assert ok_json("transfers", "--offset", "100", "--page-size", "3", socket=d.socket_path) == []

        run = kvctl("transfers", "--page-size", "3", socket=d.socket_path)
        assert run.returncode == 0, run.stderr
        assert run.stdout.splitlines()[0] == "transfers"  # the whole list: no window in the title
        assert all(rid in run.stdout for rid in whole)
        run = kvctl("transfers", "--offset", "2", "--limit", "3", "--page-size", "2", socket=d.socket_path)
        assert run.returncode == 0, run.stderr
        assert run.stdout.splitlines()[0] == "transfers 3-5 of 7"
        assert [rid for rid in whole if rid in run.stdout.split()] == whole[2:5]
        run = kvctl("transfers", "--offset", "9", socket=d.socket_path)
        assert run.returncode == 0 and run.stdout.splitlines()[0] == "transfers: none at offset 9 (7 in all)"

        # sessions: the four holders and kvctl's own session, in pages of one (the earlier kvctl
        # runs have exited; the daemon ends their sessions when it reads the hang-ups)
        def holders_only() -> None:
            _until(lambda: holders[0].stats().sessions == 4, "the earlier kvctl sessions to end")

        holders_only()
        sessions = ok_json("sessions", "--page-size", "1", socket=d.socket_path)
        names = [s["client"] for s in sessions]
        assert names[:4] == [f"holder-{i}" for i in range(4)] and names[4] == "kvctl"
        assert len(names) == 5
        window = ok_json("sessions", "--offset", "1", "--limit", "2", "--page-size", "1", socket=d.socket_path)
        assert [s["client"] for s in window] == ["holder-1", "holder-2"]
        holders_only()
        run = kvctl("sessions", "--limit", "2", socket=d.socket_path)
        assert run.returncode == 0 and run.stdout.splitlines()[0] == "sessions 1-2 of 5"
        assert "holder-0" in run.stdout and "holder-1" in run.stdout and "holder-2" not in run.stdout
    finally:
        for c in holders:
            c.close()


def test_fetch_pages_stops_at_the_total_of_a_changing_list() -> None:
    """Entries that go away between two pages end the walk; it never asks beyond the total."""
    items = list(range(10))
    asked: list[tuple[int, int]] = []

    def page(offset: int, limit: int) -> tuple[list[int], int]:
        asked.append((offset, limit))
        out = items[offset:offset + limit]
        if offset == 0:
            del items[6:]  # four entries finish while the first page is on its way
        return out, len(items) if offset else 10

    got, total = fetch_pages(page, page_size=4)
    assert got == [0, 1, 2, 3, 4, 5] and total == 6
    assert asked == [(0, 4), (4, 4)]
    got, total = fetch_pages(lambda o, n: (list(range(20))[o:o + n], 20), offset=3, limit=5, page_size=2)
    assert got == [3, 4, 5, 6, 7] and total == 20
    with pytest.raises(ValueError, match="page_size >= 1"):
        fetch_pages(page, page_size=0)


# --- a daemon without pools ----------------------------------------------------------------------


def test_a_daemon_without_pools_says_so(daemon_factory: Callable[..., DaemonProcess]) -> None:
    from tests.hostile import events

    d = daemon_factory({"pools": []}, name="nopools")
    order = [e["event"] for e in events(d)]
    assert order.index("daemon.no_pools") < order.index("daemon.ready")
    (line,) = events(d, "daemon.no_pools")
    assert line["level"] == "warning" and "add a [[pools]] table" in line["reason"]
    run = kvctl("status", socket=d.socket_path)
    assert run.returncode == 0, run.stderr
    assert "no pools configured: executors can allocate no blocks" in run.stdout
    assert "pool  kind" not in run.stdout  # no empty pools table under that line
    assert ok_json("status", socket=d.socket_path)["pools"] == []
    # a daemon with pools says nothing of the kind
    other = daemon_factory(name="withpools")
    assert events(other, "daemon.no_pools") == []
    assert "no pools configured" not in kvctl("status", socket=other.socket_path).stdout


def test_cancel_any_sessions_request_as_operator(pair: tuple[DaemonProcess, DaemonProcess]) -> None:
    """``kvctl cancel`` is the operator's force-cancel: the executor's wait raises TransferCancelled."""
    _ctx_d, gen_d = pair
    gen = Client(gen_d.socket_path, client="gen", timeout=10)
    try:
        layout = gen.pools()[0].layout
        assert layout is not None
        gen.expect("stuck-1", "gen0", layout, 0, gen.alloc("gen0", 2), deadline_s=120)
        run = kvctl("cancel", "stuck-1", socket=gen_d.socket_path)
        assert run.returncode == 0, run.stderr
        assert "cancelled 'stuck-1'" in run.stdout
        with pytest.raises(TransferCancelled, match="cancelled by an operator"):
            gen.wait("stuck-1", timeout_s=30)
        # an unknown request: the daemon's error, exit 1
        run = kvctl("cancel", "no-such-request", socket=gen_d.socket_path)
        assert run.returncode == 1 and "no-such-request" in run.stderr, (run.returncode, run.stderr)
        assert run.stderr.startswith("kvctl: [not_found] ") and len(run.stderr.splitlines()) == 1
        assert "; kvctl transfers lists the requests this daemon holds" in run.stderr  # where to look
        assert kvctl("cancel", socket=gen_d.socket_path).returncode == 2  # the id is required
    finally:
        gen.close()


def test_a_peer_whose_link_went_down_stays_listed(daemon_factory: Callable[..., DaemonProcess],
                                                   short_tmp: Path) -> None:
    """A link that was up and went down (the peer killed): the dialled side lists the peer as
    ``down`` (incoming, it does not dial back) instead of dropping it, the dialling side as
    ``connecting`` with when it last heard from it instead of "never"; both say the link was
    lost. A peer that dials again is ``up`` once more."""
    from kvd.demo.pair import write_secret

    secret = write_secret(short_tmp)
    gen_d = daemon_factory({"peer_secret_file": secret}, name="gen")
    ctx_cfg = {"node": "ctx", "peer_secret_file": secret,  # node: the same name for ctx2 and ctx3
               "peers": [{"name": "gen", "host": "127.0.0.1", "port": gen_d.peer_port}]}
    ctx_d = daemon_factory(ctx_cfg, name="ctx")
    with Client(gen_d.socket_path, client="watch-gen", timeout=10) as gen:
        _until(lambda: [p for p in gen.peers() if p.state == "up"], "ctx's link on the gen side")
        ctx_d.kill()
        (down,) = _until(lambda: [p for p in gen.peers() if p.state == "down"], "gen noticing the link went down")
        assert (down.node, down.direction) == ("ctx", "incoming") and down.last_heard_s >= 0
        assert down.error.startswith("link lost: "), down
        run = kvctl("peers", socket=gen_d.socket_path)
        assert run.returncode == 0 and run.stdout.splitlines()[2].split()[:3] == ["ctx", "down", "incoming"]
        again = daemon_factory(ctx_cfg, name="ctx2")  # the same node name: ctx dials again
        try:
            (up,) = _until(lambda: [p for p in gen.peers() if p.state == "up"], "ctx dialling again")
            assert up.node == "ctx" and up.error == ""
        finally:
            again.stop()
    ctx_d = daemon_factory(ctx_cfg, name="ctx3")
    with Client(ctx_d.socket_path, client="watch-ctx", timeout=10) as ctx:
        _until(lambda: [p for p in ctx.peers() if p.state == "up"], "the link ctx -> gen")
        gen_d.kill()
        (lost,) = _until(lambda: [p for p in ctx.peers() if p.state == "connecting"], "ctx noticing gen is gone")
        assert (lost.node, lost.direction) == ("gen", "outgoing") and lost.last_heard_s >= 0, lost
        assert lost.error, lost  # the link lost, or the first dial after it refused
