"""The page-locked launch-table ring (kvd.regroup.pinned) on a real CUDA context: a slot holds
the table's bytes, is reused only once the launch reading it is done, a failed launch retires
its slot, and a table too large or a ring all in flight is refused (the caller then copies
from pageable memory). Byte-exactness of launches through the ring: tests/gpu/test_regroup_kernel.py."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from kvd.regroup import kernel
from kvd.regroup.pinned import PinnedTables

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class Launch:
    """Stands in for a launch's event (PinnedTables only calls ``query``); the test says when it is over."""

    def __init__(self, fail: bool = False) -> None:
        self.done = False
        self.fail = fail

    def query(self) -> bool:
        if self.fail:
            raise RuntimeError("the launch failed")
        return self.done


def test_a_slot_is_reused_only_after_its_launch_and_never_after_a_failure() -> None:
    k = kernel.kernel_for(0)
    assert k is not None
    cu = kernel._driver()
    kernel._check(cu.cuCtxPushCurrent(k.ctx), "cuCtxPushCurrent")
    try:
        ring = PinnedTables(cu, slots=3, slot_bytes=64)
    finally:
        cu.cuCtxPopCurrent()
    t = np.arange(8, dtype=np.int64)  # 64 bytes: one slot
    a = ring.take(t)
    assert a is not None and ctypes.string_at(a[1], t.nbytes) == t.tobytes()
    first = Launch()
    ring.hold(a[0], first)
    b = ring.take(t[::-1].copy())
    assert b is not None and b[0] != a[0] and ctypes.string_at(b[1], t.nbytes) == t[::-1].tobytes()
    ring.hold(b[0], Launch(fail=True))  # over: a failed launch reads nothing more
    c = ring.take(t)
    assert c is not None
    ring.hold(c[0], None)  # its launch failed after the copy may have been enqueued: retired
    assert ring.take(t) is None  # the next slot (a's) is still read by its launch
    assert ring.take(np.zeros(9, dtype=np.int64)) is None  # larger than a slot
    first.done = True
    again = ring.take(t)
    assert again is not None and again[0] == a[0]
    ring.hold(again[0], Launch())
    reused = ring.take(t)
    assert reused is not None and reused[0] == b[0]
    ring.hold(reused[0], Launch())
    assert ring.take(t) is None  # c's slot stays retired


def test_a_taken_slot_is_not_handed_out_twice_before_its_hold() -> None:
    k = kernel.kernel_for(0)
    assert k is not None
    cu = kernel._driver()
    kernel._check(cu.cuCtxPushCurrent(k.ctx), "cuCtxPushCurrent")
    try:
        ring = PinnedTables(cu, slots=1, slot_bytes=64)
    finally:
        cu.cuCtxPopCurrent()
    t = np.arange(2, dtype=np.int64)
    got = ring.take(t)
    assert got is not None
    assert ring.take(t) is None  # its launch is being enqueued (no hold yet)
    done = Launch()
    done.done = True
    ring.hold(got[0], done)
    assert ring.take(t) is not None
