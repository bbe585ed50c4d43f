"""The ctx (prefill) executor: TP1, one kvd pool, K/V written straight into kvd's blocks.

What it does for each request, in the order a serving framework's context worker would:

1. ``alloc`` the blocks that hold the prompt from its kvd pool (the framework's KV manager
   would pick free blocks of a pool it owns; here kvd owns the pool and leases them);
2. run the prefill: every layer writes the prompt's K/V into those blocks through the pool
   tensor that ``attach`` mapped (:class:`~kvd.demo.model.paged.PagedKV`), in the pool's axis
   order; the last position's logits give the first generated token;
3. make the writes visible (on a GPU: synchronise the device, since kvd reads the memory from
   its own process and streams), then ``publish`` the request to the gen node's daemon;
4. later, ``wait`` for the transfer's completion and ``free`` the blocks.

This replaces the send half of a framework's own transceiver (TensorRT-LLM's cache
transceiver, vLLM's KV connector): instead of posting the blocks to a NIXL agent of its own,
the executor names the blocks and the peer node, and kvd moves and regroups them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from clients.blocking import Client
from kvd.demo.model import control as c
from kvd.demo.model.paged import PagedKV, blocks_for, pool_layout
from kvd.demo.model.transformer import ModelConfig, Segment, TPDecoder, exact_float32, full_weights, warm_up
from kvd.mapping.views import torch_dtype
from protocol.messages import Completion


@dataclass(frozen=True)
class CtxSpec:
    """What the ctx executor is told at start (a serving framework's worker config)."""

    socket_path: str
    pool: str
    peer: str  # the gen node's daemon, as this daemon's configuration names it
    model: ModelConfig
    dtype: str
    prompts: tuple[c.Prompt, ...]
    threads: int = 1
    timeout_s: float = 120.0


def completion_info(done: Completion) -> c.CompletionInfo:
    """The figures of a kvd completion the driver prints."""
    return c.CompletionInfo(done.path, done.bytes, done.duration_s, done.chunks, done.fallback)


def sync(device: torch.device) -> None:
    """Wait until this process's writes to ``device`` memory have landed (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ctx_main(conn: Connection, spec: CtxSpec) -> None:
    """Process entry point of the ctx executor."""
    c.run_worker("ctx0", conn, lambda: _run(conn, spec))


def _run(conn: Connection, spec: CtxSpec) -> None:
    torch.set_num_threads(spec.threads)
    exact_float32()
    with Client(spec.socket_path, client="ctx-rank0") as kvd, kvd.attach(spec.pool) as pool:
        layout = pool_layout(spec.model, spec.dtype, 1, 0, pool.info)
        device = pool.tensor.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        model = TPDecoder(spec.model, full_weights(spec.model), device=device, dtype=torch_dtype(spec.dtype))
        cache = PagedKV(pool.tensor, layout, rank=0)
        warm_up(model)
        conn.send(c.Ready("ctx0"))
        msg = conn.recv()
        if not isinstance(msg, c.Start):
            raise RuntimeError(f"ctx0: expected Start, got {type(msg).__name__}")
        first: dict[str, int] = {}
        seconds: dict[str, float] = {}
        logits_out: dict[str, np.ndarray[Any, Any]] = {}
        blocks: dict[str, list[int]] = {}
        for prompt in spec.prompts:
            rid, n = prompt.request_id, len(prompt.tokens)
            blocks[rid] = kvd.alloc(spec.pool, blocks_for(n, layout.tokens_per_block))
            seq = cache.add(blocks[rid])
            sync(device)
            t0 = time.perf_counter()
            logits = model.forward(torch.tensor(prompt.tokens), [Segment(seq, 0, n)], cache)[0]
            first[rid] = int(logits.argmax())
            sync(device)  # the K/V is in the pool before kvd is told to move it
            seconds[rid] = time.perf_counter() - t0
            logits_out[rid] = logits.cpu().numpy()
            kvd.publish(rid, spec.pool, layout, 0, blocks[rid], peer=spec.peer)
        conn.send(c.Published("ctx0", first, seconds, logits_out, {r: len(b) for r, b in blocks.items()}))
        done: dict[str, c.CompletionInfo] = {}
        for prompt in spec.prompts:
            rid = prompt.request_id
            done[rid] = completion_info(kvd.wait(rid, timeout_s=spec.timeout_s))
            kvd.free(spec.pool, blocks[rid])  # the peer has its copy: the blocks serve the next request
        conn.send(c.CtxDone("ctx0", done))
