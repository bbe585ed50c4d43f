"""BlockAllocator: leases per session, all-or-nothing operations, clear errors, no state change."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvd.pool import BlockAllocator
from protocol.errors import BadRequest, BlockNotLeased, LimitExceeded, OutOfBlocks


def snapshot(a: BlockAllocator, sessions: tuple[int, ...] = (1, 2, 3)) -> dict[str, Any]:
    return {
        "used": a.used,
        "free": a.free_count,
        "sessions": a.sessions,
        "leases": {s: a.leased_by(s) for s in sessions},
        "owners": [a.owner(i) for i in range(a.num_blocks)],
    }


def test_alloc_free_release() -> None:
    a = BlockAllocator(10, name="p")
    assert (a.used, a.free_count, a.sessions) == (0, 10, 0)
    x = a.alloc(1, 4)
    y = a.alloc(2, 3)
    assert len(x) == 4 and len(y) == 3 and not set(x) & set(y)
    assert (a.used, a.free_count, a.sessions) == (7, 3, 2)
    assert a.leased_by(1) == sorted(x)
    assert a.owner(x[0]) == 1
    a.check_leased(1, x)
    assert a.free(1, x[:2]) == 2
    assert a.leased_by(1) == sorted(x[2:])
    assert a.free(1, []) == 0
    assert a.release_session(2) == 3
    assert a.release_session(2) == 0
    assert a.sessions == 1
    assert a.release_session(1) == 2
    assert (a.used, a.free_count, a.sessions) == (0, 10, 0)
    assert a.release_session(99) == 0


def test_fifo_reuse_order() -> None:
    a = BlockAllocator(4)
    first = a.alloc(1, 2)
    a.free(1, first)
    # freed blocks go to the back: the next allocation gets the never-used ones first
    assert a.alloc(1, 2) == [2, 3]
    assert a.alloc(1, 2) == first


def test_numpy_ids_accepted() -> None:
    a = BlockAllocator(4)
    ids = a.alloc(1, 3)
    assert a.free(1, np.array(ids[:2], dtype=np.int64)) == 2
    assert a.leased_by(1) == [ids[2]]
    assert all(type(i) is int for i in a.alloc(1, 3))


@pytest.mark.parametrize("count", [0, -1, 1.5, True, "2"])
def test_bad_count(count: Any) -> None:
    a = BlockAllocator(4, name="p")
    a.alloc(1, 1)
    before = snapshot(a)
    with pytest.raises(BadRequest, match="block count must be a positive integer"):
        a.alloc(1, count)
    assert snapshot(a) == before


@pytest.mark.parametrize("n", [0, -3])
def test_bad_size(n: int) -> None:
    with pytest.raises(BadRequest, match="num_blocks must be a positive integer"):
        BlockAllocator(n)


def test_over_capacity_changes_nothing() -> None:
    a = BlockAllocator(8, name="p")
    a.alloc(1, 5)
    before = snapshot(a)
    with pytest.raises(OutOfBlocks, match=r"pool 'p': asked for 4 blocks, only 3 free \(5 of 8 in use\)") as info:
        a.alloc(2, 4)
    # the remedy, not only the counts
    assert info.value.message.endswith(
        ": free() the blocks of requests that ended (cancel one given up on, then free its blocks once its"
        " wait returned), or raise num_blocks / budget_mb; kvctl sessions shows which sessions hold blocks"
    ), info.value.message
    assert snapshot(a) == before
    assert len(a.alloc(2, 3)) == 3


def test_per_session_limit() -> None:
    a = BlockAllocator(8, name="p")
    a.alloc(1, 3, max_per_session=4)
    before = snapshot(a)
    with pytest.raises(LimitExceeded, match="holds 3 blocks; 2 more would exceed the limit of 4"):
        a.alloc(1, 2, max_per_session=4)
    assert snapshot(a) == before


def test_double_free() -> None:
    a = BlockAllocator(8, name="p")
    ids = a.alloc(1, 3)
    a.free(1, [ids[0]])
    before = snapshot(a)
    with pytest.raises(BlockNotLeased, match=rf"block {ids[0]} is not leased to session 1: it is free") as caught:
        a.free(1, [ids[1], ids[0]])
    assert snapshot(a) == before
    # and what to do about it
    assert str(caught.value).endswith("name only ids alloc returned to this session and it has not freed since")


def test_duplicate_in_list() -> None:
    a = BlockAllocator(8, name="p")
    ids = a.alloc(1, 3)
    before = snapshot(a)
    # the blocks are leased: the list is malformed
    with pytest.raises(BadRequest, match=rf"^\[bad_request\] pool 'p': block {ids[1]} is listed twice \(positions 0 "
                                         r"and 2 of block_ids\); name each block once$"):
        a.free(1, [ids[1], ids[2], ids[1]])
    assert snapshot(a) == before
    with pytest.raises(BadRequest, match="listed twice"):
        a.check_leased(1, [ids[0], ids[0]])
    # the general loop (any iterable) says the same
    with pytest.raises(BadRequest, match=rf"block {ids[0]} is listed twice \(positions 1 and 2 of block_ids\)"):
        a.check_leased(1, iter([ids[2], ids[0], ids[0]]))
    assert snapshot(a) == before


def test_foreign_block() -> None:
    a = BlockAllocator(8, name="p")
    mine = a.alloc(1, 2)
    theirs = a.alloc(2, 2)
    before = snapshot(a)
    with pytest.raises(
        BlockNotLeased, match=rf"block {theirs[0]} is not leased to session 1: it is leased to another"
    ):
        a.free(1, [mine[0], theirs[0]])
    assert snapshot(a) == before
    with pytest.raises(BlockNotLeased, match="leased to another session") as caught:
        a.check_leased(1, theirs)
    assert "a session names only its own blocks" in str(caught.value)


@pytest.mark.parametrize("bad", [8, 100, -1])
def test_out_of_range(bad: int) -> None:
    a = BlockAllocator(8, name="p")
    ids = a.alloc(1, 2)
    before = snapshot(a)
    with pytest.raises(BlockNotLeased, match=rf"block {bad} is out of range \(the pool has blocks 0..7\)"):
        a.free(1, [ids[0], bad])
    assert snapshot(a) == before


@pytest.mark.parametrize("bad", ["1", 1.0, None, True])
def test_non_integer_id(bad: Any) -> None:
    a = BlockAllocator(8, name="p")
    a.alloc(1, 2)
    before = snapshot(a)
    with pytest.raises(BlockNotLeased, match="is not an integer"):
        a.free(1, [bad])
    assert snapshot(a) == before


def test_random_ops_against_model() -> None:
    """Thousands of random operations; the allocator always agrees with a plain dict model."""
    rng = random.Random(1234)
    n = 64
    a = BlockAllocator(n)
    model: dict[int, int] = {}  # block -> session
    for _ in range(5000):
        op = rng.random()
        s = rng.randrange(4)
        if op < 0.45:
            count = rng.randrange(1, 12)
            if count > n - len(model):
                with pytest.raises(OutOfBlocks):
                    a.alloc(s, count)
            else:
                for i in a.alloc(s, count):
                    assert i not in model
                    model[i] = s
        elif op < 0.85:
            ids = rng.sample(range(-2, n + 2), rng.randrange(0, 5))
            ok = all(model.get(i) == s for i in ids)
            if ok:
                assert a.free(s, ids) == len(ids)
                for i in ids:
                    del model[i]
            else:
                with pytest.raises(BlockNotLeased):
                    a.free(s, ids)
        else:
            expected = sum(1 for v in model.values() if v == s)
            assert a.release_session(s) == expected
            model = {k: v for k, v in model.items() if v != s}
        assert a.used == len(model)
        assert a.free_count == n - len(model)
        assert a.sessions == len(set(model.values()))


class AllocatorMachine(RuleBasedStateMachine):
    """Stateful hypothesis test against a model."""

    N = 16

    def __init__(self) -> None:
        super().__init__()
        self.a = BlockAllocator(self.N)
        self.model: dict[int, int] = {}

    @rule(session=st.integers(0, 3), count=st.integers(1, 6))
    def alloc(self, session: int, count: int) -> None:
        if count > self.N - len(self.model):
            before = snapshot(self.a, (0, 1, 2, 3))
            with pytest.raises(OutOfBlocks):
                self.a.alloc(session, count)
            assert snapshot(self.a, (0, 1, 2, 3)) == before
        else:
            for i in self.a.alloc(session, count):
                self.model[i] = session

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), session=st.integers(0, 3))
    def free_some(self, data: st.DataObject, session: int) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), max_size=4))
        valid = len(set(ids)) == len(ids) and all(self.model[i] == session for i in ids)
        if valid:
            assert self.a.free(session, ids) == len(ids)
            for i in ids:
                del self.model[i]
        else:
            # the first offending id in list order decides: not this session's, or listed twice
            seen: set[int] = set()
            for i in ids:
                if self.model[i] != session or i in seen:
                    expected: type[Exception] = BlockNotLeased if self.model[i] != session else BadRequest
                    break
                seen.add(i)
            before = snapshot(self.a, (0, 1, 2, 3))
            with pytest.raises(expected):
                self.a.free(session, ids)
            assert snapshot(self.a, (0, 1, 2, 3)) == before

    @rule(session=st.integers(0, 3))
    def release(self, session: int) -> None:
        n = sum(1 for s in self.model.values() if s == session)
        assert self.a.release_session(session) == n
        self.model = {k: v for k, v in self.model.items() if v != session}

    @invariant()
    def agrees(self) -> None:
        assert self.a.used == len(self.model)
        assert self.a.free_count == self.N - len(self.model)
        assert self.a.sessions == len(set(self.model.values()))
        for s in range(4):
            assert self.a.leased_by(s) == sorted(k for k, v in self.model.items() if v == s)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("ids", [[3], [0, 3], [3, 0], [0, 1, 3], [0, 0], [1, 3, 3], [0, 9], [-1, 0], [0, True]])
def test_check_leased_fast_path_agrees_with_the_checks(ids: list[Any]) -> None:
    """The all-ints fast path refuses exactly what the per-id checks refuse (free blocks,
    another session's, repeats, out of range, bools), with integer session ids as the daemon uses;
    a repeat of one of the session's own blocks is a malformed list (``BadRequest``)."""
    a = BlockAllocator(8, name="p")
    a.alloc(1, 3)  # 0, 1, 2 to session 1
    a.alloc(2, 1)  # 3 to session 2; 4.. free
    with pytest.raises(BadRequest if ids == [0, 0] else BlockNotLeased):
        a.check_leased(1, ids)
    assert a.check_leased(1, [2, 0, 1]) == [2, 0, 1]
    assert a.check_leased(2, [3]) == [3]
    with pytest.raises(BlockNotLeased):
        a.check_leased(1, [4])  # free: an int session id never equals a free block's None
