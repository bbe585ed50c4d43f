"""CUDA fabric memory (``cuMemCreate`` with ``CU_MEM_HANDLE_TYPE_FABRIC``), handle kind "fabric".

Exported as a 64-byte ``CUmemFabricHandle`` that any GPU of the same NVLink domain (GB200
NVL72, with the IMEX service running) can import: the only memory whose blocks can cross
multi-node NVLink. The device attribute can say "supported" while ``cuMemCreate`` still fails
(H200 without IMEX: attribute 1, ``CUDA_ERROR_NOT_PERMITTED``), so :func:`probe_fabric` tries
the real thing: allocate, export, import back and map.
"""

from __future__ import annotations

from typing import Any

from kvd.mapping import cuda
from kvd.pool.base import ExportedHandle
from kvd.pool.vmm import VmmMemory
from protocol.errors import PoolError


class FabricMemory(VmmMemory):
    """Fabric memory on GPU ``device``; :meth:`export` gives the 64-byte fabric handle."""

    handle_type = "fabric"
    _fabric: bytes = b""

    def _export_init(self, handle: Any) -> None:
        fh = cuda.call("cuMemExportToShareableHandle", handle, cuda.handle_type("fabric"), 0)
        self._fabric = cuda.fabric_handle_to_bytes(fh)

    def _export_close(self) -> None:
        self._fabric = b""

    def export(self) -> ExportedHandle:
        if self._closed:
            raise PoolError(f"fabric pool {self.name!r} is closed")
        return ExportedHandle(handle_kind="fabric", handle=self._fabric)


def probe_fabric(device: int) -> str | None:
    """Allocate one granule of fabric memory on ``device``, export it, import it back and map it.

    Returns ``None`` when all of that works, else the error text (e.g.
    ``"cuMemCreate: CUDA_ERROR_NOT_PERMITTED (operation not permitted)"`` or
    ``"no CUDA driver: ..."``). Everything allocated is released either way.
    """
    handle: Any = None
    imported: Any = None
    ptr = 0
    size = 0
    try:
        cuda.ensure_context(device)
        prop = cuda.vmm_prop(device, "fabric")
        size = cuda.granularity(prop)
        handle = cuda.call("cuMemCreate", size, prop, 0)
        exported = cuda.call("cuMemExportToShareableHandle", handle, cuda.handle_type("fabric"), 0)
        fh = cuda.fabric_handle_from_bytes(cuda.fabric_handle_to_bytes(exported))
        imported = cuda.import_vmm(fh, "fabric")
        ptr = cuda.reserve_and_map(imported, size, [device])
        cuda.memset_zero(ptr, size)
    except PoolError as exc:
        return exc.message
    except Exception as exc:  # an unexpected cuda-python failure is a probe failure too
        return f"{type(exc).__name__}: {exc}"
    finally:
        if ptr:
            cuda.unmap_and_free(ptr, size)
        if imported is not None:
            cuda.release(imported)
        if handle is not None:
            cuda.release(handle)
    return None
