"""KV pool geometry and parallel layout, as plain data (no torch, no I/O).

A :class:`KVLayout` says how one side (ctx or gen) of a transfer holds a model's KV cache:
the model geometry (layers, KV heads, head_dim, tokens per block, dtype), the parallel
layout (TP, PP, attention DP, an optional uneven PP ``layer_split``), the axis order of each
rank's pool (C-contiguous) and the number of blocks in each rank's pool. It crosses the wire
inside ``Expect``/``Publish`` and is the planner's input (``kvd.regroup.plan.KVLayout`` is this class).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from protocol.errors import BadRequest
from protocol.limits import (
    MAX_HEAD_DIM,
    MAX_KV_HEADS,
    MAX_LAYERS,
    MAX_NUM_BLOCKS,
    MAX_TOKENS_PER_BLOCK,
    MAX_WORLD_SIZE,
)

#: Bytes per element of the dtypes kvd knows, keyed by torch dtype name.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

AXES = frozenset({"block", "layer", "kv", "head", "token", "dim"})
#: TensorRT-LLM's V1 pool: block-major, one head's tokens contiguous.
TRTLLM_AXIS_ORDER: tuple[str, ...] = ("block", "layer", "kv", "head", "token", "dim")
#: vLLM's HND layout: layer-major.
VLLM_AXIS_ORDER: tuple[str, ...] = ("layer", "kv", "block", "head", "token", "dim")


#: Upper bound of each geometry field (:mod:`protocol.limits`); the lower bound is 1.
_FIELD_MAX: dict[str, int] = {
    "num_layers": MAX_LAYERS,
    "num_kv_heads": MAX_KV_HEADS,
    "head_dim": MAX_HEAD_DIM,
    "tokens_per_block": MAX_TOKENS_PER_BLOCK,
    "tp_size": MAX_WORLD_SIZE,
    "pp_size": MAX_WORLD_SIZE,
}


#: Layouts seen valid, by their msgpack encoding: a request's layout is built four times per
#: registration (decoded, given the pool's block count, compared without blocks twice), always
#: the same few values, and each full :meth:`KVLayout.validate` costs about a microsecond. The
#: key is the encoding, not the layout: equal layouts of other field types (``64.0`` for
#: ``64``, built in Python, never decoded) encode differently and are validated on their own.
#: Only valid layouts enter; bounded (emptied when full), so distinct layouts sent at will
#: cost a validation each, as without the cache, and no memory.
_VALID: dict[bytes, None] = {}
VALID_CACHE_SIZE = 256
_encode = msgspec.msgpack.Encoder().encode


class KVLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Model geometry + parallel layout + pool axis order of one side of a transfer.

    Every field is bounded (:mod:`protocol.limits`): a layout that decodes describes at most
    ``MAX_WORLD_SIZE`` ranks of at most ``MAX_NUM_BLOCKS`` blocks, so nothing sized from a
    valid layout can be absurd; what a pool really holds is checked by the daemon.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: Annotated[str, msgspec.Meta(max_length=32)]
    tp_size: int = 1
    pp_size: int = 1
    attention_dp: bool = False
    layer_split: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_WORLD_SIZE)] | None = None
    axis_order: Annotated[
        tuple[Annotated[str, msgspec.Meta(max_length=16)], ...], msgspec.Meta(max_length=len(TRTLLM_AXIS_ORDER))
    ] = TRTLLM_AXIS_ORDER
    num_blocks: int = 0

    def __post_init__(self) -> None:
        try:
            key = _encode(self)
        except (TypeError, ValueError, OverflowError):  # not encodable: validate says what is wrong
            self.validate()
            return
        if key in _VALID:
            return
        self.validate()
        if len(_VALID) >= VALID_CACHE_SIZE:
            _VALID.clear()
        _VALID[key] = None

    # -- validation ------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise :class:`BadRequest` naming the first invalid field."""
        for name, most in _FIELD_MAX.items():
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise BadRequest(f"KVLayout.{name} must be a positive integer, got {value!r}")
            if value > most:
                raise BadRequest(f"KVLayout.{name}={value} exceeds the protocol limit of {most}")
        if self.tp_size * self.pp_size > MAX_WORLD_SIZE:
            raise BadRequest(
                f"KVLayout: tp_size*pp_size={self.tp_size * self.pp_size} ranks exceed the protocol "
                f"limit of {MAX_WORLD_SIZE}"
            )
        if not 0 <= self.num_blocks <= MAX_NUM_BLOCKS:
            raise BadRequest(f"KVLayout.num_blocks must be in [0, {MAX_NUM_BLOCKS}], got {self.num_blocks}")
        if not isinstance(self.dtype, str):
            # torch.bfloat16 and the like: the protocol carries the name, not the object
            name = str(self.dtype).removeprefix("torch.")
            hint = f" (here {name!r})" if name in DTYPE_SIZES else ""
            raise BadRequest(f"KVLayout.dtype must be a dtype's name, one of {sorted(DTYPE_SIZES)}{hint}, "
                             f"not {type(self.dtype).__name__} {self.dtype!r}")
        if self.dtype not in DTYPE_SIZES:
            raise BadRequest(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        if sorted(self.axis_order) != sorted(AXES) or len(self.axis_order) != len(AXES):
            raise BadRequest(
                f"KVLayout.axis_order must be a permutation of {sorted(AXES)}, got {list(self.axis_order)}"
            )
        if self.axis_order[-1] != "dim":
            raise BadRequest("KVLayout.axis_order must end with 'dim' (a head vector is contiguous)")
        tp = self.tp_size
        heads = self.num_kv_heads
        if tp <= heads:
            if heads % tp:
                raise BadRequest(f"num_kv_heads={heads} is not divisible by tp_size={tp}")
        elif tp % heads:
            raise BadRequest(f"tp_size={tp} > num_kv_heads={heads} must be a multiple of it")
        if self.layer_split is not None:
            if len(self.layer_split) != self.pp_size:
                raise BadRequest(
                    f"layer_split has {len(self.layer_split)} entries, pp_size is {self.pp_size}"
                )
            if any(n < 1 for n in self.layer_split) or sum(self.layer_split) != self.num_layers:
                raise BadRequest(
                    f"layer_split {list(self.layer_split)} must be positive and sum to num_layers={self.num_layers}"
                )
        elif self.num_layers % self.pp_size:
            raise BadRequest(
                f"num_layers={self.num_layers} is not divisible by pp_size={self.pp_size}; give layer_split"
            )

    # -- derived geometry ------------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    @property
    def world_size(self) -> int:
        """Number of ranks (pp_size * tp_size); rank = pp_rank * tp_size + tp_rank."""
        return self.tp_size * self.pp_size

    def layer_range(self, pp_rank: int) -> tuple[int, int]:
        """Half-open range of global layers held by PP stage ``pp_rank``."""
        split = self.layer_split or (self.num_layers // self.pp_size,) * self.pp_size
        start = sum(split[:pp_rank])
        return start, start + split[pp_rank]

    def heads_held(self) -> int:
        """KV heads in each rank's pool."""
        if self.attention_dp:
            return self.num_kv_heads
        return max(1, self.num_kv_heads // self.tp_size)

    def head_range(self, tp_rank: int) -> tuple[int, int]:
        """Half-open range of global KV heads held by TP rank ``tp_rank``."""
        if self.attention_dp:
            return 0, self.num_kv_heads
        if self.tp_size <= self.num_kv_heads:
            per = self.num_kv_heads // self.tp_size
            return tp_rank * per, (tp_rank + 1) * per
        head = tp_rank // (self.tp_size // self.num_kv_heads)
        return head, head + 1

    def local_shape(self, rank: int) -> dict[str, int]:
        """Axis sizes of rank ``rank``'s pool."""
        lo, hi = self.layer_range(rank // self.tp_size)
        return {
            "block": self.num_blocks,
            "layer": hi - lo,
            "kv": 2,
            "head": self.heads_held(),
            "token": self.tokens_per_block,
            "dim": self.head_dim,
        }

    def pool_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of rank ``rank``'s pool tensor in ``axis_order``."""
        sizes = self.local_shape(rank)
        return tuple(sizes[a] for a in self.axis_order)

    def block_bytes(self, rank: int) -> int:
        """Bytes one block occupies in rank ``rank``'s pool (all its layers)."""
        s = self.local_shape(rank)
        return s["layer"] * 2 * s["head"] * s["token"] * s["dim"] * self.itemsize

    def pool_bytes(self, rank: int) -> int:
        """Bytes of rank ``rank``'s whole pool."""
        return self.block_bytes(rank) * self.num_blocks
