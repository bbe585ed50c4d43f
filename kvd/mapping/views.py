"""Typed zero-copy views of raw pool bytes, shared by the daemon's pools and attached executors."""

from __future__ import annotations

import torch

from protocol.errors import BadRequest, PoolError


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (a :data:`protocol.layout.DTYPE_SIZES` key)."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise BadRequest(f"unknown dtype {name!r}")
    return dt


def typed_view(raw: torch.Tensor, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """View the uint8 tensor ``raw`` as ``dtype`` with ``shape`` (zero-copy)."""
    dt = torch_dtype(dtype)
    itemsize = torch.empty((), dtype=dt).element_size()
    need = itemsize
    for n in shape:
        need *= n
    if raw.numel() < need:
        raise PoolError(f"pool memory holds {raw.numel()} bytes, shape {shape} of {dtype} needs {need}")
    return raw[:need].view(dt).view(shape)
