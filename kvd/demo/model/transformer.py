"""A small decoder-only transformer in plain torch, written to run on a tensor-parallel shard.

Llama-shaped: RMSNorm, grouped-query attention with rotary position embeddings (RoPE), a
SwiGLU MLP, an untied LM head. The weights are random, drawn from a fixed seed on the CPU, so
every process (the reference, the ctx executor, every gen rank, on CPU or GPU) builds the same
model without downloading anything.

Tensor parallelism follows Megatron: the Q/K/V projections are column-parallel (rank ``r`` of
``tp`` holds query heads and KV heads ``[r * n / tp, (r + 1) * n / tp)``), the attention output
projection is row-parallel (each rank multiplies its heads' slice, an all-reduce sums the
partial results), and the MLP the same way (gate/up column-parallel, down row-parallel). The
embedding, the norms and the LM head are replicated. So a rank attends over exactly the KV heads
its KV pool holds: the heads ``KVLayout.head_range(rank)`` names.

Arithmetic is float32 everywhere. ``dtype`` rounds the weights and the KV cache to that dtype
(``bfloat16`` is what a GPU deployment stores; the KV cache in that dtype is what kvd moves), but
products are accumulated in float32: the only difference between one process and a TP group is
then the order of float32 sums, which keeps greedy tokens identical and logits within float32
rounding (a bf16 all-reduce would round each partial sum and flip near-tied tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

#: Sums a tensor over the TP group in place and returns it (identity at TP1).
AllReduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelConfig:
    """Geometry of the model; ``seed`` fixes its random weights."""

    vocab_size: int = 512
    hidden: int = 512
    num_layers: int = 4
    num_q_heads: int = 16
    num_kv_heads: int = 8
    head_dim: int = 64
    intermediate: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    seed: int = 0

    def check_tp(self, tp_size: int) -> None:
        """Raise ``ValueError`` unless ``tp_size`` splits the query heads, KV heads and MLP evenly."""
        if tp_size < 1 or self.num_kv_heads % tp_size or self.num_q_heads % tp_size or self.intermediate % tp_size:
            raise ValueError(
                f"tp_size={tp_size} must divide num_kv_heads={self.num_kv_heads}, "
                f"num_q_heads={self.num_q_heads} and intermediate={self.intermediate}"
            )
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")


def exact_float32() -> None:
    """Keep float32 matrix products in float32 on GPUs (no TF32): the comparison with the
    reference relies on it. Process-wide; called by the demo's executors and its driver."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def full_weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every weight of the model (float32, CPU), drawn from ``cfg.seed``.

    Linear weights are ``[out, in]`` (``torch.nn.Linear``'s convention) with standard deviation
    ``1/sqrt(in)``, so activations stay near unit scale; the LM head is scaled up so that logits
    spread over a few units and greedy choices are clear-cut.
    """
    gen = torch.Generator().manual_seed(cfg.seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + normal(cfg.hidden, std=0.1)

    h, d, i = cfg.hidden, cfg.head_dim, cfg.intermediate
    w: dict[str, torch.Tensor] = {"embed": normal(cfg.vocab_size, h, std=1.0)}
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}."
        w[p + "attn_norm"] = norm_weight()
        w[p + "wq"] = normal(cfg.num_q_heads * d, h, std=h**-0.5)
        w[p + "wk"] = normal(cfg.num_kv_heads * d, h, std=h**-0.5)
        w[p + "wv"] = normal(cfg.num_kv_heads * d, h, std=h**-0.5)
        w[p + "wo"] = normal(h, cfg.num_q_heads * d, std=(cfg.num_q_heads * d) ** -0.5)
        w[p + "mlp_norm"] = norm_weight()
        w[p + "w_gate"] = normal(i, h, std=h**-0.5)
        w[p + "w_up"] = normal(i, h, std=h**-0.5)
        w[p + "w_down"] = normal(h, i, std=i**-0.5)
    w["final_norm"] = norm_weight()
    w["lm_head"] = normal(cfg.vocab_size, h, std=4.0 * h**-0.5)
    return w


class KVStore(Protocol):
    """Where attention keeps and finds a sequence's keys and values (this rank's KV heads).

    ``k``/``v`` are ``[heads, tokens, head_dim]`` in the store's dtype; ``start`` and
    ``length`` are token positions in the sequence.
    """

    def write(self, seq: int, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def read(self, seq: int, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class Segment:
    """``length`` consecutive tokens of sequence ``seq`` starting at position ``start``.

    A prefill is one segment from position 0; a decode step is one segment of length 1 per
    sequence at its current length.
    """

    seq: int
    start: int
    length: int


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TPDecoder:
    """One tensor-parallel rank of the model (``tp_size=1``: the whole model).

    ``forward`` runs a packed batch of segments through every layer: it writes each segment's
    new K/V into ``kv`` (this rank's heads only), attends over the sequence's K/V read back
    from ``kv`` and returns the logits of each segment's last token (float32, replicated on
    every rank).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        all_reduce: AllReduce | None = None,
    ) -> None:
        cfg.check_tp(tp_size)
        if tp_size > 1 and all_reduce is None:
            raise ValueError("a TP rank needs an all_reduce over its group")
        self.cfg = cfg
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = torch.device(device)
        self.kv_dtype = dtype
        self._all_reduce: AllReduce = all_reduce or (lambda t: t)
        self.q_heads = cfg.num_q_heads // tp_size
        self.kv_heads = cfg.num_kv_heads // tp_size
        self.group = cfg.num_q_heads // cfg.num_kv_heads  # query heads per KV head
        d = cfg.head_dim
        q0, k0, i0 = tp_rank * self.q_heads * d, tp_rank * self.kv_heads * d, tp_rank * cfg.intermediate // tp_size
        q_rows, k_rows, i_rows = slice(q0, q0 + self.q_heads * d), slice(k0, k0 + self.kv_heads * d), slice(
            i0, i0 + cfg.intermediate // tp_size
        )

        def put(t: torch.Tensor) -> torch.Tensor:
            # rounded to the storage dtype, computed in float32 (see the module docstring)
            return t.to(dtype).to(device=self.device, dtype=torch.float32).contiguous()

        self.embed = put(weights["embed"])
        self.final_norm = put(weights["final_norm"])
        self.lm_head = put(weights["lm_head"])
        self.layers: list[dict[str, torch.Tensor]] = []
        for layer in range(cfg.num_layers):
            p = f"layers.{layer}."
            self.layers.append(
                {
                    "attn_norm": put(weights[p + "attn_norm"]),
                    "wq": put(weights[p + "wq"][q_rows]),  # column-parallel: this rank's heads
                    "wk": put(weights[p + "wk"][k_rows]),
                    "wv": put(weights[p + "wv"][k_rows]),
                    "wo": put(weights[p + "wo"][:, q_rows]),  # row-parallel: partial sums
                    "mlp_norm": put(weights[p + "mlp_norm"]),
                    "w_gate": put(weights[p + "w_gate"][i_rows]),
                    "w_up": put(weights[p + "w_up"][i_rows]),
                    "w_down": put(weights[p + "w_down"][:, i_rows]),
                }
            )
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        self._inv_freq = inv_freq.to(self.device)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float64)[:, None] * self._inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(torch.float32), emb.sin().to(torch.float32)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """q ``[q_heads, n, d]`` at positions ``start..start+n``; k, v ``[kv_heads, start+n, d]``."""
        k = k.to(torch.float32).repeat_interleave(self.group, dim=0)
        v = v.to(torch.float32).repeat_interleave(self.group, dim=0)
        n, total = q.shape[1], k.shape[1]
        scores = torch.matmul(q, k.transpose(1, 2)) / math.sqrt(self.cfg.head_dim)
        qpos = torch.arange(start, start + n, device=q.device)[:, None]
        kpos = torch.arange(total, device=q.device)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))  # causal
        return torch.matmul(torch.softmax(scores, dim=-1), v)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment], kv: KVStore) -> torch.Tensor:
        """``tokens``: the segments' tokens concatenated; returns ``[len(segments), vocab]``."""
        cfg, d = self.cfg, self.cfg.head_dim
        if tokens.numel() != sum(s.length for s in segments):
            raise ValueError(f"{tokens.numel()} tokens for segments totalling {sum(s.length for s in segments)}")
        tokens = tokens.to(self.device)
        positions = torch.cat(
            [torch.arange(s.start, s.start + s.length, device=self.device) for s in segments]
        )
        cos, sin = self._rope(positions)
        x = self.embed[tokens]
        for layer, w in enumerate(self.layers):
            h = _rms_norm(x, w["attn_norm"], cfg.norm_eps)
            q = (h @ w["wq"].T).view(-1, self.q_heads, d)
            k = (h @ w["wk"].T).view(-1, self.kv_heads, d)
            v = (h @ w["wv"].T).view(-1, self.kv_heads, d)
            q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
            k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
            outs: list[torch.Tensor] = []
            offset = 0
            for s in segments:
                rows = slice(offset, offset + s.length)
                offset += s.length
                # the cache holds K/V in its dtype: attention reads back exactly what a peer
                # holding this cache (a gen rank after a kvd transfer) would read
                kv.write(s.seq, layer, s.start, k[rows].transpose(0, 1).to(self.kv_dtype),
                         v[rows].transpose(0, 1).to(self.kv_dtype))
                keys, values = kv.read(s.seq, layer, s.start + s.length)
                o = self._attend(q[rows].transpose(0, 1), keys, values, s.start)
                outs.append(o.transpose(0, 1).reshape(s.length, self.q_heads * d))
            x = x + self._all_reduce(torch.cat(outs) @ w["wo"].T)
            h = _rms_norm(x, w["mlp_norm"], cfg.norm_eps)
            gate = torch.nn.functional.silu(h @ w["w_gate"].T)
            x = x + self._all_reduce((gate * (h @ w["w_up"].T)) @ w["w_down"].T)
        last = torch.tensor([0, *[s.length for s in segments]], device=self.device).cumsum(0)[1:] - 1
        h = _rms_norm(x[last], self.final_norm, cfg.norm_eps)
        return h @ self.lm_head.T


def warm_up(model: TPDecoder) -> None:
    """One prefill and one decode step on a scratch cache (not the pool), so the first request's
    timings leave out one-time setup: CUDA kernels and cuBLAS handles, the TP group's first
    collective (NCCL builds its communicator there)."""
    cache = DenseKV(model.cfg, [8], heads=model.kv_heads, device=model.device, dtype=model.kv_dtype)
    model.forward(torch.arange(7), [Segment(0, 0, 7)], cache)
    model.forward(torch.tensor([7]), [Segment(0, 7, 1)], cache)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


class DenseKV:
    """A contiguous per-sequence KV cache (the single-process reference; no kvd)."""

    def __init__(self, cfg: ModelConfig, max_tokens: Sequence[int], *, heads: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self._cache = [
            torch.zeros((cfg.num_layers, 2, heads, n, cfg.head_dim), device=device, dtype=dtype) for n in max_tokens
        ]

    def write(self, seq: int, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[1]
        self._cache[seq][layer, 0, :, start : start + n] = k
        self._cache[seq][layer, 1, :, start : start + n] = v

    def read(self, seq: int, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self._cache[seq]
        return c[layer, 0, :, :length], c[layer, 1, :, :length]
