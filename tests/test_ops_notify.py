"""systemd integration at the daemon level: a real daemon and a real NOTIFY_SOCKET
(the one ``kvd.demo.launch`` binds, as systemd would), with ``WATCHDOG_USEC`` set."""

from __future__ import annotations

import itertools
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
    seen = _receive(d, 1.5)
    pings = [t for t, msg in seen if msg == "WATCHDOG=1"]
    assert 4 <= len(pings) <= 10, seen
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    mean = sum(gaps) / len(gaps)
    assert 0.14 < mean < 0.35, gaps
    assert max(gaps) < 0.6, gaps

    # SIGTERM: STOPPING=1, then a clean exit
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(20) == 0
    after = [line for _, msg in _receive(d, 0.2) for line in msg.split("\n")]
    assert "STOPPING=1" in after
    assert "READY=1" not in after
    log = d.log()
    assert "daemon.draining" in log and "signal SIGTERM" in log and "daemon.stopped" in log
