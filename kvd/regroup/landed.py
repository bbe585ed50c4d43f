"""Landed events: CUDA interprocess events that tell a gen daemon its blocks are filled.

On the mapped path one regroup kernel writes a whole request from the ctx GPU into the gen
daemon's pools. Without help, gen learns that the bytes are in from ctx's ``XferDone``: ctx
must first see its own kernel complete, then do its bookkeeping, then write the message; gen
must read and decode it. A landed event removes that from the request's critical path:

- **ctx** records one of a small ring of interprocess events (:class:`LandedRing`) on the
  kernel's stream right after the launch (the launch's own completion event, handed to it by
  :meth:`LandedRing.take`; :meth:`LandedRing.record` records one after other work) and names
  it (slot, handle) in its path message, which leaves at once, while the kernel runs;
- **gen** opens the handle (once per slot: :func:`opened` / :func:`open_event`, ~0.2 ms, in a
  worker thread) and polls it from its event loop (:func:`query`, a fraction of a microsecond);
  when it completes, every byte of the request is in gen's blocks and no write of it can land
  any more.

Why a reused slot is safe: ctx records slot ``i`` for request ``n`` only after the launch
that precedes it on the same stream, and the ring records on one stream only. A reader of
slot ``i`` that comes late sees a later record of it, whose completion implies the earlier one
(a stream runs in order): it waits longer, never less. The path message leaves after the
record, so no reader can see the record before it.

``KVD_LANDED_EVENTS=0`` turns them off (gen then completes on ``XferDone``, as without a
GPU); a GPU or driver without interprocess events turns them off on its own, logged once as
``regroup.landed_events_unavailable``.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import structlog

from kvd.regroup.kernel import KernelError, _check, _driver, _primary_context

log = structlog.get_logger("kvd.regroup")

#: ``KVD_LANDED_EVENTS=0``: no landed events (gen waits for ``XferDone``).
ENABLED = os.environ.get("KVD_LANDED_EVENTS", "1") != "0"
#: Events per ring (per device of a ctx daemon): requests in flight on one stream beyond this
#: many reuse a slot, which only makes a late reader wait for a later kernel.
RING_SLOTS = 16
#: Peer events a gen daemon keeps open (least recently used closed beyond this).
OPEN_KEEP = 256


@dataclass(frozen=True)
class LandedMark:
    """What ctx's path message names: the event ``slot`` of the ring on CUDA ``device``, and
    its interprocess ``handle`` (64 bytes)."""

    device: int
    slot: int
    handle: bytes


class LandedRing:
    """A ctx daemon's interprocess events on one device, recorded in turn on one stream."""

    def __init__(self, device: int) -> None:
        cu = _driver()
        self.device = device
        self.ctx = _primary_context(device)
        self.stream: int | None = None  # the one stream it records on (fixed by the first record)
        self._next = 0
        self._lock = threading.Lock()
        flags = cu.CUevent_flags.CU_EVENT_INTERPROCESS | cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._events: list[Any] = []
        self._handles: list[bytes] = []
        _check(cu.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
        try:
            for _ in range(RING_SLOTS):
                ev = _check(cu.cuEventCreate(flags), "cuEventCreate(interprocess)")
                self._events.append(ev)
                self._handles.append(bytes(_check(cu.cuIpcGetEventHandle(ev), "cuIpcGetEventHandle").reserved))
        except BaseException:
            self._destroy()
            raise
        finally:
            cu.cuCtxPopCurrent()

    def take(self, stream: int) -> tuple[Any, LandedMark] | None:
        """The next slot's event and mark, for the caller to record on ``stream`` itself (the
        kernel records it as its own completion event: one record, not two); None as
        :meth:`record`."""
        with self._lock:
            if self.stream is None:
                self.stream = stream
            elif stream != self.stream:
                return None
            slot = self._next
            self._next = (slot + 1) % len(self._events)
        return self._events[slot], LandedMark(self.device, slot, self._handles[slot])

    def record(self, stream: int) -> LandedMark | None:
        """Record the next slot's event on CUDA stream ``stream`` (a handle, as an int); None
        when the ring records on another stream (the reuse rule holds on one stream only)."""
        taken = self.take(stream)
        if taken is None:
            return None
        event, landed = taken
        cu = _driver()
        # (the stream may be the legacy default one, 0: the context says whose it is)
        _check(cu.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
        try:
            _check(cu.cuEventRecord(event, cu.CUstream(stream)), "cuEventRecord")
        finally:
            cu.cuCtxPopCurrent()
        return landed

    def _destroy(self) -> None:
        cu = _driver()
        for ev in self._events:
            cu.cuEventDestroy(ev)
        self._events.clear()


_rings: dict[int, LandedRing | None] = {}
_rings_lock = threading.Lock()


def prepare(device: int) -> LandedRing | None:
    """The ring of ``device``, created on first call (~1 ms: call it where a worker thread
    loads the kernel); None when landed events are off or the device cannot make them (logged
    once per device)."""
    if device in _rings:
        return _rings[device]
    with _rings_lock:
        if device in _rings:
            return _rings[device]
        ring: LandedRing | None = None
        if ENABLED:
            try:
                ring = LandedRing(device)
            except Exception as exc:  # speed only: a transfer never fails for it
                reason = str(exc) if isinstance(exc, KernelError) else f"{type(exc).__name__}: {exc}"
                log.warning("regroup.landed_events_unavailable", device=device, reason=reason,
                            fallback="gen waits for the data-done message")
        _rings[device] = ring
        return ring


def prepared(device: int) -> bool:
    """Whether :func:`prepare` ran for ``device`` (whatever it found)."""
    return device in _rings


def ring_of(device: int) -> LandedRing | None:
    """``device``'s ring, if it has one (prepared and available)."""
    return _rings.get(device)


def take(device: int, stream: int) -> tuple[Any, LandedMark] | None:
    """:meth:`LandedRing.take` on ``device``'s ring; None as :func:`record`."""
    ring = _rings.get(device)
    return ring.take(stream) if ring is not None else None


def record(device: int, stream: int) -> LandedMark | None:
    """Record a landed event on ``stream`` of ``device`` after what was enqueued there; None
    when the device has no ring (not prepared, off or unavailable) or it records elsewhere."""
    ring = _rings.get(device)
    return ring.record(stream) if ring is not None else None


# -- gen side -------------------------------------------------------------------------------------

#: (peer instance, handle) -> the event opened here, or None: refused. Keyed by the peer's
#: instance too: a handle names a process's event by numbers a later process (a restarted
#: ctx daemon with the same pid) may repeat; an event of the old one, never recorded again,
#: would read "complete" at once.
_opened: OrderedDict[tuple[str, bytes], Any] = OrderedDict()
_opened_lock = threading.Lock()


def opened(instance: str, handle: bytes) -> tuple[bool, Any]:
    """(known, event): whether :func:`open_event` ran for ``handle`` of the peer instance
    ``instance`` already, and the event it opened (None when the driver refused it: never
    asked again)."""
    key = (instance, handle)
    ev = _opened.get(key, False)
    if ev is False:
        return False, None
    with _opened_lock:  # (least recently used first out: one in use is never the oldest of 256)
        if key in _opened:
            _opened.move_to_end(key)
    return True, ev


def open_event(instance: str, handle: bytes, device: int) -> Any:
    """Open the event ``handle`` of the peer instance ``instance`` (its NIXL agent name, new
    for every process) in the primary context of CUDA ``device`` (this daemon's GPU),
    remembered for :func:`opened`; blocks ~0.2 ms (a worker thread's). Returns the event, or
    None when the driver refuses the handle (logged once per handle)."""
    cu = _driver()
    known, ev = opened(instance, handle)
    if known:
        return ev
    try:
        ctx = _primary_context(device)
        _check(cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
        try:
            h = cu.CUipcEventHandle()
            h.reserved = handle
            ev = _check(cu.cuIpcOpenEventHandle(h), "cuIpcOpenEventHandle")
        finally:
            cu.cuCtxPopCurrent()
    except Exception as exc:
        log.warning("regroup.landed_event_refused", device=device, error=str(exc),
                    fallback="gen waits for the data-done message")
        ev = None
    with _opened_lock:
        _opened[(instance, handle)] = ev
        while len(_opened) > OPEN_KEEP:
            _, old = _opened.popitem(last=False)
            if old is not None:
                cu.cuEventDestroy(old)
    return ev


def query(ev: Any) -> bool | None:
    """Whether the event completed (never blocks); None when the query failed (the peer's
    context broke, say): the caller stops watching it and waits for the peer's word."""
    cu = _driver()
    res = cu.cuEventQuery(ev)
    err = res[0] if isinstance(res, tuple) else res
    if err == cu.CUresult.CUDA_SUCCESS:
        return True
    if err == cu.CUresult.CUDA_ERROR_NOT_READY:
        return False
    log.warning("regroup.landed_event_failed", error=getattr(err, "name", str(err)),
                fallback="gen waits for the data-done message")
    return None
