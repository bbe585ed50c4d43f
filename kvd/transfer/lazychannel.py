"""An unbounded trio memory channel that is opened only when someone reads it.

A transfer has three inboxes (its actor's, the bounce path's notified chunks, the receive
slots gen granted), and most transfers never read two of them: a small mapped request is
handled in its callers' steps and never queues at all. Opening a channel pair costs ~3 us
warm and ~30 us cold in a daemon's step (steptrace on the GPU host), so each is opened on
the first read; what was sent before that waits in a list and comes out first, in order.
"""

from __future__ import annotations

import math
from typing import Generic, TypeVar

import trio

T = TypeVar("T")

__all__ = ["LazyChannel"]


class LazyChannel(Generic[T]):
    """``send_nowait`` before the channel exists keeps the item; :attr:`rx` opens it (once)
    with those items in it, in the order they were sent."""

    __slots__ = ("_early", "_pair")

    def __init__(self) -> None:
        self._pair: tuple[trio.MemorySendChannel[T], trio.MemoryReceiveChannel[T]] | None = None
        self._early: list[T] = []

    @property
    def opened(self) -> bool:
        """Whether :attr:`rx` has been asked for (a reader may wait on it)."""
        return self._pair is not None

    def send_nowait(self, item: T) -> None:
        """Deliver ``item`` (never blocks: the channel is unbounded)."""
        if self._pair is None:
            self._early.append(item)
        else:
            self._pair[0].send_nowait(item)

    @property
    def rx(self) -> trio.MemoryReceiveChannel[T]:
        """The receiving end; the first call opens the channel with the items sent so far."""
        if self._pair is None:
            self._pair = trio.open_memory_channel[T](math.inf)
            early, self._early = self._early, []
            for item in early:
                self._pair[0].send_nowait(item)
        return self._pair[1]
