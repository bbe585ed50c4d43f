"""The client's side of the completion page (:mod:`kvd.mapping.words`): which request sides
this session holds slots for, and whether the page says one is done.

A client that spins (``Client(spin_s=...)``) maps the daemon's page read-only when it
connects; every ``Registered`` reply names the side's slot and token; a wait then looks at
the slot while it polls the socket, and a success found there is returned without the
``Completion`` reply (which the daemon still sends: the client drops it when it comes).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvd.mapping.words import WordsView
from protocol import messages as m
from protocol.errors import KvdError

#: Registrations remembered for a later wait (the oldest forgotten beyond: its wait uses the socket).
MAX_NOTED = 4096


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
        return m.Completion(request_id=request_id, ok=True, bytes=out.nbytes, duration_s=duration,
                            path=out.path, chunks=out.chunks, peer=noted.peer)

    def close(self) -> None:
        self.page.close()
