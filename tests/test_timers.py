"""DueHeap: items handed out when due, in due order, by one task; an earlier item moves the
task's sleep. On trio's mock clock (autojump: virtual time, no real waiting)."""

from __future__ import annotations

import trio
import trio.testing

from kvd.transfer.timers import DueHeap


async def _run(heap: DueHeap[str], seen: list[tuple[float, str]], until: float) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(heap.serve, lambda item: seen.append((trio.current_time(), item)))
        await trio.testing.wait_all_tasks_blocked()
        heap.push(trio.current_time() + 5.0, "late")
        heap.push(trio.current_time() + 1.0, "early")  # earlier than the sleep: moves it
        heap.push(trio.current_time() + 1.0, "early-too")  # a tie keeps the order items came in
        await trio.sleep(until)
        nursery.cancel_scope.cancel()


def test_items_come_out_when_due_in_due_order() -> None:
    heap: DueHeap[str] = DueHeap()
    seen: list[tuple[float, str]] = []
    clock = trio.testing.MockClock(autojump_threshold=0)
    trio.run(_run, heap, seen, 10.0, clock=clock)
    assert [item for _, item in seen] == ["early", "early-too", "late"]
    assert [round(t, 6) for t, _ in seen] == [1.0, 1.0, 5.0]  # none handed out before its time
    assert len(heap) == 0


def test_pop_first_and_keep() -> None:
    heap: DueHeap[str] = DueHeap()
    for due, item in ((3.0, "c"), (1.0, "a"), (2.0, "b"), (4.0, "d")):
        heap.push(due, item)
    assert heap.pop_first() == (1.0, "a")
    heap.keep(lambda item: item != "c")
    assert len(heap) == 2 and heap.pop_first() == (2.0, "b") and heap.pop_first() == (4.0, "d")
