"""Which memory a pool gets: a pure decision (:func:`decide`) and its executor
(:func:`choose_and_create`), which probes and creates.

The pool memory policy (README.md, "Configuration"). ``PoolConfig.memory`` is one of:

- ``auto`` (default): on a GPU (``device >= 0``) try fabric memory by allocating, exporting and
  importing it (the device attribute can lie), else fall back to ``device`` memory with the
  warning ``pool.fabric_unavailable`` (fields ``error``, ``kind``, ``pool``, ``device``). Not
  ``posix_fd``: UCX cuda_ipc cannot target POSIX-fd VMM memory (0.5 GB/s vs 308 GB/s into
  cudaMalloc). With ``device = -1``: host memory.
- ``fabric``: like ``auto`` on a GPU (the fallback is ``device``, with the same warning).
- ``device``, ``posix_fd``: that kind on a GPU. ``posix_fd`` warns
  ``pool.posix_fd_slow_nixl_target`` (a slow NIXL destination).
- ``host``: host memory (a memfd), also for a pool configured with a GPU ordinal (logged,
  ``pool.host_memory_on_gpu_config``).

``require_fabric = true`` turns the fallback into a startup failure (:class:`FabricUnavailable`
with the CUDA error). It needs ``memory`` ``auto`` or ``fabric`` and a GPU.

Environment (:data:`ENV_VARS`): ``KVD_POOL_USE_FABRIC_MEMORY`` and, for drop-in use beside
TensorRT-LLM, ``TRTLLM_KVCACHE_POOL_USE_FABRIC_MEMORY``; ``1`` = try fabric memory first, ``0`` =
don't (``true/false``, ``yes/no``, ``on/off`` are accepted too; empty = unset). They answer one
question, "try fabric memory first?", and an explicit setting always wins over the default
(like every ``KVD_*`` override, it also wins over the configuration file):

- ``0`` with ``auto``/``fabric``: no fabric attempt; ``device`` memory, no fabric warning, an
  info ``pool.fabric_disabled`` naming the variable (a *warning* for ``memory = "fabric"``,
  whose explicit request it overrides). ``0`` with ``require_fabric``: a contradiction,
  :class:`BadRequest`.
- ``1`` with ``auto``/``fabric``: the default on GPUs. With ``device``/``posix_fd``: fabric is
  tried first and that kind is the fallback (info ``pool.fabric_enabled_by_env``).
- ``1`` for host memory (``device = -1`` or ``memory = "host"``): fabric memory is GPU memory
  and cannot apply; the pool is host memory and the warning ``pool.fabric_not_applicable``
  says the variable was ignored (not an error: the same environment is commonly set for a
  whole node, GPU and CPU pools alike).
- Both variables set and disagreeing: :class:`BadRequest` naming both.

Invalid combinations (``device``/``posix_fd``/``fabric`` with ``device = -1``,
``require_fabric`` with a host pool or a non-fabric kind) are :class:`BadRequest`. When a GPU
kind is chosen on a machine without a GPU or driver, creation raises :class:`PoolError` with
the cause; with ``auto``/``fabric`` that is after the fabric probe failed and the fallback
warning was logged.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

import structlog

from kvd.config import PoolConfig
from kvd.pool.base import MemoryKind, PoolMemory
from protocol.errors import BadRequest, FabricUnavailable, PoolError

log = structlog.get_logger("kvd.pool")

#: Environment variables that say whether to try fabric memory ("1") or not ("0").
ENV_VARS: Final[tuple[str, str]] = ("KVD_POOL_USE_FABRIC_MEMORY", "TRTLLM_KVCACHE_POOL_USE_FABRIC_MEMORY")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True)
class Note:
    """A log line the executor emits for a decision (kept as data so tests can read it)."""

    level: Literal["info", "warning"]
    event: str
    fields: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """What to create for a pool.

    ``try_fabric``: probe and create fabric memory first. ``fallback_kind``: the kind created
    when fabric is not tried or fails; ``None`` when fabric is required (``require_fabric``).
    ``reason``: the pool's ``fallback_reason`` when fabric is not tried ("" = none; a failed
    probe adds its own). ``source``: the environment setting that decided (e.g.
    ``"KVD_POOL_USE_FABRIC_MEMORY=0"``), or "".
    """

    try_fabric: bool
    fallback_kind: MemoryKind | None
    reason: str = ""
    source: str = ""
    notes: tuple[Note, ...] = ()


def env_fabric_setting(env: Mapping[str, str]) -> tuple[bool | None, str]:
    """The explicit fabric setting in ``env``: (True/False/None if unset, "VAR=value" text)."""
    values: dict[str, bool] = {}
    for var in ENV_VARS:
        raw = env.get(var)
        if raw is None or raw.strip() == "":
            continue
        v = raw.strip().lower()
        if v in _TRUE:
            values[var] = True
        elif v in _FALSE:
            values[var] = False
        else:
            raise BadRequest(f"environment {var}={raw!r}: expected 1 (try fabric memory) or 0 (don't)")
    source = " and ".join(f"{var}={env[var].strip()}" for var in values)
    if len(set(values.values())) > 1:
        raise BadRequest(f"{source} disagree: set one of them, or both to the same value")
    if not values:
        return None, ""
    return next(iter(values.values())), source


def decide(cfg: PoolConfig, env: Mapping[str, str]) -> Decision:
    """The pure policy: no CUDA, no logging; raises :class:`BadRequest` for invalid settings."""
    name, dev, mem = cfg.name, cfg.device, cfg.memory
    use, source = env_fabric_setting(env)
    where = f"pool {name!r}"
    if dev < -1:
        raise BadRequest(f"{where}: device must be a CUDA ordinal or -1 (host), got {dev}")
    gpu = dev >= 0
    if cfg.require_fabric:
        if not gpu:
            raise BadRequest(f"{where}: require_fabric=true needs a GPU pool (device >= 0), got device=-1")
        if mem not in ("auto", "fabric"):
            raise BadRequest(f"{where}: require_fabric=true contradicts memory={mem!r}")
        if use is False:
            raise BadRequest(f"{where}: require_fabric=true contradicts {source} (fabric memory disabled)")
    if not gpu and mem in ("fabric", "device", "posix_fd"):
        raise BadRequest(
            f"{where}: memory={mem!r} needs a GPU (device >= 0), got device=-1 (use 'host' or 'auto')"
        )

    if not gpu or mem == "host":
        notes: list[Note] = []
        reason = ""
        if gpu:
            notes.append(
                Note("info", "pool.host_memory_on_gpu_config", {"pool": name, "device": dev, "kind": "host"})
            )
        if use is True:
            reason = f"fabric memory does not apply to host memory ({source} ignored)"
            notes.append(
                Note(
                    "warning",
                    "pool.fabric_not_applicable",
                    {"pool": name, "device": dev, "kind": "host", "variable": source},
                )
            )
        return Decision(False, "host", reason, source, tuple(notes))

    fabric_default = mem in ("auto", "fabric")
    base: MemoryKind = "device" if fabric_default else mem  # type: ignore[assignment]
    try_fabric = fabric_default if use is None else use
    fallback: MemoryKind | None = None if cfg.require_fabric else base
    if use is False and fabric_default:
        note = Note(
            "warning" if mem == "fabric" else "info",
            "pool.fabric_disabled",
            {"pool": name, "device": dev, "kind": base, "memory": mem, "variable": source},
        )
        return Decision(False, fallback, f"fabric memory disabled by {source}", source, (note,))
    if use is True and not fabric_default:
        note = Note(
            "info",
            "pool.fabric_enabled_by_env",
            {"pool": name, "device": dev, "memory": mem, "fallback": base, "variable": source},
        )
        return Decision(True, fallback, "", source, (note,))
    return Decision(try_fabric, fallback, "", source)


# --- the executor --------------------------------------------------------------------------

Creator = Callable[[MemoryKind, int, int, str], PoolMemory]
Prober = Callable[[int], str | None]


def create_memory(kind: MemoryKind, nbytes: int, device: int, name: str) -> PoolMemory:
    """Create pool memory of ``kind`` (the real backends)."""
    if kind == "host":
        from kvd.pool.host import HostMemory

        return HostMemory(nbytes, name=name)
    if kind == "device":
        from kvd.pool.device import DeviceMemory

        return DeviceMemory(nbytes, device, name=name)
    if kind == "posix_fd":
        from kvd.pool.posix_fd import PosixFdMemory

        return PosixFdMemory(nbytes, device, name=name)
    if kind == "fabric":
        from kvd.pool.fabric import FabricMemory

        return FabricMemory(nbytes, device, name=name)
    raise BadRequest(f"unknown pool memory kind {kind!r}")


def _probe(device: int) -> str | None:
    from kvd.pool.fabric import probe_fabric

    return probe_fabric(device)


def _emit(note: Note) -> None:
    getattr(log, note.level)(note.event, **note.fields)


def choose_and_create(
    cfg: PoolConfig,
    env: Mapping[str, str] | None = None,
    *,
    nbytes: int | None = None,
    create: Creator = create_memory,
    probe: Prober = _probe,
) -> tuple[PoolMemory, str]:
    """Decide, probe and create a pool's memory; returns ``(memory, fallback_reason)``.

    ``env`` defaults to ``os.environ``; ``nbytes`` to the pool's size from its layout.
    ``create`` and ``probe`` are the real backends unless a test passes fakes.
    """
    env = os.environ if env is None else env
    decision = decide(cfg, env)
    for note in decision.notes:
        _emit(note)
    size = cfg.layout().pool_bytes(cfg.rank) if nbytes is None else nbytes
    name, dev = cfg.name, cfg.device
    reason = decision.reason
    if decision.try_fabric:
        error = probe(dev)
        if error is None:
            try:
                mem = create("fabric", size, dev, name)
            except PoolError as exc:
                error = exc.message
            else:
                log.info(
                    "pool.created", pool=name, kind="fabric", device=dev, nbytes=size, map_bytes=mem.map_bytes
                )
                return mem, ""
        if decision.fallback_kind is None:
            raise FabricUnavailable(
                f"pool {name!r}: fabric memory is required (require_fabric) but unavailable on GPU {dev}: {error}"
            )
        log.warning(
            "pool.fabric_unavailable", pool=name, device=dev, error=error, kind=decision.fallback_kind
        )
        reason = f"fabric memory unavailable: {error}"
    kind = decision.fallback_kind
    if kind is None:  # pragma: no cover - decide() never asks for fabric without trying it
        raise FabricUnavailable(f"pool {name!r}: fabric memory is required but was not tried")
    if kind == "posix_fd":
        log.warning(
            "pool.posix_fd_slow_nixl_target",
            pool=name,
            device=dev,
            detail="UCX cuda_ipc cannot target POSIX-fd VMM memory: NIXL writes into this pool are slow",
        )
    try:
        mem = create(kind, size, dev, name)
    except PoolError as exc:
        where = "host memory" if kind == "host" else f"{kind} memory on GPU {dev}"
        raise PoolError(f"pool {name!r}: cannot create {where}: {exc.message}") from None
    log.info(
        "pool.created",
        pool=name,
        kind=kind,
        device=dev,
        nbytes=size,
        map_bytes=mem.map_bytes,
        fallback_reason=reason,
    )
    return mem, reason
