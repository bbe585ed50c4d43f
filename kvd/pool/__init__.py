"""KV pool memory, block leases and the memory policy.

Backends (one module each, behind :class:`PoolMemory`): :class:`HostMemory` (memfd),
:class:`DeviceMemory` (cuMemAlloc + CUDA IPC), :class:`PosixFdMemory` (VMM, fd),
:class:`FabricMemory` (VMM, fabric handle). :func:`choose_and_create` applies the pool memory
policy (README.md, "Configuration"); :class:`Pool` ties memory, layout and
:class:`BlockAllocator` together. CUDA is imported lazily: importing this package on a CPU-only
machine never touches the driver.
"""

from kvd.mapping.cuda import CudaCallError
from kvd.pool.base import HANDLE_KIND_OF, MEMORY_KINDS, ExportedHandle, HandleKind, MemoryKind, PoolMemory
from kvd.pool.blocks import BlockAllocator
from kvd.pool.device import DeviceMemory
from kvd.pool.fabric import FabricMemory, probe_fabric
from kvd.pool.host import HostMemory
from kvd.pool.policy import (
    ENV_VARS,
    Decision,
    Note,
    choose_and_create,
    create_memory,
    decide,
    env_fabric_setting,
)
from kvd.pool.pool import Pool, PoolSettingError, create_pools
from kvd.pool.posix_fd import PosixFdMemory

__all__ = [
    "ENV_VARS",
    "HANDLE_KIND_OF",
    "MEMORY_KINDS",
    "BlockAllocator",
    "CudaCallError",
    "Decision",
    "DeviceMemory",
    "ExportedHandle",
    "FabricMemory",
    "HandleKind",
    "HostMemory",
    "MemoryKind",
    "Note",
    "Pool",
    "PoolMemory",
    "PoolSettingError",
    "PosixFdMemory",
    "choose_and_create",
    "create_memory",
    "create_pools",
    "decide",
    "env_fabric_setting",
    "probe_fabric",
]
