"""kvd.ops.notify against a real AF_UNIX datagram socket standing in for systemd."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing
from structlog.testing import capture_logs

from kvd.ops.notify import Notifier, run_watchdog


class Manager:
    """The service manager's end: a bound datagram socket we read messages from."""

    def __init__(self, sock: socket.socket, notify_socket: str) -> None:
        self.sock = sock
        self.notify_socket = notify_socket

    def env(self, **extra: str) -> dict[str, str]:
        return {"NOTIFY_SOCKET": self.notify_socket, **extra}

    def messages(self) -> list[dict[str, str]]:
        """Every datagram queued so far, parsed."""
        out: list[dict[str, str]] = []
        while True:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                return out
            fields = dict(line.split("=", 1) for line in data.decode().split("\n"))
            out.append(fields)


def _bind(address: str | bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.setblocking(False)
    return sock


@pytest.fixture(params=["path", "abstract"])
def manager(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Manager]:
    if request.param == "path":
        path = str(tmp_path / "notify.sock")
        sock = _bind(path)
        notify_socket = path
    else:
        name = f"kvd-test-notify-{uuid.uuid4().hex}"
        sock = _bind(b"\0" + name.encode())
        notify_socket = "@" + name
    with sock:
        yield Manager(sock, notify_socket)


def test_no_notify_socket_is_a_no_op() -> None:
    n = Notifier({})
    assert not n.enabled
    assert n.watchdog_interval() is None
    assert n.ready("serving") is False
    assert n.status("x") is False
    assert n.watchdog() is False
    assert n.stopping() is False
    n.close()


def test_unsupported_address_is_disabled() -> None:
    with capture_logs() as logs:
        n = Notifier({"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not n.enabled
    assert [e["event"] for e in logs] == ["notify.unsupported_socket"]


def test_ready_status_stopping(manager: Manager) -> None:
    with Notifier(manager.env()) as n:
        assert n.enabled
        assert n.ready("serving 2 pools") is True
        assert n.status("3 sessions\nand a newline") is True
        assert n.stopping("draining") is True
        assert n.extend_timeout(1.5) is True
    assert manager.messages() == [
        {"READY": "1", "STATUS": "serving 2 pools"},
        {"STATUS": "3 sessions and a newline"},
        {"STOPPING": "1", "STATUS": "draining"},
        {"EXTEND_TIMEOUT_USEC": "1500000"},
    ]


def test_ready_without_status(manager: Manager) -> None:
    with Notifier(manager.env()) as n:
        n.ready()
        n.stopping()
    assert manager.messages() == [{"READY": "1"}, {"STOPPING": "1"}]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "200000"}, 0.1),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getpid())}, 0.1),
        ({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "nope"}, None),
    ],
)
def test_watchdog_interval(manager: Manager, extra: dict[str, str], expected: float | None) -> None:
    with Notifier(manager.env(**extra)) as n:
        assert n.watchdog_interval() == expected


def test_watchdog_needs_notify_socket() -> None:
    assert Notifier({"WATCHDOG_USEC": "200000"}).watchdog_interval() is None


async def test_watchdog_cadence(manager: Manager, autojump_clock: trio.testing.MockClock) -> None:
    # A real socket, virtual time: WATCHDOG_USEC=200 ms → a keep-alive every 100 ms. Each
    # keep-alive is awaited as a datagram arriving, and its (virtual) arrival time checked.
    with Notifier(manager.env(WATCHDOG_USEC="200000")) as n:
        async with trio.open_nursery() as nursery:
            t0 = trio.current_time()
            interval = await nursery.start(run_watchdog, n)
            assert interval == pytest.approx(0.1)
            # The first keep-alive is sent before started().
            assert manager.messages() == [{"WATCHDOG": "1"}]
            arrivals: list[float] = []
            while len(arrivals) < 5:
                await trio.lowlevel.wait_readable(manager.sock)
                got = manager.messages()
                assert got == [{"WATCHDOG": "1"}] * len(got)
                arrivals += [trio.current_time() - t0] * len(got)
            nursery.cancel_scope.cancel()
    assert arrivals == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert manager.messages() == []


async def test_watchdog_disabled_returns_at_once(manager: Manager) -> None:
    with Notifier(manager.env(WATCHDOG_USEC="200000", WATCHDOG_PID="1")) as n:
        async with trio.open_nursery() as nursery:
            assert await nursery.start(run_watchdog, n) is None
    assert manager.messages() == []


def test_send_failure_is_logged_once_and_never_raises(tmp_path: Path) -> None:
    # The manager is gone: its socket path does not exist.
    with capture_logs() as logs, Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")}) as n:
        assert n.enabled
        assert n.ready("x") is False
        assert n.watchdog() is False
        assert n.stopping() is False
    assert [e["event"] for e in logs] == ["notify.send_failed"]
    assert logs[0]["log_level"] == "warning"


def test_full_manager_queue_never_blocks(manager: Manager) -> None:
    # Nobody reads the manager's socket: its queue fills, sends fail with EAGAIN instead of
    # blocking, and only the first failure is logged.
    with capture_logs() as logs, Notifier(manager.env()) as n:
        results = [n.status("x" * 1000) for _ in range(5000)]
    assert results[0] is True
    assert results[-1] is False
    assert [e["event"] for e in logs] == ["notify.send_failed"]


def test_close_makes_later_calls_no_ops(manager: Manager) -> None:
    n = Notifier(manager.env())
    n.close()
    assert not n.enabled
    assert n.ready() is False
    assert manager.messages() == []
