"""A pool: configuration + layout + memory + block leases, as the daemon's pool actor holds it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from kvd.config import PoolConfig
from kvd.mapping.views import typed_view
from kvd.pool.base import PoolMemory
from kvd.pool.blocks import BlockAllocator
from kvd.pool.policy import choose_and_create
from protocol.errors import BadRequest, PoolError
from protocol.layout import KVLayout
from protocol.messages import Attached, PoolInfo


class Pool:
    """One KV pool: ``memory`` holds ``layout.num_blocks`` blocks of rank ``rank``'s pool shape."""

    def __init__(self, cfg: PoolConfig, memory: PoolMemory, *, fallback_reason: str = "") -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.layout: KVLayout = cfg.layout()
        self.rank = cfg.rank
        self.memory = memory
        self.fallback_reason = fallback_reason
        need = self.layout.pool_bytes(self.rank)
        if memory.nbytes < need:
            raise PoolError(
                f"pool {self.name!r}: memory holds {memory.nbytes} bytes, the layout needs {need}"
            )
        self.blocks = BlockAllocator(self.layout.num_blocks, name=cfg.name)
        self._typed: torch.Tensor | None = None

    @classmethod
    def create(cls, cfg: PoolConfig, env: Mapping[str, str] | None = None, **kwargs: Any) -> Pool:
        """Choose the memory kind by policy (:func:`kvd.pool.policy.choose_and_create`) and build."""
        memory, reason = choose_and_create(cfg, env, **kwargs)
        try:
            return cls(cfg, memory, fallback_reason=reason)
        except BaseException:
            memory.close()
            raise

    # -- geometry --------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        return self.memory.kind

    @property
    def device(self) -> int:
        return self.memory.device

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes(self.rank)

    @property
    def pool_bytes(self) -> int:
        return self.layout.pool_bytes(self.rank)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.pool_shape(self.rank)

    @property
    def dtype(self) -> str:
        return self.layout.dtype

    @property
    def ptr(self) -> int:
        """Address of the pool's memory in this process (for NIXL registration, copies)."""
        return self.memory.ptr

    @property
    def nbytes(self) -> int:
        """Bytes of pool memory usable by blocks (``pool_bytes``)."""
        return self.memory.nbytes

    @property
    def map_bytes(self) -> int:
        """Bytes actually mapped (>= ``nbytes``: VMM granularity)."""
        return self.memory.map_bytes

    def tensor_u8(self) -> torch.Tensor:
        """The pool's bytes as a flat ``uint8`` tensor of ``nbytes`` (zero-copy)."""
        return self.memory.tensor()

    def tensor(self) -> torch.Tensor:
        """The pool as a tensor of ``dtype`` shaped ``layout.pool_shape(rank)`` (zero-copy)."""
        if self._typed is None:
            self._typed = typed_view(self.memory.tensor(), self.dtype, self.shape)
        return self._typed

    # -- replies ---------------------------------------------------------------------------
    def info(self, sessions: int | None = None) -> PoolInfo:
        """``PoolInfo`` for ``ListPools``/``Stats``/``Attached``; ``sessions`` defaults to the
        number of sessions holding blocks."""
        return PoolInfo(
            name=self.name,
            kind=self.kind,
            device=self.device,
            fallback_reason=self.fallback_reason,
            num_blocks=self.num_blocks,
            blocks_used=self.blocks.used,
            blocks_free=self.blocks.free_count,
            sessions=self.blocks.sessions if sessions is None else sessions,
            block_bytes=self.block_bytes,
            pool_bytes=self.pool_bytes,
            dtype=self.dtype,
            shape=self.shape,
            axis_order=tuple(self.layout.axis_order),
            layout=self.layout,
            rank=self.rank,
        )

    def attach_reply(self, request_id: int, *, sessions: int | None = None) -> tuple[Attached, list[int]]:
        """The ``Attached`` reply to ``AttachPool`` and the fds to send with it (SCM_RIGHTS).

        The fds stay owned by the pool: send them (the kernel duplicates them), don't close them.
        """
        exported = self.memory.export()
        reply = Attached(
            id=request_id,
            pool=self.info(sessions),
            handle_kind=exported.handle_kind,
            handle=exported.handle,
            map_bytes=self.memory.map_bytes,
        )
        return reply, list(exported.fds)

    def close(self) -> None:
        """Free the memory (idempotent). Tensor views must not be used afterwards."""
        self._typed = None
        self.memory.close()

    def __repr__(self) -> str:
        return (
            f"<Pool {self.name!r} kind={self.kind} device={self.device} blocks={self.num_blocks}"
            f" used={self.blocks.used}>"
        )


def create_pools(configs: Iterable[PoolConfig], env: Mapping[str, str] | None = None) -> dict[str, Pool]:
    """Create every configured pool (by policy), in order; on any failure close those made so far.

    Blocking (CUDA probes and allocations): run it in a thread from trio.
    """
    pools: dict[str, Pool] = {}
    try:
        for i, cfg in enumerate(configs):
            if cfg.name in pools:
                raise BadRequest(f"duplicate pool name {cfg.name!r}")
            try:
                pools[cfg.name] = Pool.create(cfg, env)
            except PoolError as exc:
                raise _located(exc, i, cfg) from None
    except BaseException:
        for pool in pools.values():
            pool.close()
        raise
    return pools


def _located(exc: PoolError, index: int, cfg: PoolConfig) -> PoolError:
    """A pool whose memory could not be created, with the settings that chose that memory and
    what to do (other pool errors as they are)."""
    if exc.code != PoolError.code or not exc.message.startswith(f"pool {cfg.name!r}: cannot create "):
        return exc
    at = f"pools[{index}]"
    todo = (f"{at}.device must name a GPU this machine has; for a pool in host memory set "
            f'memory = "host" and device = -1')
    what = exc.message.rstrip(". ")
    if "no CUDA driver" in exc.message:
        # not something a restart fixes: the configuration (or the machine) must change first
        return PoolSettingError(f"{at}.memory / {at}.device: {what}; this machine has no CUDA driver: set "
                                f'{at}.memory = "host" and {at}.device = -1 (a host-memory pool)', f"{at}.memory")
    return PoolError(f"{at}.memory / {at}.device: {what}; {todo}")


class PoolSettingError(PoolError):
    """A pool the configuration asks for that this machine cannot have as configured (a GPU
    pool with no CUDA driver): ``setting`` names the key to change; restarting cannot help."""

    def __init__(self, message: str, setting: str) -> None:
        super().__init__(message)
        self.setting = setting
