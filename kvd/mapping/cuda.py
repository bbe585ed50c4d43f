"""Small cuda-python (``cuda.bindings.driver``) helpers shared by the GPU pool backends.

``cuda.bindings.driver`` is imported lazily (:func:`driver`), so CPU-only machines import
:mod:`kvd.pool` without touching CUDA. Every driver call goes through :func:`call`, which turns a
``CUresult`` other than ``CUDA_SUCCESS`` into :class:`CudaCallError` (a
:class:`~protocol.errors.PoolError`) naming the call and the CUDA error, e.g.
``"cuMemCreate: CUDA_ERROR_NOT_PERMITTED"``. Without a driver, cuda-python *raises* from
``cuInit`` instead of returning an error code; :func:`ensure_context` converts that to ``PoolError("no CUDA driver: ...")``.

The CUDA context used is the device's *primary* context, the one torch uses too, so pointers
made here are valid for torch tensors and vice versa.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import TYPE_CHECKING, Any, Literal

from protocol.errors import PoolError

if TYPE_CHECKING:
    import torch

VmmHandleType = Literal["fabric", "posix_fd"]

#: Bytes of a ``CUipcMemHandle`` and of a ``CUmemFabricHandle``.
IPC_HANDLE_SIZE = 64
FABRIC_HANDLE_SIZE = 64

_contexts: dict[int, Any] = {}
_contexts_lock = threading.Lock()


class CudaCallError(PoolError):
    """A CUDA driver call failed. ``call`` is the function, ``error`` the CUDA error name."""

    def __init__(self, call: str, error: str, detail: str = "") -> None:
        msg = f"{call}: {error}" + (f" ({detail})" if detail else "")
        super().__init__(msg)
        self.call = call
        self.error = error


def driver() -> Any:
    """``cuda.bindings.driver``, imported on first use."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:  # pragma: no cover - cuda-bindings is a dependency
        raise PoolError(f"cuda-python (cuda-bindings) is not installed: {exc}") from None
    return cu


def error_name(err: Any) -> str:
    """``"CUDA_ERROR_NOT_PERMITTED"`` for a ``CUresult``."""
    name = getattr(err, "name", None)
    return name if isinstance(name, str) else str(err)


def _error_string(err: Any) -> str:
    try:
        res = driver().cuGetErrorString(err)
        if res[0] == driver().CUresult.CUDA_SUCCESS and res[1]:
            text = res[1]
            return text.decode() if isinstance(text, bytes) else str(text)
    except Exception:
        pass
    return ""


def check(result: Any, call: str) -> Any:
    """Unpack a cuda-python result tuple ``(CUresult, *values)``.

    Returns ``None`` for no value, the value for one, a tuple for several; raises
    :class:`CudaCallError` when the ``CUresult`` is not ``CUDA_SUCCESS``.
    """
    if not isinstance(result, tuple):
        result = (result,)
    err = result[0]
    if err != driver().CUresult.CUDA_SUCCESS:
        raise CudaCallError(call, error_name(err), _error_string(err))
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


def call(name: str, *args: Any) -> Any:
    """Call ``cuda.bindings.driver.<name>(*args)`` and :func:`check` its result."""
    fn = getattr(driver(), name)
    try:
        result = fn(*args)
    except RuntimeError as exc:  # cuda-python raises when the driver library is missing
        raise PoolError(f"{name}: no CUDA driver: {exc}") from None
    return check(result, name)


def ensure_context(device: int) -> None:
    """Initialise the driver and make ``device``'s primary context current in this thread."""
    cu = driver()
    if device < 0:
        raise PoolError(f"no CUDA device for ordinal {device}")
    try:
        result = cu.cuInit(0)
    except RuntimeError as exc:
        raise PoolError(f"no CUDA driver: {exc}") from None
    check(result, "cuInit")
    with _contexts_lock:
        ctx = _contexts.get(device)
        if ctx is None:
            count = int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))
            if device >= count:
                raise PoolError(f"CUDA device {device} does not exist ({count} visible)")
            dev = check(cu.cuDeviceGet(device), "cuDeviceGet")
            ctx = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            _contexts[device] = ctx
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def device_attribute(device: int, name: str) -> int:
    """``cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_<name>, device)``."""
    cu = driver()
    attr = getattr(cu.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
    return int(call("cuDeviceGetAttribute", attr, device))


# --- VMM (cuMemCreate / map) ---------------------------------------------------------------


def handle_type(kind: VmmHandleType) -> Any:
    """The ``CUmemAllocationHandleType`` of a VMM kind."""
    h = driver().CUmemAllocationHandleType
    return h.CU_MEM_HANDLE_TYPE_FABRIC if kind == "fabric" else h.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def vmm_prop(device: int, kind: VmmHandleType) -> Any:
    """A ``CUmemAllocationProp`` for pinned device memory on ``device`` exportable as ``kind``.

    Marked GPUDirect-RDMA capable where the device supports RDMA on VMM memory (so NICs can
    register it for NIXL).
    """
    cu = driver()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = handle_type(kind)
    try:
        rdma = device_attribute(device, "GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED")
    except (PoolError, AttributeError):
        rdma = 0
    if rdma:
        prop.allocFlags.gpuDirectRDMACapable = 1
    return prop


def granularity(prop: Any) -> int:
    """Minimum VMM allocation granularity for ``prop`` (2 MiB on H200)."""
    cu = driver()
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(call("cuMemGetAllocationGranularity", prop, flag))


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def access_desc(device: int) -> Any:
    """Read/write access for ``device``."""
    cu = driver()
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def reserve_and_map(handle: Any, size: int, devices: list[int]) -> int:
    """Reserve ``size`` bytes of address space, map ``handle`` there, grant ``devices`` access.

    Returns the address; on failure nothing stays reserved or mapped.
    """
    ptr = call("cuMemAddressReserve", size, 0, 0, 0)
    mapped = False
    try:
        call("cuMemMap", ptr, size, 0, handle, 0)
        mapped = True
        descs = [access_desc(d) for d in devices]
        call("cuMemSetAccess", ptr, size, descs, len(descs))
    except BaseException:
        if mapped:
            quiet_call("cuMemUnmap", ptr, size)
        quiet_call("cuMemAddressFree", ptr, size)
        raise
    return int(ptr)


def unmap_and_free(ptr: int, size: int) -> None:
    """Undo :func:`reserve_and_map` (the allocation handle is released separately)."""
    cu = driver()
    dptr = cu.CUdeviceptr(ptr)
    quiet_call("cuMemUnmap", dptr, size)
    quiet_call("cuMemAddressFree", dptr, size)


def release(handle: Any) -> None:
    """``cuMemRelease`` a generic allocation handle, ignoring errors (cleanup path)."""
    quiet_call("cuMemRelease", handle)


def quiet_call(name: str, *args: Any) -> None:
    """Call for cleanup: errors are logged (``pool.cuda_cleanup_failed``), never raised."""
    try:
        call(name, *args)
    except PoolError as exc:
        import structlog

        structlog.get_logger("kvd.pool").warning("pool.cuda_cleanup_failed", call=name, error=str(exc))


def memset_zero(ptr: int, nbytes: int) -> None:
    """Zero ``nbytes`` at device address ``ptr`` and wait for it."""
    call("cuMemsetD8", driver().CUdeviceptr(ptr), 0, nbytes)
    call("cuCtxSynchronize")


# --- shareable handles as bytes ------------------------------------------------------------


def ipc_handle_to_bytes(handle: Any) -> bytes:
    """The 64 bytes of a ``CUipcMemHandle`` (its ``reserved`` field)."""
    reserved = getattr(handle, "reserved", None)
    if reserved is not None:
        return bytes(reserved)[:IPC_HANDLE_SIZE]
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_SIZE)


def ipc_handle_from_bytes(data: bytes) -> Any:
    """A ``CUipcMemHandle`` holding ``data`` (64 bytes)."""
    if len(data) != IPC_HANDLE_SIZE:
        raise PoolError(f"CUDA IPC handle must be {IPC_HANDLE_SIZE} bytes, got {len(data)}")
    handle = driver().CUipcMemHandle()
    if hasattr(handle, "reserved"):
        handle.reserved = data
    else:
        ctypes.memmove(handle.getPtr(), data, IPC_HANDLE_SIZE)
    return handle


def fabric_handle_to_bytes(handle: Any) -> bytes:
    """The 64 bytes of a ``CUmemFabricHandle``."""
    return bytes(handle.data)[:FABRIC_HANDLE_SIZE]


def fabric_handle_from_bytes(data: bytes) -> Any:
    """A ``CUmemFabricHandle`` holding ``data`` (64 bytes)."""
    if len(data) != FABRIC_HANDLE_SIZE:
        raise PoolError(f"fabric handle must be {FABRIC_HANDLE_SIZE} bytes, got {len(data)}")
    handle = driver().CUmemFabricHandle()
    handle.data = data
    return handle


def import_vmm(os_handle: Any, kind: VmmHandleType) -> Any:
    """``cuMemImportFromShareableHandle``: an fd (``posix_fd``) or a ``CUmemFabricHandle``.

    cuda-python passes ``osHandle`` as a ``void*``: the fd's value for POSIX fds, the address of
    the 64-byte handle for fabric handles.
    """
    arg = os_handle.getPtr() if kind == "fabric" else int(os_handle)
    return call("cuMemImportFromShareableHandle", arg, handle_type(kind))


# --- torch views ---------------------------------------------------------------------------


class CudaArray:
    """A ``__cuda_array_interface__`` (v3) over raw device bytes, for ``torch.as_tensor``.

    torch keeps a reference to this object for as long as any tensor over it lives, which
    :func:`views_alive` uses to notice views that outlive the memory.
    """

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def cuda_tensor(ptr: int, nbytes: int, device: int) -> tuple[torch.Tensor, CudaArray]:
    """A zero-copy ``uint8`` CUDA tensor over ``nbytes`` at ``ptr`` and its interface object."""
    import torch

    arr = CudaArray(ptr, nbytes)
    with torch.cuda.device(device):
        t = torch.as_tensor(arr, device=torch.device("cuda", device))
    if t.data_ptr() != ptr:  # as_tensor copied (the pointer belongs to another device)
        raise PoolError(f"torch could not view device memory 0x{ptr:x} as a cuda:{device} tensor")
    return t, arr


def views_alive(arr: CudaArray) -> bool:
    """Whether tensors over ``arr`` still exist (once the caller has dropped its own)."""
    # getrefcount's argument + the caller's variable
    return sys.getrefcount(arr) > 3
