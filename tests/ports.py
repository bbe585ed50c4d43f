"""TCP ports for the tests that name a port before anything listens on it: a daemon's
``peer_port`` that a test restarts it on, a peer that is configured before it is up, a
``metrics_port``.

A port the kernel picked (``bind`` to port 0) and the test then let go of can be picked again
by any process before the daemon binds it, and under the README's ``pytest -n 2`` the other
worker's daemons bind and connect all the time. :func:`unused_port` hands out ports from a
range of this worker's own below the kernel's ephemeral range (``ip_local_port_range``, where
every ``bind`` to 0 and every ``connect`` takes its port): no other worker and no port the
kernel picks can land there. Each is checked free when handed out (another program on the
machine may use that range), and each is handed out once per run.

A port that only has to refuse connections is better a socket bound to port 0 and kept open
(never listening) for as long as the test needs it.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path

#: ports per worker
SPAN = 400


def _worker() -> int:
    """This pytest-xdist worker's number (``gw1`` -> 1); 0 without xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0


def _span() -> range:
    """This worker's ports: below the ephemeral range, else above it."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    below = low - SPAN * (_worker() + 1)
    if below >= 1024:
        return range(below, below + SPAN)
    above = high + 1 + SPAN * _worker()
    if above + SPAN <= 65536:
        return range(above, above + SPAN)
    raise RuntimeError(f"no room for test ports outside the ephemeral range {low}-{high}")


def _ports() -> Iterator[int]:
    span = _span()
    start = random.randrange(len(span))  # another run on this machine at the same time starts elsewhere
    return iter([span[(start + i) % len(span)] for i in range(len(span))])


_next: Iterator[int] | None = None


def unused_port() -> int:
    """A port on 127.0.0.1 that nothing is bound to now, and that nothing but the caller will take."""
    global _next
    if _next is None:
        _next = _ports()
    for port in _next:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))  # no SO_REUSEADDR: a port in TIME_WAIT is passed over too
            except OSError:
                continue
        return port
    raise RuntimeError(f"all {SPAN} test ports of this worker are handed out or in use")
