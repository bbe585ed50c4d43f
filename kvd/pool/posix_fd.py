"""CUDA VMM memory exportable as a POSIX file descriptor (handle kind "posix_fd").

The fd can be passed to another process on this node (SCM_RIGHTS) and imported there with
``cuMemImportFromShareableHandle`` (measured working on H200, with copies from the imported
pool at link speed). But UCX cuda_ipc cannot *target* this memory: NIXL writes into it run at
about 0.5 GB/s against 308 GB/s into cudaMalloc memory (measured on H200), so the policy only uses it
when asked to, and warns (``pool.posix_fd_slow_nixl_target``).
"""

from __future__ import annotations

import os
from typing import Any

from kvd.mapping import cuda
from kvd.pool.base import ExportedHandle
from kvd.pool.vmm import VmmMemory
from protocol.errors import PoolError


class PosixFdMemory(VmmMemory):
    """VMM memory on GPU ``device``; :meth:`export` hands out one fd owned by this object."""

    handle_type = "posix_fd"
    _fd: int | None = None

    def _export_init(self, handle: Any) -> None:
        fd = cuda.call("cuMemExportToShareableHandle", handle, cuda.handle_type("posix_fd"), 0)
        self._fd = int(fd)

    def _export_close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    @property
    def fd(self) -> int:
        """The exported fd (owned by this object, closed by :meth:`close`)."""
        if self._closed or self._fd is None:
            raise PoolError(f"posix_fd pool {self.name!r} is closed")
        return self._fd

    def export(self) -> ExportedHandle:
        return ExportedHandle(handle_kind="posix_fd", handle=b"", fds=[self.fd])
