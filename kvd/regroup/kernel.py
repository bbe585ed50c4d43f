"""The regroup kernel: one CUDA launch moves a request's bytes from one source rank to all its
destination ranks (or one bounce chunk into / out of a staging buffer).

CUDA C below, compiled with NVRTC (``cuda.bindings.nvrtc``) on first use for the device's arch,
the cubin cached on disk per (source hash, NVRTC version, arch) under ``$KVD_KERNEL_CACHE``, else
``$XDG_CACHE_HOME/kvd``, else ``~/.cache/kvd``; loaded once per device with ``cuModuleLoadData``
into the device's primary context (the one torch uses) and launched with ``cuLaunchKernel`` on
the caller's stream.

What one launch does. The host packs, per pair, a descriptor of the pair's run grid
(:class:`~kvd.regroup.table.PairGrid`: digit counts and byte strides on each side, the block
offset tables, the range of the stream to move, the pointers) into one int64 table, uploaded in
one small host-to-device copy. The work is cut into *tiles* of about ``tile_bytes``: a tile is
``R`` whole runs (short runs) or one segment of a run (long runs); one thread block per tile.
Inside a block, groups of ``G`` threads (``G`` a power of two, sized to the run) take one run
each: the group decodes the run's digits once (32-bit divisions, a table lookup for the block
digit) and copies it with ``W``-byte accesses, 4 loads in flight per thread. ``W`` is 16 when
every offset, the run, the range and the pointers are 16-byte aligned, else the widest of 8, 4,
2, 1 that is. A *packed* side (staging buffer) is addressed linearly in stream order: that is
the gather (pool -> packed) and scatter (packed -> pool) of the bounce path; pool -> pool is the
mapped/local path, where the destination pointers may be a peer GPU's memory (peer access is
enabled on first use; memory mapped over CUDA IPC / VMM is addressable as it is).

If cuda-python, NVRTC or the compile is missing or fails, :func:`kernel_for` returns None and
logs ``regroup.kernel_unavailable`` once per device with the reason, and callers use the torch
path. ``KVD_KERNEL=0`` turns the kernel off; ``KVD_KERNEL_ARCH=sm_XY`` overrides the arch.
Small launch tables go as the kernel's parameter (:data:`PARAM_TABLES`;
``KVD_KERNEL_PARAM_TABLES=0`` sends them through device memory instead).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from kvd.ops.steptrace import mark
from kvd.regroup.pinned import PinnedTables
from kvd.regroup.table import MAX_DIGITS, PairGrid

__all__ = [
    "SOURCE",
    "DriverEvent",
    "KernelError",
    "PairLaunch",
    "RegroupKernel",
    "cache_dir",
    "compile_cubin",
    "kernel_available",
    "kernel_for",
    "kernel_ready",
    "pack",
    "reset",
]

log = structlog.get_logger("kvd.regroup")

ENV_CACHE = "KVD_KERNEL_CACHE"
ENV_ARCH = "KVD_KERNEL_ARCH"
ENV_SWITCH = "KVD_KERNEL"
#: Threads per block (the kernel's __launch_bounds__).
THREADS = 256
#: Default bytes per tile (one thread block).
TILE_BYTES = 16 << 10
#: Bytes of launch tables a device's table pool keeps between launches.
TABLE_POOL_KEEP = 64 << 20
#: A launch table of at most this many int64 words can go as the kernel's parameter
#: (``kvd_regroup_small``, 4 KiB with its pair count) instead of through device memory: no
#: allocation, host-to-device copy and free per launch. Measured on the H200 host (a probe of
#: the driver calls alone): after 2 ms without a launch, as between a daemon's requests, those
#: three calls took ~38 us (~7 us back to back), of a launch's ~140 us of host time.
SMALL_WORDS = 511
#: A table of at most this many words goes as the 32 KiB parameter of ``kvd_regroup_large``
#: (CUDA 12.1 and sm_70 on; 32760 bytes with its pair count, of the 32764 allowed): a
#: 256-block TP1 -> TP4 request's table is 2192 words. In the 256-block step trace on one H200
#: (docs/timeline-h200-1gpu-session11-256blocks.txt) the allocation and copy of such a table
#: took 84 us of a 1.5 ms request.
LARGE_WORDS = 4094
#: Token stores one launch of ``kvd_store_tokens`` takes (:meth:`RegroupKernel.store_tokens`).
MAX_TOKEN_STORES = 8
ENV_PARAM_TABLES = "KVD_KERNEL_PARAM_TABLES"
#: Whether small tables go as the parameter (on unless ``KVD_KERNEL_PARAM_TABLES=0``).
#: tests/gpu/test_regroup_kernel.py runs every layout kind both ways; on one H200
#: (docs/launch-cost-h200-session11-*.txt) it took the launch's host time from 35 to 23 us back
#: to back and from 141 to 62 us after 2 ms of stream queries.
PARAM_TABLES = os.environ.get(ENV_PARAM_TABLES, "1").strip().lower() not in ("0", "off", "false", "no")

# Descriptor fields (int64 each), one record of NF per pair.
NF = 36
F_SRC, F_DST, F_W, F_U, F_ULO, F_UHI, F_SPACK, F_DPACK = range(8)
F_NDIG, F_TABD, F_STAB, F_DTAB, F_TILE0, F_R, F_S, F_G = range(8, 16)
F_SEGU, F_J0, F_JEND = 16, 17, 18
F_CNT, F_SSTR, F_DSTR = 20, 25, 30

SOURCE = r"""
typedef long long i64;
typedef unsigned int u32;
#define NF 36

__device__ __forceinline__ i64 imax(i64 a, i64 b) { return a > b ? a : b; }
__device__ __forceinline__ i64 imin(i64 a, i64 b) { return a < b ? a : b; }

// Copy units [k0, k1) of W-byte vectors; the G lanes of a group stride by G, 4 loads in flight.
template <typename V>
__device__ __forceinline__ void copy_units(const char* __restrict__ s, char* __restrict__ d,
                                           i64 k0, i64 k1, int lane, int G) {
  const V* __restrict__ sv = reinterpret_cast<const V*>(s);
  V* __restrict__ dv = reinterpret_cast<V*>(d);
  i64 k = k0 + lane;
  const i64 g = G;
  for (; k + 3 * g < k1; k += 4 * g) {
    V a = sv[k]; V b = sv[k + g]; V c = sv[k + 2 * g]; V e = sv[k + 3 * g];
    dv[k] = a; dv[k + g] = b; dv[k + 2 * g] = c; dv[k + 3 * g] = e;
  }
  for (; k < k1; k += g) dv[k] = sv[k];
}

// One tile of a launch: the descriptors of its npairs pairs at desc, their block tables at tab.
__device__ __forceinline__ void regroup_tile(const i64* __restrict__ desc, const i64* __restrict__ tab,
                                             int npairs) {
  __shared__ i64 D[NF];
  const i64 tile = (i64)blockIdx.x + (i64)blockIdx.y * gridDim.x;
  // The pair this tile belongs to: the last one whose first tile is <= tile.
  int lo = 0, hi = npairs - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (desc[(i64)mid * NF + 12] <= tile) lo = mid; else hi = mid - 1;
  }
  if (threadIdx.x < NF) D[threadIdx.x] = desc[(i64)lo * NF + threadIdx.x];
  __syncthreads();
  const i64 t = tile - D[12];
  const i64 U = D[3], ulo = D[4], uhi = D[5];
  const i64 R = D[13], S = D[14], segu = D[16], j0 = D[17], jend = D[18];
  if (t < 0) return;
  i64 jf, jl, sl, sh;
  if (S > 1) {
    jf = j0 + t / S;
    if (jf >= jend) return;
    jl = jf + 1;
    sl = (t - (jf - j0) * S) * segu;
    sh = imin(U, sl + segu);
  } else {
    jf = j0 + t * R;
    jl = imin(jf + R, jend);
    sl = 0;
    sh = U;
  }
  const int W = (int)D[2];
  const int nd = (int)D[8], tabd = (int)D[9];
  const bool spack = D[6] != 0, dpack = D[7] != 0;
  const char* sbase = reinterpret_cast<const char*>(D[0]);
  char* dbase = reinterpret_cast<char*>(D[1]);
  const int G = (int)D[15];
  const int grp = threadIdx.x / G, lane = threadIdx.x - grp * G, ngrp = blockDim.x / G;
  for (i64 j = jf + grp; j < jl; j += ngrp) {
    const i64 k0 = imax(sl, ulo - j * U), k1 = imin(sh, uhi - j * U);
    if (k0 >= k1) continue;
    i64 so = 0, dof = 0;
    u32 r = (u32)j;
#pragma unroll
    for (int i = 4; i >= 0; --i) {
      if (i < nd) {
        const u32 c = (u32)D[20 + i];
        const u32 q = r / c;
        const u32 x = r - q * c;
        r = q;
        if (i == tabd) { so += tab[D[10] + x]; dof += tab[D[11] + x]; }
        else { so += (i64)x * D[25 + i]; dof += (i64)x * D[30 + i]; }
      }
    }
    const i64 packed = (j * U - ulo) * W;
    const char* s = sbase + (spack ? packed : so);
    char* d = dbase + (dpack ? packed : dof);
    switch (W) {
      case 16: copy_units<uint4>(s, d, k0, k1, lane, G); break;
      case 8: copy_units<uint2>(s, d, k0, k1, lane, G); break;
      case 4: copy_units<unsigned int>(s, d, k0, k1, lane, G); break;
      case 2: copy_units<unsigned short>(s, d, k0, k1, lane, G); break;
      default: copy_units<unsigned char>(s, d, k0, k1, lane, G); break;
    }
  }
}

// 6 blocks an SM: 40 registers, no spills (80 without the bound: 3 blocks an SM).
extern "C" __global__ void __launch_bounds__(256, 6)
kvd_regroup(const i64* __restrict__ desc, const i64* __restrict__ tab, int npairs) {
  regroup_tile(desc, tab, npairs);
}

// A small launch's whole table travels as the kernel's parameter (4 KiB, the classic limit):
// no device memory, no host-to-device copy. The threads read it where it lies (param space,
// through the constant cache).
#define SMALL_WORDS 511
struct SmallTable { i64 npairs; i64 w[SMALL_WORDS]; };

extern "C" __global__ void __launch_bounds__(256, 6)
kvd_regroup_small(const __grid_constant__ SmallTable t) {
  regroup_tile(t.w, t.w + t.npairs * NF, (int)t.npairs);
}

// A request of up to a few hundred blocks: the same, with the 32 KiB parameter that CUDA 12.1
// and Volta on allow (32764 bytes). Its own entry point, so that a small launch copies 4 KiB
// of parameter and not 32 (the driver copies the declared size). Absent where not allowed:
// the host then sends those tables through device memory.
#define LARGE_WORDS 4094
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700 && \
    (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 1))
struct LargeTable { i64 npairs; i64 w[LARGE_WORDS]; };

extern "C" __global__ void __launch_bounds__(256, 6)
kvd_regroup_large(const __grid_constant__ LargeTable t) {
  regroup_tile(t.w, t.w + t.npairs * NF, (int)t.npairs);
}
#endif

// Completion tokens (kvd.regroup.signal): launched on a stream right after a request's
// regroup kernel, it stores each (address, value) once that kernel's writes are done. The
// kernel boundary orders them before this thread; the system-scope fence makes them visible
// to every process and the host before the stores, which a spinning executor reads from a
// host page. One thread: a few 8-byte stores.
#define MAX_TOKEN_STORES 8
struct TokenStores { i64 n; i64 addr[MAX_TOKEN_STORES]; i64 value[MAX_TOKEN_STORES]; };

extern "C" __global__ void kvd_store_tokens(const __grid_constant__ TokenStores s) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  __threadfence_system();
  const int n = s.n < MAX_TOKEN_STORES ? (int)s.n : MAX_TOKEN_STORES;
  for (int i = 0; i < n; ++i)
    *reinterpret_cast<volatile unsigned long long*>(s.addr[i]) = (unsigned long long)s.value[i];
  __threadfence_system();
}
"""


class KernelError(RuntimeError):
    """The kernel cannot be compiled, loaded or launched here (the reason is the message)."""


# -- NVRTC ---------------------------------------------------------------------------------------


def _nvrtc() -> Any:
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise KernelError(f"cuda-python (cuda.bindings.nvrtc) is not importable: {exc}") from None
    return nvrtc


def _nvrtc_check(res: Any, what: str) -> Any:
    nvrtc = _nvrtc()
    err = res[0]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise KernelError(f"{what}: {getattr(err, 'name', err)}")
    return res[1] if len(res) == 2 else res[1:]


def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor); raises :class:`KernelError` when the library cannot be loaded."""
    nvrtc = _nvrtc()
    try:
        res = nvrtc.nvrtcVersion()
    except Exception as exc:  # cuda-python raises when libnvrtc cannot be found
        raise KernelError(f"NVRTC library not found: {str(exc).splitlines()[0]}") from None
    major, minor = _nvrtc_check(res, "nvrtcVersion")
    return int(major), int(minor)


def _options(arch: str) -> list[bytes]:
    return [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]


def compile_cubin(arch: str) -> bytes:
    """Compile :data:`SOURCE` for ``arch`` (``"sm_90"``) with NVRTC; needs no GPU. Raises
    :class:`KernelError` with NVRTC's log when it fails."""
    nvrtc = _nvrtc()
    nvrtc_version()
    prog = _nvrtc_check(nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"kvd_regroup.cu", 0, [], []), "nvrtcCreateProgram")
    try:
        opts = _options(arch)
        try:
            res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        except Exception as exc:
            raise KernelError(f"nvrtcCompileProgram({arch}): {exc}") from None
        if res[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = _nvrtc_check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            buf = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, buf)
            text = buf.decode(errors="replace").strip("\x00 \n")
            raise KernelError(f"NVRTC compile for {arch} failed: {getattr(res[0], 'name', res[0])}: {text[:500]}")
        size = int(_nvrtc_check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize"))
        data = b" " * size
        _nvrtc_check(nvrtc.nvrtcGetCUBIN(prog, data), "nvrtcGetCUBIN")
        return data
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def cache_dir() -> Path:
    """Where cubins are cached: ``$KVD_KERNEL_CACHE``, ``$XDG_CACHE_HOME/kvd`` or ``~/.cache/kvd``."""
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvd"


def _cache_key(arch: str) -> str:
    major, minor = nvrtc_version()
    h = hashlib.sha256()
    h.update(SOURCE.encode())
    h.update(b"\0".join(_options(arch)))
    h.update(f"nvrtc{major}.{minor}".encode())
    return f"regroup-{h.hexdigest()[:16]}-{arch}.cubin"


def cubin(arch: str) -> bytes:
    """The cubin for ``arch`` from the disk cache, compiling (and caching) it on a miss. An
    unwritable cache directory only costs a compile per process."""
    path = cache_dir() / _cache_key(arch)
    try:
        return path.read_bytes()
    except OSError:
        pass
    data = compile_cubin(arch)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        tmp.write_bytes(data)
        tmp.replace(path)  # atomic: concurrent daemons never read half a file
    except OSError as exc:
        log.debug("regroup.kernel_cache_unwritable", path=str(path), error=str(exc))
    return data


# -- the driver side -------------------------------------------------------------------------------


_cu: Any = None


def _driver() -> Any:
    """cuda-python's driver bindings (imported once: every launch, check and event query asks
    for them, and an import statement per call was ~0.4 us each, a dozen per launch)."""
    global _cu
    if _cu is None:
        try:
            from cuda.bindings import driver as cu
        except ImportError as exc:
            raise KernelError(f"cuda-python (cuda.bindings.driver) is not importable: {exc}") from None
        _cu = cu
    return _cu


def _check(res: Any, what: str) -> Any:
    cu = _driver()
    if not isinstance(res, tuple):
        res = (res,)
    if res[0] != cu.CUresult.CUDA_SUCCESS:
        raise KernelError(f"{what}: {getattr(res[0], 'name', res[0])}")
    if len(res) == 1:
        return None
    return res[1] if len(res) == 2 else res[1:]


def _primary_context(device: int) -> Any:
    cu = _driver()
    try:
        res = cu.cuInit(0)
    except RuntimeError as exc:  # cuda-python raises without a driver
        raise KernelError(f"no CUDA driver: {exc}") from None
    _check(res, "cuInit")
    count = int(_check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))
    if not 0 <= device < count:
        raise KernelError(f"no CUDA device {device} ({count} visible)")
    dev = _check(cu.cuDeviceGet(device), "cuDeviceGet")
    return _check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")


def _arch(device: int) -> str:
    override = os.environ.get(ENV_ARCH)
    if override:
        return override
    cu = _driver()
    attr = cu.CUdevice_attribute
    major = _check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device), "cuDeviceGetAttribute")
    minor = _check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device), "cuDeviceGetAttribute")
    return f"sm_{major}{minor}"


class RegroupKernel:
    """The kernel loaded on one device. Build with :func:`kernel_for`."""

    def __init__(self, device: int) -> None:
        cu = _driver()
        self.device = device
        if os.environ.get(ENV_ARCH):  # compile first: a bad override fails without a GPU too
            self.arch = _arch(device)
            data = cubin(self.arch)
            self.ctx = _primary_context(device)
        else:
            self.ctx = _primary_context(device)
            self.arch = _arch(device)
            data = cubin(self.arch)
        _check(cu.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")  # the caller's context is kept
        try:
            self._module = _check(cu.cuModuleLoadData(data), "cuModuleLoadData")
            self._func = _check(cu.cuModuleGetFunction(self._module, b"kvd_regroup"), "cuModuleGetFunction")
            self._func_small = _check(cu.cuModuleGetFunction(self._module, b"kvd_regroup_small"),
                                      "cuModuleGetFunction")
            self._func_tokens = _check(cu.cuModuleGetFunction(self._module, b"kvd_store_tokens"),
                                       "cuModuleGetFunction")
            res = cu.cuModuleGetFunction(self._module, b"kvd_regroup_large")
            # (absent when this arch or compiler does not allow a 32 KiB parameter)
            self._func_large: Any = res[1] if res[0] == cu.CUresult.CUDA_SUCCESS else None
        finally:
            cu.cuCtxPopCurrent()
        self._peers: dict[int, bool] = {}
        self._lock = threading.Lock()
        self._pool = self._table_pool(cu, device)
        # the launch's parameters (table address, block tables' address, pairs) in one buffer
        # of our own and an array of pointers to them, built once: cuLaunchKernel copies them
        # when called, and building ctypes arguments per launch cost more host time than the
        # launch (measured on the H200 host)
        self._argvals = np.zeros(3, dtype=np.uint64)
        base = self._argvals.__array_interface__["data"][0]
        self._argptrs = np.array([base, base + 8, base + 16], dtype=np.uint64)
        self._argptrs_addr = int(self._argptrs.__array_interface__["data"][0])
        # the 4 KiB and 32 KiB entry points' one parameter each, likewise built once
        self._small, self._small_ptrs, self._small_ptrs_addr = _param_buffer(SMALL_WORDS)
        self._large, self._large_ptrs, self._large_ptrs_addr = _param_buffer(LARGE_WORDS)
        # kvd_store_tokens' parameter: count, MAX_TOKEN_STORES addresses, as many values
        self._tokens, self._tokens_ptrs, self._tokens_ptrs_addr = _param_buffer(2 * MAX_TOKEN_STORES)
        self._args_lock = threading.Lock()
        #: driver stream handles by raw stream number, made on first launch there
        self._handles: dict[int, Any] = {}
        #: completed events, recorded again by later launches (no create/destroy per launch)
        self._events: list[Any] = []
        #: page-locked slots the launch tables are copied from (None: pageable tables only)
        self._pinned: PinnedTables | None = None
        _check(cu.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
        try:
            self._pinned = PinnedTables(cu)
        except OSError as exc:  # speed only: the tables go from pageable memory
            log.info("regroup.pinned_tables_unavailable", device=device, error=str(exc))
        finally:
            cu.cuCtxPopCurrent()

    @staticmethod
    def _table_pool(cu: Any, device: int) -> Any:
        """A stream-ordered memory pool of our own for launch tables that keeps what it has
        (the default pool releases its memory at every synchronisation, and growing it again
        cost ~0.4 ms of host time per launch on H200)."""
        props = cu.CUmemPoolProps()
        props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = device
        pool = _check(cu.cuMemPoolCreate(props), "cuMemPoolCreate")
        _check(
            cu.cuMemPoolSetAttribute(
                pool, cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, cu.cuuint64_t(TABLE_POOL_KEEP)
            ),
            "cuMemPoolSetAttribute",
        )
        return pool

    def enable_peer(self, peer: int) -> bool:
        """Let this device's kernels address ``peer``'s cudaMalloc memory (once per peer)."""
        with self._lock:
            ok = self._peers.get(peer)
            if ok is None:
                cu = _driver()
                try:
                    peer_ctx = _primary_context(peer)
                    _check(cu.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
                    try:
                        res = cu.cuCtxEnablePeerAccess(peer_ctx, 0)
                    finally:
                        cu.cuCtxPopCurrent()
                    err = res[0] if isinstance(res, tuple) else res
                    ok = err in (
                        cu.CUresult.CUDA_SUCCESS,
                        cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
                    )
                    if not ok:
                        log.warning("regroup.peer_access_unavailable", device=self.device, peer=peer,
                                    error=getattr(err, "name", str(err)))
                except KernelError as exc:
                    log.warning("regroup.peer_access_unavailable", device=self.device, peer=peer, error=str(exc))
                    ok = False
                self._peers[peer] = ok
            return ok

    def param_words(self) -> int:
        """The largest table (int64 words) a launch here can take as its parameter."""
        return LARGE_WORDS if self._func_large is not None else SMALL_WORDS

    def table_path(self, words: int) -> str:
        """How :meth:`run` sends a table of ``words`` words by default: ``"small"`` (the 4 KiB
        parameter), ``"large"`` (the 32 KiB one) or ``"device"`` (device memory)."""
        if PARAM_TABLES and words <= SMALL_WORDS:
            return "small"
        if PARAM_TABLES and words <= LARGE_WORDS and self._func_large is not None:
            return "large"
        return "device"

    def run(self, table: npt.NDArray[np.int64], npairs: int, ntiles: int, stream: int, *,
            small: bool | None = None, event: Any = None,
            stores: list[tuple[int, int]] | None = None) -> DriverEvent:
        """Enqueue one launch on the CUDA stream handle ``stream`` (an int, as torch's
        ``Stream.cuda_stream``) over ``ntiles`` tiles; returns an event recorded after it.

        With :data:`PARAM_TABLES`, a table of at most :meth:`param_words` words is the
        launch's parameter (the driver copies it with the launch: two driver calls in all),
        through the 4 KiB entry point when it fits, else the 32 KiB one (:meth:`table_path`).
        Otherwise the table goes to stream-ordered device memory (``cuMemAllocFromPoolAsync``
        from a pool of our own, one host-to-device copy from a page-locked slot, freed after
        the kernel on the same stream). ``small`` forces the parameter (True) or device memory
        (False) (tests); a table too large for the parameter is a :class:`KernelError` then.
        ``event``: a CUDA event of the caller's to record after the launch instead of one of
        the kernel's (a landed event: the caller keeps it, the returned one never frees it).
        ``stores``: completion tokens ``kvd_store_tokens`` stores right after the event, in the
        same context push (:meth:`store_tokens`; a refused token launch is logged, never
        raised: the launch is in flight and the replies still come)."""
        if table.dtype != np.int64 or not table.flags.c_contiguous:
            raise KernelError("a launch table is a contiguous int64 array")
        if small is None:
            how = self.table_path(table.size)
        elif small:
            if table.size > self.param_words():
                raise KernelError(f"a launch table of {table.size} words does not fit the "
                                  f"{self.param_words()}-word parameter")
            how = "small" if table.size <= SMALL_WORDS else "large"
        else:
            how = "device"
        cu = _driver()
        hs = self._handles.get(stream)
        if hs is None:  # (a handle object per stream, kept: building one per launch costs host time)
            if len(self._handles) >= 64:
                self._handles.clear()
            hs = self._handles[stream] = cu.CUstream(stream)
        _check(cu.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
        mark("kernel.pushed", how)
        try:
            ev = self._enqueue_how(cu, how, table, npairs, ntiles, hs, event, small)
            if stores:
                try:
                    self._launch_tokens(cu, hs, stores)
                except KernelError as exc:
                    log.warning("transfer.tokens_not_stored", device=self.device, error=str(exc),
                                fallback="executors wait for their replies")
            return ev
        finally:
            cu.cuCtxPopCurrent()

    def _enqueue_how(self, cu: Any, how: str, table: npt.NDArray[np.int64], npairs: int, ntiles: int, hs: Any,
                     event: Any, small: bool | None) -> DriverEvent:
        """:meth:`run`'s launch by the table path ``how``, in the pushed context."""
        if how == "small":
            return self._enqueue_param(cu, table, npairs, ntiles, hs, self._func_small, self._small,
                                       self._small_ptrs_addr, event)
        if how == "large":
            try:
                return self._enqueue_param(cu, table, npairs, ntiles, hs, self._func_large, self._large,
                                           self._large_ptrs_addr, event)
            except KernelError as exc:
                if small:
                    raise
                # a driver older than the compiler refuses the 32 KiB parameter: nothing
                # was enqueued; say so once and send such tables through device memory
                self._func_large = None
                log.warning("regroup.large_parameter_refused", device=self.device, error=str(exc))
        return self._enqueue(cu, table, npairs, ntiles, hs, event)

    def _enqueue_param(self, cu: Any, table: npt.NDArray[np.int64], npairs: int, ntiles: int, hs: Any,
                       func: Any, buf: npt.NDArray[np.int64], ptrs_addr: int, event: Any = None) -> DriverEvent:
        if ntiles > 0:
            gx, gy = _grid(ntiles)
            with self._args_lock:  # cuLaunchKernel copies the parameter before it returns
                buf[0] = npairs
                buf[1 : 1 + table.size] = table
                _check(cu.cuLaunchKernel(func, gx, gy, 1, THREADS, 1, 1, 0, hs, ptrs_addr, 0), "cuLaunchKernel")
        mark("kernel.launched")
        return DriverEvent(self.ctx, hs, self._events, device=self.device, event=event)

    def _enqueue(self, cu: Any, table: npt.NDArray[np.int64], npairs: int, ntiles: int, hs: Any,
                 event: Any = None) -> DriverEvent:
        nbytes = table.nbytes
        slot = self._pinned.take(table) if self._pinned is not None else None
        host = slot[1] if slot is not None else table.__array_interface__["data"][0]
        try:
            ev = self._enqueue_from(cu, host, nbytes, npairs, ntiles, hs, event)
        except BaseException:
            if slot is not None:
                assert self._pinned is not None
                self._pinned.hold(slot[0], None)  # its copy may be enqueued: never reuse it
            raise
        if slot is not None:
            assert self._pinned is not None
            self._pinned.hold(slot[0], ev)
        return ev

    def _enqueue_from(self, cu: Any, host: int, nbytes: int, npairs: int, ntiles: int, hs: Any,
                      event: Any = None) -> DriverEvent:
        dptr = _check(cu.cuMemAllocFromPoolAsync(nbytes, self._pool, hs), "cuMemAllocFromPoolAsync")
        try:
            _check(cu.cuMemcpyHtoDAsync(dptr, host, nbytes, hs), "cuMemcpyHtoDAsync")
            mark("kernel.table_copied")
            if ntiles > 0:
                gx, gy = _grid(ntiles)
                base = int(dptr)
                with self._args_lock:  # (the int parameter reads the low 4 bytes of its slot)
                    vals = self._argvals
                    vals[0], vals[1], vals[2] = base, base + npairs * NF * 8, npairs
                    _check(cu.cuLaunchKernel(self._func, gx, gy, 1, THREADS, 1, 1, 0, hs, self._argptrs_addr, 0),
                           "cuLaunchKernel")
            mark("kernel.launched")
        finally:
            _check(cu.cuMemFreeAsync(dptr, hs), "cuMemFreeAsync")
        return DriverEvent(self.ctx, hs, self._events, device=self.device, event=event)


    def store_tokens(self, stream: int, stores: list[tuple[int, int]]) -> None:
        """Enqueue one launch of ``kvd_store_tokens`` on ``stream`` (a handle, as in
        :meth:`run`): each ``(device address, value)`` 64-bit store happens once everything
        enqueued before it there has finished (at most :data:`MAX_TOKEN_STORES`). Raises
        :class:`KernelError` (nothing enqueued) when the driver refuses."""
        cu = _driver()
        hs = cu.CUstream(stream)
        _check(cu.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
        try:
            self._launch_tokens(cu, hs, stores)
        finally:
            cu.cuCtxPopCurrent()

    def _launch_tokens(self, cu: Any, hs: Any, stores: list[tuple[int, int]]) -> None:
        """:meth:`store_tokens`' launch, in the pushed context."""
        if not 0 < len(stores) <= MAX_TOKEN_STORES:
            raise KernelError(f"{len(stores)} token stores; a launch takes 1 to {MAX_TOKEN_STORES}")
        with self._args_lock:  # cuLaunchKernel copies the parameter before it returns
            buf = self._tokens
            buf[:] = 0
            buf[0] = len(stores)
            for i, (addr, value) in enumerate(stores):
                buf[1 + i] = _as_i64(addr)
                buf[1 + MAX_TOKEN_STORES + i] = _as_i64(value)
            _check(cu.cuLaunchKernel(self._func_tokens, 1, 1, 1, 32, 1, 1, 0, hs, self._tokens_ptrs_addr, 0),
                   "cuLaunchKernel")
        mark("tokens stored")


def _as_i64(u: int) -> int:
    """An unsigned 64-bit value as the int64 word with the same bits."""
    if not 0 <= u < 1 << 64:
        raise KernelError(f"{u} is not an unsigned 64-bit value")
    return u - (1 << 64) if u >= 1 << 63 else u


def _param_buffer(words: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint64], int]:
    """A parameter-table entry point's one parameter: a buffer of the pair count and ``words``
    table words, the one-pointer array ``cuLaunchKernel`` takes (keep both alive while
    launching) and that array's address."""
    buf = np.zeros(words + 1, dtype=np.int64)
    ptrs = np.array([buf.__array_interface__["data"][0]], dtype=np.uint64)
    return buf, ptrs, int(ptrs.__array_interface__["data"][0])


def _grid(ntiles: int) -> tuple[int, int]:
    """The launch grid of ``ntiles`` tiles, one thread block each: x up to 2^30, then y rows
    (the kernel numbers a tile ``blockIdx.y * gridDim.x + blockIdx.x``; tiles past the last
    pair's end do nothing)."""
    gx = min(ntiles, 1 << 30)
    return gx, -(-ntiles // gx)


#: Completed events a kernel keeps for reuse (more are destroyed).
EVENT_POOL = 64


class DriverEvent:
    """A CUDA event recorded on a stream; :meth:`query` never blocks (``cuEventQuery``).
    ``pool``: completed events of the recording context, taken from and given back to it.
    ``event``: record this event of the caller's instead (never pooled nor destroyed here)."""

    def __init__(self, ctx: Any, stream: Any, pool: list[Any] | None = None, *, device: int = -1,
                 event: Any = None) -> None:
        cu = _driver()
        #: the CUDA device of ``ctx`` (-1: not said)
        self.device = device
        self._borrowed = event is not None
        self._pool = None if self._borrowed else pool
        ev = event
        if ev is None and pool:
            with contextlib.suppress(IndexError):  # another thread took the last one
                ev = pool.pop()
        if ev is None:
            ev = _check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        self._ev: Any = ev
        self._ctx = ctx
        #: the stream it was recorded on (what a landed event after the same work records on)
        self.stream = stream
        try:
            _check(cu.cuEventRecord(self._ev, stream), "cuEventRecord")
        except BaseException:
            self._pool = None  # never give back an event in an unknown state
            self._destroy()
            raise

    def query(self) -> bool:
        """True once the work before the event has finished."""
        if self._ev is None:
            return True
        cu = _driver()
        res = cu.cuEventQuery(self._ev)
        err = res[0] if isinstance(res, tuple) else res
        if err == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        if err != cu.CUresult.CUDA_SUCCESS:
            self._pool = None  # a failed event is destroyed, never reused
        _check(res, "cuEventQuery")  # a launch failure surfaces here
        self._destroy()
        return True

    def synchronize(self) -> None:
        """Block until the work before the event has finished."""
        if self._ev is not None:
            res = _driver().cuEventSynchronize(self._ev)
            err = res[0] if isinstance(res, tuple) else res
            if err != _driver().CUresult.CUDA_SUCCESS:
                self._pool = None  # a failed event is destroyed, never reused
            _check(res, "cuEventSynchronize")
            self._destroy()

    def _destroy(self) -> None:
        """Called once the event completed (or failed): back to the pool, else destroyed."""
        ev, self._ev = self._ev, None
        if ev is None or self._borrowed:
            return  # (a borrowed event is its owner's to keep)
        pool, self._pool = self._pool, None
        if pool is not None and len(pool) < EVENT_POOL:
            pool.append(ev)
        else:
            _driver().cuEventDestroy(ev)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the bindings may be gone
            self._destroy()  # the driver releases a pending event once it completes


_kernels: dict[int, RegroupKernel | None] = {}
_kernels_lock = threading.Lock()


def kernel_for(device: int) -> RegroupKernel | None:
    """The kernel loaded on ``device``, or None when it cannot be used there (logged once per
    device as ``regroup.kernel_unavailable`` with the reason; callers take the torch path)."""
    k = _kernels.get(device, False)
    if k is not False:
        return k  # type: ignore[return-value]
    with _kernels_lock:
        if device in _kernels:
            return _kernels[device]
        kernel: RegroupKernel | None = None
        switch = os.environ.get(ENV_SWITCH, "").strip().lower()
        try:
            if switch in ("0", "off", "false", "no"):
                raise KernelError(f"turned off by {ENV_SWITCH}={os.environ[ENV_SWITCH]}")
            kernel = RegroupKernel(device)
        except KernelError as exc:
            log.warning("regroup.kernel_unavailable", device=device, reason=str(exc), fallback="torch")
        except Exception as exc:  # a broken install must cost speed, never a transfer
            log.warning("regroup.kernel_unavailable", device=device, reason=f"{type(exc).__name__}: {exc}",
                        fallback="torch")
        _kernels[device] = kernel
        return kernel


def kernel_ready(device: int) -> bool | None:
    """The verdict for ``device`` if it was reached already (True / False), else None: lets
    an event loop skip a worker-thread hop once the kernel is loaded."""
    k = _kernels.get(device, False)
    return None if k is False else k is not None


def kernel_available(device: int) -> bool:
    """Whether the regroup kernel runs on CUDA device ``device`` (compiling it on first call)."""
    return kernel_for(device) is not None


def reset() -> None:
    """Forget loaded kernels and verdicts (tests; after changing ``KVD_KERNEL*``)."""
    with _kernels_lock:
        _kernels.clear()


# -- packing ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PairLaunch:
    """One pair's part of a launch: stream bytes ``[lo, hi)`` from ``src_ptr`` to ``dst_ptr``.
    A packed side's pointer is the staging address of byte ``lo``; a pool side's, the pool's
    base address."""

    grid: PairGrid
    src_ptr: int
    dst_ptr: int
    lo: int
    hi: int
    src_packed: bool = False
    dst_packed: bool = False


def _pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 1


def _width(p: PairLaunch, align: tuple[int, int] | None = None) -> int:
    """Widest access (16, 8, 4, 2 or 1 bytes) that every address of the launch allows
    (``align``: the pool sides' alignment when not the grid's own)."""
    g = math.gcd(p.grid.run, p.lo, p.hi, 16, p.src_ptr, p.dst_ptr)
    for i, (side, packed) in enumerate((("src", p.src_packed), ("dst", p.dst_packed))):
        if not packed:
            g = math.gcd(g, align[i] if align is not None else p.grid.alignment(side))  # type: ignore[arg-type]
    return 1 << ((g & -g).bit_length() - 1)


@dataclass(frozen=True)
class LaunchTemplate:
    """One launch's descriptors, shared by every request with the same grids' shapes, sizes
    and pools: such requests differ only in their block tables (:meth:`table`). Building the
    descriptors cost ~0.3 ms of host time per launch on the H200 host; filling in tables, a
    few numpy calls. Build with :func:`template`."""

    desc: npt.NDArray[np.int64]
    npairs: int
    tiles: int
    nbytes: int
    #: per descriptor: the largest src / dst table value that keeps the pair inside its pools
    limits: tuple[tuple[int, int], ...]

    #: per-element limits of the block-table part of a table, by the tables' sizes (every
    #: request of a template has the same sizes; a few kept)
    _bounds: dict[tuple[int, ...], npt.NDArray[np.int64]] = field(default_factory=dict, compare=False, repr=False)

    def table(self, tables: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]], *,
              check: bool = True) -> npt.NDArray[np.int64]:
        """The launch table of one request: the descriptors, then its (src, dst) block tables,
        one pair per descriptor in order. Raises ValueError when a table reaches outside its
        pool; ``check=False`` leaves that check to a caller that knows no table can
        (:meth:`within`)."""
        if len(tables) != len(self.limits):
            raise ValueError(f"{len(tables)} pairs of block tables for a template of {len(self.limits)}")
        flat: list[npt.NDArray[np.int64]] = [self.desc]
        for st, dt in tables:
            flat += (st, dt)
        if not check:
            return np.concatenate(flat)
        # one concatenation, then one comparison against every entry's limit (a max per
        # table and a check each cost more than the copy for small requests)
        out = np.concatenate(flat)
        sizes = tuple(a.size for a in flat)
        bound = self._bounds.get(sizes)
        if bound is None:
            if len(self._bounds) >= 8:
                self._bounds.clear()
            flat_limits = np.array([x for lim in self.limits for x in lim], dtype=np.int64)
            bound = self._bounds[sizes] = np.repeat(flat_limits, np.array(sizes[1:], dtype=np.int64))
        if (out[sizes[0]:] > bound).any():
            raise ValueError("a block table reaches outside its pool (the pool is smaller than its layout)")
        return out


def within(tpl: LaunchTemplate, bounds: list[tuple[int, int]]) -> bool:
    """Whether block tables whose values are at most ``bounds`` (per pair, src and dst, in
    the template's order) always keep every pair inside its pools."""
    return len(bounds) == len(tpl.limits) and all(
        s <= ls and d <= ld for (s, d), (ls, ld) in zip(bounds, tpl.limits, strict=True))


def template(
    pairs: list[PairLaunch], align: list[tuple[int, int]], limits: list[tuple[int, int]], tile_bytes: int = TILE_BYTES
) -> LaunchTemplate:
    """The descriptors of a launch of whole-pair ``pairs`` (pool to pool), for every request
    whose block tables are multiples of ``align`` (per pair: src, dst pool-side alignment the
    layouts' strides guarantee) and at most ``limits`` (per pair)."""
    keep = [i for i, p in enumerate(pairs) if p.hi > p.lo]
    table, npairs, tiles = pack([pairs[i] for i in keep], tile_bytes, align=[align[i] for i in keep])
    return LaunchTemplate(desc=table[: npairs * NF].copy(), npairs=npairs, tiles=tiles,
                          nbytes=sum(pairs[i].hi - pairs[i].lo for i in keep),
                          limits=tuple(limits[i] for i in keep))


def pack(
    pairs: list[PairLaunch], tile_bytes: int = TILE_BYTES, *, align: list[tuple[int, int]] | None = None
) -> tuple[npt.NDArray[np.int64], int, int]:
    """The launch table (descriptors, then block tables), the number of pairs in it (empty
    ranges are left out) and the number of tiles. ``align``: per pair, the pool sides'
    alignment to assume instead of the grids' own (a template's, valid for any blocks)."""
    if align is not None:
        align = [a for a, p in zip(align, pairs, strict=True) if p.hi > p.lo]
    pairs = [p for p in pairs if p.hi > p.lo]
    # rows as Python lists, one array at the end: item assignment into a numpy row costs ~0.3 µs
    # a field, and this runs on the event loop for every launch
    rows: list[list[int]] = []
    tables: list[npt.NDArray[np.int64]] = []
    tab_at = 0
    tiles = 0
    for pi, p in enumerate(pairs):
        g = p.grid
        if len(g.counts) > MAX_DIGITS:
            raise KernelError(f"grid has {len(g.counts)} digits, the kernel takes {MAX_DIGITS}")
        if g.nruns >= 1 << 32:
            raise KernelError(f"{g.nruns} runs exceed the kernel's 32-bit run index")
        w = _width(p, align[pi] if align is not None else None)
        u = g.run // w
        ulo, uhi = p.lo // w, p.hi // w
        j0, jend = ulo // u, -(-uhi // u)
        tile_units = max(1, tile_bytes // w)
        if u > tile_units:
            segs, runs_per_tile, seg_units = -(-u // tile_units), 1, tile_units
            ntiles = (jend - j0) * segs
            group = THREADS
        else:
            segs, runs_per_tile, seg_units = 1, max(1, tile_units // u), u
            ntiles = -(-(jend - j0) // runs_per_tile)
            # groups sized to the run (about 4 units a thread), and no more groups than runs
            group = max(min(THREADS, _pow2(max(1, u // 4))), THREADS // (1 << (runs_per_tile - 1).bit_length()))
            group = min(group, THREADS)
        d = [0] * NF
        # a pool side's pointer is moved to the box's first run; a packed side's is byte lo
        d[F_SRC] = p.src_ptr + (0 if p.src_packed else g.src_base)
        d[F_DST] = p.dst_ptr + (0 if p.dst_packed else g.dst_base)
        d[F_W], d[F_U], d[F_ULO], d[F_UHI] = w, u, ulo, uhi
        d[F_SPACK], d[F_DPACK] = int(p.src_packed), int(p.dst_packed)
        d[F_NDIG], d[F_TABD] = len(g.counts), g.table_digit
        d[F_STAB], d[F_DTAB] = tab_at, tab_at + g.src_table.size
        tables += [g.src_table, g.dst_table]
        tab_at += g.src_table.size + g.dst_table.size
        d[F_TILE0], d[F_R], d[F_S], d[F_G] = tiles, runs_per_tile, segs, group
        d[F_SEGU], d[F_J0], d[F_JEND] = seg_units, j0, jend
        n = len(g.counts)
        d[F_CNT : F_CNT + n] = g.counts
        d[F_SSTR : F_SSTR + n] = g.src_strides
        d[F_DSTR : F_DSTR + n] = g.dst_strides
        rows.append(d)
        tiles += ntiles
    desc = np.array(rows, dtype=np.int64).reshape(len(rows), NF)
    flat = np.concatenate([desc.reshape(-1), *tables]) if tables else desc.reshape(-1)
    return np.ascontiguousarray(flat, dtype=np.int64), len(pairs), tiles
