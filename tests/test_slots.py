"""Receive/send slots are shared fairly between transfers and always reclaimed."""

from __future__ import annotations

import pytest
import trio
import trio.testing

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
    a = [pool.try_acquire_ahead("x"), pool.try_acquire_ahead("y")]
    assert None not in a and pool.ahead == 2
    assert pool.try_acquire_ahead("z") is None  # the third is kept
    last = pool.try_acquire("z")  # taken the ordinary way
    assert last is not None and pool.in_use == 3
    pool.settle(a[0])  # x now holds what it was missing
    assert pool.ahead == 1
    pool.release("z", last)
    assert pool.try_acquire_ahead("z") == last and pool.ahead == 2
    pool.release("y", a[1])  # released while ahead
    assert pool.ahead == 1
    assert pool.release_owner("z") == 1 and pool.ahead == 0
    assert SlotPool(1).try_acquire_ahead("solo") is None  # one slot: never ahead


async def test_no_slot_is_taken_ahead_while_owners_wait() -> None:
    pool = SlotPool(2)
    held = [pool.try_acquire("a"), pool.try_acquire("a")]
    async with trio.open_nursery() as nursery:
        got: list[int] = []

        async def want() -> None:
            got.append(await pool.acquire("b"))

        nursery.start_soon(want)
        await trio.testing.wait_all_tasks_blocked()
        pool.release("a", held[0])  # straight to the waiter
        assert pool.try_acquire_ahead("c") is None
    assert got == [held[0]]
