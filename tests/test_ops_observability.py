"""Observability: one canonical ``transfer.done`` line per transfer and side, the
Prometheus endpoint moving with real traffic, and docs/events.md naming every event.

Real daemons (subprocesses, JSON logs) and real transfers: a local regroup (ctx TP1 → gen
TP2 pools on one daemon, path ``local``) and one between two daemons over their peer link
(``kvd.demo.pair.start_pair``). The log lines are checked field by field against the
``Completion`` each executor got back.
"""

from __future__ import annotations

import ast
import json
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients import Client
from kvd.demo.launch import DaemonProcess
from kvd.demo.pair import GEOMETRY, start_pair
from protocol.errors import TransferTimeout
from protocol.layout import KVLayout
from protocol.messages import Completion
from tests.conftest import host_pool
from tests.ports import unused_port

REPO = Path(__file__).resolve().parents[1]
TRANSFER_DONE_FIELDS = {
    "event", "level", "logger", "timestamp",
    "request_id", "role", "peer", "bytes", "duration_s", "gbps", "path", "chunks", "fallback",
}  # fmt: skip


def _records(d: DaemonProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]


def _done_lines(d: DaemonProcess, request_id: str) -> list[dict[str, Any]]:
    return [r for r in _records(d) if r.get("event") == "transfer.done" and r.get("request_id") == request_id]


def _check_done_line(line: dict[str, Any], completion: Completion, *, role: str, peer: str) -> None:
    """The canonical line says exactly what the executor was told."""
    assert set(line) >= TRANSFER_DONE_FIELDS, sorted(line)
    assert line["level"] == "info" and line["logger"] == "kvd.transfer"
    assert line["request_id"] == completion.request_id
    assert line["role"] == role
    assert line["peer"] == peer
    assert line["bytes"] == completion.bytes > 0
    assert line["path"] == completion.path
    assert line["chunks"] == completion.chunks >= 0
    assert line["fallback"] == (completion.fallback or None)
    assert line["duration_s"] == pytest.approx(completion.duration_s, abs=1e-5)
    assert line["gbps"] == pytest.approx(completion.bytes / completion.duration_s / 1e9, abs=1e-3)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z", line["timestamp"])


def _until_sessions_closed(d: DaemonProcess, count: int, timeout: float = 20.0) -> None:
    """Wait until ``d`` logged ``session.closed`` ``count`` times (it sets the gauges first)."""
    deadline = time.monotonic() + timeout
    while sum(r.get("event") == "session.closed" for r in _records(d)) < count:
        assert time.monotonic() < deadline, f"fewer than {count} sessions closed within {timeout} s"
        time.sleep(0.02)


def _scrape(port: int) -> dict[str, float]:
    """``GET /metrics`` → {"name{label=value,...}": value} for the kvd_* samples."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("kvd_"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}"] = s.value
    return out


# --- local transfer + metrics -------------------------------------------------------------


def test_local_transfer_log_lines_and_metrics(daemon_factory: Callable[..., DaemonProcess]) -> None:
    port = unused_port()
    geometry = {k: host_pool()[k] for k in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_block", "dtype")}
    pools = [
        host_pool("ctx0", num_blocks=32),
        host_pool("gen0", num_blocks=32, tp_size=2, rank=0),
        host_pool("gen1", num_blocks=32, tp_size=2, rank=1),
    ]
    d = daemon_factory({"pools": pools, "metrics_port": port}, name="obs")
    assert any(r["event"] == "metrics.listening" and r["port"] == port for r in _records(d))
    ctx_layout = KVLayout(**geometry, tp_size=1)
    gen_layout = KVLayout(**geometry, tp_size=2)
    nblocks = 6

    before = _scrape(port)
    assert before["kvd_sessions{}"] == 0
    assert before["kvd_pool_blocks_used{pool=ctx0}"] == 0
    assert before["kvd_pool_blocks_free{pool=ctx0}"] == 32  # set at startup, not on first use
    assert before["kvd_bounce_chunks_in_use{}"] == 0
    assert not any(k.startswith("kvd_transfers_total") for k in before)

    with Client(d.socket_path, client="gen", timeout=10) as gen, Client(d.socket_path, client="ctx", timeout=10) as ctx:
        gen_ids = {r: gen.alloc(f"gen{r}", nblocks) for r in (0, 1)}
        ctx_ids = ctx.alloc("ctx0", nblocks)
        during = _scrape(port)
        assert during["kvd_sessions{}"] == 2
        assert during["kvd_pool_blocks_used{pool=ctx0}"] == nblocks
        assert during["kvd_pool_blocks_used{pool=gen1}"] == nblocks
        assert during["kvd_pool_blocks_free{pool=gen0}"] == 32 - nblocks

        for r in (0, 1):
            gen.expect("obs-1", f"gen{r}", gen_layout, r, gen_ids[r])
        ctx.publish("obs-1", "ctx0", ctx_layout, 0, ctx_ids, peer="obs")  # own node: path "local"
        ctx_done = ctx.wait("obs-1", timeout_s=30)
        gen_done = gen.wait("obs-1", timeout_s=30)

        after = _scrape(port)
        nbytes = ctx_layout.block_bytes(0) * nblocks
        assert ctx_done.path == gen_done.path == "local"
        assert ctx_done.bytes == gen_done.bytes == nbytes
        assert after["kvd_transfers_total{path=local,role=ctx}"] == 1
        assert after["kvd_transfers_total{path=local,role=gen}"] == 1
        assert after["kvd_transfer_bytes_total{role=ctx}"] == nbytes
        assert after["kvd_transfer_bytes_total{role=gen}"] == nbytes
        assert after["kvd_transfer_seconds_count{role=gen}"] == 1
        assert after["kvd_sessions{}"] == 2
        assert after["kvd_pool_blocks_used{pool=gen0}"] == nblocks

    # exactly one canonical line per side, saying what the executors were told
    lines = _done_lines(d, "obs-1")
    assert sorted(line["role"] for line in lines) == ["ctx", "gen"]
    by_role = {line["role"]: line for line in lines}
    _check_done_line(by_role["ctx"], ctx_done, role="ctx", peer="obs")
    assert by_role["gen"]["chunks"] == by_role["ctx"]["chunks"] == 2  # one per (ctx rank, gen rank) pair
    # (the engine leaves the gen side's peer empty on the local path; the line agrees with the Completion)
    _check_done_line(by_role["gen"], gen_done, role="gen", peer=gen_done.peer)

    # sessions gone: the gauges follow. Closing a Client does not wait for the daemon, which
    # ends the session when it reads the hang-up: wait for its two session.closed lines
    _until_sessions_closed(d, 2)
    final = _scrape(port)
    assert final["kvd_sessions{}"] == 0
    assert final["kvd_pool_blocks_used{pool=ctx0}"] == 0
    assert final["kvd_pool_blocks_free{pool=gen1}"] == 32
    assert final["kvd_transfers_total{path=local,role=ctx}"] == 1

    # a transfer that fails: one transfer.failed line, counted by error code
    with Client(d.socket_path, client="gen", timeout=10) as gen:
        ids = gen.alloc("ctx0", 2)
        gen.expect("doomed", "ctx0", ctx_layout, 0, ids, deadline_s=0.3)  # nobody ever publishes it
        with pytest.raises(TransferTimeout, match="missed its deadline"):
            gen.wait("doomed", timeout_s=10)
    failed = [r for r in _records(d) if r.get("event") == "transfer.failed" and r.get("request_id") == "doomed"]
    assert len(failed) == 1
    line = failed[0]
    assert line["level"] == "warning" and line["role"] == "gen" and line["code"] == "transfer_timeout"
    assert "missed its deadline" in line["error"]
    assert _scrape(port)["kvd_transfer_failures_total{code=transfer_timeout}"] == 1


# --- a transfer between two daemons -------------------------------------------------------


def test_peer_transfer_log_lines_on_both_daemons(short_tmp: Path) -> None:
    """ctx TP1 → gen TP2 through the bounce buffer over NIXL (``mapped = false``: the path
    between nodes), 9 MiB in 1 MiB chunks."""
    blocks = 4
    transfer = {"bounce_size_mb": 4, "chunk_mb": 1, "deadline_s": 60.0, "mapped": False}
    ctx_d, gen_d = start_pair(
        short_tmp, gen_tp=2, blocks=blocks, bounce_mb=4, chunk_mb=1, extra={"transfer": transfer}
    )
    try:
        ctx_layout = KVLayout(**GEOMETRY, tp_size=1)
        gen_layout = KVLayout(**GEOMETRY, tp_size=2)
        completions: dict[str, Completion] = {}
        errors: list[BaseException] = []
        registered = threading.Barrier(3)

        def gen_rank(rank: int) -> None:
            try:
                with Client(gen_d.socket_path, client=f"gen{rank}", timeout=60) as kvd:
                    ids = kvd.alloc(f"gen{rank}", blocks)
                    kvd.expect("pair-1", f"gen{rank}", gen_layout, rank, ids)
                    registered.wait(30)
                    completions[f"gen{rank}"] = kvd.wait("pair-1", timeout_s=60)
            except BaseException as exc:
                errors.append(exc)
                registered.abort()

        threads = [threading.Thread(target=gen_rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        with Client(ctx_d.socket_path, client="ctx0", timeout=60) as kvd:
            ids = kvd.alloc("ctx0", blocks)
            registered.wait(30)
            kvd.publish("pair-1", "ctx0", ctx_layout, 0, ids, peer="gen")
            completions["ctx0"] = kvd.wait("pair-1", timeout_s=60)
        for t in threads:
            t.join(60)
        assert not errors, errors
        # a request after the replies: each daemon's step that replied (and then logged its
        # transfer.done line) has ended
        for d in (ctx_d, gen_d):
            with Client(d.socket_path, client="sync", timeout=60) as kvd:
                kvd.ping()
        ctx_c = completions["ctx0"]
        assert ctx_c.bytes == ctx_layout.block_bytes(0) * blocks
        assert completions["gen0"].path == completions["gen1"].path == ctx_c.path

        ctx_lines = _done_lines(ctx_d, "pair-1")
        assert len(ctx_lines) == 1
        _check_done_line(ctx_lines[0], ctx_c, role="ctx", peer="gen")
        gen_lines = _done_lines(gen_d, "pair-1")
        assert len(gen_lines) == 1  # one gen side (both ranks) on the gen daemon
        _check_done_line(gen_lines[0], completions["gen0"], role="gen", peer="ctx")
        assert ctx_c.path == "bounce" and ctx_c.fallback == ""
        assert ctx_c.chunks == completions["gen0"].chunks >= 9  # 9 MiB through 1 MiB chunks
    finally:
        ctx_d.stop()
        gen_d.stop()


# --- docs/events.md -----------------------------------------------------------------------

_LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}
_EVENT = re.compile(r"[a-z][a-z_]*\.[a-z][a-z_]*")


def _emitted_events() -> dict[str, str]:
    """Every structlog event name in kvd/: the first argument of a logger call (also through a
    ``level = log.info`` alias, or a ``warn``/``warn_`` callable: a logger's or a rate
    limiter's warning), or of a policy ``Note(level, event, fields)``."""
    found: dict[str, str] = {}
    for path in sorted((REPO / "kvd").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            arg: ast.expr | None = None
            logger_call = isinstance(func, ast.Attribute) and func.attr in _LEVELS
            # level = log.info if ... else log.debug; warn = log.warning or Throttle(log).warning
            alias_call = isinstance(func, ast.Name) and func.id in ("level", "warn", "warn_")
            if (logger_call or alias_call) and node.args:
                arg = node.args[0]
            elif isinstance(func, ast.Name) and func.id == "Note" and len(node.args) >= 2:
                arg = node.args[1]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _EVENT.fullmatch(arg.value):
                found.setdefault(arg.value, f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_every_event_is_documented() -> None:
    doc = (REPO / "docs" / "events.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \|", doc, flags=re.M))
    emitted = _emitted_events()
    assert {"transfer.done", "transfer.failed", "transfer.bounce_fallback", "session.rejected"} <= set(emitted)
    missing = {name: where for name, where in emitted.items() if name not in documented}
    assert not missing, f"events logged but not documented in docs/events.md: {missing}"
    stale = documented - set(emitted)
    assert not stale, f"docs/events.md documents events nothing logs any more: {sorted(stale)}"
