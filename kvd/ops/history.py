"""Recently finished transfers, for ``kvctl transfers`` (a bounded ring, newest last).

The engine forgets a transfer side once every executor collected its completion (``wait``);
an operator still wants to see how it ended. :class:`TransferHistory` keeps the last
:data:`HISTORY_SIZE` finished sides as :class:`~protocol.messages.TransferInfo` snapshots
taken when they finished, with the completion's ``duration_s`` and outcome.
"""

from __future__ import annotations

from collections import deque

import msgspec

from protocol import messages as m

#: Finished transfer sides kept for ``kvctl transfers``.
HISTORY_SIZE = 256

_FINISHED = ("done", "failed")


class TransferHistory:
    """A ring of finished transfer sides."""

    def __init__(self, size: int = HISTORY_SIZE) -> None:
        self._ring: deque[m.TransferInfo] = deque(maxlen=size)

    def record(self, info: m.TransferInfo, completion: m.Completion) -> None:
        """Keep ``info`` (a side that just finished) with its completion's outcome."""
        self._ring.append(
            msgspec.structs.replace(
                info,
                state="done" if completion.ok else "failed",
                path=completion.path or info.path,
                bytes_done=completion.bytes,
                chunks_done=completion.chunks,
                duration_s=completion.duration_s,
                error="" if completion.ok else f"[{completion.error_code}] {completion.error_message}",
            )
        )

    def merged(self, live: list[m.TransferInfo]) -> list[m.TransferInfo]:
        """The engine's sides still in progress, then every finished side kept here (newest
        last). A finished side the engine still holds (not collected by ``wait`` yet) was
        recorded here when it finished, so it is shown once, as recorded; a request id cannot
        run again while its finished side is held, so (request id, role) identifies it."""
        recorded = {(t.request_id, t.role) for t in self._ring}
        shown = [t for t in live if t.state not in _FINISHED or (t.request_id, t.role) not in recorded]
        return [*shown, *self._ring]

    def outcome(self, request_id: str) -> str | None:
        """How the newest kept side of ``request_id`` ended (``done`` / ``failed``); None if none
        is kept (an error path's question: a scan of the ring)."""
        for info in reversed(self._ring):
            if info.request_id == request_id:
                return info.state
        return None

    def __len__(self) -> int:
        return len(self._ring)
