"""Which peers' NIXL agents stay loaded while their link is down (sans-IO: decisions only).

Forgetting a remote NIXL agent and loading it again while its process lives leaves one TCP
connection behind in UCX for every such cycle (nixl-cu13 1.5.1; ``python -m
kvd.bench.ucx_reconnect`` shows it with two bare agents), so a link that flaps between two live
daemons would cost a descriptor per flap. Loading a live agent again *without* forgetting it
first leaves nothing. So when a link ends, its peer's agent is kept loaded (only the handles
and descriptor lists prepared for it are released), and when the link comes back:

- from the **same instance** (the agent name carries the peer's pid and a random tag), the kept
  agent is loaded again over itself;
- from **another instance** of that node (the peer restarted), the kept one is forgotten: its
  process is gone.

A kept agent is not kept when an operation with it failed, and is loaded afresh when UCX
refuses a probe notification on its return: when the network broke the UCX connection along
with the link, reloading metadata over the agent would not mend the failed endpoint
(``CONNECTION_FAILED``; :meth:`kvd.transport.NixlAgent.failed_with`, ``probe_remote``).

A kept agent whose peer never comes back costs little (UCX closes its connections once the
peer's process is gone), but peers are not counted, so at most ``limit`` are kept: beyond,
the one kept longest is forgotten. The daemon's NIXL agent forgets every remote when it closes.

:class:`KeptAgents` holds the decisions; :class:`kvd.peer.links.PeerLinks` carries them out.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

#: reasons an agent is forgotten, as logged (``peer.agent_forgotten``)
NEW_INSTANCE = "a new instance of the peer"
OVER_LIMIT = "more peers' agents kept than the limit"
CONNECTION_FAILED = "its connection failed"

#: how many peers' agents stay loaded while their links are down
DEFAULT_LIMIT = 256


@dataclass(frozen=True)
class Forget:
    """Forget ``agent`` (the agent of ``node``) now, for ``reason``."""

    node: str
    agent: str
    reason: str


class KeptAgents:
    """Peer agents loaded while their link is down, oldest first, at most ``limit``."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.limit = limit
        self._kept: OrderedDict[str, str] = OrderedDict()  # node -> agent

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, node: object) -> bool:
        return node in self._kept

    def agent_of(self, node: str) -> str | None:
        """The agent kept for ``node``, if any."""
        return self._kept.get(node)

    def agents(self) -> set[str]:
        """The names of every kept agent."""
        return set(self._kept.values())

    def link_down(self, node: str, agent: str) -> list[Forget]:
        """``node``'s link (to ``agent``) ended: keep its agent. Returns what to forget now."""
        out: list[Forget] = []
        old = self._kept.pop(node, None)
        if old is not None and old != agent:  # cannot happen while link_up is called for each link
            out.append(Forget(node, old, NEW_INSTANCE))
        self._kept[node] = agent
        while len(self._kept) > self.limit:
            victim, victim_agent = self._kept.popitem(last=False)
            out.append(Forget(victim, victim_agent, OVER_LIMIT))
        return out

    def link_up(self, node: str, agent: str) -> list[Forget]:
        """A link to ``node`` whose agent ``agent`` is loaded came up (whether it was kept:
        :meth:`agent_of`, asked before). Returns what to forget now."""
        kept = self._kept.pop(node, None)
        out: list[Forget] = []
        if kept is not None and kept != agent:
            out.append(Forget(node, kept, NEW_INSTANCE))
        # an agent of that name kept for another node is the one now loaded for this node:
        # it is in use again, so it must not be forgotten when that other entry goes
        for other in [n for n, a in self._kept.items() if a == agent]:
            del self._kept[other]
        return out
