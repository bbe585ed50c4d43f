"""The idle garbage collector (kvd.ops.collector): CPython's own generation rule, collections
at idle moments, the automatic threshold raised while it runs and put back after."""

from __future__ import annotations

import gc
import weakref

import pytest
import trio
import trio.testing

from kvd.ops import collector
from kvd.ops.collector import BUSY_FACTOR, IdleCollector, due_generation


@pytest.mark.parametrize(("counts", "expected"), [
    ((0, 0, 0), None),
    ((699, 9, 9), None),  # the youngest below its threshold: nothing is due, whatever the others say
    ((700, 0, 0), 0),
    ((700, 9, 0), 0),
    ((700, 10, 0), 1),  # this collection would be generation 1's eleventh: 1 is due
    ((700, 10, 10), 2),
    ((5000, 3, 10), 2),
])
def test_due_generation_follows_the_interpreters_rule(counts: tuple[int, int, int], expected: int | None) -> None:
    assert due_generation(counts, (700, 10, 10)) == expected


def test_a_zero_threshold_means_never() -> None:
    assert due_generation((10_000, 50, 50), (0, 10, 10)) is None
    assert due_generation((10_000, 50, 50), (700, 0, 0)) == 0


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycles(n: int) -> weakref.ref[_Node]:
    """``n`` two-object cycles, unreachable once this returns; a weak reference to one."""
    first = None
    for _ in range(n):
        a, b = _Node(), _Node()
        a.other, b.other = b, a
        if first is None:
            first = a
    assert first is not None
    return weakref.ref(first)


async def test_garbage_is_collected_at_the_idle_moment_and_the_threshold_comes_back() -> None:
    before = gc.get_threshold()
    c = IdleCollector()
    async with trio.open_nursery() as nursery:
        await nursery.start(c.run)
        assert gc.get_threshold() == (before[0] * BUSY_FACTOR, before[1], before[2])
        gc.collect()  # a clean start: only our cycles below are young garbage
        probe = _cycles(before[0])  # twice the threshold's objects: a collection is due
        assert probe() is not None  # (the raised automatic threshold has not collected them)
        c.idle()
        await trio.testing.wait_all_tasks_blocked()  # the collector ran and waits again
        assert probe() is None
        assert sum(c.collections) == 1
        c.idle()  # nothing due now: no collection
        await trio.testing.wait_all_tasks_blocked()
        assert sum(c.collections) == 1
        nursery.cancel_scope.cancel()
    assert gc.get_threshold() == before


async def test_two_collectors_in_one_process_put_the_threshold_back_once_both_stopped() -> None:
    before = gc.get_threshold()
    async with trio.open_nursery() as outer:
        await outer.start(IdleCollector().run)
        async with trio.open_nursery() as inner:
            await inner.start(IdleCollector().run)
            assert gc.get_threshold()[0] == before[0] * BUSY_FACTOR  # raised once, not twice
            inner.cancel_scope.cancel()
        assert gc.get_threshold()[0] == before[0] * BUSY_FACTOR  # the outer one still runs
        outer.cancel_scope.cancel()
    assert gc.get_threshold() == before and collector._running == 0
