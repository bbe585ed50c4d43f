"""The data path's entry point: apply a plan's regroup with the best engine for the memory.

Three calls, one per use, all on flat-byte pools (contiguous numpy arrays or torch tensors of any
dtype, viewed as bytes; the pools of the ranks the call touches):

``regroup(plan, src_rank, src_pool, dst_pools, *, stream=None, engine="auto",
launch_on="src") -> Completion``
    Every pair ``(src_rank, d)`` of the plan, from ``src_pool`` straight into ``dst_pools[d]``
    (the mapped and local paths; ``dst_pools`` may hold a peer GPU's memory). One kernel launch
    on the source GPU for all destination ranks (push), or with ``launch_on="dst"`` one per
    destination GPU (pull: for CUDA IPC mappings, which only their own GPU can address).
``gather_chunk(plan, src_rank, dst_rank, src_pool, staging, *, offset, nbytes, stream=None,
engine="auto") -> Completion``
    Bytes ``[offset, offset + nbytes)`` of pair (src_rank, dst_rank)'s stream, packed into
    ``staging`` from its first byte (the bounce path's sender side).
``scatter_chunk(plan, src_rank, dst_rank, staging, dst_pool, *, offset, nbytes, stream=None,
engine="auto") -> Completion``
    The reverse, on the receiver: ``staging[:nbytes]`` into the pair's bytes of ``dst_pool``.

A pair's *stream* is its runs in the planner's fragment order (:mod:`kvd.regroup.table`);
:func:`chunk_ranges` cuts every pair's stream into ``(src, dst, index, offset, nbytes)`` chunks,
the same cuts and staged bytes as :func:`kvd.regroup.stager.schedule`, so either side may run any engine.

Engines (``engine="auto"`` picks): ``"kernel"`` — CUDA memory, the NVRTC kernel
(:mod:`kvd.regroup.kernel`) on the source GPU (``regroup``, ``gather_chunk``) or the
destination GPU (``scatter_chunk``); ``"torch"`` — CUDA memory where the kernel is unavailable
(``regroup.kernel_unavailable`` was logged once): the same row tables through ``index_select`` /
``index_copy_``; ``"host"`` — numpy / CPU tensors: the host twin (:mod:`kvd.regroup.hostkernel`),
synchronous. GPU work goes on ``stream`` (a ``torch.cuda.Stream``; default: the launching
device's current stream) and is ordered after the work already on it; the caller makes that
stream wait for whatever wrote the source (an executor's event, a NIXL notification).

The returned :class:`Completion` has ``done()`` (non-blocking: ``cuEventQuery`` on an event
recorded after the work, for polling from the event loop), ``wait()``, ``engine`` and
``nbytes``; every call takes an optional ``tile_bytes`` (the kernel's bytes per thread block,
default 16 KiB; 4-64 KiB measured alike). A launch failure surfaces in ``done()``/``wait()`` as
:class:`~kvd.regroup.kernel.KernelError`.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from kvd.ops.steptrace import mark
from kvd.regroup import hostkernel, kernel
from kvd.regroup.kernel import kernel_available
from kvd.regroup.plan import Plan
from kvd.regroup.table import ChunkRange, PairGrid, chunk_ranges, pair_grid, row_tables, stride_alignment

if TYPE_CHECKING:
    import torch

__all__ = [
    "ChunkRange",
    "Completion",
    "Engine",
    "LaunchOn",
    "chunk_ranges",
    "gather_chunk",
    "kernel_available",
    "raw_stream",
    "regroup",
    "scatter_chunk",
    "template_parts",
]

Engine = Literal["auto", "kernel", "torch", "host"]
#: Where :func:`regroup` launches: the source GPU (push) or each destination GPU (pull).
LaunchOn = Literal["src", "dst"]
#: Bytes per indexed step of the torch path (as kvd.regroup.plan.APPLY_STEP_BYTES_CUDA).
TORCH_STEP_BYTES = 256 << 20


class Completion:
    """Completion of one regroup call. Host work is done when the call returns."""

    def __init__(self, engine: str, nbytes: int, events: list[Any] | None = None) -> None:
        #: ``"kernel"``, ``"torch"`` or ``"host"``.
        self.engine = engine
        #: Bytes moved.
        self.nbytes = nbytes
        self._events = events or []

    @property
    def events(self) -> list[Any]:
        """The events recorded after the work (one per device; none for host work)."""
        return self._events

    def done(self) -> bool:
        """Whether the work has finished; never blocks (an event query per device)."""
        return all(e.query() for e in self._events)

    def wait(self) -> None:
        """Block until the work has finished."""
        for e in self._events:
            e.synchronize()

    def __repr__(self) -> str:
        return f"Completion(engine={self.engine!r}, nbytes={self.nbytes}, done={self.done()})"


def _is_cuda(pool: Any) -> bool:
    return getattr(pool, "is_cuda", False) is True


def _u8(t: torch.Tensor) -> torch.Tensor:
    import torch

    if not t.is_contiguous():
        raise ValueError("pool must be contiguous")
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _pick(engine: Engine, pools: list[Any], launch_device: int | None) -> Engine:
    cuda = [_is_cuda(p) for p in pools]
    if engine == "host":
        if any(cuda):
            raise ValueError("engine='host' needs host pools")
        return "host"
    if engine == "kernel":
        if not all(cuda):
            raise ValueError("engine='kernel' needs CUDA pools")
        if launch_device is None or not kernel_available(launch_device):
            raise RuntimeError("the regroup kernel is unavailable here (see regroup.kernel_unavailable)")
        return "kernel"
    if engine == "torch":
        return "torch"
    if not any(cuda):
        return "host"
    if all(cuda) and launch_device is not None and kernel_available(launch_device):
        return "kernel"
    return "torch"


def _stream(stream: Any, device: int) -> Any:
    import torch

    return stream if stream is not None else torch.cuda.current_stream(device)


def _raw_stream(stream: Any, device: int) -> int:
    """The CUDA stream handle to launch on: ``stream``'s, else ``device``'s current stream.
    torch's private raw getter when present: building a ``torch.cuda.Stream`` object per launch
    cost ~25 µs of host time per request in the daemon (profiled on the H200 host)."""
    if stream is not None:
        return int(stream.cuda_stream)
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device))
    return int(torch.cuda.current_stream(device).cuda_stream)


def _record(stream: Any) -> Any:
    import torch

    ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ev.record(stream)
    return ev


def _grids(p: Plan, src_rank: int, dst_ranks: list[int]) -> list[PairGrid]:
    out = []
    for d in dst_ranks:
        g = pair_grid(p, src_rank, d)
        if g is not None and g.nruns:
            out.append(g)
    return out


def _check_size(name: str, pool: Any, need: int) -> None:
    have = hostkernel.as_bytes(pool).size if not _is_cuda(pool) else pool.numel() * pool.element_size()
    if have < need:
        raise ValueError(f"{name} holds {have} bytes, the regroup touches {need}")


def _launch(dev: int, launches: list[kernel.PairLaunch], stream: Any, nbytes: int, tile_bytes: int) -> Completion:
    k = kernel.kernel_for(dev)
    assert k is not None
    table, npairs, tiles = kernel.pack(launches, tile_bytes)
    mark("regroup.packed")
    done = Completion("kernel", nbytes, [k.run(table, npairs, tiles, stream.cuda_stream)])
    mark("regroup.run")
    return done


def _torch_range(grid: PairGrid, src: Any, dst: Any, lo: int, hi: int, *, src_packed: bool, dst_packed: bool) -> None:
    """The torch path for stream bytes [lo, hi): the host twin's row tables, on the devices."""
    import torch

    from kvd.regroup.stager import elem_width, torch_rows

    row = hostkernel.row_bytes(grid, lo, hi, src_packed=src_packed, dst_packed=dst_packed)
    src_u8, dst_u8 = _u8(src), _u8(dst)
    w = elem_width(row, src_u8, dst_u8)
    src_rows, dst_rows = torch_rows(src_u8, row, w), torch_rows(dst_u8, row, w)
    step = max(1, TORCH_STEP_BYTES // row)
    for si, di in row_tables(grid, lo, hi, row, src_packed=src_packed, dst_packed=dst_packed, step_rows=step):
        sidx = torch.from_numpy(si).to(src_rows.device)
        didx = torch.from_numpy(di).to(dst_rows.device)
        buf = torch.index_select(src_rows, 0, sidx)
        dst_rows.index_copy_(0, didx, buf.to(dst_rows.device))


def _run_pairs(
    engine: Engine,
    items: list[tuple[PairGrid, Any, Any, int, int, bool, bool]],
    launch_device: int | None,
    stream: Any,
    tile_bytes: int,
) -> Completion:
    """Move ``(grid, src, dst, lo, hi, src_packed, dst_packed)`` items with ``engine``."""
    nbytes = sum(hi - lo for _, _, _, lo, hi, _, _ in items)
    for g, src, dst, lo, hi, sp, dp in items:
        if not 0 <= lo <= hi <= g.nbytes:
            raise ValueError(f"range [{lo}, {hi}) outside pair ({g.src}, {g.dst})'s {g.nbytes}-byte stream")
        _check_size("staging" if sp else "source pool", src, hi - lo if sp else g.extent("src"))
        _check_size("staging" if dp else "destination pool", dst, hi - lo if dp else g.extent("dst"))
    if engine == "host":
        for g, src, dst, lo, hi, sp, dp in items:
            hostkernel.copy_range(g, hostkernel.as_bytes(src), hostkernel.as_bytes(dst), lo, hi,
                                  src_packed=sp, dst_packed=dp)
        return Completion("host", nbytes)
    import torch

    if engine == "kernel":
        assert launch_device is not None
        k = kernel.kernel_for(launch_device)
        assert k is not None
        launches = []
        for g, src, dst, lo, hi, sp, dp in items:
            for t in (src, dst):
                if t.device.index != launch_device and not k.enable_peer(int(t.device.index)):
                    return _run_pairs("torch", items, launch_device, stream, tile_bytes)
            launches.append(kernel.PairLaunch(g, src.data_ptr(), dst.data_ptr(), lo, hi, sp, dp))
        mark("regroup.checked")
        return _launch(launch_device, launches, _stream(stream, launch_device), nbytes, tile_bytes)
    # torch: on the launching device's stream; other devices' current streams order the rest
    devices = sorted({t.device.index for _, s, d, *_ in items for t in (s, d) if t.is_cuda})
    dev = launch_device if launch_device is not None else (devices[0] if devices else None)
    if dev is None:  # CPU tensors forced onto the torch path (tests)
        for g, src, dst, lo, hi, sp, dp in items:
            _torch_range(g, src, dst, lo, hi, src_packed=sp, dst_packed=dp)
        return Completion("torch", nbytes)
    st = _stream(stream, dev)
    with torch.cuda.device(dev), torch.cuda.stream(st):
        for g, src, dst, lo, hi, sp, dp in items:
            _torch_range(g, src, dst, lo, hi, src_packed=sp, dst_packed=dp)
    events = [_record(st)] + [_record(torch.cuda.current_stream(o)) for o in devices if o != dev]
    return Completion("torch", nbytes, events)


def regroup(
    plan: Plan,
    src_rank: int,
    src_pool: Any,
    dst_pools: Mapping[int, Any],
    *,
    stream: Any = None,
    engine: Engine = "auto",
    tile_bytes: int = kernel.TILE_BYTES,
    launch_on: LaunchOn = "src",
    event_for: EventFor | None = None,
) -> Completion:
    """Move every pair ``(src_rank, d)`` of ``plan`` from ``src_pool`` into ``dst_pools[d]``
    (pools as flat bytes, laid out as the plan's layouts say). Ranks of ``dst_pools`` that the
    source rank does not feed are ignored; a fed rank missing from it is a ``KeyError``.

    ``launch_on="src"``: one launch on the source GPU storing into the destinations (push);
    ``"dst"``: one launch per destination GPU loading from the source (pull), each on that
    GPU's current stream, or ``stream`` for the launch on ``stream``'s own GPU. Pull is for
    destinations this process mapped by CUDA IPC on their own GPU: such a mapping belongs to
    that GPU's context, and another GPU's kernel cannot address it (measured:
    ``CUDA_ERROR_ILLEGAL_ADDRESS``), while the source pool, plain device memory, is reachable
    from any peer GPU.

    ``event_for(device, stream)``: the event to record after a single launch from a cached
    template (a landed event, :mod:`kvd.regroup.landed`), or None for the kernel's own; not
    asked on any other path."""
    if engine in ("auto", "kernel"):
        done = _templated(plan, src_rank, src_pool, dst_pools, stream, tile_bytes, launch_on, event_for)
        if done is not None:
            return done
    dsts = [d for s, d in plan.pairs() if s == src_rank]
    grids = _grids(plan, src_rank, dsts)
    mark("regroup.grids")
    items = [(g, src_pool, dst_pools[g.dst], 0, g.nbytes, False, False) for g in grids]
    src_dev = src_pool.device.index if _is_cuda(src_pool) else None
    if launch_on == "src" or src_dev is None or not items:
        eng = _pick(engine, [src_pool, *(dst_pools[g.dst] for g in grids)], src_dev)
        return _run_pairs(eng, items, src_dev, stream, tile_bytes)
    by_dev: dict[int, list[tuple[PairGrid, Any, Any, int, int, bool, bool]]] = {}
    for it in items:
        dst = it[2]
        if not _is_cuda(dst):
            raise ValueError("launch_on='dst' needs CUDA destination pools")
        by_dev.setdefault(dst.device.index, []).append(it)
    parts = [
        _run_pairs(_pick(engine, [src_pool, *(it[2] for it in its)], dev), its, dev,
                   stream if stream is not None and stream.device.index == dev else None, tile_bytes)
        for dev, its in sorted(by_dev.items())
    ]
    return Completion(parts[0].engine if len({c.engine for c in parts}) == 1 else "mixed",
                      sum(c.nbytes for c in parts), [e for c in parts for e in c._events])


#: Launch templates kept (least recently used dropped): one per layout pair, request size,
#: source rank and set of pools that regroup() launched the kernel for.
TEMPLATE_CACHE = 512
_templates: OrderedDict[tuple[Any, ...], list[tuple[int, kernel.LaunchTemplate, list[tuple[int, int]]]]] = OrderedDict()


#: ``event_for(device, stream)`` of :func:`regroup`: an event to record after the launch, or None.
EventFor = Callable[[int, int], Any]


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size())


def _desc(t: Any) -> tuple[int, int, int]:
    """(address, bytes, device index) of CUDA tensor ``t``: what a launch template bakes in."""
    return int(t.data_ptr()), _nbytes(t), int(t.device.index)


#: Pool tensors the templated launches have seen, by id: a weak reference (a reused id of a
#: dead tensor is told from the tensor by it) and :func:`_desc`, or None for a tensor not on
#: CUDA. Emptied when full.
_POOL_DESC: dict[int, tuple[weakref.ref[Any], tuple[int, int, int] | None]] = {}
POOL_DESC_KEEP = 1024


def _pool_desc(t: Any) -> tuple[int, int, int] | None:
    """:func:`_desc` of a pool tensor, or None when it is not a CUDA tensor; computed once
    per tensor object. The pools kvd passes are fixed views over kvd-owned memory (the
    pool's ``tensor_u8()``, a mapping's ``raw``), made once and never re-pointed, so their
    address, size and device are properties of the object: asking torch for them (five
    calls a pool, twenty-five a TP1 -> TP4 launch) on every request cost more host time
    than the table. Not for per-call views (a bounce slot's slice): use :func:`_desc`."""
    hit = _POOL_DESC.get(id(t))
    if hit is not None and hit[0]() is t:
        return hit[1]
    desc = _desc(t) if _is_cuda(t) else None
    try:
        ref = weakref.ref(t)
    except TypeError:  # (not weakly referenceable: not remembered)
        return desc
    if len(_POOL_DESC) >= POOL_DESC_KEEP:
        _POOL_DESC.clear()
    _POOL_DESC[id(t)] = (ref, desc)
    return desc


def _templated(
    plan: Plan, src_rank: int, src_pool: Any, dst_pools: Mapping[int, Any], stream: Any, tile_bytes: int,
    launch_on: LaunchOn, event_for: EventFor | None = None,
) -> Completion | None:
    """:func:`regroup` on the kernel from a cached launch template: the request's block tables
    are all that is computed. None when the kernel cannot do it here (the caller's general
    path then decides: torch, or an error)."""
    parts = template_parts(plan, src_rank, src_pool, dst_pools, tile_bytes, launch_on)
    if parts is None:
        return None
    mark("regroup.template")
    kernels = [kernel.kernel_for(dev) for dev, _, _ in parts]
    if any(k is None for k in kernels):
        return None  # made unavailable since (tests do): the general path says what happens
    tables = [tpl.table([(plan.ctx_offsets[s], plan.gen_offsets[d]) for s, d in pairs]) for _, tpl, pairs in parts]
    mark("regroup.tables", sum(t.size for t in tables))
    events = []
    nbytes = 0
    for (dev, tpl, _), k, table in zip(parts, kernels, tables, strict=True):
        assert k is not None
        st = _raw_stream(stream if stream is not None and stream.device.index == dev else None, dev)
        ev = event_for(dev, st) if event_for is not None and len(parts) == 1 else None
        events.append(k.run(table, tpl.npairs, tpl.tiles, st, event=ev))
        nbytes += tpl.nbytes
    mark("regroup.run")
    return Completion("kernel", nbytes, events)


def template_parts(
    plan: Plan, src_rank: int, src_pool: Any, dst_pools: Mapping[int, Any], tile_bytes: int = kernel.TILE_BYTES,
    launch_on: LaunchOn = "src",
) -> list[tuple[int, kernel.LaunchTemplate, list[tuple[int, int]]]] | None:
    """The cached launch templates of :func:`regroup` on the kernel for ``plan``'s shape and
    these pools: per launching device, its template and the (src, dst) pairs whose block
    tables it takes, in order (built on first use). None when the kernel cannot do it here."""
    if plan.shape_key is None:
        return None
    src_desc = _pool_desc(src_pool)
    if src_desc is None:
        return None
    dsts = []
    for d, t in dst_pools.items():
        dst_desc = _pool_desc(t)
        if dst_desc is None:
            return None
        dsts.append((d, dst_desc))
    dsts.sort()
    key = (plan.shape_key, src_rank, launch_on, tile_bytes, src_desc, tuple(dsts))
    parts = _templates.get(key)
    if parts is None:
        parts = _build_templates(plan, src_rank, src_pool, dst_pools, tile_bytes, launch_on)
        if parts is None:
            return None
        _templates[key] = parts
        while len(_templates) > TEMPLATE_CACHE:
            _templates.popitem(last=False)
    else:
        _templates.move_to_end(key)
    return parts


def raw_stream(device: int) -> int:
    """The CUDA stream handle :func:`regroup` launches on for ``device`` when given none."""
    return _raw_stream(None, device)


def _run_chunk(
    plan: Plan, eng: Engine, item: tuple[PairGrid, Any, Any, int, int, bool, bool], dev: int | None, stream: Any,
    tile_bytes: int,
) -> Completion:
    """One gather or scatter chunk: from a launch template on the kernel when one applies."""
    if eng == "kernel":
        assert dev is not None
        done = _templated_chunk(plan, item, dev, stream, tile_bytes)
        if done is not None:
            return done
    return _run_pairs(eng, [item], dev, stream, tile_bytes)


def _templated_chunk(
    plan: Plan, item: tuple[PairGrid, Any, Any, int, int, bool, bool], dev: int, stream: Any, tile_bytes: int
) -> Completion | None:
    """A bounce chunk's gather or scatter on the kernel from a cached launch template (every
    request of one shape cuts the same chunks). None when the general path must decide."""
    g, src, dst, lo, hi, sp, dp = item
    if plan.shape_key is None or g.src not in plan.ctx_offsets or g.dst not in plan.gen_offsets:
        return None
    # a packed side is a bounce slot, sliced anew for each chunk: asked; a pool side: remembered
    src_desc = _desc(src) if sp else _pool_desc(src)
    dst_desc = _desc(dst) if dp else _pool_desc(dst)
    if src_desc is None or dst_desc is None:
        return None  # (not CUDA: the general path says what happens)
    key = ("chunk", plan.shape_key, dev, tile_bytes, g.src, g.dst, lo, hi, sp, dp, src_desc, dst_desc)
    parts = _templates.get(key)
    if parts is None:
        k = kernel.kernel_for(dev)
        if k is None or not 0 <= lo < hi <= g.nbytes:
            return None  # nothing to move, or out of range: the general path answers
        for t in (src, dst):
            if t.device.index != dev and not k.enable_peer(int(t.device.index)):
                return None
        # a packed side holds [lo, hi) from its first byte; a pool side, the pair's runs
        if (sp and _nbytes(src) < hi - lo) or (dp and _nbytes(dst) < hi - lo):
            return None  # the general path raises the clear error
        never = 1 << 62  # a packed side's table is not read
        limits = (never if sp else _nbytes(src) - g.extent_without_table("src"),
                  never if dp else _nbytes(dst) - g.extent_without_table("dst"))
        align = (stride_alignment(plan, g, "src"), stride_alignment(plan, g, "dst"))
        tpl = kernel.template([kernel.PairLaunch(g, src.data_ptr(), dst.data_ptr(), lo, hi, sp, dp)], [align],
                              [limits], tile_bytes)
        parts = [(dev, tpl, [(g.src, g.dst)])]
        _templates[key] = parts
        while len(_templates) > TEMPLATE_CACHE:
            _templates.popitem(last=False)
    else:
        _templates.move_to_end(key)
    _, tpl, _ = parts[0]
    k = kernel.kernel_for(dev)
    if k is None:
        return None
    table = tpl.table([(plan.ctx_offsets[g.src], plan.gen_offsets[g.dst])])
    return Completion("kernel", tpl.nbytes, [k.run(table, tpl.npairs, tpl.tiles, _raw_stream(stream, dev))])


def _build_templates(
    plan: Plan, src_rank: int, src_pool: Any, dst_pools: Mapping[int, Any], tile_bytes: int, launch_on: LaunchOn,
) -> list[tuple[int, kernel.LaunchTemplate, list[tuple[int, int]]]] | None:
    grids = _grids(plan, src_rank, [d for s, d in plan.pairs() if s == src_rank])
    if not grids or any(s not in plan.ctx_offsets for s in [src_rank]) or any(g.dst not in plan.gen_offsets for g in grids):
        return None
    by_dev: dict[int, list[PairGrid]] = {}
    for g in grids:
        dev = src_pool.device.index if launch_on == "src" else dst_pools[g.dst].device.index
        by_dev.setdefault(dev, []).append(g)
    out = []
    for dev, gs in sorted(by_dev.items()):
        if not kernel_available(dev):
            return None
        k = kernel.kernel_for(dev)
        assert k is not None
        launches, align, limits = [], [], []
        for g in gs:
            dst = dst_pools[g.dst]
            for t in (src_pool, dst):
                if t.device.index != dev and not k.enable_peer(int(t.device.index)):
                    return None  # the general path falls back to torch, and says so
            launches.append(kernel.PairLaunch(g, src_pool.data_ptr(), dst.data_ptr(), 0, g.nbytes, False, False))
            align.append((stride_alignment(plan, g, "src"), stride_alignment(plan, g, "dst")))
            limits.append((_nbytes(src_pool) - g.extent_without_table("src"),
                           _nbytes(dst) - g.extent_without_table("dst")))
        out.append((dev, kernel.template(launches, align, limits, tile_bytes), [(g.src, g.dst) for g in gs]))
    return out


def _chunk(
    plan: Plan, src_rank: int, dst_rank: int, offset: int, nbytes: int
) -> PairGrid:
    g = pair_grid(plan, src_rank, dst_rank)
    if g is None:
        raise ValueError(f"pair ({src_rank}, {dst_rank}) moves nothing in this plan")
    if offset < 0 or nbytes < 0 or offset + nbytes > g.nbytes:
        raise ValueError(f"chunk [{offset}, {offset + nbytes}) outside the pair's {g.nbytes}-byte stream")
    return g


def gather_chunk(
    plan: Plan,
    src_rank: int,
    dst_rank: int,
    src_pool: Any,
    staging: Any,
    *,
    offset: int,
    nbytes: int,
    stream: Any = None,
    engine: Engine = "auto",
    tile_bytes: int = kernel.TILE_BYTES,
) -> Completion:
    """Pack stream bytes ``[offset, offset + nbytes)`` of pair (src_rank, dst_rank) from
    ``src_pool`` into ``staging[:nbytes]``."""
    g = _chunk(plan, src_rank, dst_rank, offset, nbytes)
    dev = src_pool.device.index if _is_cuda(src_pool) else None
    eng = _pick(engine, [src_pool, staging], dev)
    return _run_chunk(plan, eng, (g, src_pool, staging, offset, offset + nbytes, False, True), dev, stream, tile_bytes)


def scatter_chunk(
    plan: Plan,
    src_rank: int,
    dst_rank: int,
    staging: Any,
    dst_pool: Any,
    *,
    offset: int,
    nbytes: int,
    stream: Any = None,
    engine: Engine = "auto",
    tile_bytes: int = kernel.TILE_BYTES,
) -> Completion:
    """Unpack ``staging[:nbytes]`` into stream bytes ``[offset, offset + nbytes)`` of pair
    (src_rank, dst_rank) in ``dst_pool`` (launched on the destination GPU)."""
    g = _chunk(plan, src_rank, dst_rank, offset, nbytes)
    dev = dst_pool.device.index if _is_cuda(dst_pool) else None
    eng = _pick(engine, [staging, dst_pool], dev)
    return _run_chunk(plan, eng, (g, staging, dst_pool, offset, offset + nbytes, True, False), dev, stream, tile_bytes)
