"""Reconnect delays for a peer link: exponential backoff with bounded jitter (no I/O, no clock).

A configured peer that refuses us (wrong shared secret, another protocol version, another
node name at that address) is retried forever: the operator may fix the other side at any
time. Retrying every second forever only floods both logs, so the delay doubles from
``initial`` up to ``maximum`` and starts again from ``initial`` once a link came up.
"""

from __future__ import annotations

import random

__all__ = ["Backoff"]


class Backoff:
    """Delays ``initial``, ``2 * initial``, ... capped at ``maximum``, each shortened by up to
    ``jitter`` of itself (so daemons restarted together do not retry in lockstep)."""

    def __init__(self, initial: float, maximum: float, *, multiplier: float = 2.0, jitter: float = 0.2,
                 rng: random.Random | None = None) -> None:
        if not 0 < initial <= maximum or multiplier < 1 or not 0 <= jitter < 1:
            raise ValueError("need 0 < initial <= maximum, multiplier >= 1 and 0 <= jitter < 1")
        self.initial = initial
        self.maximum = maximum
        self.multiplier = multiplier
        self.jitter = jitter
        self._rng = rng or random.Random()
        self._next = initial
        #: failed attempts since the last success (what ``kvctl peers`` shows)
        self.failures = 0

    def failed(self) -> float:
        """One more attempt failed: the seconds to wait before the next one."""
        self.failures += 1
        delay = self._next
        self._next = min(self.maximum, self._next * self.multiplier)
        return delay * (1 - self.jitter * self._rng.random())

    def reset(self) -> None:
        """An attempt succeeded: the next failure waits ``initial`` again."""
        self._next = self.initial
        self.failures = 0
