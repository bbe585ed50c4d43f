"""An accept loop that stays calm at the file-descriptor limit.

``trio.serve_listeners`` logs an error *with a traceback* and retries every 0.1 s when
``accept()`` fails with EMFILE/ENFILE/ENOBUFS/ENOMEM: a client flood at the fd limit then
writes a traceback ten times a second while every client hangs in the listen backlog. This
loop instead:

- logs one warning (rate-limited, :class:`~kvd.ops.throttle.Throttle`) and backs off
  exponentially (``BACKOFF_MIN_S`` .. ``BACKOFF_MAX_S``), resetting once an accept succeeds;
- keeps one spare descriptor: at the limit it frees it, accepts the waiting connection with
  it and closes it at once (after ``on_overflow`` had a chance to say why), so clients get an
  answer instead of hanging, then takes the spare back and tries a normal accept again.

Handlers run in a nursery the caller passes in, so the caller can stop accepting (cancel the
loop) without cancelling the connections already being served (a drain).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Awaitable, Callable

import structlog
import trio

from kvd.ops.throttle import Throttle

__all__ = ["BACKOFF_MAX_S", "BACKOFF_MIN_S", "CAPACITY_ERRNOS", "accept_loop"]

log = structlog.get_logger("kvd.ops.accept")

#: accept() errors that mean "out of resources", not "the listener is broken".
CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0

_throttle = Throttle(log)


def _spare_fd() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


async def accept_loop(
    listener: trio.SocketListener,
    handler: Callable[[trio.SocketStream], Awaitable[object]],
    handler_nursery: trio.Nursery,
    *,
    what: str,
    on_overflow: Callable[[socket.socket], None] | None = None,
) -> None:
    """Accept connections forever, starting ``handler(stream)`` in ``handler_nursery``.

    ``what`` names the listener in the log (``executor``, ``peer``). ``on_overflow(sock)`` is
    called (synchronously, best effort) for a connection accepted with the spare descriptor
    at the fd limit, right before it is closed.
    """
    spare = _spare_fd()
    backoff = BACKOFF_MIN_S
    try:
        while True:
            try:
                # SocketListener.accept skips the errors of a connection that died before we
                # took it (ECONNABORTED, EPROTO, ...); what is left is ours to handle
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in CAPACITY_ERRNOS:
                    raise
                shed = False
                if spare is not None:
                    os.close(spare)
                    spare = None
                    shed = _shed_one(listener, on_overflow)
                spare = _spare_fd()  # None while we are still at the limit: retried next time
                _throttle.warning(
                    "listener.fd_limit",
                    listener=what,
                    error=exc.strerror or str(exc),
                    shed_connection=shed,
                    retry_in_s=0 if shed else backoff,
                )
                if shed:  # progress: try the next one at once (a normal accept if fds are free)
                    await trio.lowlevel.checkpoint()
                    continue
                await trio.sleep(backoff)
                backoff = min(BACKOFF_MAX_S, backoff * 2)
                continue
            backoff = BACKOFF_MIN_S
            handler_nursery.start_soon(handler, stream)
    finally:
        if spare is not None:
            os.close(spare)


def _shed_one(listener: trio.SocketListener, on_overflow: Callable[[socket.socket], None] | None) -> bool:
    """Accept one waiting connection with the freed spare descriptor and close it at once.

    One at a time: the next accept is a normal one, so once descriptors are free again no
    further client is shed.
    """
    # a stdlib view of the listening descriptor (no new fd; detached, not closed, below)
    view = socket.socket(fileno=listener.socket.fileno())
    try:
        view.setblocking(False)  # trio's listener is non-blocking already; say so to Python
        sock, _addr = view.accept()
    except OSError:  # none waiting any more (EAGAIN), or still no descriptor
        return False
    finally:
        view.detach()
    try:
        sock.setblocking(False)
        if on_overflow is not None:
            with contextlib.suppress(OSError):  # a full or closed socket: it just gets the close
                on_overflow(sock)
    finally:
        sock.close()
    return True
