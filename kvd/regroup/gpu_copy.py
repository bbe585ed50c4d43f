"""Regroup copies on the GPU copy engines: 2D and batched memcpy through cuda-python.

The regroup is a strided copy, and the copy engines do strided copies at link speed without
taking an SM from the model (measured on H200: one ``cuMemcpy2DAsync`` per gen rank, 8 KiB rows at a
32 KiB pitch, ran at 393 GB/s GPU0 -> GPU1 against a 386-395 GB/s contiguous ceiling). This
module turns a plan's fragments, or a bounce chunk's pieces, into a few 2D copies and submits
them on a :class:`CopyStream`:

- :func:`gather_2d` / :func:`scatter_2d`: a :class:`~kvd.regroup.stager.Chunk` of the bounce schedule,
  pool -> bounce region and bounce region -> pool;
- :func:`apply_pair_2d`: the direct regroup of one (ctx rank, gen rank) pair, for the mapped
  path (the peer's pool imported here by CUDA IPC / POSIX fd / fabric handle), no bounce.

Grouping (:func:`group_2d`, pure numpy, no per-fragment Python): consecutive fragments of equal
width whose source AND destination offsets advance by the same pitches become one 2D copy;
a copy whose rows are contiguous on both sides becomes one 1D copy. For GPT-OSS-120B
TP1 -> TP4 (TensorRT-LLM block-major pools) that is one copy per block, fewer where the
request's block ids are consecutive on both sides. Pitches stay within ``[width, MAX_PITCH]``
(a fragment list that walks a pool backwards is split rather than given a negative pitch).

Submission: a chunk's / pair's copies are a :class:`Copies2D`, built once and cached (weakly,
per chunk and per plan); for each (source base, destination base) the driver arguments are
prepared once and cached too, so a repeated submission costs one Python loop or one call.
Methods (``method=``):

- ``memcpy2d``: one ``cuMemcpy2DAsync`` per copy through cuda-python, ``CUDA_MEMCPY2D``
  structs built once (building one costs ~1.2 us of Python: cheap, but not per call);
- ``memcpy2d_raw``: the same driver entry point called through ctypes with structs laid out
  in one numpy array (built vectorized, no per-copy Python besides the call);
- ``batch3d``: every copy in ONE ``cuMemcpy3DBatchAsync`` (CUDA >= 12.8), ops built
  vectorized in numpy and passed by pointer through ctypes;
- ``batch3d_py``: the same through cuda-python's list of ``CUDA_MEMCPY3D_BATCH_OP`` objects;
- ``batch1d``: every ROW as a 1D copy in one ``cuMemcpyBatchAsync`` (the per-fragment batch,
  for comparison);
- ``auto``: :data:`AUTO_METHOD` where available, else ``memcpy2d``.

The raw entry points are taken from the driver with ``cuGetProcAddress`` at the ABI of the
driver's CUDA version (13.x: the batch calls have no ``failIdx``; 12.8/12.9: they do), and the
numpy record layouts are checked against cuda-python's own structs in the CPU tests.

Measured (H200 x2, NV18, driver 580 / CUDA 13.0, cuda-bindings 13.3, torch 2.11; GPT-OSS-120B
TP1 -> TP4, 256 random blocks = 576 MiB, 1024 direct 2D copies of 72 x 8 KiB rows, 1032 + 1030
for gather / scatter through 64 MiB chunks; ``python -m kvd.bench.regroup``), GB/s:

======================================  ==========  ==========
path                                    same GPU    GPU0->GPU1
======================================  ==========  ==========
contiguous copy (torch / cuMemcpyAsync)  1900-2030   377-393
torch gather+scatter (kvd.regroup.stager)        760-794     253-262
torch direct (Plan.apply)                738-817     268-287
copy engines, direct, batch3d            159-175     145
copy engines, direct, memcpy2d           90-159      145-147
copy engines, g+s pipelined, batch3d     75-83       98-110
copy engines, direct, batch1d (rows)     2           13.5
======================================  ==========  ==========

Each 2D copy costs the copy engine a fixed ~2.5 us beyond its bytes (576 KiB copies: 147 GB/s
over NVLink; 2.3 MiB copies: 266; one copy per gen rank: 393), and on one GPU
the driver also spends ~5 us of CPU per copy (submission-bound: 89-105 GB/s at 576 KiB). Rows
are not what costs: a 1D row in ``cuMemcpyBatchAsync`` costs ~0.6 us (peer) to ~5 us (same
GPU) each. Spreading copies over several streams (``lanes``) changed nothing (140-145 GB/s
over NVLink with 1-8 lanes; one submitting thread per lane: 230 instead of 170 for the direct
regroup on one GPU, but slower pipelines); having the destination GPU pull over the link was
slower still (53-61). Submission cost per copy: 1.6 us (batch3d) to 2-3.5 us (memcpy2d)
cross-device, 3.5-6.7 us on one GPU. Building the driver
arguments in Python: ``CUDA_MEMCPY2D`` 1.3 us, ``CUDA_MEMCPY3D_BATCH_OP`` 4.6 us each through
cuda-python, 0.03 us each as numpy records (hence the caches).

So with scattered block ids the copy engines lose to torch's index kernels (2x over NVLink,
5x on one GPU); they win only with few, large copies (:attr:`Copies2D.bytes_per_copy` of
several MiB, e.g. consecutive block ids, which :func:`group_2d` merges into one copy), or where
keeping the SMs free for the model matters more than bandwidth. See
:data:`COPY_ENGINE_MIN_COPY_BYTES`.

``cuda.bindings.driver`` is imported lazily: CPU-only machines import this module freely,
and where :func:`available` is False callers use :mod:`kvd.regroup.stager`'s torch path instead.
Every CUDA call is checked; a failure raises :class:`~protocol.errors.TransferError` naming
the call and the CUDA error (``"cuMemcpy2DAsync: CUDA_ERROR_INVALID_VALUE"``).

Addresses are plain ints: a torch tensor's ``data_ptr()`` (torch uses the device's primary
context, which :class:`CopyStream` uses too), a mapped peer pool's address, a bounce region's.
Copies use unified addressing, so source and destination may be on different devices once
peer access is enabled (:func:`enable_peer_access`; VMM mappings get it from ``cuMemSetAccess``).
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from protocol.errors import TransferError

if TYPE_CHECKING:
    from kvd.regroup.plan import Plan
    from kvd.regroup.stager import Chunk

__all__ = [
    "AUTO_METHOD",
    "BATCH_MAX_OPS",
    "COPY_ENGINE_MIN_COPY_BYTES",
    "MAX_PITCH",
    "METHODS",
    "Copies2D",
    "CopyEvent",
    "CopyStream",
    "apply_pair_2d",
    "available",
    "chunk_copies",
    "copy_contiguous",
    "enable_peer_access",
    "expand_2d",
    "gather_2d",
    "group_2d",
    "methods_available",
    "pair_copies",
    "scatter_2d",
]

Int64Array = npt.NDArray[np.int64]
Method = Literal["auto", "memcpy2d", "memcpy2d_raw", "batch3d", "batch3d_py", "batch1d"]
#: Every concrete submission method (``auto`` picks one of them).
METHODS: tuple[str, ...] = ("memcpy2d", "memcpy2d_raw", "batch3d", "batch3d_py", "batch1d")
#: What ``method="auto"`` uses where its entry point exists (else ``memcpy2d``).
AUTO_METHOD = "batch3d"
#: Largest pitch given to one 2D copy (the device's maximum pitch on H200 is 2**31 - 1);
#: fragments further apart are split into separate copies.
MAX_PITCH = (1 << 31) - 1
#: Copies per batch call; a longer list is submitted in several calls.
BATCH_MAX_OPS = 16384
#: Bytes per copy from which the copy engines reach ~90% of NVLink bandwidth (at ~2.5 us of
#: fixed cost a copy; measured on H200): below it, prefer kvd.regroup.stager's torch kernels unless
#: the SMs must stay free.
COPY_ENGINE_MIN_COPY_BYTES = 8 << 20
#: Prepared (base, base, method) submissions kept per :class:`Copies2D`.
_PREPARED_MAX = 8

# Columns of a copy table (M, 6).
SRC, SRC_PITCH, DST, DST_PITCH, WIDTH, HEIGHT = range(6)

_EMPTY = np.zeros((0, 6), dtype=np.int64)

# --- driver access --------------------------------------------------------------------------


def _driver() -> Any:
    """``cuda.bindings.driver``, imported on first use."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:  # pragma: no cover - cuda-bindings is a dependency
        raise TransferError(f"cuda-python (cuda-bindings) is not installed: {exc}") from None
    return cu


def _error_name(err: Any) -> str:
    if isinstance(err, int) and not hasattr(err, "name"):
        try:
            err = _driver().CUresult(err)
        except ValueError:
            return f"CUresult {err}"
    name = getattr(err, "name", None)
    return name if isinstance(name, str) else str(err)


def _check(result: Any, call: str) -> Any:
    """Unpack a cuda-python result ``(CUresult, *values)``; raise :class:`TransferError`
    naming ``call`` and the CUDA error unless it is ``CUDA_SUCCESS``."""
    if not isinstance(result, tuple):
        result = (result,)
    err = result[0]
    if err:  # CUresult is an int enum; CUDA_SUCCESS == 0
        raise TransferError(f"{call}: {_error_name(err)}")
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


_contexts: dict[int, Any] = {}
_contexts_lock = threading.Lock()


def _ensure_context(device: int) -> Any:
    """Make ``device``'s primary context (the one torch uses) current in this thread; return it."""
    cu = _driver()
    with _contexts_lock:
        ctx = _contexts.get(device)
        if ctx is None:
            try:
                res = cu.cuInit(0)
            except Exception as exc:  # cuda-python raises when there is no driver library
                raise TransferError(f"cuInit: no CUDA driver: {exc}") from None
            _check(res, "cuInit")
            count = int(_check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))
            if not 0 <= device < count:
                raise TransferError(f"CUDA device {device} does not exist ({count} visible)")
            dev = _check(cu.cuDeviceGet(device), "cuDeviceGet")
            ctx = _contexts[device] = _check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


def available(device: int = 0) -> bool:
    """Whether copy-engine copies can run on ``device`` here (a driver and that device exist).
    Never raises: False on CPU-only machines."""
    try:
        _ensure_context(device)
    except Exception:
        return False
    return True


def enable_peer_access(device: int, peer: int) -> bool:
    """Let ``device``'s primary context access ``peer``'s memory (``cuCtxEnablePeerAccess``;
    already enabled counts as success). False where the hardware cannot. For copies between
    ordinary allocations (``cudaMalloc``, torch) of two devices; VMM mappings are granted
    access with ``cuMemSetAccess`` instead."""
    if device == peer:
        return True
    cu = _driver()
    _ensure_context(device)
    dev = _check(cu.cuDeviceGet(device), "cuDeviceGet")
    pdev = _check(cu.cuDeviceGet(peer), "cuDeviceGet")
    if not _check(cu.cuDeviceCanAccessPeer(dev, pdev), "cuDeviceCanAccessPeer"):
        return False
    peer_ctx = _ensure_context(peer)
    _ensure_context(device)
    res = cu.cuCtxEnablePeerAccess(peer_ctx, 0)
    err = res[0] if isinstance(res, tuple) else res
    if err and err != cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
        _check(res, "cuCtxEnablePeerAccess")
    return True


# --- raw entry points (ctypes) ----------------------------------------------------------------

_VOID = ctypes.c_void_p
_SIZE = ctypes.c_size_t


class _Raw:
    """Driver entry points called through ctypes, resolved once with ``cuGetProcAddress``."""

    def __init__(self) -> None:
        cu = _driver()
        self.version = 0
        self.memcpy2d: Callable[..., int] | None = None
        self.memcpy_batch: Callable[..., int] | None = None
        self.memcpy3d_batch: Callable[..., int] | None = None
        #: True for the 12.8/12.9 ABI of the batch calls (a ``size_t *failIdx`` argument).
        self.fail_idx = False
        try:
            _check(cu.cuInit(0), "cuInit")  # cuGetProcAddress needs an initialized driver
            self.version = int(_check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
        except Exception:
            return
        self.memcpy2d = self._get("cuMemcpy2DAsync", 4000, ctypes.CFUNCTYPE(ctypes.c_int, _VOID, _VOID))
        if self.version >= 13000:
            ver = 13000
            batch = ctypes.CFUNCTYPE(ctypes.c_int, _VOID, _VOID, _VOID, _SIZE, _VOID, _VOID, _SIZE, _VOID)
            batch3d = ctypes.CFUNCTYPE(ctypes.c_int, _SIZE, _VOID, ctypes.c_ulonglong, _VOID)
        elif self.version >= 12080:
            ver = 12080
            self.fail_idx = True
            batch = ctypes.CFUNCTYPE(
                ctypes.c_int, _VOID, _VOID, _VOID, _SIZE, _VOID, _VOID, _SIZE, _VOID, _VOID
            )
            batch3d = ctypes.CFUNCTYPE(ctypes.c_int, _SIZE, _VOID, _VOID, ctypes.c_ulonglong, _VOID)
        else:
            return
        self.memcpy_batch = self._get("cuMemcpyBatchAsync", ver, batch)
        self.memcpy3d_batch = self._get("cuMemcpy3DBatchAsync", ver, batch3d)

    def _get(self, name: str, version: int, proto: Any) -> Callable[..., int] | None:
        cu = _driver()
        try:
            res = cu.cuGetProcAddress(
                name.encode(), version, cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
            )
        except Exception:
            return None
        if not isinstance(res, tuple) or res[0]:
            return None
        pfn = res[1]
        status = res[2] if len(res) > 2 else None
        if status is not None and int(status) != 0:  # CU_GET_PROC_ADDRESS_SUCCESS
            return None
        addr = int(pfn) if pfn else 0
        if not addr:
            return None
        fn: Callable[..., int] = proto(addr)
        return fn


_raw: _Raw | None = None
_raw_lock = threading.Lock()


def _raw_entry() -> _Raw:
    global _raw
    with _raw_lock:
        if _raw is None:
            _raw = _Raw()
        return _raw


def methods_available() -> list[str]:
    """The submission methods whose driver entry points exist here."""
    cu = _driver()
    raw = _raw_entry()
    out = ["memcpy2d"]
    if raw.memcpy2d is not None:
        out.append("memcpy2d_raw")
    if raw.memcpy3d_batch is not None:
        out.append("batch3d")
    if hasattr(cu, "cuMemcpy3DBatchAsync") and raw.version >= 12080:
        out.append("batch3d_py")
    if raw.memcpy_batch is not None:
        out.append("batch1d")
    return out


def _raise_rc(rc: int, call: str) -> None:
    raise TransferError(f"{call}: {_error_name(rc)}")


# --- streams and events -----------------------------------------------------------------------


class CopyEvent:
    """A CUDA event recorded on a :class:`CopyStream` (timing disabled)."""

    def __init__(self, handle: Any, ctx: Any) -> None:
        self._event = handle
        self._ctx = ctx
        self.handle = int(handle)

    def query(self) -> bool:
        """True once the work recorded before the event has finished."""
        if self._event is None:
            raise TransferError("CopyEvent is closed")
        cu = _driver()
        res = cu.cuEventQuery(self._event)
        err = res[0] if isinstance(res, tuple) else res
        if err == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        _check(res, "cuEventQuery")
        return True

    def synchronize(self) -> None:
        """Block until the event has completed."""
        if self._event is None:
            raise TransferError("CopyEvent is closed")
        _check(_driver().cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        _check(_driver().cuEventSynchronize(self._event), "cuEventSynchronize")

    def close(self) -> None:
        """Destroy the event (idempotent)."""
        if self._event is not None:
            ev, self._event = self._event, None
            _check(_driver().cuEventDestroy(ev), "cuEventDestroy")

    def __enter__(self) -> CopyEvent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CopyStream:
    """An ordered queue of copies on ``device`` (its primary context, the one torch uses):
    ``lanes`` non-blocking CUDA streams that behave as one stream.

    With ``lanes > 1`` each submission is forked over the lanes (lanes 1.. wait for lane 0's
    tail, each lane takes a contiguous slice of the copies, lane 0 then waits for the others),
    so that the copy engines work on several copies at once while the order between
    submissions, :meth:`record`, :meth:`wait` and :meth:`synchronize` stay those of one
    stream. ``threads=True`` submits the lanes' slices from worker threads (the driver's CPU
    time per copy then runs in parallel). Measured on H200, neither raised throughput over
    NVLink (the copy engines' per-copy cost does not overlap across streams): the default is
    one lane. Close it when done (or use ``with``)."""

    def __init__(self, device: int, lanes: int = 1, *, threads: bool = False) -> None:
        cu = _driver()
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        self.device = device
        self.lanes = lanes
        self._ctx = _ensure_context(device)
        flags = int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        no_timing = int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        self._streams: list[Any] = []
        self._events: list[Any] = []
        self._pool: ThreadPoolExecutor | None = None
        try:
            for _ in range(lanes):
                self._streams.append(_check(cu.cuStreamCreate(flags), "cuStreamCreate"))
            if lanes > 1:  # [0]: the fork point on lane 0; [k]: lane k's join point
                for _ in range(lanes):
                    self._events.append(_check(cu.cuEventCreate(no_timing), "cuEventCreate"))
        except TransferError:
            self._destroy()
            raise
        if threads and lanes > 1:
            self._pool = ThreadPoolExecutor(lanes, thread_name_prefix=f"kvd-copy{device}")
        #: Lane handles (``CUstream`` as ints, for ctypes calls and other libraries).
        self.handles = [int(st) for st in self._streams]
        #: Lane 0's handle: the stream that the queue's order is kept on.
        self.handle = self.handles[0]
        self._closed = False

    def __repr__(self) -> str:
        return f"CopyStream(device={self.device}, lanes={self.lanes}, handle=0x{self.handle:x})"

    @property
    def stream(self) -> Any:
        """Lane 0's cuda-python ``CUstream``."""
        if self._closed:
            raise TransferError(f"CopyStream on device {self.device} is closed")
        return self._streams[0]

    def activate(self) -> None:
        """Make the stream's context current in this thread (each submission does)."""
        if self._closed:
            raise TransferError(f"CopyStream on device {self.device} is closed")
        _check(_driver().cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def record(self) -> CopyEvent:
        """Record a new event: it completes when the work enqueued so far has."""
        cu = _driver()
        self.activate()
        ev = _check(cu.cuEventCreate(int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)), "cuEventCreate")
        try:
            _check(cu.cuEventRecord(ev, self._streams[0]), "cuEventRecord")
        except TransferError:
            cu.cuEventDestroy(ev)
            raise
        return CopyEvent(ev, self._ctx)

    def wait(self, event: CopyEvent | int) -> None:
        """Make later work wait for ``event`` (a :class:`CopyEvent` or a raw ``CUevent``
        handle, e.g. ``torch.cuda.Event().cuda_event``)."""
        cu = _driver()
        self.activate()
        ev = event._event if isinstance(event, CopyEvent) else cu.CUevent(event)
        if ev is None:
            raise TransferError("CopyEvent is closed")
        _check(cu.cuStreamWaitEvent(self._streams[0], ev, 0), "cuStreamWaitEvent")

    def query(self) -> bool:
        """True when all work enqueued has finished."""
        cu = _driver()
        res = cu.cuStreamQuery(self.stream)
        err = res[0] if isinstance(res, tuple) else res
        if err == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        _check(res, "cuStreamQuery")
        return True

    def synchronize(self) -> None:
        """Block until all work enqueued has finished."""
        self.activate()
        for st in self._streams:
            _check(_driver().cuStreamSynchronize(st), "cuStreamSynchronize")

    def _fork(self) -> None:
        cu = _driver()
        _check(cu.cuEventRecord(self._events[0], self._streams[0]), "cuEventRecord")
        for st in self._streams[1:]:
            _check(cu.cuStreamWaitEvent(st, self._events[0], 0), "cuStreamWaitEvent")

    def _join(self) -> None:
        cu = _driver()
        for st, ev in zip(self._streams[1:], self._events[1:], strict=True):
            _check(cu.cuEventRecord(ev, st), "cuEventRecord")
            _check(cu.cuStreamWaitEvent(self._streams[0], ev, 0), "cuStreamWaitEvent")

    def _destroy(self) -> None:
        cu = _driver()
        cu.cuCtxSetCurrent(self._ctx)
        errors = []
        for ev in self._events:
            res = cu.cuEventDestroy(ev)
            if res[0]:
                errors.append(res)
        for st in self._streams:
            res = cu.cuStreamDestroy(st)
            if res[0]:
                errors.append(res)
        self._events, self._streams = [], []
        if errors:
            _check(errors[0], "cuStreamDestroy/cuEventDestroy")

    def close(self) -> None:
        """Destroy the streams (idempotent). Work already enqueued still completes."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._destroy()

    def __enter__(self) -> CopyStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- grouping fragments into 2D copies (pure numpy) -------------------------------------------


def group_2d(
    src_off: npt.ArrayLike, dst_off: npt.ArrayLike, width: npt.ArrayLike, max_pitch: int = MAX_PITCH
) -> Int64Array:
    """Group a list of copies ``(src_off[i], dst_off[i], width[i])`` into 2D copies, int64
    (M, 6): ``(src_off, src_pitch, dst_off, dst_pitch, width, height)``. Row ``j`` of copy ``k``
    is ``width`` bytes from ``src_off + j * src_pitch`` to ``dst_off + j * dst_pitch``; copies
    keep the input order (expanding them gives back the input, zero widths dropped).

    Consecutive entries of equal width whose offsets advance by the same (src, dst) pitches,
    both in ``[width, max_pitch]``, join one copy; where neighbouring runs compete for the
    entry between them, a long run wins it (vectorized, no per-entry Python). A copy whose
    rows are contiguous on both sides (pitch == width) is emitted as one row of
    ``width * height`` bytes."""
    so = np.asarray(src_off, dtype=np.int64).reshape(-1)
    do = np.asarray(dst_off, dtype=np.int64).reshape(-1)
    w = np.asarray(width, dtype=np.int64).reshape(-1)
    if not so.size == do.size == w.size:
        raise ValueError("src_off, dst_off and width must have the same length")
    keep = w > 0
    if not keep.all():
        so, do, w = so[keep], do[keep], w[keep]
    n = so.size
    if n == 0:
        return _EMPTY.copy()
    ds = np.zeros(n, dtype=np.int64)
    ds[1:] = np.diff(so)
    dd = np.zeros(n, dtype=np.int64)
    dd[1:] = np.diff(do)
    # valid[i]: entry i may follow entry i-1 in a 2D copy.
    valid = np.zeros(n, dtype=bool)
    wi = w[1:]
    valid[1:] = (
        (wi == w[:-1]) & (ds[1:] >= wi) & (dd[1:] >= wi) & (ds[1:] <= max_pitch) & (dd[1:] <= max_pitch)
    )
    same = np.zeros(n, dtype=bool)
    same[2:] = (ds[2:] == ds[1:-1]) & (dd[2:] == dd[1:-1])
    # Runs: maximal stretches of valid links with equal pitches. The resolution of
    # neighbouring runs follows kvd.regroup.stager._copy2d (one side generalized to two).
    run_start = valid.copy()
    run_start[2:] &= ~(valid[1:-1] & same[2:])
    run_id = np.cumsum(run_start) - 1
    run_len = np.bincount(run_id[valid], minlength=max(int(run_id[-1]) + 1, 0))
    long_ = valid.copy()
    long_[valid] = run_len[run_id[valid]] >= 2
    short = valid & ~long_
    s_start = short.copy()
    s_start[1:] &= ~short[:-1]
    idx = np.arange(n)
    first = np.maximum.accumulate(np.where(s_start, idx, 0))
    shift = np.zeros(n, dtype=np.int64)
    shift[1:] = long_[:-1]
    shift = shift[first]
    link_short = short & ((idx - first) % 2 == shift)
    link_short[:-1] &= ~long_[1:]
    taken = long_ | link_short
    link_long = long_.copy()
    link_long[1:] &= ~(run_start[1:] & taken[:-1])
    start = ~(link_long | link_short)
    start[0] = True
    s = np.flatnonzero(start)
    height = np.diff(np.append(s, n))
    out = np.empty((s.size, 6), dtype=np.int64)
    out[:, SRC] = so[s]
    out[:, DST] = do[s]
    out[:, WIDTH] = w[s]
    out[:, HEIGHT] = height
    out[:, SRC_PITCH] = out[:, WIDTH]
    out[:, DST_PITCH] = out[:, WIDTH]
    tall = height > 1
    st = s[tall]
    out[tall, SRC_PITCH] = so[st + 1] - so[st]
    out[tall, DST_PITCH] = do[st + 1] - do[st]
    flat = tall & (out[:, SRC_PITCH] == out[:, WIDTH]) & (out[:, DST_PITCH] == out[:, WIDTH])
    if flat.any():
        out[flat, WIDTH] *= out[flat, HEIGHT]
        out[flat, SRC_PITCH] = out[flat, WIDTH]
        out[flat, DST_PITCH] = out[flat, WIDTH]
        out[flat, HEIGHT] = 1
    return out


def expand_2d(copies: Int64Array) -> Int64Array:
    """The rows of a copy table (M, 6) as (R, 3) ``(src_off, dst_off, width)``, in order."""
    if copies.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    h = copies[:, HEIGHT]
    rep = np.repeat(np.arange(copies.shape[0]), h)
    j = np.arange(rep.size, dtype=np.int64) - np.repeat(np.cumsum(h) - h, h)
    rows = np.empty((rep.size, 3), dtype=np.int64)
    rows[:, 0] = copies[rep, SRC] + j * copies[rep, SRC_PITCH]
    rows[:, 1] = copies[rep, DST] + j * copies[rep, DST_PITCH]
    rows[:, 2] = copies[rep, WIDTH]
    return rows


# --- copy tables with cached submissions ------------------------------------------------------


# Raw struct layouts (the CUDA driver ABI; checked against cuda-python's structs in the tests).
def _struct(itemsize: int, *fields: tuple[str, str, int]) -> np.dtype[Any]:
    """A numpy record type laid out as a C struct: (name, format, byte offset) fields; bytes
    not named (padding, fields left zero) are part of ``itemsize``."""
    return np.dtype(
        {
            "names": [f[0] for f in fields],
            "formats": [f[1] for f in fields],
            "offsets": [f[2] for f in fields],
            "itemsize": itemsize,
        }
    )


_U4, _U8 = "<u4", "<u8"
#: CUDA_MEMCPY2D (128 bytes; srcXInBytes, srcY, *Host, *Array stay 0).
_MEMCPY2D = _struct(
    128,
    ("srcMemoryType", _U4, 16),
    ("srcDevice", _U8, 32),
    ("srcPitch", _U8, 48),
    ("dstMemoryType", _U4, 72),
    ("dstDevice", _U8, 88),
    ("dstPitch", _U8, 104),
    ("WidthInBytes", _U8, 112),
    ("Height", _U8, 120),
)
#: CUDA_MEMCPY3D_BATCH_OP (112 bytes): two CUmemcpy3DOperand of 40 bytes (type, then the
#: pointer operand: ptr, rowLength, layerHeight, locHint), CUextent3D, srcAccessOrder, flags.
_BATCH_OP = _struct(
    112,
    ("src_type", _U4, 0),
    ("src_ptr", _U8, 8),
    ("src_row", _U8, 16),
    ("src_layer", _U8, 24),
    ("dst_type", _U4, 40),
    ("dst_ptr", _U8, 48),
    ("dst_row", _U8, 56),
    ("dst_layer", _U8, 64),
    ("width", _U8, 80),
    ("height", _U8, 88),
    ("depth", _U8, 96),
    ("order", _U4, 104),
    ("flags", _U4, 108),
)
#: CUmemcpyAttributes (24 bytes: srcAccessOrder, srcLocHint, dstLocHint, flags).
_MEMCPY_ATTRS = _struct(24, ("order", _U4, 0), ("flags", _U4, 20))
_MEMORYTYPE_UNIFIED = 4  # CU_MEMORYTYPE_UNIFIED
_OPERAND_POINTER = 1  # CU_MEMCPY_OPERAND_TYPE_POINTER
_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM


def _memcpy2d_records(table: Int64Array, src_base: int, dst_base: int) -> npt.NDArray[Any]:
    rec = np.zeros(table.shape[0], dtype=_MEMCPY2D)
    rec["srcMemoryType"] = _MEMORYTYPE_UNIFIED
    rec["dstMemoryType"] = _MEMORYTYPE_UNIFIED
    rec["srcDevice"] = table[:, SRC] + src_base
    rec["dstDevice"] = table[:, DST] + dst_base
    rec["srcPitch"] = table[:, SRC_PITCH]
    rec["dstPitch"] = table[:, DST_PITCH]
    rec["WidthInBytes"] = table[:, WIDTH]
    rec["Height"] = table[:, HEIGHT]
    return rec


def _batch_op_records(table: Int64Array, src_base: int, dst_base: int) -> npt.NDArray[Any]:
    rec = np.zeros(table.shape[0], dtype=_BATCH_OP)
    rec["src_type"] = _OPERAND_POINTER
    rec["dst_type"] = _OPERAND_POINTER
    rec["src_ptr"] = table[:, SRC] + src_base
    rec["dst_ptr"] = table[:, DST] + dst_base
    rec["src_row"] = table[:, SRC_PITCH]  # elements of 1 byte for pointer operands
    rec["dst_row"] = table[:, DST_PITCH]
    rec["width"] = table[:, WIDTH]
    rec["height"] = table[:, HEIGHT]
    rec["depth"] = 1
    rec["order"] = _ORDER_STREAM
    return rec


def _attrs_record() -> npt.NDArray[Any]:
    rec = np.zeros(1, dtype=_MEMCPY_ATTRS)
    rec["order"] = _ORDER_STREAM
    return rec


def _py_memcpy2d(table: Int64Array, src_base: int, dst_base: int) -> list[Any]:
    """cuda-python ``CUDA_MEMCPY2D`` structs, one per copy."""
    cu = _driver()
    unified = cu.CUmemorytype.CU_MEMORYTYPE_UNIFIED
    out = []
    for so, sp, do, dp, w, h in table.tolist():
        m = cu.CUDA_MEMCPY2D()
        m.srcMemoryType = unified
        m.dstMemoryType = unified
        m.srcDevice = so + src_base
        m.dstDevice = do + dst_base
        m.srcPitch = sp
        m.dstPitch = dp
        m.WidthInBytes = w
        m.Height = h
        out.append(m)
    return out


def _py_batch_ops(table: Int64Array, src_base: int, dst_base: int) -> list[Any]:
    """cuda-python ``CUDA_MEMCPY3D_BATCH_OP`` structs, one per copy."""
    cu = _driver()
    ptr = cu.CUmemcpy3DOperandType.CU_MEMCPY_OPERAND_TYPE_POINTER
    order = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    out = []
    for so, sp, do, dp, w, h in table.tolist():
        op = cu.CUDA_MEMCPY3D_BATCH_OP()
        op.src.type = ptr
        op.src.op.ptr.ptr = so + src_base
        op.src.op.ptr.rowLength = sp
        op.dst.type = ptr
        op.dst.op.ptr.ptr = do + dst_base
        op.dst.op.ptr.rowLength = dp
        op.extent.width = w
        op.extent.height = h
        op.extent.depth = 1
        op.srcAccessOrder = order
        out.append(op)
    return out


class Copies2D:
    """A copy table (M, 6) (see :func:`group_2d`) relative to a source and a destination
    base address, with its driver arguments prepared per (bases, method) on first use."""

    def __init__(self, table: Int64Array) -> None:
        self.table = np.ascontiguousarray(table, dtype=np.int64).reshape(-1, 6)
        #: Bytes moved.
        self.nbytes = int((self.table[:, WIDTH] * self.table[:, HEIGHT]).sum())
        #: Rows (1D pieces) over all copies.
        self.rows = int(self.table[:, HEIGHT].sum())
        self._prepared: dict[tuple[str, int, int], Any] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self.table.shape[0])

    @property
    def bytes_per_copy(self) -> float:
        """Mean bytes per copy (0 for none): what decides copy-engine throughput."""
        return self.nbytes / len(self) if len(self) else 0.0

    def __repr__(self) -> str:
        return f"Copies2D(copies={len(self)}, rows={self.rows}, bytes={self.nbytes})"

    def _prepare(self, method: str, src_base: int, dst_base: int) -> Any:
        key = (method, src_base, dst_base)
        with self._lock:
            prep = self._prepared.get(key)
        if prep is not None:
            return prep
        t = self.table
        if method == "memcpy2d":
            prep = _py_memcpy2d(t, src_base, dst_base)
        elif method == "memcpy2d_raw":
            rec = _memcpy2d_records(t, src_base, dst_base)
            addr = rec.ctypes.data
            prep = (rec, [addr + i * _MEMCPY2D.itemsize for i in range(rec.size)])
        elif method == "batch3d":
            prep = (_batch_op_records(t, src_base, dst_base),)
        elif method == "batch3d_py":
            prep = _py_batch_ops(t, src_base, dst_base)
        elif method == "batch1d":
            rows = expand_2d(t)
            prep = (
                (rows[:, 1] + dst_base).astype(np.uint64),
                (rows[:, 0] + src_base).astype(np.uint64),
                rows[:, 2].astype(np.uint64),
                _attrs_record(),
                np.zeros(1, dtype=np.uint64),  # attrsIdxs
                np.zeros(1, dtype=np.uint64),  # failIdx (CUDA 12.8/12.9 ABI)
            )
        else:
            raise ValueError(f"unknown copy method {method!r}; one of {', '.join(('auto', *METHODS))}")
        with self._lock:
            if len(self._prepared) >= _PREPARED_MAX:
                self._prepared.pop(next(iter(self._prepared)))
            self._prepared[key] = prep
        return prep

    def submit(self, src_base: int, dst_base: int, stream: CopyStream, method: str = "auto") -> None:
        """Enqueue the copies from ``src_base + src_off`` to ``dst_base + dst_off`` on
        ``stream`` (asynchronous: synchronize the stream or wait on an event recorded after)."""
        if not len(self):
            return
        stream.activate()
        if method == "auto":
            method = _auto_method()
        prep = self._prepare(method, int(src_base), int(dst_base))
        n = self.rows if method == "batch1d" else len(self)
        lanes = min(stream.lanes, n)
        if lanes <= 1:
            _submit_range(method, prep, 0, n, stream._streams[0])
            return
        bounds = [n * k // lanes for k in range(lanes + 1)]
        stream._fork()
        pool = stream._pool
        if pool is None:
            for k in range(lanes):
                _submit_range(method, prep, bounds[k], bounds[k + 1], stream._streams[k])
        else:
            ctx = stream._ctx

            def lane(k: int) -> None:
                _check(_driver().cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
                _submit_range(method, prep, bounds[k], bounds[k + 1], stream._streams[k])

            futures = [pool.submit(lane, k) for k in range(lanes)]
            errors = [f.exception() for f in futures]
            for e in errors:
                if e is not None:
                    raise e
        stream._join()


def _submit_range(method: str, prep: Any, a: int, b: int, cu_stream: Any) -> None:
    """Enqueue items [a, b) of a prepared submission (copies; rows for ``batch1d``)."""
    if a >= b:
        return
    raw = _raw_entry()
    h = int(cu_stream)
    if method == "memcpy2d":
        fn = _driver().cuMemcpy2DAsync
        for m in prep[a:b]:
            res = fn(m, cu_stream)
            if res[0]:
                _check(res, "cuMemcpy2DAsync")
    elif method == "memcpy2d_raw":
        fn2 = _need(raw.memcpy2d, "cuMemcpy2DAsync")
        for addr in prep[1][a:b]:
            rc = fn2(addr, h)
            if rc:
                _raise_rc(rc, "cuMemcpy2DAsync")
    elif method == "batch3d":
        fn3 = _need(raw.memcpy3d_batch, "cuMemcpy3DBatchAsync")
        base = prep[0].ctypes.data
        for k in range(a, b, BATCH_MAX_OPS):
            n = min(BATCH_MAX_OPS, b - k)
            addr = base + k * _BATCH_OP.itemsize
            if raw.fail_idx:
                fail = ctypes.c_size_t(0)
                rc = fn3(n, addr, ctypes.addressof(fail), 0, h)
            else:
                rc = fn3(n, addr, 0, h)
            if rc:
                _raise_rc(rc, "cuMemcpy3DBatchAsync")
    elif method == "batch3d_py":
        fn4 = _driver().cuMemcpy3DBatchAsync
        for k in range(a, b, BATCH_MAX_OPS):
            ops = prep[k : min(b, k + BATCH_MAX_OPS)]
            _check(fn4(len(ops), ops, 0, cu_stream), "cuMemcpy3DBatchAsync")
    elif method == "batch1d":
        fn5 = _need(raw.memcpy_batch, "cuMemcpyBatchAsync")
        dsts, srcs, sizes, attrs, idxs, fail = prep
        pa, pi, pf = attrs.ctypes.data, idxs.ctypes.data, fail.ctypes.data
        for k in range(a, b, BATCH_MAX_OPS):
            n = min(BATCH_MAX_OPS, b - k)
            d, s_, z = dsts.ctypes.data + 8 * k, srcs.ctypes.data + 8 * k, sizes.ctypes.data + 8 * k
            args = (d, s_, z, n, pa, pi, 1, pf, h) if raw.fail_idx else (d, s_, z, n, pa, pi, 1, h)
            rc = fn5(*args)
            if rc:
                _raise_rc(rc, "cuMemcpyBatchAsync")
    else:  # pragma: no cover - _prepare rejected it
        raise ValueError(method)


def _need(fn: Callable[..., int] | None, name: str) -> Callable[..., int]:
    if fn is None:
        raise TransferError(f"{name}: not available from this CUDA driver")
    return fn


def _auto_method() -> str:
    raw = _raw_entry()
    if AUTO_METHOD == "batch3d" and raw.memcpy3d_batch is not None:
        return "batch3d"
    if AUTO_METHOD == "memcpy2d_raw" and raw.memcpy2d is not None:
        return "memcpy2d_raw"
    return "memcpy2d"


# --- chunks and pairs ---------------------------------------------------------------------------

_cache_lock = threading.Lock()
_chunk_cache: weakref.WeakKeyDictionary[Chunk, dict[str, Copies2D]] = weakref.WeakKeyDictionary()
_plan_cache: weakref.WeakKeyDictionary[Plan, dict[tuple[int, int], Copies2D]] = weakref.WeakKeyDictionary()


def chunk_copies(chunk: Chunk, op: Literal["gather", "scatter"]) -> Copies2D:
    """A chunk's pieces as 2D copies: ``gather`` from the source pool (offsets relative to the
    pool) to the chunk's bounce region (relative to the region's start), ``scatter`` from the
    bounce region to the destination pool. Built once per chunk and cached."""
    if op not in ("gather", "scatter"):
        raise ValueError(f"op must be 'gather' or 'scatter', got {op!r}")
    with _cache_lock:
        per = _chunk_cache.get(chunk)
        if per is None:
            per = _chunk_cache[chunk] = {}
        c = per.get(op)
    if c is not None:
        return c
    p = chunk.pieces
    if op == "gather":
        c = Copies2D(group_2d(p[:, 0], p[:, 3], p[:, 2]))
    else:
        c = Copies2D(group_2d(p[:, 3], p[:, 1], p[:, 2]))
    with _cache_lock:
        per[op] = c
    return c


def pair_copies(plan: Plan, s: int, d: int) -> Copies2D:
    """Pair (s, d)'s fragments (``plan.fragments(s, d)``) as 2D copies from rank ``s``'s pool
    to rank ``d``'s pool. Built once per (plan, pair) and cached."""
    with _cache_lock:
        per = _plan_cache.get(plan)
        if per is None:
            per = _plan_cache[plan] = {}
        c = per.get((s, d))
    if c is not None:
        return c
    f = plan.fragments(s, d)
    c = Copies2D(group_2d(f[:, 0], f[:, 1], f[:, 2]))
    with _cache_lock:
        per[(s, d)] = c
    return c


def gather_2d(
    chunk: Chunk, src_base: int, bounce_base: int, stream: CopyStream, *, method: str = "auto"
) -> None:
    """Enqueue the gather of ``chunk``: its pieces from the source pool at ``src_base`` into
    the chunk's bounce region at ``bounce_base`` (the bounce buffer's address plus
    ``chunk.bounce_offset``, or wherever the region lies)."""
    chunk_copies(chunk, "gather").submit(src_base, bounce_base, stream, method)


def scatter_2d(
    chunk: Chunk, bounce_base: int, dst_base: int, stream: CopyStream, *, method: str = "auto"
) -> None:
    """Enqueue the scatter of ``chunk``: its bounce region at ``bounce_base`` into the
    destination pool at ``dst_base``."""
    chunk_copies(chunk, "scatter").submit(bounce_base, dst_base, stream, method)


def apply_pair_2d(
    plan: Plan, s: int, d: int, src_base: int, dst_base: int, stream: CopyStream, *, method: str = "auto"
) -> None:
    """Enqueue the direct regroup of pair (s, d): from ctx rank ``s``'s pool at ``src_base``
    straight into gen rank ``d``'s pool at ``dst_base`` (the mapped path, no bounce)."""
    pair_copies(plan, s, d).submit(src_base, dst_base, stream, method)


def copy_contiguous(src: int, dst: int, nbytes: int, stream: CopyStream) -> None:
    """Enqueue one contiguous ``cuMemcpyAsync`` of ``nbytes`` (the baseline the 2D copies are
    compared with)."""
    if nbytes <= 0:
        return
    stream.activate()
    cu = _driver()
    _check(cu.cuMemcpyAsync(cu.CUdeviceptr(dst), cu.CUdeviceptr(src), nbytes, stream.stream), "cuMemcpyAsync")
