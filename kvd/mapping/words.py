"""Completion words: a daemon's shared page of per-request outcome slots, read without a syscall.

A waiting executor normally learns that its request is done from the daemon's ``Completion``
reply: a socket write by the daemon and a wake-up of the executor, each tens of microseconds
on a sandboxed host, on every request's critical path. The completion page lets a spinning
executor (or a step loop polling ``PollingClient.get_finished``) see it sooner: each side of
a request hosted by a daemon gets a **slot** of the daemon's page (a ``memfd``, shared
read-only with its executors), and a **token** (a 64-bit number the daemon never gives
twice). The slot reads that token once the side is done:

- the daemon stores it when it reports the side done (before the reply is written);
- on the mapped path with GPU pools, the ctx daemon's GPU stream writes it into the gen
  daemon's page right after the regroup kernel (``cuStreamWriteValue64``, which orders the
  kernel's writes before it), and into its own page for its ctx executor: the executors are
  done when the bytes are, before either daemon has looked.

Only success is signalled: a failure comes as the ``Completion`` reply, as before. A slot
that reads another token (a later request reusing it) only means "look at the socket".

Layout of a slot (:data:`SLOT_WORDS` little-endian ``uint64``): ``token``, ``bytes``, ``meta``
(path code in the low byte, chunks above), ``duration_ns``. The other words are written before
the token (for a GPU-written token, when the request's destination was set up), so a reader
that sees its token reads the rest of the slot as the writer left it.

This module is the leaf the daemon and the clients share: the layout, and mapping a page.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvd.mapping.fdmap import mmap_fd
from protocol.errors import PoolError

#: ``uint64`` words per slot: token, bytes, meta, duration_ns.
SLOT_WORDS = 4
#: Bytes per slot (a slot never straddles a cache line: 32-byte slots, 64-byte lines).
SLOT_BYTES = SLOT_WORDS * 8
#: Paths as the ``meta`` word's low byte names them (0: not said).
PATH_CODES: dict[str, int] = {"local": 1, "mapped": 2, "direct": 3, "bounce": 4, "fragment": 5}
PATH_NAMES: dict[int, str] = {v: k for k, v in PATH_CODES.items()}


def pack_meta(path: str, chunks: int) -> int:
    """The ``meta`` word: path code, chunks."""
    return (PATH_CODES.get(path, 0) & 0xFF) | (max(0, chunks) << 8)


@dataclass(frozen=True)
class SlotOutcome:
    """What a done slot says."""

    nbytes: int
    path: str
    chunks: int
    duration_s: float


class WordsView:
    """A completion page mapped into this process (read-only unless ``writable``)."""

    def __init__(self, fd: int, slots: int, *, writable: bool = False) -> None:
        if slots < 1:
            raise PoolError(f"a completion page of {slots} slots")
        size = slots * SLOT_BYTES
        self._mm = mmap_fd(fd, size, "completion page", writable=writable)
        self.slots = slots
        self.nbytes = size
        self.words: npt.NDArray[np.uint64] = np.frombuffer(self._mm, dtype=np.uint64)
        if writable:  # (frombuffer of a read-only mapping is read-only: writing raises)
            self.words.flags.writeable = True

    @property
    def address(self) -> int:
        """The mapping's address in this process (for registering it with CUDA)."""
        return int(self.words.ctypes.data)

    def token_at(self, slot: int) -> int:
        """The token slot ``slot`` holds now (0: none yet)."""
        return int(self.words[slot * SLOT_WORDS])

    def outcome(self, slot: int, token: int) -> SlotOutcome | None:
        """The slot's outcome when it holds ``token`` (the side is done), else None."""
        base = slot * SLOT_WORDS
        w = self.words
        if int(w[base]) != token or token == 0:
            return None
        meta = int(w[base + 2])
        return SlotOutcome(nbytes=int(w[base + 1]), path=PATH_NAMES.get(meta & 0xFF, ""), chunks=meta >> 8,
                           duration_s=int(w[base + 3]) / 1e9)

    def close(self) -> None:
        """Unmap (a view still held elsewhere keeps the mapping until it is dropped)."""
        self.words = np.zeros(0, dtype=np.uint64)
        with contextlib.suppress(BufferError):  # a numpy view still refers to it: it goes with the view
            self._mm.close()
