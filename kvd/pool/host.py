"""Host pool memory: an anonymous memfd, mmapped, shareable by fd (SCM_RIGHTS).

Serves CPU-only machines, tests and the demo. The memfd is sealed against shrinking and
growing (``F_SEAL_SHRINK | F_SEAL_GROW``), so an executor holding the fd cannot truncate it and
make the daemon's accesses fault with SIGBUS.

Lifetime: :meth:`HostMemory.close` closes the memfd and drops the daemon's reference to the
mapping. If no tensor view of it is left, the mapping is unmapped at once; if views are still
alive, it is unmapped when the last one is released, so a stale view can never crash the
process. Views must not be used after ``close()`` all the same: the blocks may belong to
someone else by then.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import sys

import structlog
import torch

from kvd.mapping.host import map_fd
from kvd.pool.base import ExportedHandle, PoolMemory, check_nbytes
from protocol.errors import PoolError

log = structlog.get_logger("kvd.pool")

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def drop_mapping(mm: mmap.mmap) -> bool:
    """Release the caller's reference to ``mm``; True when no tensor view keeps it mapped.

    (The mapping is unmapped by the mmap object's deallocation, i.e. when the caller's last
    reference goes if no view holds one.)
    """
    # references: the caller's variable + this parameter + getrefcount's argument
    return sys.getrefcount(mm) <= 3


class HostMemory(PoolMemory):
    """A memfd of ``nbytes``, mapped here; :meth:`export` hands out the memfd (handle kind "fd")."""

    def __init__(self, nbytes: int, *, name: str = "pool") -> None:
        check_nbytes(nbytes)
        self.kind = "host"
        self.device = -1
        self.nbytes = nbytes
        self.map_bytes = nbytes
        self.name = name
        try:
            fd = os.memfd_create(f"kvd-pool-{name}"[:200], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise PoolError(f"memfd_create for host pool {name!r} failed: {exc}") from None
        try:
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            mm, base = map_fd(fd, nbytes)
        except OSError as exc:
            os.close(fd)
            raise PoolError(f"host pool {name!r} of {nbytes} bytes: {exc}") from None
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        self._mm: mmap.mmap | None = mm
        self._base: torch.Tensor | None = base
        self.ptr = base.data_ptr()

    @property
    def closed(self) -> bool:
        return self._fd is None

    @property
    def fd(self) -> int:
        """The memfd (owned by this object)."""
        if self._fd is None:
            raise PoolError(f"host pool {self.name!r} is closed")
        return self._fd

    def tensor(self) -> torch.Tensor:
        if self._base is None:
            raise PoolError(f"host pool {self.name!r} is closed")
        return self._base

    def export(self) -> ExportedHandle:
        return ExportedHandle(handle_kind="fd", handle=b"", fds=[self.fd])

    def close(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        mm, self._mm = self._mm, None
        self._base = None
        try:
            os.close(fd)
        finally:
            if mm is not None and not drop_mapping(mm):
                log.debug("pool.views_alive_at_close", pool=self.name, kind="host")
            del mm
