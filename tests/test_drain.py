"""SIGTERM drains: a request whose other side never came fails at once with ``daemon_stopping``
(its executor's ``wait`` raises :class:`DaemonStopping`, not a closed connection), a transfer
whose data moves runs to completion, and one still running at ``drain_timeout_s`` fails with
``daemon_stopping`` before the sessions close. Real daemon subprocesses, real NIXL."""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from clients import Client
from kvd.demo.launch import DaemonProcess
from protocol import messages as m
from protocol.codec import encode
from protocol.errors import DaemonStopping
from protocol.layout import KVLayout
from tests.hostile import IO_TIMEOUT, Raw, events, wait_until
from tests.transfer_harness import start_pair

Factory = Callable[..., DaemonProcess]
CTX_LAYOUT = KVLayout(4, 8, 64, 32, "bfloat16")
# half the tokens per block on gen: a regroup, so the bytes take the bounce path (not direct writes)
GEN_LAYOUT = KVLayout(4, 8, 64, 16, "bfloat16")


def _state(c: Client, rid: str) -> str:
    return next((t.state for t in c.transfers() if t.request_id == rid), "")


def test_sigterm_fails_unmatched_requests_and_finishes_moving_ones(daemon_factory: Factory, short_tmp: Path) -> None:
    # gen grants no bounce credit: "moving" waits bounce_wait_s for one, then completes by
    # per-fragment writes. The ctx daemon is frozen (SIGSTOP) while gen's daemon is told to
    # stop, so "moving" is in flight however slow the machine is; thawed, it goes on.
    # (heartbeats: the frozen ctx must not be declared gone, however long the freeze takes)
    gen_transfer = {"bounce_size_mb": 4, "chunk_mb": 1, "grant_credits": False, "bounce_wait_s": 2.0,
                    "heartbeat_timeout_s": 300.0}
    pair = start_pair(daemon_factory, short_tmp, CTX_LAYOUT, GEN_LAYOUT,
                      transfer={"bounce_wait_s": 2.0, "heartbeat_timeout_s": 300.0},
                      gen_extra={"transfer": gen_transfer, "drain_timeout_s": 60.0})
    with Client(pair.gen.socket_path, client="gen", timeout=IO_TIMEOUT) as gen, \
            Client(pair.gen.socket_path, client="gen-lonely", timeout=IO_TIMEOUT) as lonely, \
            Client(pair.gen.socket_path, client="gen-watch", timeout=IO_TIMEOUT) as watch, \
            Client(pair.ctx.socket_path, client="ctx", timeout=IO_TIMEOUT) as ctx, \
            ThreadPoolExecutor(4) as pool:
        wait_until(lambda: watch.stats().peers_connected == 1, "the peer link")
        # two requests no ctx executor will ever publish: one waiting for an offer, one whose
        # destination gen already announced to the ctx daemon (expect names the peer)
        l_ids = lonely.alloc("gen0", 4)
        lonely.expect("lonely", "gen0", GEN_LAYOUT, 0, l_ids[:2], deadline_s=120)
        lonely.expect("lonely-announced", "gen0", GEN_LAYOUT, 0, l_ids[2:], peer="ctx", deadline_s=120)
        lonely_waits = [pool.submit(lonely.wait, rid, 60) for rid in ("lonely", "lonely-announced")]
        # and one transfer in flight
        g_ids = gen.alloc("gen0", 8)
        c_ids = ctx.alloc("ctx0", 4)
        gen.expect("moving", "gen0", GEN_LAYOUT, 0, g_ids, deadline_s=120)
        ctx.publish("moving", "ctx0", CTX_LAYOUT, 0, c_ids, peer="gen", deadline_s=120)
        gen_done = pool.submit(gen.wait, "moving", 60)
        ctx_done = pool.submit(ctx.wait, "moving", 60)
        # receiving: ctx chose the bounce path (its path message came) and waits for a credit
        wait_until(lambda: _state(watch, "moving") == "receiving", "ctx to start sending")
        pair.ctx.proc.send_signal(signal.SIGSTOP)
        try:
            pair.gen.read_notify()
            pair.gen.proc.send_signal(signal.SIGTERM)
            # (the unmatched ones may still be named in the first status line: they end a moment later)
            waiting = re.compile(r"STATUS=draining: waiting for \d+ transfer\(s\) \([^)]*\bmoving\b")
            wait_until(lambda: any(waiting.search(msg) for msg in pair.gen.read_notify()),
                       "the drain to wait for the moving transfer")
        finally:
            pair.ctx.proc.send_signal(signal.SIGCONT)
        # the unmatched ones were answered while the daemon still serves its sessions
        for fut, rid in zip(lonely_waits, ("lonely", "lonely-announced"), strict=True):
            with pytest.raises(DaemonStopping, match="other side never came") as err:
                fut.result(IO_TIMEOUT)
            assert err.value.code == "daemon_stopping" and "signal SIGTERM" in err.value.message, rid
        assert watch.ping(b"still serving") == b"still serving"
        assert gen_done.result(60).ok, gen_done.result()
        assert ctx_done.result(60).ok, ctx_done.result()
    assert pair.gen.proc.wait(IO_TIMEOUT) == 0
    (unmatched,) = events(pair.gen, "daemon.drain_unmatched")
    assert unmatched["request_ids"] == ["lonely", "lonely-announced"] and unmatched["requests"] == 2
    failed = {e["request_id"]: e["code"] for e in events(pair.gen, "transfer.failed")}
    assert failed == {"lonely": "daemon_stopping", "lonely-announced": "daemon_stopping"}
    assert [e["request_id"] for e in events(pair.gen, "transfer.done")] == ["moving"]
    assert not events(pair.gen, "daemon.drain_timeout")
    assert events(pair.gen, "daemon.stopping")[0]["transfers_active"] == 0
    # the ctx daemon, holding gen's announced destination, was told: it dropped it (no executor
    # of its own had published, so no one waits there)
    # (the line names the request when the actor logs it, not when the feeding step does)
    def dropped() -> list[dict[str, object]]:
        return [e for e in events(pair.ctx, "transfer.dropped")
                if e.get("request_id", "lonely-announced") == "lonely-announced" and e["code"] == "daemon_stopping"]

    wait_until(lambda: bool(dropped()), "ctx to drop the announced destination")
    assert dropped()[0]["role"] == "ctx" and dropped()[0]["peer"] == "gen"


def test_a_transfer_still_running_at_the_drain_timeout_fails_with_daemon_stopping(
        daemon_factory: Factory, short_tmp: Path) -> None:
    # gen never grants credit and ctx waits long for it: the transfer cannot finish within the drain
    gen_transfer = {"bounce_size_mb": 4, "chunk_mb": 1, "grant_credits": False, "bounce_wait_s": 120.0}
    pair = start_pair(daemon_factory, short_tmp, CTX_LAYOUT, GEN_LAYOUT, transfer={"bounce_wait_s": 120.0},
                      gen_extra={"transfer": gen_transfer, "drain_timeout_s": 1.0})
    with Client(pair.gen.socket_path, client="gen", timeout=IO_TIMEOUT) as gen, \
            Client(pair.gen.socket_path, client="gen-watch", timeout=IO_TIMEOUT) as watch, \
            Client(pair.ctx.socket_path, client="ctx", timeout=IO_TIMEOUT) as ctx, \
            Client(pair.ctx.socket_path, client="ctx-watch", timeout=IO_TIMEOUT) as ctx_watch, \
            ThreadPoolExecutor(2) as pool:
        wait_until(lambda: watch.stats().peers_connected == 1, "the peer link")
        g_ids = gen.alloc("gen0", 8)
        c_ids = ctx.alloc("ctx0", 4)
        gen.expect("stuck", "gen0", GEN_LAYOUT, 0, g_ids, deadline_s=300)
        ctx.publish("stuck", "ctx0", CTX_LAYOUT, 0, c_ids, peer="gen", deadline_s=300)
        gen_done = pool.submit(gen.wait, "stuck", 60)
        ctx_done = pool.submit(ctx.wait, "stuck", 60)
        wait_until(lambda: _state(ctx_watch, "stuck") == "sending", "ctx to start sending")
        pair.gen.proc.send_signal(signal.SIGTERM)
        with pytest.raises(DaemonStopping, match=r"drain_timeout_s=1 passed before the transfer finished"):
            gen_done.result(60)
        # ctx heard of it at once (gen's failure message), long before its own deadline
        with pytest.raises(DaemonStopping, match="gen side failed: kvd on node 'gen' is stopping"):
            ctx_done.result(60)
    assert pair.gen.proc.wait(IO_TIMEOUT) == 0
    (timeout,) = events(pair.gen, "daemon.drain_timeout")
    assert timeout["request_ids"] == ["stuck"] and timeout["transfers_failing"] == 1
    assert events(pair.gen, "daemon.stopping")[0]["transfers_active"] == 0  # it ended within the grace
    assert not events(pair.gen, "daemon.drain_unmatched")  # its ctx had spoken: it was not waiting


def test_local_request_without_its_gen_side_fails_on_sigterm(daemon_factory: Factory) -> None:
    """ctx and gen on one daemon, gen never registers: the executor's wait, blocked in a thread,
    raises DaemonStopping; the daemon stops at once (not after drain_timeout_s)."""
    d = daemon_factory({"drain_timeout_s": 300.0}, name="solo")
    with Client(d.socket_path, client="ctx", timeout=IO_TIMEOUT) as ctx:
        layout = ctx.pools()[0].layout
        assert layout is not None
    raw = Raw(d.socket_path)  # the wait must be in before the signal: its Ping answered after it
    raw.hello("ctx")
    raw.send_body({"type": "alloc", "id": 2, "pool": "host0", "count": 2})
    alloc = raw.receive()
    assert isinstance(alloc, m.Allocated)
    raw.send(encode(m.Publish(id=3, request_id="alone", pool="host0", layout=layout, rank=0,
                              block_ids=alloc.block_ids, peer="solo", deadline_s=300))
             + encode(m.Wait(id=4, request_id="alone", timeout_s=60)) + encode(m.Ping(id=5)))
    assert isinstance(raw.receive(), m.Registered)
    assert isinstance(raw.receive(), m.Pong)  # frames are served in order: the wait is waiting
    d.proc.send_signal(signal.SIGTERM)
    done = raw.receive()
    assert isinstance(done, m.Completion) and done.id == 4 and not done.ok, done
    assert done.error_code == DaemonStopping.code and "other side never came" in done.error_message, done
    raw.close()
    assert d.proc.wait(IO_TIMEOUT) == 0
    assert events(d, "daemon.drain_unmatched")[0]["request_ids"] == ["alone"]
    assert not events(d, "daemon.drain_timeout")
