"""The systemd notify protocol (``sd_notify``), spoken over ``$NOTIFY_SOCKET``.

systemd (``Type=notify``) hands the service an ``AF_UNIX``/``SOCK_DGRAM`` socket address in
``NOTIFY_SOCKET``: a filesystem path, or a Linux abstract-namespace name written with a leading
``@``. Each datagram is newline-separated ``KEY=VALUE`` assignments: ``READY=1`` once the
daemon serves, ``STATUS=...`` free text for ``systemctl status``, ``WATCHDOG=1`` keep-alives
(at least every ``WATCHDOG_USEC``; we send every half of it) and ``STOPPING=1`` when shutdown
begins.

Rules this module keeps:

- No ``NOTIFY_SOCKET`` (not under systemd, or ``Type=simple``): every call is a no-op.
- Sending never blocks the event loop: the socket is non-blocking; a datagram the manager cannot
  take right now (``EAGAIN``) is dropped. A failing send is logged once (``notify.send_failed``)
  and ignored: telling systemd about us must never take the daemon down.
- ``WATCHDOG_PID`` set to another process (the watchdog is meant for a different main PID)
  disables the watchdog for us, as ``sd_watchdog_enabled()`` does.

The watchdog runs as a task in the root nursery (:func:`run_watchdog`), so a keep-alive proves
the trio event loop still runs: a wedged loop stops the pings and systemd restarts the service.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import trio

from kvd.ops.logs import get_logger

__all__ = ["Notifier", "run_watchdog"]

_log = get_logger(__name__)

# Minimum keep-alive period we accept: a WATCHDOG_USEC below 2 ms would make us spin.
_MIN_INTERVAL_S = 0.001


def _address(raw: str) -> str | bytes | None:
    """``NOTIFY_SOCKET`` → a ``socket.connect``/``sendto`` address, or None if unsupported."""
    if raw.startswith("@"):
        # Linux abstract namespace: the leading "@" stands for a NUL byte.
        return b"\0" + os.fsencode(raw[1:])
    if raw.startswith("/"):
        return raw
    # e.g. "vsock:CID:PORT" (systemd ≥ 254, VMs); not something kvd runs under.
    return None


def _clean(text: str) -> str:
    """One assignment's value: newlines would start a new assignment, so flatten them."""
    return " ".join(text.splitlines())


class Notifier:
    """Sends sd_notify messages to the service manager, if there is one.

    ``env`` is the process environment (pass ``os.environ``); it is read once, here.
    Use :meth:`close` (or ``with Notifier(env) as n:``) to release the socket.
    """

    def __init__(self, env: Mapping[str, str]) -> None:
        self._sock: socket.socket | None = None
        self._addr: str | bytes | None = None
        self._warned = False
        self._watchdog_usec = env.get("WATCHDOG_USEC", "")
        self._watchdog_pid = env.get("WATCHDOG_PID", "")
        raw = env.get("NOTIFY_SOCKET", "")
        if not raw:
            return
        addr = _address(raw)
        if addr is None:
            _log.warning("notify.unsupported_socket", notify_socket=raw)
            return
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        except OSError as exc:
            _log.warning("notify.socket_failed", notify_socket=raw, error=str(exc))
            return
        sock.setblocking(False)
        self._sock = sock
        self._addr = addr

    # --- state ------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """True when there is a service manager to talk to (``NOTIFY_SOCKET`` set and usable)."""
        return self._sock is not None

    def watchdog_interval(self) -> float | None:
        """Seconds between keep-alives (half of ``WATCHDOG_USEC``), or None when no watchdog.

        None when notify is disabled, ``WATCHDOG_USEC`` is missing, not a positive integer, or
        ``WATCHDOG_PID`` names a process other than this one.
        """
        if not self.enabled or not self._watchdog_usec:
            return None
        try:
            usec = int(self._watchdog_usec)
        except ValueError:
            return None
        if usec <= 0:
            return None
        if self._watchdog_pid:
            try:
                pid = int(self._watchdog_pid)
            except ValueError:
                return None
            if pid != os.getpid():
                return None
        return max(usec / 2_000_000, _MIN_INTERVAL_S)

    # --- messages -----------------------------------------------------------------------

    def notify(self, **fields: str | int) -> bool:
        """Send one datagram of ``KEY=VALUE`` assignments. True if the manager got it.

        Never raises and never blocks; with notify disabled it does nothing (returns False).
        """
        if self._sock is None or self._addr is None or not fields:
            return False
        payload = "\n".join(f"{key}={_clean(str(value))}" for key, value in fields.items())
        try:
            self._sock.sendto(payload.encode(), self._addr)
        except OSError as exc:
            # EAGAIN (manager's queue full), ECONNREFUSED/ENOENT (manager gone), ...: never fatal.
            if not self._warned:
                self._warned = True
                _log.warning(
                    "notify.send_failed",
                    error=str(exc),
                    fields=sorted(fields),
                    note="further notify failures are not logged",
                )
            return False
        return True

    def ready(self, status: str = "") -> bool:
        """``READY=1`` (startup finished), with an optional ``STATUS=`` line."""
        if status:
            return self.notify(READY=1, STATUS=status)
        return self.notify(READY=1)

    def status(self, text: str) -> bool:
        """``STATUS=text``: free-form state shown by ``systemctl status``."""
        return self.notify(STATUS=text)

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: one keep-alive."""
        return self.notify(WATCHDOG=1)

    def stopping(self, status: str = "") -> bool:
        """``STOPPING=1``: shutdown has begun (drain), with an optional ``STATUS=`` line."""
        if status:
            return self.notify(STOPPING=1, STATUS=status)
        return self.notify(STOPPING=1)

    def extend_timeout(self, seconds: float) -> bool:
        """``EXTEND_TIMEOUT_USEC=``: ask for more time to start or stop (e.g. a long drain)."""
        return self.notify(EXTEND_TIMEOUT_USEC=max(0, int(seconds * 1_000_000)))

    # --- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Release the socket; later calls are no-ops."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Notifier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def run_watchdog(
    notifier: Notifier, *, task_status: trio.TaskStatus[float | None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Send ``WATCHDOG=1`` every :meth:`Notifier.watchdog_interval` seconds, forever.

    Start it in the root nursery with ``await nursery.start(run_watchdog, notifier)``: the first
    keep-alive is sent before ``started()``, whose value is the interval. Without a watchdog
    (interval None) it reports ``started(None)`` and returns at once.
    """
    interval = notifier.watchdog_interval()
    if interval is None:
        task_status.started(None)
        return
    notifier.watchdog()
    task_status.started(interval)
    while True:
        await trio.sleep(interval)
        notifier.watchdog()
