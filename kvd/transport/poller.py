"""The daemon's one NIXL poller: drains an agent's notifications and drives UCX.

Without NIXL's progress thread, UCX only makes progress inside calls into the agent, so one
task per agent calls :meth:`~kvd.transport.nixl_agent.NixlAgent.notifications` for the
agent's whole life (see :mod:`kvd.transport.nixl_agent` for why). How often it calls is the
trade this module makes: a spin while transfers run (the receiver's poll rate bounds the
sender's completion latency), backing off to almost nothing while idle.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import trio

from kvd.transport.nixl_agent import NixlAgent

__all__ = ["poll_notifications"]


async def poll_notifications(
    agent: NixlAgent,
    on_notif: Callable[[str, bytes], object],
    *,
    idle_poll: float = 0.001,
    idle_max: float | None = None,
    spin: float = 0.002,
    hot: Callable[[], bool] | None = None,
    polite: bool = False,
    wakeup: Callable[[], trio.Event] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Drain ``agent``'s notifications forever, calling ``on_notif(remote_agent, msg)`` for each.

    Run exactly one per agent for its whole life (without the progress thread this poll is
    what drives UCX). It polls with ``trio.sleep(0)`` between calls (a "spin": ≈4 µs per
    round, one core busy) while ``hot()`` is true (e.g. "a transfer into us is in progress")
    and for ``spin`` seconds after the last notification; otherwise every ``idle_poll``
    seconds, doubling up to ``idle_max`` (when given) while nothing happens — an idle daemon
    then costs almost nothing. ``wakeup()`` returns an event set when work starts: an idle
    sleep ends at once then. Sub-millisecond sleeps are pointless: trio rounds them up to
    ≈1.1 ms under epoll. The poll rate of the *receiving* agent bounds the *sender's*
    completion latency: a 1 MiB host write completes in ≈0.2 ms when the target spins, ≈3 ms
    when it polls every ms. ``on_notif`` must not block (use a memory channel's
    ``send_nowait``). Polling pauses while a worker thread is inside the agent
    (:attr:`NixlAgent.busy`). ``polite``: every spin round also yields the CPU
    (``sched_yield``, the GIL released), for hosts with few cores, where a plain spin takes
    the core that the worker threads copying host chunks need (measured on 2 cores, host
    bounce: a plain spin cost more than half the throughput; polling every ms instead of
    spinning cost the small requests ~1 ms per chunk).
    """
    task_status.started()
    last_activity = time.monotonic()
    interval = idle_poll
    while True:
        if agent.busy:
            spinning = hot is not None and hot()
            if spinning and polite:
                os.sched_yield()
            await trio.sleep(0 if spinning else idle_poll)
            continue
        notifs = agent.notifications()
        now = time.monotonic()
        if notifs:
            last_activity = now
            for remote, msgs in notifs.items():
                for msg in msgs:
                    on_notif(remote, msg)
        if now - last_activity < spin or (hot is not None and hot()):
            interval = idle_poll
            if polite:
                os.sched_yield()  # without the GIL: this process's worker threads run first
            await trio.sleep(0)
        elif wakeup is not None:
            with trio.move_on_after(interval):
                await wakeup().wait()
            interval = min(interval * 2, idle_max if idle_max is not None else idle_poll)
        else:
            await trio.sleep(interval)
            interval = min(interval * 2, idle_max if idle_max is not None else idle_poll)
