"""The one interface every pool memory backend implements.

A :class:`PoolMemory` is one contiguous region of memory owned by the daemon: host memory
(a memfd), ordinary device memory (``cuMemAlloc``, shared by CUDA IPC handle), CUDA VMM memory
exportable as a POSIX fd, or CUDA fabric memory (exportable across an NVLink domain). The pool
above it only needs: a byte tensor over the memory (zero-copy), a shareable handle for
executors (:meth:`PoolMemory.export`) and an idempotent :meth:`PoolMemory.close`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Literal

if TYPE_CHECKING:
    import torch

MemoryKind = Literal["fabric", "device", "posix_fd", "host"]
HandleKind = Literal["fd", "posix_fd", "cuda_ipc", "fabric"]

MEMORY_KINDS: Final[tuple[MemoryKind, ...]] = ("fabric", "device", "posix_fd", "host")

#: How executors map each memory kind (``Attached.handle_kind``):
#: - ``"fd"``: host memory; one memfd arrives as SCM_RIGHTS, the client ``mmap``s it.
#: - ``"posix_fd"``: CUDA VMM memory; one fd arrives as SCM_RIGHTS, the client imports it
#:   (``cuMemImportFromShareableHandle``) and maps it.
#: - ``"cuda_ipc"``: ``cuMemAlloc`` memory; ``handle`` is the 64-byte ``CUipcMemHandle``.
#: - ``"fabric"``: CUDA fabric memory; ``handle`` is the 64-byte ``CUmemFabricHandle``.
HANDLE_KIND_OF: Final[dict[MemoryKind, HandleKind]] = {
    "host": "fd",
    "posix_fd": "posix_fd",
    "device": "cuda_ipc",
    "fabric": "fabric",
}


@dataclass(frozen=True)
class ExportedHandle:
    """How another process on this node (or NVLink domain) maps a pool.

    ``fds`` stay owned by the pool memory: the sender passes them with SCM_RIGHTS (the
    kernel duplicates them) and must not close them; they are closed by
    :meth:`PoolMemory.close`.
    """

    handle_kind: HandleKind
    handle: bytes = b""
    fds: list[int] = field(default_factory=list)


class PoolMemory(abc.ABC):
    """Memory owned by the daemon for one pool. Backends live in one module each."""

    kind: MemoryKind
    device: int  # CUDA ordinal, -1 for host memory
    nbytes: int  # bytes requested (the pool's size)
    map_bytes: int  # bytes actually allocated and mapped (>= nbytes: VMM granularity)
    ptr: int  # address of the memory in this process

    @abc.abstractmethod
    def tensor(self) -> torch.Tensor:
        """A ``uint8`` tensor of ``nbytes`` over the memory (CPU or ``cuda:device``), zero-copy.

        Views must not be used after :meth:`close`.
        """

    @abc.abstractmethod
    def export(self) -> ExportedHandle:
        """The handle an executor needs to map this memory (see :data:`HANDLE_KIND_OF`)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Unmap and free everything; idempotent."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""

    def __enter__(self) -> PoolMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"ptr=0x{self.ptr:x}"
        return (
            f"<{type(self).__name__} kind={self.kind} device={self.device} nbytes={self.nbytes}"
            f" map_bytes={self.map_bytes} {state}>"
        )


def check_nbytes(nbytes: int) -> int:
    """Validate a requested pool size (a positive int)."""
    from protocol.errors import BadRequest

    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
        raise BadRequest(f"pool size must be a positive number of bytes, got {nbytes!r}")
    return nbytes
