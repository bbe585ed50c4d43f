"""The sd_notify protocol of a real kvd subprocess, read from a real AF_UNIX datagram socket.

``start_daemon`` binds the datagram socket and passes it as ``NOTIFY_SOCKET``, as systemd does
for ``Type=notify``; the daemon must say ``READY=1`` (with a ``STATUS=`` line) once it serves,
``WATCHDOG=1`` every half ``WATCHDOG_USEC`` while it runs, and ``STOPPING=1`` on SIGTERM.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Callable

from clients import Client
from kvd.demo.launch import DaemonProcess


def _parse(datagram: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in datagram.split("\n"))


def _collect(d: DaemonProcess, seconds: float) -> list[tuple[float, dict[str, str]]]:
    """Datagrams that arrive within ``seconds``, with their arrival time."""
    out: list[tuple[float, dict[str, str]]] = []
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        for msg in d.read_notify(min(left, 0.05)):
            out.append((time.monotonic(), _parse(msg)))
    return out


def test_ready_watchdog_stopping(daemon_factory: Callable[..., DaemonProcess]) -> None:
    env = {**os.environ, "WATCHDOG_USEC": "400000"}  # keep-alive every 0.2 s
    d = daemon_factory(name="wd", env=env)
    first = [_parse(msg) for msg in d.messages]
    # READY=1 comes in one datagram with its STATUS= line, after the "starting" status.
    ready = [f for f in first if f.get("READY") == "1"]
    assert len(ready) == 1
    assert "serving 1 pool(s)" in ready[0]["STATUS"]
    assert d.socket_path in ready[0]["STATUS"]
    assert first[0] == {"STATUS": "starting: creating pools"}
    # The daemon serves once READY=1 was sent.
    with Client(d.socket_path, timeout=10) as c:
        assert c.ping(b"up") == b"up"

    got = _collect(d, 1.5)
    pings = [t for t, f in got if f == {"WATCHDOG": "1"}]
    assert 5 <= len(pings) <= 10, got
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    assert max(gaps) < 0.6, gaps  # never near the 0.4 s watchdog limit
    assert not any("STOPPING" in f for _t, f in got)

    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(20) == 0
    after = [f for _t, f in _collect(d, 0.3)]
    stopping = [f for f in after if f.get("STOPPING") == "1"]
    assert len(stopping) == 1
    # after STOPPING=1 the status says so and no keep-alive claims the daemon is healthy
    i = after.index(stopping[0])
    assert any(f.get("STATUS", "").startswith("draining: 0 transfer(s) in flight") for f in after[i:])
    assert not os.path.exists(d.socket_path)


def test_no_watchdog_without_watchdog_usec(daemon_factory: Callable[..., DaemonProcess]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("WATCHDOG_USEC", "WATCHDOG_PID")}
    d = daemon_factory(name="nowd", env=env)
    assert any(_parse(msg).get("READY") == "1" for msg in d.messages)
    got = _collect(d, 0.6)
    assert not any("WATCHDOG" in f for _t, f in got), got
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(20) == 0
    flags = [f for _t, f in _collect(d, 0.3)]
    assert any(f.get("STOPPING") == "1" for f in flags)


def test_watchdog_pid_of_another_process_disables_watchdog(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    env = {**os.environ, "WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getpid())}
    d = daemon_factory(name="otherpid", env=env)
    got = _collect(d, 0.5)
    assert not any("WATCHDOG" in f for _t, f in got), got
    assert not any("WATCHDOG" in _parse(msg) for msg in d.messages)
