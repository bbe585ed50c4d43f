"""A peer link and link table in one process, for tests that drive one :class:`Transfer`
without a peer daemon: what the transfer sends is kept in order in :attr:`FakeLink.sent`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trio

from protocol import transfer as x


class FakeLink:
    """A peer link whose writer takes messages at once (``nowait``) or only awaited. With
    ``held``, an awaited send waits until :attr:`release` is set (:attr:`sending` says one
    started); without, it is taken at once too."""

    def __init__(self, *, nowait: bool = True, held: bool = True, agent: str = "agent-1") -> None:
        self.takes_nowait = nowait
        self.agent = agent
        self.mapped: dict[str, Any] = {}
        self.sent: list[x.XferMessage] = []
        self.release = trio.Event()
        self.sending = trio.Event()  # set once an awaited send started
        if not held:
            self.release.set()

    def send_nowait(self, msg: x.XferMessage) -> bool:
        self.sent.append(msg)
        return True

    async def send(self, msg: x.XferMessage) -> None:
        self.sending.set()
        await self.release.wait()
        self.sent.append(msg)

    def cork(self) -> None:
        pass

    def uncork(self) -> None:
        pass


@dataclass
class FakeLinks:
    """The engine's link table, as a transfer asks it: links by peer, and messages owed."""

    links: dict[str, FakeLink]
    owed: list[x.XferMessage] = field(default_factory=list)

    def owe(self, peer: str, msg: x.XferMessage) -> None:
        self.owed.append(msg)
