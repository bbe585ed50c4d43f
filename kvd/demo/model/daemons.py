"""The two kvd daemons of the model demo: ``gen`` (one pool per gen rank) and ``ctx`` (one pool).

Both run on loopback as real subprocesses (:func:`kvd.demo.launch.start_daemon`), share a fresh
peer secret, and the ctx daemon knows the gen daemon as its peer ``gen``. Host pools on the CPU;
on GPUs the ctx pool sits on GPU 0 and gen rank ``r``'s on GPU ``r % count``, memory policy
``auto`` (fabric memory where it works, else device memory with kvd's warning).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kvd.demo.launch import DaemonProcess, start_daemon
from kvd.demo.model.names import AXIS_ORDERS
from kvd.demo.model.options import DemoOptions
from kvd.demo.pair import write_secret


def gen_devices(opts: DemoOptions, tp: int | None = None) -> list[int]:
    """CUDA ordinal of each gen rank's pool (round robin over the GPUs), or -1 on the CPU."""
    tp = opts.gen_tp if tp is None else tp
    if opts.device == "cpu":
        return [-1] * tp
    count = torch.cuda.device_count()
    if count < 1:
        raise SystemExit("kvd demo --model --device cuda: no CUDA device visible")
    return [r % count for r in range(tp)]


def dist_backend(opts: DemoOptions) -> str:
    """gloo on the CPU; NCCL when every gen rank has a GPU of its own (NCCL needs that), else gloo
    (which all-reduces CUDA tensors too)."""
    if opts.backend != "auto":
        return opts.backend
    devices = gen_devices(opts)
    return "nccl" if opts.device == "cuda" and len(set(devices)) == len(devices) else "gloo"


def gen_pool(tp: int, rank: int) -> str:
    """Name of gen rank ``rank``'s pool at TP ``tp`` (a gen daemon may serve several TP sizes)."""
    return f"tp{tp}-gen{rank}"


def start_daemons(
    workdir: Path, opts: DemoOptions, gen_layouts: Mapping[int, tuple[str, int]] | None = None
) -> tuple[DaemonProcess, DaemonProcess]:
    """The gen daemon, then the ctx daemon (pool ``ctx0``) with gen as its peer.

    The gen daemon gets one pool per rank for each TP size in ``gen_layouts`` (TP size → axis
    order name and tokens per block; default: ``opts.gen_tp`` with ``opts.gen_axis_order`` and
    ``opts.gen_tokens_per_block``).
    """
    cfg = opts.model
    memory = "host" if opts.device == "cpu" else "auto"
    geometry: dict[str, Any] = {
        "num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "dtype": opts.dtype, "num_blocks": opts.pool_blocks,
    }
    common: dict[str, Any] = {
        "peer_secret_file": write_secret(workdir),
        "transfer": {"bounce_size_mb": 16, "chunk_mb": 2, "deadline_s": opts.timeout_s, "mapped": opts.mapped},
    }
    layouts = gen_layouts or {opts.gen_tp: (opts.gen_axis_order, opts.gen_tokens_per_block or opts.tokens_per_block)}
    gen_pools = [
        {"name": gen_pool(tp, r), "memory": memory, "device": dev, **geometry, "tp_size": tp, "rank": r,
         "axis_order": list(AXIS_ORDERS[order]), "tokens_per_block": tpb}
        for tp, (order, tpb) in layouts.items()
        for r, dev in enumerate(gen_devices(opts, tp))
    ]
    ctx_pool = {"name": "ctx0", "memory": memory, "device": -1 if opts.device == "cpu" else 0, **geometry,
                "axis_order": list(AXIS_ORDERS[opts.ctx_axis_order]), "tokens_per_block": opts.tokens_per_block}
    gen = start_daemon({**common, "pools": gen_pools}, workdir=workdir, name="gen")
    try:
        ctx = start_daemon(
            {**common, "pools": [ctx_pool], "peers": [{"name": "gen", "host": "127.0.0.1", "port": gen.peer_port}]},
            workdir=workdir, name="ctx",
        )
    except BaseException:
        gen.stop()
        raise
    return ctx, gen
