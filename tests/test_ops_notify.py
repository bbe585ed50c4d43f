"""systemd integration at the daemon level: a real daemon and a real NOTIFY_SOCKET
(the one ``kvd.demo.launch`` binds, as systemd would), with ``WATCHDOG_USEC`` set."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from kvd.demo.launch import DaemonProcess

WATCHDOG_USEC = 400_000  # → a keep-alive every 0.2 s


def _receive(d: DaemonProcess, seconds: float) -> list[tuple[float, str]]:
    """(arrival time, datagram) for every notification received within ``seconds``."""
    out: list[tuple[float, str]] = []
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        out.extend((time.monotonic(), msg) for msg in d.read_notify(min(left, 0.05)))
    return out


def _paced_keepalives(d: DaemonProcess, count: int, interval: float, timeout: float = 30.0) -> list[str]:
    """Wait for ``count`` keep-alives sent from now on; returns every datagram read meanwhile.

    They must keep coming (``count`` within ``timeout``), and no faster than one per
    ``interval``: the daemon sleeps ``interval`` between two, so ``count`` of them span at
    least ``(count - 1) * interval``, however loaded the machine is (load only stretches the
    span). That they come every ``interval`` and no later is checked on virtual time
    (tests/test_notify.py), not here against the wall clock.
    """
    start = time.monotonic()
    d.read_notify()  # sent before ``start``: not counted
    seen: list[str] = []
    while seen.count("WATCHDOG=1") < count:
        assert time.monotonic() - start < timeout, f"{seen.count('WATCHDOG=1')} of {count} keep-alives: {seen}"
        seen += d.read_notify(0.05)
    span = time.monotonic() - start
    assert span >= (count - 1) * interval - 1e-3, (span, seen)
    return seen


def test_ready_watchdog_stopping(daemon_factory: Callable[..., DaemonProcess]) -> None:
    env = {**os.environ, "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    d = daemon_factory(name="wd", env=env)

    # READY=1 came once startup was done, with a STATUS= line saying what the daemon serves
    # (start_daemon returned when it saw it); the first keep-alive was sent before it.
    startup = [line for msg in d.messages for line in msg.split("\n")]
    assert startup.count("READY=1") == 1
    assert startup.index("WATCHDOG=1") < startup.index("READY=1")
    assert any(line.startswith("STATUS=serving 1 pool(s) on ") for line in startup)

    # WATCHDOG=1 every WATCHDOG_USEC / 2
    seen = _paced_keepalives(d, 6, WATCHDOG_USEC / 2e6)
    assert "STOPPING=1" not in seen

    # SIGTERM: STOPPING=1, then a clean exit
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(20) == 0
    after = [line for _, msg in _receive(d, 0.2) for line in msg.split("\n")]
    assert "STOPPING=1" in after
    assert "READY=1" not in after
    log = d.log()
    assert "daemon.draining" in log and "signal SIGTERM" in log and "daemon.stopped" in log
