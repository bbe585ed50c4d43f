"""What one ``kvd bench transfer --layout`` run moves and where: the two sides' parallel layouts,
the ranks each request names, and the GPU of every rank's pool.

Plain data and checks (no torch, no daemons): :mod:`kvd.bench.layouts` runs what this describes.

Placement rules (each broken rule is one :class:`SpecError` line):

- a GPU list is comma-separated ordinals, each at most once, each below the machine's GPU count;
- ``--gen-gpus`` lists at most one GPU per gen rank; gen rank ``g`` sits on ``gen_gpus[g % n]``
  (a shorter list wraps: on two GPUs every gen pool shares GPU 1);
- ``--ctx-gpus`` lists at most one GPU per ctx rank (wrapping the same way), or a multiple of the
  ctx world size: then the ctx daemon holds one ctx *instance* (a full set of ctx ranks) per
  ``world`` GPUs, as several ctx engines on one node do, and instance ``k``'s rank ``r`` sits on
  ``ctx_gpus[k * world + r]``;
- no GPU is in both lists: ctx and gen pools on one GPU would measure a local copy, not the link.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.errors import KvdError
from protocol.layout import KVLayout

#: Options that select the layout bench (``kvd bench transfer`` hands the run over to
#: :mod:`kvd.bench.layouts` when one is given; asked here, without importing torch).
OPTIONS = ("--layout", "--ctx-gpus", "--gen-gpus", "--concurrent", "--concurrent-blocks", "--paths")


def wanted(argv: list[str]) -> bool:
    """Whether ``argv`` asks for the layout bench."""
    return any(a.split("=", 1)[0] in OPTIONS for a in argv)


#: GPT-OSS-120B's KV geometry (the seed's model): 2.25 MiB a block at TP1.
GPT_OSS_120B: dict[str, Any] = {
    "num_layers": 36,
    "num_kv_heads": 8,
    "head_dim": 64,
    "tokens_per_block": 32,
    "dtype": "bfloat16",
}


class SpecError(Exception):
    """A layout or GPU list the bench cannot run; the message is one line for the user."""


@dataclass(frozen=True)
class Side:
    """One side's parallel layout (the model geometry is shared by both sides)."""

    tp_size: int = 1
    pp_size: int = 1
    attention_dp: bool = False
    layer_split: tuple[int, ...] | None = None

    def layout(self, geometry: dict[str, Any], num_blocks: int = 0) -> KVLayout:
        """This side's :class:`KVLayout`; an impossible one raises :class:`SpecError`."""
        try:
            return KVLayout(**geometry, tp_size=self.tp_size, pp_size=self.pp_size,
                            attention_dp=self.attention_dp, layer_split=self.layer_split, num_blocks=num_blocks)
        except KvdError as exc:
            raise SpecError(f"layout {self.describe()}: {exc.message}") from None
        except TypeError as exc:
            raise SpecError(f"layout {self.describe()}: {exc}") from None

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def describe(self) -> str:
        """``TP2``, ``PP2``, ``TP4 attention-DP``, ``TP2 PP2 layers [20, 16]``."""
        parts = []
        if self.tp_size > 1 or self.pp_size == 1:
            parts.append(f"TP{self.tp_size}")
        if self.pp_size > 1:
            parts.append(f"PP{self.pp_size}")
        if self.attention_dp:
            parts.append("attention-DP")
        if self.layer_split:
            parts.append(f"layers {list(self.layer_split)}")
        return " ".join(parts)

    def request_ranks(self, index: int) -> list[int]:
        """The ranks request number ``index`` names on this side.

        Every rank, except under attention DP: there a request lives on one DP rank per PP
        stage, and consecutive requests take consecutive DP ranks (round robin).
        """
        if not self.attention_dp:
            return list(range(self.world_size))
        dp = index % self.tp_size
        return [stage * self.tp_size + dp for stage in range(self.pp_size)]

    def as_dict(self) -> dict[str, Any]:
        return {"tp_size": self.tp_size, "pp_size": self.pp_size, "attention_dp": self.attention_dp,
                "layer_split": list(self.layer_split) if self.layer_split else None}


#: The layout kinds ``--layout`` names: (ctx, gen).
KINDS: dict[str, tuple[Side, Side]] = {
    "tp1-tp4": (Side(tp_size=1), Side(tp_size=4)),
    "tp2-tp4": (Side(tp_size=2), Side(tp_size=4)),
    "tp4-tp1": (Side(tp_size=4), Side(tp_size=1)),
    "pp2-pp1": (Side(pp_size=2), Side()),
    "tp1-dp4": (Side(tp_size=1), Side(tp_size=4, attention_dp=True)),
}

_SIDE_KEYS = {"tp_size", "pp_size", "attention_dp", "layer_split"}


@dataclass(frozen=True)
class LayoutSpec:
    """What one bench run moves: its name, both sides, the model geometry."""

    name: str
    ctx: Side
    gen: Side
    geometry: dict[str, Any]

    def layouts(self) -> tuple[KVLayout, KVLayout]:
        """Both sides' layouts, checked (each valid, and regroupable into the other)."""
        ctx, gen = self.ctx.layout(self.geometry), self.gen.layout(self.geometry)
        if self.ctx.attention_dp:
            raise SpecError(f"layout {self.name}: the bench runs attention DP on the gen side only")
        return ctx, gen


def _side(table: Any, where: str) -> Side:
    if not isinstance(table, dict):
        raise SpecError(f"{where}: expected a table ([ctx] / [gen])")
    unknown = set(table) - _SIDE_KEYS
    if unknown:
        raise SpecError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(_SIDE_KEYS)}")
    split = table.get("layer_split")
    try:
        side = Side(tp_size=int(table.get("tp_size", 1)), pp_size=int(table.get("pp_size", 1)),
                    attention_dp=bool(table.get("attention_dp", False)),
                    layer_split=tuple(int(n) for n in split) if split is not None else None)
    except (TypeError, ValueError) as exc:
        raise SpecError(f"{where}: {exc}") from None
    return side


def load_layout(arg: str) -> LayoutSpec:
    """A layout kind (``tp1-tp4`` ...) or a TOML file with ``[ctx]``, ``[gen]`` and optionally
    ``[geometry]`` (fields of :data:`GPT_OSS_120B` to override)."""
    if arg in KINDS:
        ctx, gen = KINDS[arg]
        spec = LayoutSpec(arg, ctx, gen, dict(GPT_OSS_120B))
    else:
        path = Path(arg)
        if not path.is_file():
            raise SpecError(f"--layout {arg!r} is neither a layout kind ({', '.join(KINDS)}) nor a file")
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise SpecError(f"--layout {arg}: {exc}") from None
        unknown = set(data) - {"ctx", "gen", "geometry"}
        if unknown or "ctx" not in data or "gen" not in data:
            raise SpecError(f"--layout {arg}: needs tables [ctx] and [gen] (and optionally [geometry]), "
                            f"found {sorted(data)}")
        geometry = data.get("geometry", {})
        if not isinstance(geometry, dict) or set(geometry) - set(GPT_OSS_120B):
            raise SpecError(f"--layout {arg}: [geometry] may set {sorted(GPT_OSS_120B)} only")
        spec = LayoutSpec(path.stem, _side(data["ctx"], f"{arg} [ctx]"), _side(data["gen"], f"{arg} [gen]"),
                          {**GPT_OSS_120B, **geometry})
    spec.layouts()  # fail here, with one line, rather than in a daemon
    return spec


def parse_gpus(option: str, text: str) -> tuple[int, ...]:
    """``"0,1,2"`` -> ``(0, 1, 2)``; non-integers, negatives, duplicates and empty lists fail."""
    items = [s.strip() for s in text.split(",")]
    if not text.strip() or any(not s for s in items):
        raise SpecError(f"{option} {text!r}: give comma-separated GPU ordinals, e.g. 1,2,3,4")
    gpus: list[int] = []
    for s in items:
        if not s.isdigit():
            raise SpecError(f"{option} {text!r}: {s!r} is not a GPU ordinal")
        if int(s) in gpus:
            raise SpecError(f"{option} {text!r} names GPU {int(s)} twice")
        gpus.append(int(s))
    return tuple(gpus)


@dataclass(frozen=True)
class Placement:
    """The GPU of every ctx and gen rank's pool."""

    ctx_gpus: tuple[int, ...]
    gen_gpus: tuple[int, ...]
    ctx_world: int
    gen_world: int

    @property
    def instances(self) -> int:
        """ctx instances the ctx daemon holds (one full set of ctx ranks each)."""
        return max(1, len(self.ctx_gpus) // self.ctx_world)

    def ctx_gpu(self, instance: int, rank: int) -> int:
        if self.instances > 1:
            return self.ctx_gpus[instance * self.ctx_world + rank]
        return self.ctx_gpus[rank % len(self.ctx_gpus)]

    def gen_gpu(self, rank: int) -> int:
        return self.gen_gpus[rank % len(self.gen_gpus)]

    def as_dict(self) -> dict[str, Any]:
        return {
            "ctx_gpus": list(self.ctx_gpus), "gen_gpus": list(self.gen_gpus), "ctx_instances": self.instances,
            "ctx_ranks": [{"instance": k, "rank": r, "gpu": self.ctx_gpu(k, r)}
                          for k in range(self.instances) for r in range(self.ctx_world)],
            "gen_ranks": [{"rank": g, "gpu": self.gen_gpu(g)} for g in range(self.gen_world)],
        }


def place(ctx_gpus: tuple[int, ...], gen_gpus: tuple[int, ...], spec: LayoutSpec, have: int | None) -> Placement:
    """Check the lists against the layout (and against ``have`` GPUs, when given)."""
    ctx_world, gen_world = spec.ctx.world_size, spec.gen.world_size
    if have is not None:
        for option, gpus in (("--ctx-gpus", ctx_gpus), ("--gen-gpus", gen_gpus)):
            beyond = [g for g in gpus if g >= have]
            if beyond:
                raise SpecError(f"{option} names GPU {beyond[0]}; this machine has {have} CUDA GPU(s)"
                                + (f" (0-{have - 1})" if have else ""))
    shared = sorted(set(ctx_gpus) & set(gen_gpus))
    if shared:
        raise SpecError(f"--ctx-gpus and --gen-gpus share GPU {shared[0]}: ctx and gen pools on one GPU "
                        "would measure a local copy, not the link")
    if len(gen_gpus) > gen_world:
        raise SpecError(f"--gen-gpus lists {len(gen_gpus)} GPUs for gen {spec.gen.describe()}'s {gen_world} "
                        f"rank(s): give at most {gen_world}")
    if len(ctx_gpus) > ctx_world and len(ctx_gpus) % ctx_world:
        raise SpecError(f"--ctx-gpus lists {len(ctx_gpus)} GPUs for ctx {spec.ctx.describe()}'s {ctx_world} "
                        f"rank(s): give at most {ctx_world} (shorter lists wrap) or a multiple of {ctx_world} "
                        "(one ctx instance per group)")
    return Placement(ctx_gpus, gen_gpus, ctx_world, gen_world)
