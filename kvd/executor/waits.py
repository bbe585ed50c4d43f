"""A session's pending ``Wait`` requests, answered in the step that reports their request.

A wait used to be a task of the session: one scheduler pass to start it, one to wake it once
the request ended, even when its reply had already gone out from the reporting step: eight
task steps per request on a gen daemon of four executors. Here a wait is an engine watch
(:meth:`kvd.transfer.engine.Engine.watch`) and a deadline: the reporting step writes the
reply (when no other reply is being written and the socket takes all of it, else a short
task finishes it), and one task per session, started with its first timed wait, expires
them: it sleeps in a cancel scope whose deadline is the earliest pending one (a new, earlier
deadline moves it without waking the task).

Rules kept from the task per wait: one reply per wait (an expired wait is never answered
again); ``session.inflight`` counts a wait until its reply is written; when the session ends
its waits end with it, unanswered.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from kvd.ops.steptrace import mark
from protocol import messages as m
from protocol.errors import WaitTimeout

if TYPE_CHECKING:
    from kvd.daemon import Daemon
    from kvd.executor.session import SessionConnection

_BROKEN = (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError)


def wait_timeout(msg: m.Wait) -> WaitTimeout:
    """The error of a wait whose ``timeout_s`` passed (the request goes on)."""
    return WaitTimeout(f"request {msg.request_id!r} still running after wait timeout {msg.timeout_s}s; "
                       "it goes on (wait again, or cancel it)")


@dataclass(eq=False)
class _Pending:
    msg: m.Wait
    deadline: float  # trio clock; inf without a timeout
    stop: Callable[[], None] = field(default=lambda: None)  # ends the engine's watch


class Waits:
    """The pending waits of one session (see the module docstring)."""

    def __init__(self, daemon: Daemon, conn: SessionConnection, nursery: trio.Nursery) -> None:
        self._daemon = daemon
        self._conn = conn
        self._nursery = nursery
        self._pending: set[_Pending] = set()
        self._timer: trio.CancelScope | None = None  # the expiring task's sleep, while it sleeps
        self._timer_started = False
        self._closed = False

    def add(self, msg: m.Wait) -> None:
        """Wait for ``msg``'s request, which has not ended; raises (changing nothing) as the
        engine's watch does (a request this session did not register)."""
        deadline = math.inf if msg.timeout_s is None else trio.current_time() + msg.timeout_s
        w = _Pending(msg, deadline)
        w.stop = self._daemon.watch(self._conn.session, msg, lambda reply: self._answer(w, reply))
        self._pending.add(w)
        self._conn.session.inflight += 1
        if deadline < math.inf:
            self._arm(deadline)

    def close(self) -> None:
        """The session ends: its waits end unanswered (no reply may start after this)."""
        self._closed = True
        for w in self._pending:
            w.stop()
        self._conn.session.inflight -= len(self._pending)  # no reply is owed to a gone executor
        self._pending.clear()

    # -- answers (in the reporting step) ---------------------------------------------------
    def _answer(self, w: _Pending, reply: m.Completion) -> None:
        if w not in self._pending:
            return  # expired or closed meanwhile (its watch was stopped: not reached)
        self._pending.discard(w)
        rest = self._conn.write_nowait(reply)
        if rest == b"":
            self._conn.session.inflight -= 1
            mark("session.replied", "Completion")
        elif rest is None:  # another reply is being written: this one goes after it
            self._nursery.start_soon(self._send, reply)
        else:  # the socket took part of it: the rest under the send lock, which write_nowait took
            self._nursery.start_soon(self._finish, rest)

    async def _send(self, reply: m.Message) -> None:
        try:
            await self._conn.send(reply)
            mark("session.replied", type(reply).__name__)
        except _BROKEN:
            pass  # the session's receive loop sees the connection end
        finally:
            self._conn.session.inflight -= 1

    async def _finish(self, rest: bytes) -> None:
        try:
            await self._conn.finish_write(rest)  # releases the send lock, however it ends
            mark("session.replied", "Completion")
        except _BROKEN:
            pass
        finally:
            self._conn.session.inflight -= 1

    # -- timeouts ------------------------------------------------------------------------------
    def _arm(self, deadline: float) -> None:
        if self._timer is not None:
            # only an earlier deadline moves the sleep: trio's deadline setter is a context
            # manager and a deadline heap update (~130 bytecodes), the usual later one needs none
            if deadline < self._timer.deadline:
                self._timer.deadline = deadline
        elif not self._timer_started and not self._closed:
            self._timer_started = True
            self._nursery.start_soon(self._expire)
        # else the task is between two sleeps: it reads every deadline before the next one

    def _earliest(self) -> float:
        return min((w.deadline for w in self._pending), default=math.inf)

    async def _expire(self) -> None:
        """Answer the waits whose timeout passed with ``wait_timeout``, as their deadlines come."""
        while True:
            with trio.CancelScope(deadline=self._earliest()) as timer:
                self._timer = timer
                await trio.sleep_forever()
            self._timer = None
            now = trio.current_time()
            for w in [w for w in self._pending if w.deadline <= now]:
                if w not in self._pending:
                    continue  # answered while an earlier expiry's error was being written
                self._pending.discard(w)
                w.stop()
                try:
                    await self._conn.send_error(w.msg.id, wait_timeout(w.msg))
                except _BROKEN:
                    pass
                finally:
                    self._conn.session.inflight -= 1
