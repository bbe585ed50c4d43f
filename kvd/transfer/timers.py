"""Items due at trio times, served by one task for all of them.

The engine keeps two such sets: the deadlines of transfers that have no actor task, and the
ended requests it remembers until their deadline. A task per item cost ~45 us of scheduler
work on the GPU host; here one task sleeps until the earliest item is due, and an item added
earlier than that moves the sleep's deadline (trio re-reads it: no wake-up, no extra pass).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Generic, TypeVar

import trio

__all__ = ["DueHeap"]

T = TypeVar("T")


class DueHeap(Generic[T]):
    """Items by the trio time they are due; :meth:`serve` hands each to a callback then."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._seq = 0  # ties in due time keep the order items came in (items need no ordering)
        self._sleep: trio.CancelScope | None = None  # serve()'s sleep, while it sleeps

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, due: float, item: T) -> None:
        """Add ``item``, due at trio time ``due``."""
        self._seq += 1
        heapq.heappush(self._heap, (due, self._seq, item))
        if self._sleep is not None and due < self._sleep.deadline:
            self._sleep.deadline = due  # trio re-reads it: no wake-up

    def pop_first(self) -> tuple[float, T]:
        """Remove and return the item due first, with its due time (before it is due)."""
        due, _, item = heapq.heappop(self._heap)
        return due, item

    def keep(self, wanted: Callable[[T], bool]) -> None:
        """Drop every item ``wanted`` says no to (their time need not come)."""
        self._heap[:] = [e for e in self._heap if wanted(e[2])]
        heapq.heapify(self._heap)

    async def serve(self, on_due: Callable[[T], object]) -> None:
        """Call ``on_due(item)`` for each item once it is due, forever (cancel to stop).
        ``on_due`` must not block; what it raises ends this task."""
        heap = self._heap
        while True:
            now = trio.current_time()
            while heap and heap[0][0] <= now:
                on_due(heapq.heappop(heap)[2])
            # no checkpoint from the test above to the sleep: push() sees the scope
            with trio.move_on_at(heap[0][0] if heap else math.inf) as scope:
                self._sleep = scope
                await trio.sleep_forever()
            self._sleep = None
