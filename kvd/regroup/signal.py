"""Completion tokens stored by a GPU stream after the work enqueued before them.

The mapped path's regroup kernel writes a request into the gen daemon's pools; right after it
(after its landed event, :mod:`kvd.regroup.landed`) the ctx daemon enqueues
stores of the request's completion tokens into the completion pages (:mod:`kvd.mapping.words`)
of both daemons: by default a one-thread kernel launched behind the regroup kernel
(:func:`store_by_kernel`, which fences at system scope before it stores), or
``cuStreamWriteValue64`` stream memory operations (:func:`store_after`, with a memory barrier
before the store). Either runs once the work before it on the stream has finished: an executor
that reads its token finds every byte of the request in place. The pages are host memory
registered with CUDA (:func:`register_host`).
"""

from __future__ import annotations

import threading
from typing import Any

import structlog

from kvd.regroup.kernel import KernelError, _check, _driver, _primary_context, kernel_for

log = structlog.get_logger("kvd.regroup")

_registered: dict[int, int] = {}  # host address -> device address, for unregister
_lock = threading.Lock()


def register_host(address: int, nbytes: int, device: int) -> int:
    """Register ``nbytes`` of host memory at ``address`` with CUDA (pinned, mapped into every
    context: portable) and return the address GPU work uses for it. Blocks (a worker thread's);
    raises :class:`KernelError` when the driver refuses."""
    cu = _driver()
    ctx = _primary_context(device)
    _check(cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        flags = cu.CU_MEMHOSTREGISTER_PORTABLE | cu.CU_MEMHOSTREGISTER_DEVICEMAP
        _check(cu.cuMemHostRegister(address, nbytes, flags), "cuMemHostRegister")
        try:
            dptr = int(_check(cu.cuMemHostGetDevicePointer(address, 0), "cuMemHostGetDevicePointer"))
        except BaseException:
            cu.cuMemHostUnregister(address)
            raise
    finally:
        cu.cuCtxPopCurrent()
    with _lock:
        _registered[address] = dptr
    return dptr


def unregister_host(address: int) -> None:
    """Undo :func:`register_host` (no store into it may be pending)."""
    with _lock:
        if _registered.pop(address, None) is None:
            return
    _driver().cuMemHostUnregister(address)


def store_after(ctx: Any, stream: int, stores: list[tuple[int, int]]) -> None:
    """Enqueue ``(device address, value)`` 64-bit stores on ``stream`` of context ``ctx``,
    each after everything enqueued there before it. Raises :class:`KernelError`."""
    cu = _driver()
    _check(cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        st = cu.CUstream(stream)
        for addr, value in stores:
            _check(cu.cuStreamWriteValue64(st, cu.CUdeviceptr(addr), value, 0), "cuStreamWriteValue64")
    finally:
        cu.cuCtxPopCurrent()


def store_by_kernel(device: int, stream: int, stores: list[tuple[int, int]]) -> None:
    """The same stores as :func:`store_after`, by a one-thread kernel launched on ``stream``
    of ``device`` (``kvd_store_tokens``): a launch behind the regroup kernel, where the driver
    emulates stream memory operations. Raises :class:`KernelError` (also when the regroup
    kernel is not loaded there)."""
    k = kernel_for(device)
    if k is None:
        raise KernelError(f"the regroup kernel is not loaded on device {device}")
    k.store_tokens(stream, stores)


__all__ = ["KernelError", "register_host", "store_after", "store_by_kernel", "unregister_host"]
