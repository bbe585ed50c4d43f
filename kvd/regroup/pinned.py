"""Page-locked host slots for the regroup kernel's launch tables.

``cuMemcpyHtoDAsync`` from pageable memory stages the bytes through the driver's own buffer and
may wait for the stream's earlier work first; from page-locked memory it only enqueues. Measured
on the H200 host: a bounce gather's launch spent ~90 us in the driver calls when its stream
still ran the previous chunk's kernel, against ~18 us on an idle stream. A launch copies its
table into the next free slot of a small ring and the copy reads it from there; the slot is
reused only once that launch's event reports done (the copy ran before the kernel). A table
larger than a slot, or a ring whose slots are all in flight, goes the pageable way as before:
never a wait.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

#: Slots in a device's ring and bytes per slot: a 256-block TP1 -> TP4 table is ~17 KiB.
SLOTS = 16
SLOT_BYTES = 256 << 10


class _Done(Protocol):
    def query(self) -> bool: ...


class PinnedTables:
    """A ring of page-locked slots (``cuMemHostAlloc``; the caller's CUDA context current).
    :meth:`take` copies a table into a free slot and returns its address; :meth:`hold` ties
    the slot to the event after the launch that reads it. Thread-safe."""

    def __init__(self, cu: Any, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> None:
        res = cu.cuMemHostAlloc(slots * slot_bytes, cu.CU_MEMHOSTALLOC_PORTABLE)
        err = res[0] if isinstance(res, tuple) else res
        if err != cu.CUresult.CUDA_SUCCESS:
            raise OSError(f"cuMemHostAlloc of {slots * slot_bytes} bytes failed: {getattr(err, 'name', err)}")
        self.base = int(res[1])
        self.slot_bytes = slot_bytes
        self._view: npt.NDArray[np.uint8] = np.ctypeslib.as_array(
            (ctypes.c_uint8 * (slots * slot_bytes)).from_address(self.base))
        #: per slot: None (free), True (taken, its launch being enqueued), the event of the
        #: launch reading it, or False (retired: a launch failed after its copy may have been
        #: enqueued, so the slot is never reused)
        self._busy: list[_Done | bool | None] = [None] * slots
        self._next = 0
        self._lock = threading.Lock()

    def take(self, table: npt.NDArray[np.int64]) -> tuple[int, int] | None:
        """``(slot, address)`` of a free slot now holding ``table``'s bytes, or None (too
        large, or every slot still read by a launch in flight: use the pageable table)."""
        n = table.nbytes
        if n > self.slot_bytes:
            return None
        with self._lock:
            i = self._next
            held = self._busy[i]
            if isinstance(held, bool) or (held is not None and not _done(held)):
                return None  # taken by a launch being enqueued, retired, or still read
            self._busy[i] = True  # taken: no other thread gets it before hold()
            self._next = (i + 1) % len(self._busy)
        off = i * self.slot_bytes
        self._view[off : off + n] = table.view(np.uint8)
        return i, self.base + off

    def hold(self, slot: int, event: _Done | None) -> None:
        """The launch that reads ``slot`` was enqueued and ``event`` follows it; None: it
        failed after its copy may have been enqueued: the slot is retired."""
        self._busy[slot] = event if event is not None else False


def _done(event: _Done) -> bool:
    """Whether the launch behind ``event`` is over (a failed launch is over too)."""
    with contextlib.suppress(Exception):
        return event.query()
    return True
