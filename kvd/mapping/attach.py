"""Map a kvd pool into an executor process.

The daemon answers ``AttachPool`` with :class:`~protocol.messages.Attached` (plus fds as
SCM_RIGHTS for fd-shared kinds); :func:`map_pool` turns that into a :class:`MappedPool` whose
``tensor`` writes straight into the daemon's memory, shaped ``attached.pool.shape`` with dtype
``attached.pool.dtype``:

============  ==========================================================  ===========
handle_kind   how it is mapped                                            tensor
============  ==========================================================  ===========
``fd``        host memfd, ``mmap`` (shared, read/write)                   CPU
``posix_fd``  ``cuMemImportFromShareableHandle`` + reserve/map/access      ``cuda:N``
``cuda_ipc``  ``cuIpcOpenMemHandle`` (lazy peer access)                    ``cuda:N``
``fabric``    64-byte fabric handle, imported + reserve/map/access         ``cuda:N``
============  ==========================================================  ===========

GPU pools are mapped on ``device`` (default: the pool's own ordinal, ``attached.pool.device``;
pass it when this process sees the GPUs under other ordinals, e.g. another
``CUDA_VISIBLE_DEVICES``). A ``cuda_ipc`` handle cannot be opened in the process that exported
it (CUDA's rule), i.e. not inside the daemon.

Lifetime: :meth:`MappedPool.close` (idempotent) unmaps the memory. The tensors must not be used
afterwards: for GPU pools the memory is gone (a warning ``pool.views_alive_at_close`` is logged
if views still exist); for host pools the mapping is released when the last view is, so a
stale view cannot crash the process, but its blocks may belong to another session by then.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Sequence
from typing import Any

import structlog
import torch

from kvd.mapping import cuda
from kvd.mapping.host import map_fd
from kvd.mapping.views import typed_view
from protocol.errors import PoolError
from protocol.messages import Attached, PoolInfo

log = structlog.get_logger("kvd.pool")

__all__ = ["MappedPool", "map_pool"]


class MappedPool:
    """A pool mapped into this process (see :func:`map_pool`)."""

    def __init__(
        self,
        attached: Attached,
        raw: torch.Tensor,
        *,
        device: int,
        ptr: int,
        closer: Callable[[], None],
    ) -> None:
        self.info: PoolInfo = attached.pool
        self.name = attached.pool.name
        self.kind = attached.pool.kind
        self.handle_kind = attached.handle_kind
        self.device = device
        self.nbytes = raw.numel()
        self.map_bytes = attached.map_bytes or self.nbytes
        self.ptr = ptr
        self._raw: torch.Tensor | None = raw
        shape = tuple(attached.pool.shape)
        self._tensor: torch.Tensor | None = typed_view(raw, attached.pool.dtype, shape) if shape else raw
        self._closer: Callable[[], None] | None = closer

    @property
    def closed(self) -> bool:
        return self._closer is None

    @property
    def tensor(self) -> torch.Tensor:
        """The pool, shaped ``info.shape`` with dtype ``info.dtype``, over kvd's memory."""
        if self._tensor is None:
            raise PoolError(f"pool {self.name!r} is no longer mapped (closed)")
        return self._tensor

    @property
    def raw(self) -> torch.Tensor:
        """The pool's bytes as a flat uint8 tensor (``info.pool_bytes`` long)."""
        if self._raw is None:
            raise PoolError(f"pool {self.name!r} is no longer mapped (closed)")
        return self._raw

    def close(self) -> None:
        """Unmap (idempotent). The tensors must not be used afterwards."""
        closer, self._closer = self._closer, None
        if closer is None:
            return
        self._tensor = None
        self._raw = None
        closer()

    def __enter__(self) -> MappedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"ptr=0x{self.ptr:x}"
        return (
            f"<MappedPool {self.name!r} kind={self.kind} device={self.device} nbytes={self.nbytes} {state}>"
        )


def map_pool(attached: Attached, fds: Sequence[int], *, device: int | None = None) -> MappedPool:
    """Map the pool described by ``attached`` into this process.

    Takes ownership of ``fds`` (the SCM_RIGHTS fds that came with the reply): they are closed
    before this returns, whether mapping worked or not (the mapping keeps what it needs).
    Raises :class:`PoolError` naming the cause when the handle cannot be mapped.
    """
    try:
        return _map(attached, list(fds), device)
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _one_fd(attached: Attached, fds: list[int]) -> int:
    if len(fds) != 1:
        raise PoolError(
            f"pool {attached.pool.name!r}: handle kind {attached.handle_kind!r} needs exactly one fd, got {len(fds)}"
        )
    return fds[0]


def _map(attached: Attached, fds: list[int], device: int | None) -> MappedPool:
    info = attached.pool
    nbytes = info.pool_bytes or attached.map_bytes
    map_bytes = max(attached.map_bytes, nbytes)
    kind = attached.handle_kind
    if nbytes < 1:
        raise PoolError(f"pool {info.name!r}: Attached reply gives no size")
    if kind == "fd":
        mm, raw = map_fd(_one_fd(attached, fds), nbytes, map_bytes)
        holder: list[mmap.mmap] = [mm]
        del mm

        def close_host() -> None:
            # unmapped now if no view is left, else when the last view goes (never dangling)
            holder.pop()

        return MappedPool(attached, raw, device=-1, ptr=raw.data_ptr(), closer=close_host)

    if kind not in ("posix_fd", "cuda_ipc", "fabric"):
        raise PoolError(f"pool {info.name!r}: unknown handle kind {kind!r}")
    dev = info.device if device is None else device
    if dev < 0:
        raise PoolError(f"pool {info.name!r}: a {kind} handle needs a CUDA device, got {dev}")
    cuda.ensure_context(dev)
    if kind == "cuda_ipc":
        if fds:
            raise PoolError(f"pool {info.name!r}: a cuda_ipc handle comes without fds, got {len(fds)}")
        return _map_ipc(attached, nbytes, dev)
    if kind == "posix_fd":
        handle = cuda.import_vmm(_one_fd(attached, fds), "posix_fd")
    else:
        if fds:
            raise PoolError(f"pool {info.name!r}: a fabric handle comes without fds, got {len(fds)}")
        handle = cuda.import_vmm(cuda.fabric_handle_from_bytes(attached.handle), "fabric")
    return _map_vmm(attached, handle, nbytes, map_bytes, dev)


def _cuda_closer(
    info: PoolInfo, dev: int, arrs: list[cuda.CudaArray], release: Callable[[], None]
) -> Callable[[], None]:
    def close() -> None:
        arr = arrs.pop()
        if cuda.views_alive(arr):
            log.warning("pool.views_alive_at_close", pool=info.name, kind=info.kind, device=dev)
        del arr
        cuda.ensure_context(dev)
        cuda.quiet_call("cuCtxSynchronize")
        release()

    return close


def _map_ipc(attached: Attached, nbytes: int, dev: int) -> MappedPool:
    info = attached.pool
    cu = cuda.driver()
    handle = cuda.ipc_handle_from_bytes(attached.handle)
    dptr = cuda.call("cuIpcOpenMemHandle", handle, cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
    try:
        raw, arr = cuda.cuda_tensor(int(dptr), nbytes, dev)
    except BaseException:
        cuda.quiet_call("cuIpcCloseMemHandle", dptr)
        raise
    arrs = [arr]
    del arr

    def release() -> None:
        cuda.quiet_call("cuIpcCloseMemHandle", dptr)

    return MappedPool(attached, raw, device=dev, ptr=int(dptr), closer=_cuda_closer(info, dev, arrs, release))


def _map_vmm(attached: Attached, handle: Any, nbytes: int, map_bytes: int, dev: int) -> MappedPool:
    info = attached.pool
    try:
        ptr = cuda.reserve_and_map(handle, map_bytes, [dev])
        try:
            raw, arr = cuda.cuda_tensor(ptr, nbytes, dev)
        except BaseException:
            cuda.unmap_and_free(ptr, map_bytes)
            raise
    except BaseException:
        cuda.release(handle)
        raise
    arrs = [arr]
    del arr

    def release() -> None:
        cuda.unmap_and_free(ptr, map_bytes)
        cuda.release(handle)

    return MappedPool(attached, raw, device=dev, ptr=ptr, closer=_cuda_closer(info, dev, arrs, release))
