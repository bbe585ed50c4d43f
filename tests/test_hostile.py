"""No input from an executor or a peer can crash, wedge, stop or corrupt the daemon.

One test per way kvd fell when attacked (each against a real daemon subprocess, over its Unix
socket or a raw TCP connection to its peer port): after each attack the daemon still serves a
normal client, holds no extra lease, session or file descriptor, and logged one warning line
for it, no traceback (:class:`tests.hostile.Baseline`).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest

from clients import Client
from kvd.demo.launch import DaemonProcess
from kvd.peer.auth import load_secret, new_nonce
from protocol import messages as m
from protocol.codec import encode
from protocol.errors import Draining
from protocol.framing import frame
from protocol.layout import KVLayout
from protocol.limits import MAX_HELLO_FRAME, MAX_REQUEST_ID_LEN
from protocol.peer import (
    PEER_PROTOCOL_VERSION,
    PeerAuth,
    PeerChallenge,
    PeerError,
    PeerHello,
    encode_peer,
    encode_peer_payload,
)
from tests.conftest import host_pool
from tests.hostile import IO_TIMEOUT, Baseline, Raw, RawPeer, events, fd_count, wait_until
from tests.layout_fields import Shape
from tests.transfer_harness import write_secret

Factory = Callable[..., DaemonProcess]
LAYOUT = KVLayout(4, 8, 64, 32, "bfloat16")
NOBODY = 65534

needs_setpriv = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to run a client as another uid",
)


def _nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"


def _with_extra(body: bytes, extra: bytes) -> bytes:
    """A msgpack map (fewer than 15 keys) with one more key, whose value is ``extra``."""
    return bytes([body[0] + 1]) + body[1:] + msgspec.msgpack.encode("extra") + extra


def _peer_daemon(factory: Factory, workdir: Path, **config: Any) -> tuple[DaemonProcess, bytes]:
    secret_path = write_secret(workdir, "attacked.secret")
    d = factory({"peer_secret_file": secret_path, **config}, name="attacked")
    assert d.peer_port
    return d, load_secret(secret_path)


def _one_warning(base: Baseline, event: str) -> dict[str, Any]:
    """Exactly one warning line since the baseline, and it is ``event`` (waits for it: the daemon
    may close a connection before it writes the line)."""
    wait_until(lambda: any(r["event"] == event for r in base.new_warnings()), f"the {event} warning")
    got = base.new_warnings()
    assert [r["event"] for r in got] == [event], got
    return got[0]


# --- 1. a deeply nested frame ----------------------------------------------------------------------


def test_deeply_nested_peer_hello_is_refused_with_one_warning(daemon_factory: Factory, short_tmp: Path) -> None:
    d, _secret = _peer_daemon(daemon_factory, short_tmp)
    base = Baseline.take(d)
    hello = encode_peer_payload(PeerHello(version=PEER_PROTOCOL_VERSION, node="evil", nonce=b"n" * 32))
    payload = _with_extra(hello, _nested(1000))
    assert len(payload) < 1100  # one ~1 KB unauthenticated frame
    attacker = RawPeer(d.peer_port)
    attacker.send(frame(payload))
    assert attacker.rest() == []  # closed, nothing said to an unauthenticated stranger
    attacker.close()
    line = _one_warning(base, "peer.handshake_failed")
    assert "nested too deeply" in line["reason"] and line["remote"].startswith("127.0.0.1:")
    base.check()


def test_deeply_nested_request_gets_an_error_reply(daemon_factory: Factory) -> None:
    d = daemon_factory()
    base = Baseline.take(d)
    raw = Raw(d.socket_path)
    raw.hello()
    expect = msgspec.to_builtins(m.Expect(id=5, request_id="r", pool="host0", layout=LAYOUT, rank=0, block_ids=[0]))
    raw.send(frame(_with_extra(msgspec.msgpack.encode(expect), _nested(100_000))))
    err = raw.error()
    # id 0: not even the id can be read back from a frame too deep to parse
    assert (err.id, err.code) == (0, "protocol") and "nested too deeply" in err.message
    raw.ping()  # the session goes on
    raw.close()
    assert _one_warning(base, "session.bad_frame")["handshaken"] is True
    base.check()


# --- 2. non-finite floats ------------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_non_finite_or_negative_floats_are_refused(daemon_factory: Factory, value: float) -> None:
    d = daemon_factory()
    base = Baseline.take(d)
    raw = Raw(d.socket_path)
    raw.hello()
    raw.send_body({"type": "alloc", "id": 2, "pool": "host0", "count": 1})
    ids = raw.receive()
    assert isinstance(ids, m.Allocated)
    good = m.Expect(id=0, request_id="r", pool="host0", layout=LAYOUT, rank=0, block_ids=ids.block_ids)
    for rid, body in enumerate(
        [
            {**msgspec.to_builtins(good), "id": 10, "deadline_s": value},
            {**msgspec.to_builtins(good), "id": 11, "type": "publish", "peer": "p", "deadline_s": value},
            {"type": "wait", "id": 12, "request_id": "r", "timeout_s": value},
        ],
        start=10,
    ):
        raw.send_body(body)
        err = raw.error()
        assert (err.id, err.code) == (rid, "protocol"), err
        assert "deadline_s" in err.message or "timeout_s" in err.message
    raw.ping()  # the session serves on, the daemon still accepts connections
    with Client(d.socket_path, client="bystander", timeout=IO_TIMEOUT) as c:
        assert c.stats().requests_registered == 0
    raw.close()
    line = _one_warning(base, "session.bad_frame")
    assert line["handshaken"] is True and "suppressed" not in line  # the other two were suppressed
    base.check()


# --- 3. absurd geometry ------------------------------------------------------------------------------


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_absurd_geometry_is_refused_before_anything_is_sized(daemon_factory: Factory) -> None:
    d = daemon_factory()
    base = Baseline.take(d)
    rss = _rss(d.pid)
    log_size = os.path.getsize(d.log_path)
    raw = Raw(d.socket_path)
    raw.hello()
    raw.send_body({"type": "alloc", "id": 2, "pool": "host0", "count": 1})
    ids = raw.receive()
    assert isinstance(ids, m.Allocated)
    huge = {**msgspec.to_builtins(LAYOUT), "tp_size": 2**24, "attention_dp": True}
    big = {**msgspec.to_builtins(LAYOUT), "tp_size": 4096, "attention_dp": True}
    base_body = {"type": "expect", "pool": "host0", "rank": 0, "block_ids": ids.block_ids}
    for i in range(4):  # four ~200-byte Expects drove the daemon to 4.7 GB and 627 MB of log
        raw.send_body({**base_body, "id": 10 + i, "request_id": f"r{i}", "layout": huge})
        err = raw.error()
        assert err.code == "bad_request" and "exceeds the protocol limit of 4096" in err.message
    # within the protocol's bounds but beyond what this daemon can hold: refused by the limit
    raw.send_body({**base_body, "id": 20, "request_id": "big", "layout": big})
    err = raw.error()
    assert err.code == "limit_exceeded" and "max_ranks_per_request=256" in err.message
    raw.ping()
    raw.send_body({"type": "free", "id": 30, "pool": "host0", "block_ids": ids.block_ids})
    assert isinstance(raw.receive(), m.Freed)
    raw.close()
    assert _rss(d.pid) - rss < 64 << 20
    assert os.path.getsize(d.log_path) - log_size < 64 << 10
    _one_warning(base, "session.bad_frame")
    base.check()


# --- 4. operator verbs ------------------------------------------------------------------------------

#: Runs as uid/gid 65534: send Drain, report the outcome as JSON.
DRAIN_AS_NOBODY = textwrap.dedent(
    """
    import json, sys
    from clients.blocking import Client
    from protocol.errors import KvdError
    with Client(sys.argv[1], client="nobody", timeout=10) as c:
        try:
            c.drain()
            out = {"ok": True}  # the daemon stops (nothing in flight): no ping after it
        except KvdError as exc:
            out = {"ok": False, "code": exc.code, "message": exc.message}
            out["pong"] = c.ping(b"after").decode()
    print(json.dumps(out), flush=True)
    """
)


def _as_nobody(args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd="/", **kw)


@needs_setpriv
def test_drain_needs_an_operator(daemon_factory: Factory, short_tmp: Path) -> None:
    short_tmp.chmod(0o755)
    plain = daemon_factory(
        {"pools": [host_pool()], "socket_mode": 0o666, "access": {"allowed_uids": [NOBODY]}}, name="plain"
    )
    ops = daemon_factory(
        {"pools": [host_pool()], "socket_mode": 0o666, "access": {"allowed_uids": [NOBODY], "operator_gids": [NOBODY]}},
        name="ops",
    )
    base = Baseline.take(plain)
    run = _as_nobody([sys.executable, "-c", DRAIN_AS_NOBODY, plain.socket_path])
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["ok"] is False and out["code"] == "permission_denied", out
    assert "drain changes the daemon and needs an operator" in out["message"]
    assert out["pong"] == "after"  # refused, not disconnected
    line = _one_warning(base, "session.operator_refused")
    assert line["verb"] == "drain" and line["uid"] == NOBODY
    with Client(plain.socket_path, timeout=IO_TIMEOUT) as c:
        assert not c.stats().draining
    base.check()
    # a member of an operator group may drain: the daemon stops cleanly
    run = _as_nobody([sys.executable, "-c", DRAIN_AS_NOBODY, ops.socket_path])
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["ok"] is True
    assert ops.proc.wait(IO_TIMEOUT) == 0
    assert [r["reason"] for r in events(ops, "daemon.draining")] == ["drain requested by client"]


# --- 5. idle connections and the fd limit ---------------------------------------------------------

#: Runs as uid 65534: hold N idle connections, then try a real client; report as JSON lines.
IDLE_FLOOD = textwrap.dedent(
    """
    import json, socket, sys
    from clients.blocking import Client
    from protocol.errors import KvdError
    from protocol.codec import decode_reply
    from protocol.framing import FrameBuffer
    path, n = sys.argv[1], int(sys.argv[2])
    idle = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(path)
        idle.append(s)
    try:
        with Client(path, client="late", timeout=10) as c:
            late = {"ok": True}
    except KvdError as exc:
        late = {"ok": False, "code": exc.code, "message": exc.message}
    print(json.dumps(late), flush=True)
    sys.stdin.readline()  # the test checked what it wanted while the flood holds
    codes = []
    for s in idle:
        buf, got = FrameBuffer(1 << 20), []
        while True:
            data = s.recv(65536)
            if not data:
                break
            got += [decode_reply(p).code for p in buf.feed(data)]
        codes.append(got)
    print(json.dumps(codes), flush=True)
    """
)


@needs_setpriv
def test_idle_connections_cannot_lock_anyone_out(daemon_factory: Factory, short_tmp: Path) -> None:
    short_tmp.chmod(0o755)
    pending, flood = 4, 10
    d = daemon_factory(
        {
            "pools": [host_pool()],
            "socket_mode": 0o666,
            "access": {"allowed_uids": [NOBODY]},
            "limits": {"max_pending_connections": pending, "operator_reserve": 2, "handshake_timeout_s": 5.0,
                       "max_sessions": 8},
        },
        name="idle",
    )
    base = Baseline.take(d)
    with Client(d.socket_path, client="session-before", timeout=IO_TIMEOUT) as before:
        cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
               sys.executable, "-c", IDLE_FLOOD, d.socket_path, str(flood)]
        with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/") as proc:
            assert proc.stdout is not None and proc.stdin is not None
            late = json.loads(proc.stdout.readline())
            # the flood fills the pending slots: another (non-operator) client is refused at once...
            assert late["ok"] is False and late["code"] == "limit_exceeded", late
            assert f"max_pending_connections={pending}" in late["message"]
            # ...but sessions are untouched, and an operator still gets in (the reserve)
            assert before.ping(b"x") == b"x"
            with Client(d.socket_path, client="operator", timeout=IO_TIMEOUT) as op:
                # no idle connection became a session: "before" and ours (the baseline's probe
                # hung up earlier; the daemon ends its session once it reads that)
                wait_until(lambda: op.stats().sessions == 2, "the sessions to be before's and ours")
            proc.stdin.write("go\n")
            proc.stdin.flush()
            codes = json.loads(proc.stdout.readline())
    # every idle connection ended: refused at once, or closed at the handshake deadline
    assert all(c in (["limit_exceeded"], ["handshake_required"]) for c in codes), codes
    assert codes.count(["handshake_required"]) >= pending
    got = sorted(r["event"] for r in base.new_warnings())
    assert got == ["session.handshake_timeout", "session.pending_limit"], got
    base.check()


def test_fd_limit_is_one_warning_and_a_clean_refusal(daemon_factory: Factory) -> None:
    d = daemon_factory({"limits": {"handshake_timeout_s": 60.0}})
    base = Baseline.take(d)
    soft, hard = resource.prlimit(d.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (base.fds + 2, hard))
    clients: list[socket.socket] = []
    accepted = shed = 0
    try:
        # one connection at a time, each one's fate read before the next: the daemon either
        # takes it (a session: Welcome) or, at the limit, sheds it with an error and a close
        # instead of leaving it hanging in the backlog
        while shed < 3:
            raw = Raw(d.socket_path)
            clients.append(raw.sock)
            raw.send(encode(m.Hello(id=1, version=m.PROTOCOL_VERSION, client="filler")))
            reply = raw.receive()
            if isinstance(reply, m.Welcome):
                assert shed == 0, "a connection was accepted after the limit was hit"
                accepted += 1
            else:
                assert isinstance(reply, m.Error) and reply.code == "limit_exceeded", reply
                assert "file-descriptor limit" in reply.message
                assert raw.receive() is None
                shed += 1
            assert len(clients) < 64
        assert accepted >= 1
    finally:
        resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (soft, hard))
        for s in clients:
            s.close()
    line = _one_warning(base, "listener.fd_limit")
    assert line["listener"] == "executor" and line["error"] == "Too many open files"
    base.check()


def test_peer_port_handshake_deadline_and_pending_limit(daemon_factory: Factory, short_tmp: Path) -> None:
    d, _secret = _peer_daemon(daemon_factory, short_tmp, limits={"max_pending_peers": 2, "handshake_timeout_s": 3.0})
    base = Baseline.take(d)
    idle = [RawPeer(d.peer_port) for _ in range(2)]
    wait_until(lambda: fd_count(d.pid) >= base.fds + 2, "the two idle peers to be accepted")
    extra = RawPeer(d.peer_port)  # over the limit: closed at once
    assert extra.rest() == []
    extra.close()
    for conn in idle:  # closed at the handshake deadline, without a word
        assert conn.receive() is None
        conn.close()
    wait_until(lambda: len(base.new_warnings()) >= 2, "two warnings")
    got = sorted(r["event"] for r in base.new_warnings())
    assert got == ["peer.handshake_failed", "peer.pending_limit"], got
    assert "did not complete the handshake within 3.0 s" in events(d, "peer.handshake_failed")[0]["reason"]
    base.check()


# --- 6. SIGTERM drains ----------------------------------------------------------------------------


def test_sigterm_lets_an_in_flight_transfer_finish(daemon_factory: Factory, short_tmp: Path) -> None:
    from tests.transfer_harness import start_pair

    # the gen side never grants bounce credit: the transfer stays in flight for bounce_wait_s,
    # then completes by per-fragment writes; SIGTERM the ctx daemon in between. (gen has half
    # the tokens per block: a regroup, so the bytes need the bounce path, not direct writes)
    gen_layout = KVLayout(4, 8, 64, 16, "bfloat16")
    pair = start_pair(daemon_factory, short_tmp, LAYOUT, gen_layout, transfer={"bounce_wait_s": 4.0},
                      gen_extra={"transfer": {"bounce_size_mb": 4, "chunk_mb": 1, "grant_credits": False}},
                      ctx_extra={"drain_timeout_s": 30.0})
    with Client(pair.gen.socket_path, client="gen", timeout=IO_TIMEOUT) as gen, \
            Client(pair.ctx.socket_path, client="ctx", timeout=IO_TIMEOUT) as ctx, \
            Client(pair.ctx.socket_path, client="ctx-other", timeout=IO_TIMEOUT) as other, \
            ThreadPoolExecutor(2) as pool:
        wait_until(lambda: other.stats().peers_connected == 1, "the peer link")
        g_ids = gen.alloc("gen0", 8)
        c_ids = ctx.alloc("ctx0", 4)
        gen.expect("drained", "gen0", gen_layout, 0, g_ids, deadline_s=60)
        ctx.publish("drained", "ctx0", LAYOUT, 0, c_ids, peer="gen", deadline_s=60)
        ctx_done = pool.submit(ctx.wait, "drained", 30)
        gen_done = pool.submit(gen.wait, "drained", 30)
        wait_until(lambda: other.stats().transfers_active == 1, "the transfer to run")
        pair.ctx.read_notify()
        pair.ctx.proc.send_signal(signal.SIGTERM)
        wait_until(
            lambda: any("STATUS=draining: waiting for 1 transfer(s) (drained)" in msg for msg in pair.ctx.read_notify()),
            "the drain status",
        )
        assert any("STOPPING=1" in msg for msg in pair.ctx.messages)
        # sessions are still served while draining; new work is refused
        with pytest.raises(Draining, match="draining"):
            other.alloc("ctx0", 1)
        assert ctx_done.result(30).ok, ctx_done.result()
        assert gen_done.result(30).ok, gen_done.result()
    assert pair.ctx.proc.wait(IO_TIMEOUT) == 0
    assert not events(pair.ctx, "daemon.drain_timeout")
    assert events(pair.ctx, "daemon.stopping")[0]["transfers_active"] == 0


# --- 7. unbounded strings -------------------------------------------------------------------------


def test_huge_names_and_request_ids_are_refused(daemon_factory: Factory) -> None:
    d = daemon_factory()
    base = Baseline.take(d)
    log_size = os.path.getsize(d.log_path)
    # a 60 KiB client name: refused at the handshake (the Hello itself is within its 64 KiB)
    raw = Raw(d.socket_path)
    raw.send(encode(m.Hello(id=1, version=m.PROTOCOL_VERSION, client="n" * (60 << 10))))
    err = raw.error()
    assert err.code == "protocol" and "$.client" in err.message and len(err.message) < 200
    assert raw.receive() is None
    raw.close()
    # a 9 MiB one: a Hello frame above MAX_HELLO_FRAME, refused as soon as its length arrives
    # (the daemon hangs up before it read all of it: our send may break)
    raw = Raw(d.socket_path)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        raw.send(encode(m.Hello(id=1, version=m.PROTOCOL_VERSION, client="n" * (9 << 20))))
    err = raw.error()
    assert err.code == "frame_too_large" and str(MAX_HELLO_FRAME) in err.message
    raw.close()
    # 1 MiB request ids: each an Error, the session goes on
    raw = Raw(d.socket_path)
    raw.hello()
    for i in range(16):
        raw.send_body({"type": "cancel", "id": 100 + i, "request_id": "x" * (1 << 20)})
        err = raw.error()
        assert (err.id, err.code) == (100 + i, "protocol") and "$.request_id" in err.message
    raw.ping()
    # names at the limit are fine, and `kvctl sessions` lists them
    with Client(d.socket_path, client="c" * 256, timeout=IO_TIMEOUT) as c:
        run = subprocess.run([sys.executable, "-m", "clients.kvctl", "--socket", d.socket_path, "sessions", "--json"],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        assert "c" * 256 in [s["client"] for s in json.loads(run.stdout)]
        c.ping(b"x")
    raw.close()
    assert os.path.getsize(d.log_path) - log_size < 64 << 10  # no megabytes of log
    # 17 bad frames, one (rate-limited) line; and the oversized Hello's
    wait_until(lambda: len(base.new_warnings()) >= 2, "the warnings")
    assert sorted(r["event"] for r in base.new_warnings()) == ["session.bad_frame", "session.frame_too_large"]
    base.check()


# --- 8. replies larger than a frame ---------------------------------------------------------------


def test_a_reply_too_large_fails_the_request_not_the_session(daemon_factory: Factory) -> None:
    n = 3000  # TransferInfo of a 256-character id is ~400 bytes: ~1.2 MB, more than a 1 MiB frame
    # one tiny block per request: a block belongs to one unfinished request at a time
    tiny: Shape = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "tokens_per_block": 1}
    d = daemon_factory({"pools": [host_pool("host0", **tiny, num_blocks=n)],
                        "limits": {"max_frame_size": 1 << 20, "max_inflight_per_session": 4096}})
    base = Baseline.take(d)
    raw = Raw(d.socket_path)
    raw.hello()
    raw.send_body({"type": "alloc", "id": 2, "pool": "host0", "count": n})
    ids = raw.receive()
    assert isinstance(ids, m.Allocated)
    body = msgspec.to_builtins(m.Expect(request_id="", pool="host0", layout=KVLayout(**tiny, dtype="bfloat16"),
                                        rank=0, block_ids=[0], deadline_s=3600))
    rids = [f"{i:06d}".ljust(MAX_REQUEST_ID_LEN, "r") for i in range(n)]
    for start in range(0, n, 100):  # in batches: the replies must not fill the socket both ways
        batch = list(enumerate(rids))[start : start + 100]
        raw.send(b"".join(frame(msgspec.msgpack.encode({**body, "id": 10 + i, "request_id": r,
                                                        "block_ids": [ids.block_ids[i]]})) for i, r in batch))
        for i, _r in batch:
            reply = raw.receive()
            assert isinstance(reply, m.Registered) and reply.id == 10 + i, reply
    raw.send(encode(m.ListTransfers(id=5)))
    err = raw.error()
    assert (err.id, err.code) == (5, "reply_too_large"), err
    raw.ping()  # the session goes on
    # paged, everything is there
    seen: list[str] = []
    while len(seen) < n:
        raw.send(encode(m.ListTransfers(id=6, offset=len(seen), limit=1000)))
        page = raw.receive()
        assert isinstance(page, m.TransfersReply) and page.total == n, page
        seen += [t.request_id for t in page.transfers]
    assert sorted(seen) == rids
    # before the hang-up: once the daemon reads it, each of the session's requests fails with
    # a transfer.failed warning of its own, written while the test would be reading the log
    _one_warning(base, "session.reply_too_large")
    raw.close()  # the session's requests are cancelled and its block returned
    base.check()  # (idle: every request reported, so every line of theirs is written)
    failed = [r for r in base.new_warnings() if r["event"] != "session.reply_too_large"]
    assert {(r["event"], r["code"]) for r in failed} == {("transfer.failed", "transfer_cancelled")}
    assert sorted(r["request_id"] for r in failed) == rids


# --- 9. a flood of wrong-secret handshakes ---------------------------------------------------------


def test_wrong_secret_handshakes_are_logged_at_a_bounded_rate(daemon_factory: Factory, short_tmp: Path) -> None:
    """Anyone who reaches the peer port can fail the MAC check at will; like every warning a
    stranger can trigger, ``peer.auth_failed`` is rate-limited (one line per 10 s, then a count),
    and each attempt still gets its refusal and a closed connection."""
    d, secret = _peer_daemon(daemon_factory, short_tmp)
    base = Baseline.take(d)
    attempts = 5
    t0 = time.monotonic()
    for _ in range(attempts):
        attacker = RawPeer(d.peer_port)
        attacker.send(encode_peer(PeerHello(version=PEER_PROTOCOL_VERSION, node="evil", nonce=new_nonce())))
        assert isinstance(attacker.receive(), PeerChallenge)
        attacker.send(encode_peer(PeerAuth(mac=b"\0" * 32)))
        refusal = attacker.rest()  # the daemon logs (or counts) the failure before it answers and closes
        attacker.close()
        assert len(refusal) == 1 and isinstance(refusal[0], PeerError), refusal
        assert "MAC does not match" in refusal[0].message
    elapsed = time.monotonic() - t0
    lines = events(d, "peer.auth_failed")
    # one line per 10 s window the attempts spanned (one, unless this machine stalled for 10 s)
    assert 1 <= len(lines) <= 1 + int(elapsed // 10), (elapsed, lines)
    assert lines[0]["remote"].startswith("127.0.0.1:") and lines[0]["side"] == "server"
    # the port still serves a daemon that holds the secret
    friend = RawPeer(d.peer_port)
    friend.authenticate(secret, node="friend")
    friend.close()  # before sending its own welcome: the daemon says so, once it notices
    wait_until(lambda: bool(events(d, "peer.handshake_failed")), "the daemon to notice the friend left mid-handshake")
    assert {r["event"] for r in base.new_warnings()} == {"peer.auth_failed", "peer.handshake_failed"}
    base.check()
