"""The named choices of ``kvd demo --model``: its dtypes (with the logit tolerance of each) and
its pool axis orders. Torch-free: the command line offers them, and refuses a bad option, before
torch is imported."""

from __future__ import annotations

from protocol.layout import TRTLLM_AXIS_ORDER, VLLM_AXIS_ORDER

#: Pool axis orders by name: TensorRT-LLM's block-major V1 pool, vLLM's layer-major HND.
AXIS_ORDERS = {"trtllm": TRTLLM_AXIS_ORDER, "vllm": VLLM_AXIS_ORDER}

#: Largest |logit - reference| accepted, by KV/weight dtype. Arithmetic is float32 everywhere
#: (see the transformer module); float32 differences come from the order of sums only, bf16
#: ones also from a K/V value of a decoded token rounding to the neighbouring bf16 number.
LOGIT_TOLERANCE: dict[str, float] = {"float32": 1e-3, "bfloat16": 2e-2, "float16": 1e-2}
