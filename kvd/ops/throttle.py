"""Warnings that an attacker can trigger at will, logged at a bounded rate.

A flood of idle connections, malformed frames or accept failures must not turn into a flood
of log lines (the journal is shared, and writing it costs the daemon CPU). :class:`Throttle`
logs the first ``burst`` occurrences of an event in a window of ``interval_s`` at once and
suppresses the rest of that window; the next line it writes says how many it suppressed
meanwhile (``suppressed=N``), so nothing is hidden, only summarised.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["Throttle"]

#: Default: at most one line per event every 10 s.
DEFAULT_INTERVAL_S = 10.0


class Throttle:
    """Per-event rate limit for warning lines (``burst`` per ``interval_s``, then a count)."""

    def __init__(
        self,
        logger: Any,
        interval_s: float = DEFAULT_INTERVAL_S,
        *,
        burst: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0 or burst < 1:
            raise ValueError("need interval_s > 0 and burst >= 1")
        self.logger = logger
        self.interval_s = interval_s
        self.burst = burst
        self._clock = clock
        self._window: dict[str, tuple[float, int]] = {}  # event -> (window start, lines written)
        self._suppressed: dict[str, int] = {}

    def warning(self, event: str, *, throttle_key: str | None = None, **fields: Any) -> bool:
        """``logger.warning(event, **fields)`` unless ``event`` used up its burst in this window.

        ``throttle_key`` (default: the event) names what counts as a repeat: lines with
        different keys are limited separately (e.g. one key per failure reason, so a new
        reason is logged at once). Returns True when the line was written.
        """
        key = event if throttle_key is None else throttle_key
        now = self._clock()
        start, written = self._window.get(key, (now, 0))
        if now - start >= self.interval_s:
            start, written = now, 0
        if written >= self.burst:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._window[key] = (start, written + 1)
        suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            fields["suppressed"] = suppressed
        self.logger.warning(event, **fields)
        return True

    def suppressed(self, key: str) -> int:
        """Lines of ``key`` (an event, or a ``throttle_key``) suppressed since the last one written."""
        return self._suppressed.get(key, 0)
