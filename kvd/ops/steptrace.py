"""A trio instrument that records every task step (start, duration, task name) for finding
where an event loop's time goes between two points of a request (``KVD_TRACE_STEPS=PREFIX``
on ``kvd serve``; written to ``PREFIX.<pid>.steps`` at exit, one ``start_s dur_us task`` line
per step, the last 400,000 steps)."""

from __future__ import annotations

import gc
import time
from collections import deque
from typing import Any

from trio.abc import Instrument

#: The tracer of this process, when ``KVD_TRACE_STEPS`` is set (marks are dropped otherwise).
_active: StepTrace | None = None


def mark(label: str, *parts: object) -> None:
    """Record a point inside a step (``= label parts...`` lines in the dump); nearly free when
    no tracer is active. ``parts`` are kept as given and formatted only when the trace is
    written (pass values that do not change afterwards): formatting them here, an action
    list's repr above all, cost 1-16 us inside the very step being measured."""
    if _active is not None:
        _active._steps.append((time.perf_counter(), 0.0, (label, parts)))


def _gc_marks(phase: str, info: dict[str, int]) -> None:
    """Garbage collections as marks of the active tracer: ``= gc N`` ... ``= gc.done N``."""
    if phase == "start":
        mark("gc", info["generation"])
    else:
        mark("gc.done", info["collected"])


def _mark_text(label: str, parts: tuple[object, ...]) -> str:
    return " ".join(["=", label, *(str(p) for p in parts)])


class StepTrace(Instrument):
    """Records task steps in a ring buffer; :meth:`dump` writes them out. The latest one
    constructed also receives :func:`mark` calls."""

    def __init__(self, path: str, keep: int = 400_000) -> None:
        self.path = path
        # a step's task name, an io wait, or a mark's (label, parts), formatted by dump()
        self._steps: deque[tuple[float, float, str | tuple[str, tuple[object, ...]]]] = deque(maxlen=keep)
        self._t0 = 0.0
        self._io_t0 = 0.0
        global _active
        _active = self
        if _gc_marks not in gc.callbacks:  # (once per process, not once per tracer)
            gc.callbacks.append(_gc_marks)

    def before_task_step(self, task: Any) -> None:
        self._t0 = time.perf_counter()

    def after_task_step(self, task: Any) -> None:
        t1 = time.perf_counter()
        self._steps.append((self._t0, t1 - self._t0, task.name))

    def before_io_wait(self, timeout: float) -> None:
        self._io_t0 = time.perf_counter()

    def after_io_wait(self, timeout: float) -> None:
        t1 = time.perf_counter()
        self._steps.append((self._io_t0, t1 - self._io_t0, f"<io_wait timeout={timeout:.6f}>"))

    def dump(self) -> None:
        with open(self.path, "w") as f:
            for t0, dur, name in self._steps:
                if not isinstance(name, str):
                    name = _mark_text(*name)
                f.write(f"{t0:.6f} {dur * 1e6:.1f} {name}\n")
