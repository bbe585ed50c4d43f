"""This daemon's completion page (:mod:`kvd.mapping.words`): slots handed to request sides,
tokens stored when a side is done, the fds executors and same-node peers map it by.

One ``memfd`` of :data:`SLOTS` slots, created at startup. Slots go round in FIFO order, so a
freed slot is reused as late as possible: an executor still spinning on a slot its request
left sees another token and falls back to its socket (never a wrong outcome: tokens are never
given twice). When every slot is held, a side simply gets none (-1) and its executors wait on
the socket as before.
"""

from __future__ import annotations

import os
import secrets
from collections import deque

import structlog

from kvd.mapping.words import SLOT_WORDS, WordsView, pack_meta

log = structlog.get_logger("kvd.transfer")

#: Slots per daemon page (32 bytes each: 256 KiB); more than the live request sides a daemon takes.
SLOTS = 8192


class CompletionPage:
    """The daemon's completion page and its slot allocator (event-loop thread only)."""

    def __init__(self, slots: int = SLOTS) -> None:
        self.slots = slots
        self.fd = os.memfd_create("kvd-completions", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, slots * SLOT_WORDS * 8)
            self.view = WordsView(self.fd, slots, writable=True)
            # the fd executors get: read-only, so no session can forge another's completion
            self.read_only_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            os.close(self.fd)
            raise
        self._free: deque[int] = deque(range(slots))
        # tokens start at a random point: a client that kept a dead daemon's page mapped
        # never reads a token the next daemon hands out
        self._next_token = secrets.randbits(62) | 1
        self.device_ptr = 0  # the page as this process's GPUs address it (0: not registered)

    def take(self) -> tuple[int, int]:
        """A free slot and a fresh token for a side (the slot cleared); (-1, 0) when none is free."""
        if not self._free:
            return -1, 0
        slot = self._free.popleft()
        token = self._next_token
        self._next_token += 1
        self.view.words[slot * SLOT_WORDS: (slot + 1) * SLOT_WORDS] = 0
        return slot, token

    def prime(self, slot: int, nbytes: int, path: str, chunks: int = 0) -> None:
        """Write what a done slot will say (all but the token): for a token another process's
        GPU stores (the mapped path's gen side)."""
        if slot < 0:
            return
        w, base = self.view.words, slot * SLOT_WORDS
        w[base + 1] = nbytes
        w[base + 2] = pack_meta(path, chunks)

    def done(self, slot: int, token: int, nbytes: int, path: str, chunks: int, duration_s: float) -> None:
        """The side is done: its outcome, then its token (what a spinning executor reads)."""
        if slot < 0:
            return
        self.prime(slot, nbytes, path, chunks)
        w, base = self.view.words, slot * SLOT_WORDS
        w[base + 3] = max(0, int(duration_s * 1e9))
        w[base] = token

    def primed_bytes(self, slot: int) -> int:
        """The byte count :meth:`prime` (or :meth:`done`) wrote into ``slot``."""
        return int(self.view.words[slot * SLOT_WORDS + 1]) if slot >= 0 else 0

    def holds(self, slot: int, token: int) -> bool:
        """Whether ``slot`` reads ``token`` (the side's success was signalled, by us or a GPU)."""
        return slot >= 0 and token != 0 and self.view.token_at(slot) == token

    def give_back(self, slot: int) -> None:
        """The side ended and no write of its token can come any more: the slot is free."""
        if slot >= 0:
            self._free.append(slot)

    def close(self) -> None:
        self.view.close()
        os.close(self.read_only_fd)
        os.close(self.fd)
