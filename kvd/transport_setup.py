"""Bring up the daemon's data plane: one NIXL agent, its registrations and staging regions.

Registered once at startup (DESIGN.md: registration is slow, never per transfer):

- every pool (the source of sends, and the target of direct and fallback writes);
- the *receive* region: ``bounce_size_mb`` cut into ``chunk_mb`` slots the peer writes into;
- the *send* staging region: the same size, where chunks are gathered before their write.

Staging lives where the pools live (the first GPU pool's device, else host memory) and is
NIXL-targetable memory: ``cudaMalloc`` on GPUs, plain host memory on CPUs (DESIGN.md: UCX
cuda_ipc cannot target POSIX-fd VMM memory, so staging is never VMM).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
import torch

from kvd.transport import NixlAgent, Region

if TYPE_CHECKING:
    from kvd.daemon import Daemon

log = structlog.get_logger("kvd.transport")


@dataclass(eq=False)
class StagingRegion:
    """A contiguous registered region cut into equal slots."""

    tensor: torch.Tensor  # uint8, slot_count * slot_bytes
    slot_bytes: int
    slot_count: int

    @property
    def addr(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.slot_count

    @property
    def device(self) -> int:
        return self.tensor.device.index if self.tensor.is_cuda else -1

    def slot_addr(self, slot: int) -> int:
        return self.addr + slot * self.slot_bytes

    def slot_tensor(self, slot: int) -> torch.Tensor:
        return self.tensor[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]

    def region(self) -> Region:
        dev = self.device
        return Region(self.addr, self.nbytes, dev, "VRAM" if dev >= 0 else "DRAM")


@dataclass(eq=False)
class Transport:
    """The NIXL agent plus the staging regions it has registered."""

    agent: NixlAgent
    recv: StagingRegion
    send: StagingRegion

    def close(self) -> None:
        self.agent.close()


def _staging(nbytes_slot: int, slots: int, device: int) -> StagingRegion:
    dev = torch.device("cpu") if device < 0 else torch.device("cuda", device)
    tensor = torch.zeros(nbytes_slot * slots, dtype=torch.uint8, device=dev)
    return StagingRegion(tensor, nbytes_slot, slots)


def setup_transport(daemon: Daemon, chunk_bytes: int, slots: int) -> Transport:
    """Create the agent, allocate staging, register pools + staging (blocking: run in a thread)."""
    cfg = daemon.config
    gpu_devices = [p.device for p in daemon.pools.values() if p.device >= 0]
    device = gpu_devices[0] if gpu_devices else -1
    name = f"{cfg.node}-{os.getpid()}-{secrets.token_hex(4)}"
    agent = NixlAgent(name, progress_thread=cfg.transfer.nixl_progress_thread)
    try:
        recv = _staging(chunk_bytes, slots, device)
        send = _staging(chunk_bytes, slots, device)
        regions = [recv.region(), send.region()]
        for pool in daemon.pools.values():
            regions.append(Region(pool.ptr, pool.nbytes, pool.device, "VRAM" if pool.device >= 0 else "DRAM"))
        agent.register(regions)
    except BaseException:
        agent.close()
        raise
    log.info(
        "transport.ready",
        agent=name,
        staging_device=device,
        slots=slots,
        slot_mb=chunk_bytes >> 20,
        pools_registered=len(daemon.pools),
    )
    return Transport(agent, recv, send)
