"""The peers view for ``kvctl peers``: live links, configured peers that are not connected, and
peers whose link went down (an incoming one stays listed, ``down``, until it dials again).

Read from the engine's peer links on the trio thread (no locking: the answer is one snapshot
between two awaits). A configured peer without a link shows why its last attempt failed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from protocol import messages as m

if TYPE_CHECKING:
    from kvd.config import Config
    from kvd.transfer.engine import Engine

_FINISHED = ("done", "failed")


def peer_infos(config: Config, engine: Engine | None) -> list[m.PeerInfo]:
    """One :class:`~protocol.messages.PeerInfo` per linked or configured peer, by node name."""
    links = engine.links if engine is not None else None
    active: dict[str, int] = {}
    for t in engine.transfer_infos() if engine is not None else []:
        if t.state not in _FINISHED and t.peer:
            active[t.peer] = active.get(t.peer, 0) + 1
    configured = {p.name: f"{p.host}:{p.port}" for p in config.peers}
    out: dict[str, m.PeerInfo] = {}
    now = trio.current_time()
    for node, link in (links.links.items() if links is not None else []):
        out[node] = m.PeerInfo(
            node=node,
            state="up",
            # who dialled this link: with a pair listing each other, it is one of the two
            direction="incoming" if link.dialled_by == node else "outgoing",
            remote=link.conn.remote_addr or configured.get(node, ""),
            last_heard_s=max(0.0, now - link.conn.last_received),
            transfers_active=active.get(node, 0),
            mapped=bool(link.mapped),
        )
    lost = links.lost if links is not None else {}
    for node, remote in configured.items():
        if node not in out:
            gone = lost.get(node)
            error = links.last_error.get(node, "") if links is not None else "peer links are not running"
            out[node] = m.PeerInfo(
                node=node,
                state="connecting",
                direction="outgoing",
                remote=remote,
                # heard from before its link went down: when, and why it went (until a dial fails)
                last_heard_s=max(0.0, now - gone.last_received) if gone is not None else -1.0,
                transfers_active=active.get(node, 0),
                error=error or (f"link lost: {gone.reason}" if gone is not None else ""),
                attempts=links.attempts.get(node, 0) if links is not None else 0,
            )
    for node, gone in lost.items():
        if node not in out:  # a peer that dialled us: we do not dial it back, it should
            out[node] = m.PeerInfo(
                node=node,
                state="down",
                direction="incoming" if gone.incoming else "outgoing",
                remote=gone.remote,
                last_heard_s=max(0.0, now - gone.last_received),
                transfers_active=active.get(node, 0),
                error=f"link lost: {gone.reason}",
            )
    return [out[node] for node in sorted(out)]
