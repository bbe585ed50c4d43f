"""The sd_notify protocol of a real kvd subprocess, read from a real AF_UNIX datagram socket.

``start_daemon`` binds the datagram socket and passes it as ``NOTIFY_SOCKET``, as systemd does
for ``Type=notify``; the daemon must say ``READY=1`` (with a ``STATUS=`` line) once it serves,
``WATCHDOG=1`` every half ``WATCHDOG_USEC`` while it runs, and ``STOPPING=1`` on SIGTERM.
"""

from __future__ import annotations

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


def _paced_keepalives(d: DaemonProcess, count: int, interval: float,
                      timeout: float = 30.0) -> list[dict[str, str]]:
    """Wait for ``count`` keep-alives sent from now on; returns every datagram read meanwhile.

    They must keep coming (``count`` within ``timeout``), and no faster than one per
    ``interval``: the daemon sleeps ``interval`` between two, so ``count`` of them span at
    least ``(count - 1) * interval``. That bound holds however loaded the machine is (load only
    stretches the span); that they come every ``interval`` and no later is checked on virtual
    time (tests/test_notify.py), not here against the wall clock.
    """
    start = time.monotonic()
    d.read_notify()  # sent before ``start``: not counted
    seen: list[dict[str, str]] = []
    pings = 0
    while pings < count:
        assert time.monotonic() - start < timeout, f"{pings} of {count} keep-alives within {timeout} s: {seen}"
        for msg in d.read_notify(0.05):
            seen.append(_parse(msg))
            pings += seen[-1] == {"WATCHDOG": "1"}
    span = time.monotonic() - start
    assert span >= (count - 1) * interval - 1e-3, (span, seen)
    return seen


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

    # keep-alives every 0.2 s (half WATCHDOG_USEC) while it serves, nothing about stopping
    got = _paced_keepalives(d, 6, 0.2)
    assert not any("STOPPING" in f for f in got)

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
