"""A gen (decode) executor rank: TP2/TP4, one kvd pool per rank, torch.distributed between ranks.

Each rank holds the KV heads ``KVLayout.head_range(rank)`` of every request in its own pool.
For each request, in the order a serving framework's generation worker would:

1. ``alloc`` blocks for the prompt *and* the tokens it will decode (the framework's KV manager
   sizes a request's allocation the same way);
2. ``expect`` the request into the first ``ceil(prompt / tokens_per_block)`` of them: kvd
   writes this rank's heads of the ctx side's K/V there, in this pool's axis order;
3. ``wait`` for the completion (the data has landed when it returns), then decode greedily:
   every step writes the new token's K/V into the request's blocks after the prompt (the rest
   of the last prompt block first, then the further blocks) and attends over all of them, read
   straight from the pool; the row-parallel projections are summed over the TP group, and rank
   0's choice of the next token is broadcast so the ranks never diverge;
4. ``free`` the blocks when the request is done.

This replaces the receive half of a framework's transceiver: no NIXL agent, no metadata
exchange and no regroup in the executor; it names blocks, and kvd fills them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from clients.blocking import Client
from kvd.demo.model import control as c
from kvd.demo.model.ctx import completion_info, sync
from kvd.demo.model.paged import PagedKV, blocks_for, pool_layout
from kvd.demo.model.transformer import ModelConfig, Segment, TPDecoder, exact_float32, full_weights, warm_up
from kvd.mapping.views import torch_dtype


@dataclass(frozen=True)
class GenSpec:
    """What one gen rank is told at start."""

    socket_path: str
    pool: str
    rank: int
    tp_size: int
    dist_file: str  # FileStore rendezvous of the TP group (no port to race for)
    backend: str  # "gloo" or "nccl"
    model: ModelConfig
    dtype: str
    prompts: tuple[c.Prompt, ...]
    new_tokens: int
    threads: int = 1
    timeout_s: float = 120.0


def gen_main(conn: Connection, spec: GenSpec) -> None:
    """Process entry point of gen rank ``spec.rank``."""
    c.run_worker(f"gen{spec.rank}", conn, lambda: _run(conn, spec))


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t


def _run(conn: Connection, spec: GenSpec) -> None:
    torch.set_num_threads(spec.threads)
    exact_float32()
    name = f"gen{spec.rank}"
    with Client(spec.socket_path, client=f"gen-rank{spec.rank}") as kvd, kvd.attach(spec.pool) as pool:
        layout = pool_layout(spec.model, spec.dtype, spec.tp_size, spec.rank, pool.info)
        device = pool.tensor.device
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL binds the rank to the current device
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the TP group talks over loopback only
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # a few small all-reduces need no NVLink multicast
        dist.init_process_group(spec.backend, init_method=f"file://{spec.dist_file}", rank=spec.rank,
                                world_size=spec.tp_size)
        try:
            model = TPDecoder(spec.model, full_weights(spec.model), tp_rank=spec.rank, tp_size=spec.tp_size,
                              device=device, dtype=torch_dtype(spec.dtype), all_reduce=_all_reduce)
            cache = PagedKV(pool.tensor, layout, rank=spec.rank)
            warm_up(model)
            conn.send(c.Ready(name))
            if not isinstance(msg := conn.recv(), c.Start):
                raise RuntimeError(f"{name}: expected Start, got {type(msg).__name__}")
            tpb = layout.tokens_per_block
            blocks: dict[str, list[int]] = {}
            for p in spec.prompts:
                n = len(p.tokens)
                blocks[p.request_id] = kvd.alloc(spec.pool, blocks_for(n + spec.new_tokens, tpb))
                kvd.expect(p.request_id, spec.pool, layout, spec.rank, blocks[p.request_id][: blocks_for(n, tpb)])
            conn.send(c.Expected(name))
            if not isinstance(first := conn.recv(), c.FirstTokens):
                raise RuntimeError(f"{name}: expected FirstTokens, got {type(first).__name__}")
            done = {p.request_id: completion_info(kvd.wait(p.request_id, timeout_s=spec.timeout_s))
                    for p in spec.prompts}
            tokens, logits, seconds = _decode(model, cache, spec, blocks, first.tokens, device)
            for ids in blocks.values():
                kvd.free(spec.pool, ids)
            conn.send(c.GenDone(name, tokens, logits if spec.rank == 0 else {}, done, seconds,
                                device=str(device), backend=spec.backend))
        finally:
            dist.destroy_process_group()


def _decode(
    model: TPDecoder, cache: PagedKV, spec: GenSpec, blocks: dict[str, list[int]], first: dict[str, int],
    device: torch.device,
) -> tuple[dict[str, list[int]], dict[str, np.ndarray[Any, Any]], float]:
    """Greedy decode of every request as one batch; returns tokens, every step's logits, seconds."""
    rids = [p.request_id for p in spec.prompts]
    seqs = [cache.add(blocks[r]) for r in rids]
    lengths = [len(p.tokens) for p in spec.prompts]
    current = torch.tensor([first[r] for r in rids], device=device)
    tokens: dict[str, list[int]] = {r: [] for r in rids}
    steps: list[torch.Tensor] = []
    sync(device)
    t0 = time.perf_counter()
    for step in range(spec.new_tokens):
        segments = [Segment(s, n + step, 1) for s, n in zip(seqs, lengths, strict=True)]
        out = model.forward(current, segments, cache)
        nxt = out.argmax(dim=-1)
        dist.broadcast(nxt, src=0)  # rank 0 samples; every rank feeds the same tokens
        steps.append(out)
        current = nxt
        for r, t in zip(rids, nxt.tolist(), strict=True):
            tokens[r].append(int(t))
    sync(device)
    seconds = time.perf_counter() - t0
    stacked = torch.stack(steps, dim=1).cpu().numpy() if steps else np.zeros((len(rids), 0, 0), np.float32)
    return tokens, {r: stacked[i] for i, r in enumerate(rids)}, seconds
