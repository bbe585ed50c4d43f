"""Map a host pool's memfd (received over SCM_RIGHTS) into this process as a uint8 tensor."""

from __future__ import annotations

import mmap
import os

import torch

from protocol.errors import PoolError


def map_fd(fd: int, nbytes: int, map_bytes: int | None = None) -> tuple[mmap.mmap, torch.Tensor]:
    """``mmap`` (shared, read/write) ``map_bytes`` of ``fd`` and view the first ``nbytes`` as uint8.

    The caller keeps the fd: it may be closed right after this returns. Raises
    :class:`PoolError` when the file is smaller than ``map_bytes``.
    """
    size = nbytes if map_bytes is None else map_bytes
    if nbytes < 1 or size < nbytes:
        raise PoolError(f"cannot map {nbytes} bytes of a {size}-byte mapping")
    try:
        file_size = os.fstat(fd).st_size
    except OSError as exc:
        raise PoolError(f"pool fd {fd} is not usable: {exc}") from None
    if file_size < size:
        raise PoolError(f"pool fd {fd} holds {file_size} bytes, expected at least {size}")
    try:
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise PoolError(f"mmap of pool fd {fd} ({size} bytes) failed: {exc}") from None
    # torch.frombuffer keeps a reference to the mmap object for as long as the storage lives.
    return mm, torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
