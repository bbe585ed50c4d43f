"""Map a file received as a descriptor (a pool's memfd, a completion page), checked first.

No torch here: the clients' completion page (:mod:`kvd.mapping.words`) maps through this too.
"""

from __future__ import annotations

import mmap
import os

from protocol.errors import PoolError


def mmap_fd(fd: int, size: int, what: str, *, writable: bool = True) -> mmap.mmap:
    """``mmap`` (shared) ``size`` bytes of ``fd``, read/write or read-only. Raises
    :class:`PoolError` naming ``what`` (``"pool"``, ``"completion page"``) when the fd is not
    usable, the file is smaller than ``size`` or the mapping fails. The caller keeps the fd."""
    try:
        have = os.fstat(fd).st_size
    except OSError as exc:
        raise PoolError(f"{what} fd {fd} is not usable: {exc}") from None
    if have < size:
        raise PoolError(f"{what} fd {fd} holds {have} bytes, expected at least {size}")
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
    except OSError as exc:
        raise PoolError(f"mmap of {what} fd {fd} ({size} bytes) failed: {exc}") from None
