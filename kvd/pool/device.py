"""Ordinary device memory: one ``cuMemAlloc`` allocation shared by CUDA IPC handle.

The fallback when fabric memory is unavailable (README.md, "Configuration"): cudaMalloc
memory is what UCX cuda_ipc writes into at link speed, unlike POSIX-fd VMM memory. The whole
pool is one driver allocation (not torch's caching allocator, whose blocks are sub-allocations
that CUDA IPC cannot export on their own), exported with ``cuIpcGetMemHandle`` as a 64-byte
handle; executors open it with ``cuIpcOpenMemHandle`` (see :mod:`kvd.mapping.attach`).

After :meth:`DeviceMemory.close` the memory is freed: tensor views must not be used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from kvd.mapping import cuda
from kvd.pool.base import ExportedHandle, PoolMemory, check_nbytes
from protocol.errors import PoolError

if TYPE_CHECKING:
    import torch

log = structlog.get_logger("kvd.pool")


class DeviceMemory(PoolMemory):
    """``nbytes`` of zeroed device memory on GPU ``device`` (handle kind "cuda_ipc")."""

    def __init__(self, nbytes: int, device: int, *, name: str = "pool") -> None:
        check_nbytes(nbytes)
        self.kind = "device"
        self.device = device
        self.nbytes = nbytes
        self.map_bytes = nbytes
        self.name = name
        cuda.ensure_context(device)
        ptr = cuda.call("cuMemAlloc", nbytes)
        try:
            cuda.memset_zero(int(ptr), nbytes)
            self._handle = cuda.ipc_handle_to_bytes(cuda.call("cuIpcGetMemHandle", ptr))
            self._tensor: torch.Tensor | None
            self._tensor, self._arr = cuda.cuda_tensor(int(ptr), nbytes, device)
        except BaseException:
            cuda.call("cuMemFree", ptr)
            raise
        self._dptr = ptr
        self.ptr = int(ptr)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise PoolError(f"device pool {self.name!r} is closed")
        return self._tensor

    def export(self) -> ExportedHandle:
        if self._closed:
            raise PoolError(f"device pool {self.name!r} is closed")
        return ExportedHandle(handle_kind="cuda_ipc", handle=self._handle)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._tensor = None
        arr = self._arr
        del self._arr
        if cuda.views_alive(arr):
            log.warning("pool.views_alive_at_close", pool=self.name, kind=self.kind, device=self.device)
        del arr
        cuda.ensure_context(self.device)
        cuda.call("cuCtxSynchronize")
        cuda.call("cuMemFree", self._dptr)
