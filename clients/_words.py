"""The client's side of the completion page (:mod:`kvd.mapping.words`): which request sides
this session holds slots for, and whether the page says one is done.

A client made with ``completion_page=True`` (a ``Client`` that spins, ``spin_s`` > 0, or a
``PollingClient``) maps the daemon's page read-only when it connects; every ``Registered``
reply names the side's slot and token. A spinning wait looks at the slot while it polls the
socket; ``PollingClient.get_finished`` looks at the slots of every watched request at once
(:meth:`PageWatch.finished`: no syscall; one numpy gather when there are many). A success
found there is returned without the ``Completion`` reply, which the daemon still sends (its
wait collects the request): the client drops it when it comes.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvd.mapping.words import SLOT_WORDS, WordsView
from protocol import messages as m
from protocol.errors import KvdError

#: Registrations remembered for a later wait (the oldest forgotten beyond: its wait uses the socket).
MAX_NOTED = 4096
#: Up to this many tracked requests, :meth:`PageWatch.finished` reads their slots one by one
#: (about 1 us for 8); beyond, with one numpy gather (about 4 us whatever the count).
SCAN_ONE_BY_ONE = 8


@dataclass(frozen=True)
class _Noted:
    word: int
    token: int
    peer: str
    registered_at: float


class PageWatch:
    """The daemon's completion page as this session reads it."""

    def __init__(self, page: WordsView) -> None:
        self.page = page
        self._noted: OrderedDict[str, _Noted] = OrderedDict()
        self.seen = 0  # completions found in the page (not from a reply)
        # tracked requests (see track), dense in positions 0 .. len(self._keys) - 1: the index of
        # each one's token word in the page and the token it waits for, as lists (read one by
        # one) and as arrays (read by one gather)
        self._at: dict[int, int] = {}  # key -> position
        self._keys: list[int] = []
        self._rids: list[str] = []
        self._index_list: list[int] = []
        self._token_list: list[int] = []
        self._index: npt.NDArray[np.intp] = np.zeros(16, dtype=np.intp)
        self._tokens: npt.NDArray[np.uint64] = np.zeros(16, dtype=np.uint64)
        self._words = page.words.data  # a word read as an int: cheaper than numpy's

    @staticmethod
    def open(reply: m.WordsAttached, fds: list[int]) -> PageWatch | None:
        """Map the page that came with ``reply``; None when it cannot be (the fds are closed)."""
        try:
            if len(fds) != 1:
                return None
            return PageWatch(WordsView(fds[0], reply.slots))
        except KvdError:
            return None
        finally:
            for fd in fds:
                os.close(fd)

    def note(self, reply: m.Registered, peer: str) -> None:
        """Remember the slot a registration's reply named (if any)."""
        if reply.word < 0 or reply.token == 0 or reply.word >= self.page.slots:
            return
        self._noted[reply.request_id] = _Noted(reply.word, reply.token, peer, time.monotonic())
        while len(self._noted) > MAX_NOTED:
            self._noted.popitem(last=False)

    def forget(self, request_id: str) -> None:
        self._noted.pop(request_id, None)

    def watching(self, request_id: str) -> bool:
        return request_id in self._noted

    def done(self, request_id: str) -> m.Completion | None:
        """The request's successful completion when the page says so (then forgotten), else None."""
        noted = self._noted.get(request_id)
        if noted is None:
            return None
        out = self.page.outcome(noted.word, noted.token)
        if out is None:
            return None
        del self._noted[request_id]
        self.seen += 1
        duration = out.duration_s or (time.monotonic() - noted.registered_at)
        # as the daemon's reply says it: the fragment path is the one fallback a success takes;
        # the peer is the one the registration named ("" when it named none: the daemon's
        # reply would name the node that matched it)
        return m.Completion(request_id=request_id, ok=True, bytes=out.nbytes, duration_s=duration,
                            path=out.path, chunks=out.chunks, peer=noted.peer,
                            fallback="fragment" if out.path == "fragment" else "")

    def track(self, request_id: str, key: int) -> bool:
        """Have :meth:`finished` look at a noted request's slot, under ``key`` (the caller's
        handle for it: a watch's wait id); False when the request is not noted (its outcome
        comes from the socket alone) or ``key`` is tracked already."""
        noted = self._noted.get(request_id)
        if noted is None or key in self._at:
            return False
        pos = len(self._keys)
        if pos == len(self._index):
            self._index = np.concatenate([self._index, np.zeros(pos, dtype=np.intp)])
            self._tokens = np.concatenate([self._tokens, np.zeros(pos, dtype=np.uint64)])
        self._index[pos] = noted.word * SLOT_WORDS
        self._tokens[pos] = noted.token
        self._index_list.append(noted.word * SLOT_WORDS)
        self._token_list.append(noted.token)
        self._keys.append(key)
        self._rids.append(request_id)
        self._at[key] = pos
        return True

    def untrack(self, key: int) -> None:
        """Stop looking at ``key``'s slot (the last tracked request takes its position)."""
        pos = self._at.pop(key, None)
        if pos is None:
            return
        last = len(self._keys) - 1
        if pos != last:
            moved = self._keys[last]
            self._keys[pos], self._rids[pos] = moved, self._rids[last]
            self._index[pos], self._tokens[pos] = self._index[last], self._tokens[last]
            self._index_list[pos], self._token_list[pos] = self._index_list[last], self._token_list[last]
            self._at[moved] = pos
        self._keys.pop()
        self._rids.pop()
        self._index_list.pop()
        self._token_list.pop()

    def finished(self) -> list[tuple[int, m.Completion]]:
        """The tracked requests the page says are done, with their keys (each then untracked and
        forgotten, counted in :attr:`seen`): every tracked slot read, no syscall."""
        n = len(self._keys)
        if n == 0:
            return []
        if n <= SCAN_ONE_BY_ONE:
            words, index, tokens = self._words, self._index_list, self._token_list
            hits = [pos for pos in range(n) if words[index[pos]] == tokens[pos]]
        else:
            hits = np.flatnonzero(self.page.words[self._index[:n]] == self._tokens[:n]).tolist()
        if not hits:
            return []
        found = [(self._keys[pos], self._rids[pos]) for pos in hits]
        out: list[tuple[int, m.Completion]] = []
        for key, request_id in found:
            self.untrack(key)
            done = self.done(request_id)  # None: forgotten meanwhile (MAX_NOTED); the reply says
            if done is not None:
                out.append((key, done))
        return out

    def close(self) -> None:
        self._words.release()  # (else the mapping stays until this object goes)
        self.page.close()
