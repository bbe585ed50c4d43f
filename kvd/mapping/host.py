"""Map a host pool's memfd (received over SCM_RIGHTS) into this process as a uint8 tensor."""

from __future__ import annotations

import mmap

import torch

from kvd.mapping.fdmap import mmap_fd
from protocol.errors import PoolError


def map_fd(fd: int, nbytes: int, map_bytes: int | None = None) -> tuple[mmap.mmap, torch.Tensor]:
    """``mmap`` (shared, read/write) ``map_bytes`` of ``fd`` and view the first ``nbytes`` as uint8.

    The caller keeps the fd: it may be closed right after this returns. Raises
    :class:`PoolError` when the file is smaller than ``map_bytes``.
    """
    size = nbytes if map_bytes is None else map_bytes
    if nbytes < 1 or size < nbytes:
        raise PoolError(f"cannot map {nbytes} bytes of a {size}-byte mapping")
    mm = mmap_fd(fd, size, "pool")
    # torch.frombuffer keeps a reference to the mmap object for as long as the storage lives.
    return mm, torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
