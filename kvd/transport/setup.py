"""Bring up the daemon's data plane: one NIXL agent, its registrations and staging regions.

Registered once (registration is slow, never per transfer):

- every pool, at startup (the source of sends, and the target of direct and fallback writes);
- the bounce staging, only once peer links are enabled (a daemon that serves only local
  transfers never allocates it): the *receive* region, ``bounce_size_mb`` cut into
  ``chunk_mb`` slots the peer writes into, and the *send* region of the same size, where
  chunks are gathered before their write.

Staging lives where the pools live (the first GPU pool's device, else host memory) and is
NIXL-targetable memory: ``cudaMalloc`` on GPUs, plain host memory on CPUs (UCX
cuda_ipc cannot target POSIX-fd VMM memory, so staging is never VMM).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
import torch

from kvd.transport import NixlAgent, Region
from kvd.transport.slots import SlotPool

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
class Staging:
    """The bounce staging: receive and send regions, and the slot pools that share them."""

    recv: StagingRegion
    send: StagingRegion
    recv_slots: SlotPool
    send_slots: SlotPool


@dataclass(eq=False)
class Transport:
    """The NIXL agent, and the staging regions once :meth:`ensure_staging` made them."""

    agent: NixlAgent
    device: int  # where staging goes: the first GPU pool's device, else -1 (host)
    chunk_bytes: int
    slots: int
    staging: Staging | None = None

    def ensure_staging(self) -> Staging:
        """Allocate and register the bounce staging on first use (blocking: run in a thread)."""
        if self.staging is None:
            recv = _staging(self.chunk_bytes, self.slots, self.device)
            send = _staging(self.chunk_bytes, self.slots, self.device)
            self.agent.register([recv.region(), send.region()])
            self.staging = Staging(recv, send, SlotPool(self.slots), SlotPool(self.slots))
            log.info("transport.staging_ready", staging_device=self.device, slots=self.slots,
                     slot_mb=self.chunk_bytes >> 20)
        return self.staging

    def close(self) -> None:
        self.agent.close()


def _staging(nbytes_slot: int, slots: int, device: int) -> StagingRegion:
    dev = torch.device("cpu") if device < 0 else torch.device("cuda", device)
    tensor = torch.zeros(nbytes_slot * slots, dtype=torch.uint8, device=dev)
    return StagingRegion(tensor, nbytes_slot, slots)


def device_transport_warnings(daemon: Daemon, env: Mapping[str, str]) -> list[dict[str, str]]:
    """Say at startup when UCX will move device memory slowly (never a silent slow path).

    - ``UCX_TLS`` set without ``cuda_ipc`` (or ``all``/``^`` exclusions of it): GPU-to-GPU
      writes on a node fall back to staging through host memory.
    - a ``posix_fd`` pool: UCX cuda_ipc cannot target POSIX-fd VMM memory (0.5 GB/s measured,
      against ~300 GB/s into cudaMalloc memory), so NIXL writes INTO it crawl.
    """
    gpu_pools = [p for p in daemon.pools.values() if p.device >= 0]
    if not gpu_pools:
        return []
    out: list[dict[str, str]] = []
    tls = env.get("UCX_TLS", "")
    if tls:
        names = [t.strip() for t in tls.split(",")]
        excluded = tls.startswith("^") and any(n.lstrip("^") in ("cuda_ipc", "cuda") for n in names)
        listed = any(n in ("all", "cuda_ipc", "cuda") for n in names)
        if excluded or (not tls.startswith("^") and not listed):
            out.append({"reason": f"UCX_TLS={tls} leaves out cuda_ipc: GPU writes go through host memory",
                        "setting": "UCX_TLS"})
    for p in gpu_pools:
        if p.kind == "posix_fd":
            out.append({"reason": f"pool {p.name} is POSIX-fd VMM memory: UCX cuda_ipc cannot write into it "
                                  "(0.5 GB/s measured on H200); use memory = auto or device for NIXL targets",
                        "setting": f"pools.{p.name}.memory"})
    return out


def setup_transport(daemon: Daemon, chunk_bytes: int, slots: int) -> Transport:
    """Create the agent and register the pools (blocking: run in a thread); staging comes later."""
    cfg = daemon.config
    gpu_devices = [p.device for p in daemon.pools.values() if p.device >= 0]
    device = gpu_devices[0] if gpu_devices else -1
    name = f"{cfg.node}-{os.getpid()}-{secrets.token_hex(4)}"
    agent = NixlAgent(name, progress_thread=cfg.transfer.nixl_progress_thread)
    try:
        regions = [Region(p.ptr, p.nbytes, p.device, "VRAM" if p.device >= 0 else "DRAM")
                   for p in daemon.pools.values()]
        if regions:
            agent.register(regions)
    except BaseException:
        agent.close()
        raise
    for warning in device_transport_warnings(daemon, os.environ):
        log.warning("transport.slow_device_path", **warning)
    log.info("transport.ready", agent=name, staging_device=device, pools_registered=len(daemon.pools))
    return Transport(agent, device, chunk_bytes, slots)
