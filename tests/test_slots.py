"""Receive/send slots are shared fairly between transfers and always reclaimed."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.transport.slots import SlotPool


async def test_waiting_owners_get_slots_round_robin() -> None:
    """A transfer waiting for many slots cannot starve the others: slots freed one at a time go
    a, b, c, a, b, a for waiters queued as a x3, b x2, c x1."""
    pool = SlotPool(1)
    held = pool.try_acquire("big")
    assert held is not None
    order: list[str] = []

    async def want(owner: str) -> None:
        slot = await pool.acquire(owner)
        order.append(owner)
        pool.release(owner, slot)  # done with it: back to the pool's round-robin

    async with trio.open_nursery() as nursery:
        for owner in ["a", "a", "a", "b", "b", "c"]:  # queue order, one waiter at a time
            nursery.start_soon(want, owner)
            await trio.testing.wait_all_tasks_blocked()
        pool.release("big", held)
    assert order == ["a", "b", "c", "a", "b", "a"]
    assert pool.in_use == 0


async def test_release_owner_reclaims_held_slots_and_drops_waiters() -> None:
    pool = SlotPool(3)
    held = [pool.try_acquire("r1"), pool.try_acquire("r1")]
    assert None not in held and pool.in_use == 2
    assert pool.release_owner("r1") == 2
    assert pool.in_use == 0 and pool.owned_by("r1") == set()


async def test_cancelled_waiter_loses_nothing() -> None:
    pool = SlotPool(1)
    slot = pool.try_acquire("x")
    assert slot is not None
    with trio.move_on_after(0.01):
        await pool.acquire("y")  # cancelled while waiting
    pool.release("x", slot)
    assert pool.in_use == 0  # the slot went back to the free list, not to the cancelled waiter
    assert pool.try_acquire("z") == slot


def test_releasing_a_slot_not_held_is_an_error() -> None:
    pool = SlotPool(1)
    with pytest.raises(ValueError, match="not held"):
        pool.release("nobody", 0)


def test_slots_taken_ahead_leave_one_for_owners_that_hold_everything_else() -> None:
    """At most count - 1 slots are held ahead: the last one can only be taken by an owner that
    waits with its other resource in hand. Settling or releasing a slot ends its ahead hold."""
    pool = SlotPool(3)
    x, y = pool.try_acquire_ahead("x"), pool.try_acquire_ahead("y")
    assert x is not None and y is not None and pool.ahead == 2
    assert pool.try_acquire_ahead("z") is None  # the third is kept
    last = pool.try_acquire("z")  # taken the ordinary way
    assert last is not None and pool.in_use == 3
    pool.settle(x)  # x now holds what it was missing
    assert pool.ahead == 1
    pool.release("z", last)
    assert pool.try_acquire_ahead("z") == last and pool.ahead == 2
    pool.release("y", y)  # released while ahead
    assert pool.ahead == 1
    assert pool.release_owner("z") == 1 and pool.ahead == 0
    assert SlotPool(1).try_acquire_ahead("solo") is None  # one slot: never ahead


async def test_no_slot_is_taken_ahead_while_owners_wait() -> None:
    pool = SlotPool(2)
    first, second = pool.try_acquire("a"), pool.try_acquire("a")
    assert first is not None and second is not None
    async with trio.open_nursery() as nursery:
        got: list[int] = []

        async def want() -> None:
            got.append(await pool.acquire("b"))

        nursery.start_soon(want)
        await trio.testing.wait_all_tasks_blocked()
        pool.release("a", first)  # straight to the waiter
        assert pool.try_acquire_ahead("c") is None
    assert got == [first]


@given(st.integers(1, 5), st.lists(st.tuples(st.sampled_from(["take", "ahead", "settle", "release", "drop"]),
                                             st.sampled_from(["a", "b", "c"])), max_size=60))
@settings(max_examples=200, deadline=None)
def test_any_sequence_keeps_the_books(count: int, ops: list[tuple[str, str]]) -> None:
    """Whatever owners take, take ahead, settle and give back (without waiting), every slot is
    free or held by exactly one owner, at most count - 1 are held ahead, and only held slots
    are held ahead."""
    pool = SlotPool(count)
    held: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    for op, owner in ops:
        if op == "take":
            slot = pool.try_acquire(owner)
            if slot is not None:
                held[owner].append(slot)
        elif op == "ahead":
            slot = pool.try_acquire_ahead(owner)
            if slot is not None:
                held[owner].append(slot)
        elif op == "settle" and held[owner]:
            pool.settle(held[owner][0])
        elif op == "release" and held[owner]:
            pool.release(owner, held[owner].pop())
        elif op == "drop":
            assert pool.release_owner(owner) == len(held[owner])
            held[owner] = []
        mine = [s for slots in held.values() for s in slots]
        assert len(mine) == len(set(mine)) == pool.in_use <= count
        assert {o: pool.owned_by(o) for o in held} == {o: set(s) for o, s in held.items()}
        assert pool.ahead <= max(0, count - 1)
        assert pool._ahead <= set(mine)
