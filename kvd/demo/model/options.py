"""What one run of ``kvd demo --model`` is: its options and its prompts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from kvd.demo.model.control import Prompt
from kvd.demo.model.transformer import ModelConfig

Order = Literal["gen-first", "ctx-first"]


@dataclass(frozen=True)
class DemoOptions:
    """One run of the model demo."""

    gen_tp: int = 4
    order: Order = "gen-first"
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: str = "float32"
    prompt_lengths: tuple[int, ...] = (5, 16, 37, 90, 130)
    new_tokens: int = 24
    tokens_per_block: int = 16  # the ctx pool's
    gen_tokens_per_block: int = 0  # the gen pools' (0 = the ctx pool's); one must divide the other
    pool_blocks: int = 64
    mapped: bool = True  # same-node mapped path; False = NIXL (bounce buffer, or direct)
    ctx_axis_order: str = "trtllm"
    gen_axis_order: str = "trtllm"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    model: ModelConfig = field(default_factory=ModelConfig)
    threads: int = 1
    timeout_s: float = 120.0
    request_prefix: str = "req"


def make_prompts(lengths: tuple[int, ...], vocab: int, prefix: str = "req", seed: int = 1) -> tuple[Prompt, ...]:
    """Random prompts of the given lengths (fixed seed), ids ``<prefix>-0``, ``<prefix>-1``, ..."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        Prompt(f"{prefix}-{i}", tuple(int(t) for t in torch.randint(0, vocab, (n,), generator=gen)))
        for i, n in enumerate(lengths)
    )
