"""Typed keyword arguments of :class:`protocol.layout.KVLayout`, for tests that build layouts from dicts.

Tests keep geometries and per-side overrides as dicts and merge them; annotating those dicts as
:class:`LayoutFields` lets mypy check every merged ``KVLayout(**kw)`` call field by field.
"""

from __future__ import annotations

from typing import TypedDict


class LayoutFields(TypedDict, total=False):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: str
    tp_size: int
    pp_size: int
    attention_dp: bool
    layer_split: tuple[int, ...] | None
    axis_order: tuple[str, ...]
    num_blocks: int


class Shape(TypedDict):
    """The model geometry without its element type (a pool config gives that separately)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int


class Geometry(Shape):
    """The model geometry every layout needs; the parallel layout is passed as keywords next to it."""

    dtype: str
