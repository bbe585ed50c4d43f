"""Receive/send slots are shared fairly between transfers and always reclaimed."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from kvd.slots import SlotPool


async def test_waiting_owners_get_slots_round_robin() -> None:
    pool = SlotPool(2)
    assert {pool.try_acquire("big"), pool.try_acquire("big")} == {0, 1}
    got: list[str] = []

    async def want(owner: str, n: int) -> None:
        for _ in range(n):
            slot = await pool.acquire(owner)
            got.append(owner)
            pool.release(owner, slot)
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(want, "a", 3)
        nursery.start_soon(want, "b", 3)
        nursery.start_soon(want, "c", 3)
        await trio.testing.wait_all_tasks_blocked()
        # the big transfer gives its slots back: they alternate over the waiting owners
        pool.release("big", 0)
        pool.release("big", 1)
    assert sorted(got) == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    first_round = got[:3]
    assert sorted(first_round) == ["a", "b", "c"], got  # nobody gets a second slot before all got one
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
