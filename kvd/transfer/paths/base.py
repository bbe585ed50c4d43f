"""What every path gets (:class:`Job`), reports (:class:`Progress`) and returns (:class:`Sent`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from kvd.pool import Pool
    from kvd.regroup.plan import Plan
    from kvd.transport import NixlAgent
    from protocol.transfer import RemoteRegion


class Progress(Protocol):
    """How a path tells its transfer what it does (never blocks)."""

    def posted(self, n: int = 1) -> None:
        """``n`` writes into gen memory are about to start."""

    def planned(self, chunks: int) -> None:
        """The path will move the request in ``chunks`` chunks (NIXL writes, bounce chunks):
        what ``kvctl transfers`` shows progress against."""

    def check(self) -> None:
        """Raise :class:`~protocol.errors.TransferCancelled` if the transfer is aborting: a
        write announced earlier (:meth:`posted`) must not start now."""

    def ended(self, n: int = 1) -> None:
        """``n`` writes reached a final state (completed, or aborted and confirmed)."""

    def moved(self, nbytes: int, chunks: int = 1) -> None:
        """Bytes done, for progress reports."""

    def mark(self, stage: str) -> None:
        """A stage of the path just ended (logged with the transfer)."""


@dataclass(frozen=True)
class Sent:
    """What a sending path did: ``writes`` NIXL notifications gen must see."""

    writes: int
    chunks: int
    nbytes: int
    fallback: str = ""


@dataclass
class Job:
    """One request's data movement, as a path needs it."""

    request_id: str
    owner: str  # the transfer's name for slot leases (unique per peer pair and request)
    plan: Plan
    src: dict[int, Pool]  # ctx rank -> pool (here)
    progress: Progress
    # peer paths
    nixl: NixlAgent | None = None
    remote_agent: str = ""
    remote_pools: dict[int, RemoteRegion] = field(default_factory=dict)
    # local/mapped paths: gen rank -> typed destination tensor
    dst: dict[int, Any] = field(default_factory=dict)
    # mapped path: gen rank -> the peer's pool as mapped here (a kvd.mapping MappedPool)
    mapped: dict[int, Any] = field(default_factory=dict)
    # bounce: the receive slots gen grants, and the send staging here
    grants: Callable[[], Awaitable[int]] | None = None
    staging: Any = None
    slot_pool: Any = None
    remote_region: RemoteRegion | None = None
    remote_slot_bytes: int = 0
    chunk_bytes: int = 64 << 20
    descs_per_write: int = 8192  # NIXL descriptors per write (direct / fragment paths)
    gpu_chunk_bytes: int = 128 << 20
    stages: dict[str, float] = field(default_factory=dict)
    # mapped path: completion tokens (device address, value) the GPU stores after the kernel
    stores: list[tuple[int, int]] = field(default_factory=list)
    # NIXL paths: the peer's number for the request, named in each write's notification (0: not known)
    peer_ref: int = 0


def mem(device: int) -> Literal["DRAM", "VRAM"]:
    """NIXL's memory type of a kvd device number (-1 = host)."""
    return "DRAM" if device < 0 else "VRAM"
