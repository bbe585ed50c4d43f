"""A configured peer that refuses us is retried with a growing delay, and the repeated failure
fills neither log: the first one is logged, its repeats are counted (``suppressed=N``, at most
a line per 10 s), ``kvctl peers`` shows how many attempts failed. Once the peer accepts us,
the link comes up and the count starts again."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import structlog
from structlog.testing import capture_logs

from clients import Client
from kvd.demo.launch import DaemonProcess
from kvd.ops.throttle import Throttle
from kvd.peer.retry import Backoff
from tests.hostile import IO_TIMEOUT, events, wait_until
from tests.ports import unused_port
from tests.transfer_harness import write_secret

Factory = Callable[..., DaemonProcess]
#: The throttle's window: a repeated failure is written at most once per this many seconds.
LOG_INTERVAL_S = 10.0


def test_backoff_doubles_to_the_cap_and_starts_again_after_a_success() -> None:
    b = Backoff(1.0, 30.0, jitter=0.0)
    assert [b.failed() for _ in range(8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert b.failures == 8
    b.reset()
    assert b.failures == 0 and b.failed() == 1.0 and b.failed() == 2.0


def test_backoff_jitter_only_shortens_and_is_bounded() -> None:
    b = Backoff(1.0, 30.0, jitter=0.2, rng=random.Random(7))
    nominal = [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0, 30.0]
    for want in nominal:
        got = b.failed()
        assert 0.8 * want <= got <= want, (got, want)


def test_backoff_refuses_nonsense() -> None:
    for args in [(0.0, 1.0), (2.0, 1.0)]:
        try:
            Backoff(*args)
        except ValueError:
            continue
        raise AssertionError(f"Backoff{args} accepted")
    try:
        Backoff(1.0, 2.0, jitter=1.0)
    except ValueError:
        pass
    else:
        raise AssertionError("jitter 1.0 accepted (a delay could be 0)")


def test_throttle_key_limits_each_reason_separately() -> None:
    now = [0.0]
    t = Throttle(structlog.get_logger("test"), LOG_INTERVAL_S, clock=lambda: now[0])
    with capture_logs() as logs:
        assert t.warning("peer.connect_failed", throttle_key="a", error="a")
        assert not t.warning("peer.connect_failed", throttle_key="a", error="a")
        assert t.warning("peer.connect_failed", throttle_key="b", error="b")  # a new reason: at once
        assert not t.warning("peer.connect_failed", throttle_key="a", error="a")
        assert t.suppressed("a") == 2 and t.suppressed("b") == 0
        now[0] = LOG_INTERVAL_S
        assert t.warning("peer.connect_failed", throttle_key="a", error="a")  # the summary line
    assert [(e["error"], e.get("suppressed")) for e in logs] == [("a", None), ("b", None), ("a", 2)]


def _attempts(c: Client) -> int:
    (peer,) = c.peers()
    return peer.attempts


def test_wrong_secret_backs_off_and_logs_boundedly(daemon_factory: Factory, short_tmp: Path) -> None:
    gen_dir, ctx_dir = short_tmp / "g", short_tmp / "c"
    gen_dir.mkdir()
    ctx_dir.mkdir()
    port = unused_port()  # gen is restarted on it below: a port nothing else takes meanwhile
    gen = daemon_factory({"peer_secret_file": write_secret(gen_dir), "peer_port": port}, name="gen")
    # short delays so that many attempts happen quickly: 20 ms doubling to at most 80 ms
    t0 = time.monotonic()
    ctx = daemon_factory({"peer_secret_file": write_secret(ctx_dir),  # another secret
                          "transfer": {"bounce_size_mb": 4, "chunk_mb": 1, "reconnect_initial_s": 0.02,
                                       "reconnect_max_s": 0.08},
                          "peers": [{"name": "gen", "host": "127.0.0.1", "port": port}]}, name="ctx")
    with Client(ctx.socket_path, client="watch", timeout=IO_TIMEOUT) as watch:
        wait_until(lambda: _attempts(watch) >= 25, "25 failed attempts", timeout=60)
        (peer,) = watch.peers()
        assert peer.state == "connecting" and "failed the shared-secret handshake" in peer.error
        attempts = peer.attempts
    # every attempt failed, yet each kind of line was written once per throttle window at most
    # (the windows counted up to the read of the log: the daemon goes on failing meanwhile)
    auth = [e for e in events(ctx, "peer.auth_failed") if e["side"] == "client"]
    failed = events(ctx, "peer.connect_failed")
    elapsed = time.monotonic() - t0
    windows = 1 + int(elapsed // LOG_INTERVAL_S)
    assert 1 <= len(auth) <= windows and 1 <= len(failed) <= windows, (len(auth), len(failed), attempts, elapsed)
    assert len(auth) + len(failed) < attempts
    first = failed[0]
    assert first["attempt"] == 1 and first["node"] == "gen" and 0.016 <= first["retry_in_s"] <= 0.02
    assert "shared-secret handshake" in first["error"] and "suppressed" not in first
    for later in failed[1:]:  # a summary line: how many it stood for
        assert later["suppressed"] >= 1
    assert auth[0]["reason"].startswith("its MAC does not match our secret") and "suppressed" not in auth[0]

    # the operator fixes gen's secret: gen restarts on the same port, the link comes up and the
    # count of failed attempts starts again
    gen.stop()
    (gen_dir / "peer.secret").write_bytes((ctx_dir / "peer.secret").read_bytes())
    gen2 = daemon_factory({"peer_secret_file": str(gen_dir / "peer.secret"), "peer_port": port}, name="gen")
    with Client(ctx.socket_path, client="watch", timeout=IO_TIMEOUT) as watch:
        wait_until(lambda: watch.peers()[0].state == "up", "the link with the right secret", timeout=60)
        (peer,) = watch.peers()
        assert peer.attempts == 0 and peer.error == ""
    # ctx counts the link up once it sent its welcome; gen logs peer.accepted when it has read it
    wait_until(lambda: bool(events(gen2, "peer.accepted")), "gen to accept the link")
