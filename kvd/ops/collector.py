"""Garbage collection between requests instead of inside them.

CPython collects its youngest generation whenever allocations outnumber deallocations by
700 (``gc.get_threshold()[0]``). A daemon allocates a few hundred objects per request (the
messages, the transfer's state, numpy tables), so without a policy a young collection fell
inside roughly every other request's critical path (publish to kernel launch), and every tenth
of those was a generation-1 collection, around a millisecond on a busy host. Startup objects
are already kept out of every generation (``gc.freeze()`` in :mod:`kvd.server`).

:class:`IdleCollector` moves that work to the moments the daemon has nothing unfinished:

- the engine calls :meth:`IdleCollector.idle` when its last unfinished request ends; the
  collector's task then runs, after the step that reported the request (its replies are
  written), and collects the generations that are due by CPython's own rule at the usual
  thresholds (:func:`due_generation`);
- while requests keep overlapping (a daemon never idle), the automatic collector still runs,
  at :data:`BUSY_FACTOR` times the young threshold: fewer, larger collections in the request
  path, and memory stays bounded either way.

Nothing but timing changes: every object that would have been collected is collected.
"""

from __future__ import annotations

import gc

import trio

#: The automatic young-generation threshold while the collector runs, as a multiple of the
#: interpreter's: the safety net for a daemon that is never idle.
BUSY_FACTOR = 10


def due_generation(counts: tuple[int, int, int], thresholds: tuple[int, int, int]) -> int | None:
    """The oldest generation due for collection by CPython's counting rule, or None when the
    youngest has not reached its threshold (nothing is due). ``counts`` as ``gc.get_count()``
    (allocations net of frees; then collections of the generation below, for the older two),
    ``thresholds`` as ``gc.get_threshold()``; a threshold of 0 means never."""
    t0 = thresholds[0]
    if t0 <= 0 or counts[0] < t0:
        return None
    # a collection of generation g counts one for generation g + 1: g + 1 is due when that
    # count would pass its threshold, as in the interpreter's collect_generations()
    for gen in (2, 1):
        if thresholds[gen] > 0 and counts[gen] + 1 > thresholds[gen]:
            return gen
    return 0


class IdleCollector:
    """Runs garbage collections when the daemon has nothing unfinished (see the module's
    docstring). Start :meth:`run` in a nursery; call :meth:`idle` from the event loop."""

    def __init__(self) -> None:
        self._wake = trio.Event()
        #: collections run by this collector, by generation (for tests and the operator)
        self.collections = [0, 0, 0]
        self._thresholds: tuple[int, int, int] = gc.get_threshold()

    def idle(self) -> None:
        """Nothing is unfinished now: collect what is due, once the current step is over."""
        self._wake.set()

    def collect_due(self) -> int | None:
        """Collect the generation due at the interpreter's own thresholds, if any; returns it."""
        gen = due_generation(gc.get_count(), self._thresholds)
        if gen is not None:
            gc.collect(gen)
            self.collections[gen] += 1
        return gen

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Raise the automatic young threshold (the safety net) and collect at each idle
        moment until cancelled; the thresholds are put back once the last collector of the
        process stops (tests run several daemons in one process)."""
        self._thresholds = _raise_threshold()
        try:
            task_status.started()
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                self.collect_due()
        finally:
            _restore_threshold()


#: the interpreter's thresholds while collectors run, and how many run (one event loop thread
#: per daemon; several daemons share a process only in tests)
_saved: tuple[int, int, int] | None = None
_running = 0


def _raise_threshold() -> tuple[int, int, int]:
    global _saved, _running
    if _running == 0:
        _saved = t0, t1, t2 = gc.get_threshold()
        gc.set_threshold(t0 * BUSY_FACTOR, t1, t2)
    _running += 1
    assert _saved is not None
    return _saved


def _restore_threshold() -> None:
    global _saved, _running
    _running -= 1
    if _running == 0 and _saved is not None:
        gc.set_threshold(*_saved)
        _saved = None
