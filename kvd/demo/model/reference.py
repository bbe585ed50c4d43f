"""The single-process reference (prefill and decode in one process, no kvd) and the comparison.

The reference runs the whole model (TP1) with a contiguous KV cache, one request at a time:
prefill, then greedy decode from its own cache. The disaggregated run must give the same
first token (ctx), the same decoded tokens at every step (gen), and logits within the dtype's
tolerance; :func:`compare` names the request and step of every difference.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvd.demo.model.control import GenDone, Prompt, Published
from kvd.demo.model.transformer import DenseKV, ModelConfig, Segment, TPDecoder, full_weights
from kvd.mapping.views import torch_dtype


@dataclass(frozen=True)
class ReferenceResult:
    """Per request: the prefill's logits and first token, then each decode step's token and logits."""

    first_tokens: dict[str, int]
    prefill_logits: dict[str, np.ndarray[Any, Any]]
    tokens: dict[str, list[int]]
    logits: dict[str, np.ndarray[Any, Any]]  # [steps, vocab]


def reference_run(
    cfg: ModelConfig, dtype: str, device: torch.device | str, prompts: Sequence[Prompt], new_tokens: int
) -> ReferenceResult:
    """Prefill + greedy decode of every prompt in this process, with the whole model."""
    model = TPDecoder(cfg, full_weights(cfg), device=device, dtype=torch_dtype(dtype))
    cache = DenseKV(cfg, [len(p.tokens) + new_tokens for p in prompts], heads=cfg.num_kv_heads,
                    device=model.device, dtype=torch_dtype(dtype))
    first: dict[str, int] = {}
    prefill: dict[str, np.ndarray[Any, Any]] = {}
    tokens: dict[str, list[int]] = {}
    logits: dict[str, np.ndarray[Any, Any]] = {}
    for seq, p in enumerate(prompts):
        n = len(p.tokens)
        out = model.forward(torch.tensor(p.tokens), [Segment(seq, 0, n)], cache)[0]
        first[p.request_id] = token = int(out.argmax())
        prefill[p.request_id] = out.cpu().numpy()
        steps: list[np.ndarray[Any, Any]] = []
        tokens[p.request_id] = []
        for step in range(new_tokens):
            out = model.forward(torch.tensor([token]), [Segment(seq, n + step, 1)], cache)[0]
            token = int(out.argmax())
            tokens[p.request_id].append(token)
            steps.append(out.cpu().numpy())
        logits[p.request_id] = np.stack(steps) if steps else np.zeros((0, cfg.vocab_size), np.float32)
    return ReferenceResult(first, prefill, tokens, logits)


@dataclass(frozen=True)
class Comparison:
    """What :func:`compare` found: the differences (empty = identical) and the largest logit gap."""

    mismatches: list[str]
    max_logit_diff: float

    @property
    def token_identical(self) -> bool:
        return not self.mismatches


def compare(
    ref: ReferenceResult, published: Published, gens: Mapping[str, GenDone], tolerance: float
) -> Comparison:
    """Compare the ctx executor's prefill and the gen ranks' decode with the reference.

    Tokens must be identical; logits within ``tolerance``. A request's comparison stops at its
    first differing token (every later step would differ too). Every gen rank must report the
    same tokens (rank 0's choices are broadcast; a difference means the ranks diverged).
    """
    out: list[str] = []
    worst = 0.0
    rank0 = gens.get("gen0")
    if rank0 is None:
        return Comparison(["gen rank 0 reported nothing"], float("inf"))
    for rid, want in ref.first_tokens.items():
        got = published.first_tokens.get(rid)
        if got is None:
            out.append(f"{rid}: the ctx executor reported no prefill")
            continue
        diff = float(np.abs(published.prefill_logits[rid] - ref.prefill_logits[rid]).max())
        worst = max(worst, diff)
        if got != want:
            out.append(f"{rid} prefill: first token {got}, reference {want}")
            continue
        if diff > tolerance:
            out.append(f"{rid} prefill: logits differ by {diff:.3g} (tolerance {tolerance:g})")
        toks, logits = rank0.tokens.get(rid), rank0.logits.get(rid)
        if toks is None or logits is None:
            out.append(f"{rid}: gen rank 0 reported no decode")
            continue
        if len(toks) != len(ref.tokens[rid]):
            out.append(f"{rid}: decoded {len(toks)} tokens, reference {len(ref.tokens[rid])}")
        for step, (t, r) in enumerate(zip(toks, ref.tokens[rid], strict=False)):
            diff = float(np.abs(logits[step] - ref.logits[rid][step]).max())
            worst = max(worst, diff)
            if t != r:
                out.append(f"{rid} step {step}: token {t}, reference {r} (logits differ by {diff:.3g})")
                break
            if diff > tolerance:
                out.append(f"{rid} step {step}: logits differ by {diff:.3g} (tolerance {tolerance:g})")
        for name, g in sorted(gens.items()):
            if g.tokens.get(rid) != toks:
                out.append(f"{rid}: {name} decoded {g.tokens.get(rid)}, gen0 {toks} (TP ranks diverged)")
    return Comparison(out, worst)
