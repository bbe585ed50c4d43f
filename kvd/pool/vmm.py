"""CUDA VMM memory (``cuMemCreate`` + reserve + map + set access), the common part of the
``fabric`` and ``posix_fd`` backends; they differ only in the shareable handle type.

The allocation is rounded up to the VMM granularity (2 MiB on H200): ``map_bytes`` >= ``nbytes``.
After :meth:`VmmMemory.close` the memory is unmapped: tensor views must not be used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog

from kvd.mapping import cuda
from kvd.pool.base import PoolMemory, check_nbytes
from protocol.errors import PoolError

if TYPE_CHECKING:
    import torch

log = structlog.get_logger("kvd.pool")


class VmmMemory(PoolMemory):
    """``nbytes`` (rounded up to the granularity) of zeroed VMM memory on GPU ``device``."""

    handle_type: cuda.VmmHandleType

    def __init__(self, nbytes: int, device: int, *, name: str = "pool") -> None:
        check_nbytes(nbytes)
        self.kind = self.handle_type
        self.device = device
        self.nbytes = nbytes
        self.name = name
        cuda.ensure_context(device)
        prop = cuda.vmm_prop(device, self.handle_type)
        self.map_bytes = cuda.round_up(nbytes, cuda.granularity(prop))
        handle = cuda.call("cuMemCreate", self.map_bytes, prop, 0)
        try:
            ptr = cuda.reserve_and_map(handle, self.map_bytes, [device])
            try:
                cuda.memset_zero(ptr, self.map_bytes)
                self._export_init(handle)
                self._tensor: torch.Tensor | None
                self._tensor, self._arr = cuda.cuda_tensor(ptr, nbytes, device)
            except BaseException:
                self._export_close()
                cuda.unmap_and_free(ptr, self.map_bytes)
                raise
        except BaseException:
            cuda.release(handle)
            raise
        self._handle: Any = handle
        self.ptr = ptr
        self._closed = False

    # subclasses: make and drop the shareable handle
    def _export_init(self, handle: Any) -> None:
        raise NotImplementedError

    def _export_close(self) -> None:
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        return self._closed

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise PoolError(f"{self.kind} pool {self.name!r} is closed")
        return self._tensor

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
        try:
            cuda.ensure_context(self.device)
            cuda.quiet_call("cuCtxSynchronize")
            cuda.unmap_and_free(self.ptr, self.map_bytes)
            cuda.release(self._handle)
        finally:
            self._export_close()
