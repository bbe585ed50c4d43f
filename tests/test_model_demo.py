"""A small transformer served through kvd: ctx TP1 prefill → gen TP2/TP4 decode, token-identical.

The executors are real processes (a ctx executor, one process per gen rank in a gloo group over
loopback) talking to two real daemons over NIXL; the driver orders the two registration sides
by pipe events (gen ranks report "expected" before ctx is started, or ctx reports "published"
before the gen ranks are), never by sleeps.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from kvd.demo.launch import DaemonProcess
from kvd.demo.model import control as c
from kvd.demo.model.cli import main
from kvd.demo.model.daemons import start_daemons
from kvd.demo.model.options import DemoOptions, Order
from kvd.demo.model.paged import PagedKV, canonical_view, pool_layout
from kvd.demo.model.reference import ReferenceResult, compare, reference_run
from kvd.demo.model.run import run_on_daemons
from kvd.demo.model.transformer import DenseKV, ModelConfig, Segment, TPDecoder, full_weights
from protocol.errors import IncompatibleLayout
from protocol.layout import TRTLLM_AXIS_ORDER, VLLM_AXIS_ORDER, KVLayout
from protocol.messages import PoolInfo

SMALL = DemoOptions(prompt_lengths=(3, 16, 21), new_tokens=6, tokens_per_block=8, pool_blocks=24, mapped=False)


# -- the model and its paged cache, in one process -------------------------------------------
@pytest.mark.parametrize("axis_order", [TRTLLM_AXIS_ORDER, VLLM_AXIS_ORDER], ids=["trtllm", "vllm"])
def test_paged_cache_in_any_axis_order_decodes_like_a_dense_one(axis_order: tuple[str, ...]) -> None:
    cfg = ModelConfig()
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, "float32", axis_order=axis_order,
                      num_blocks=12)
    pool = torch.zeros(layout.pool_shape(0))
    paged = PagedKV(pool, layout, rank=0)
    seq = paged.add([9, 2, 7, 4])  # scattered, out of order: position p lives in block ids[p // 8]
    model = TPDecoder(cfg, full_weights(cfg))
    prompt = torch.arange(11) * 37 % cfg.vocab_size
    dense = DenseKV(cfg, [16], heads=cfg.num_kv_heads, device=torch.device("cpu"), dtype=torch.float32)
    want = model.forward(prompt, [Segment(0, 0, 11)], dense)
    got = model.forward(prompt, [Segment(seq, 0, 11)], paged)
    assert torch.equal(got, want)
    # the K/V sit where the pool's layout says: token 10 of layer 3 = block ids[1] = 2, slot 2
    view = canonical_view(pool, axis_order)
    k_dense, v_dense = dense.read(0, 3, 11)
    assert torch.equal(view[2, 3, 0, :, 2], k_dense[:, 10])
    assert torch.equal(view[9, 3, 1, :, :8], v_dense[:, :8])
    assert not view[[0, 1, 3, 4, 5, 6, 7, 8, 10, 11]].any()  # 11 tokens: blocks 9 and 2 only
    tokens = [int(want.argmax())]
    for step in range(5):
        out_d = model.forward(torch.tensor(tokens[-1:]), [Segment(0, 11 + step, 1)], dense)
        out_p = model.forward(torch.tensor(tokens[-1:]), [Segment(seq, 11 + step, 1)], paged)
        assert torch.equal(out_p, out_d), f"step {step}"
        tokens.append(int(out_d.argmax()))


def test_paged_cache_refuses_positions_beyond_its_blocks() -> None:
    layout = KVLayout(2, 8, 64, 4, "float32", num_blocks=4)
    paged = PagedKV(torch.zeros(layout.pool_shape(0)), layout, rank=0)
    seq = paged.add([1, 3])
    k = torch.zeros(8, 3, 64)
    paged.write(seq, 0, 5, k, k)  # positions 5..7: the last slots of the second block
    with pytest.raises(ValueError, match="beyond its 2 blocks"):
        paged.write(seq, 0, 6, k, k)
    with pytest.raises(ValueError, match="need 3 blocks, it has 2"):
        paged.read(seq, 0, 9)
    with pytest.raises(ValueError, match="needs"):
        PagedKV(torch.zeros(3, 2, 2, 8, 4, 64), layout, rank=0)


def test_executor_refuses_a_pool_configured_for_another_model_or_rank() -> None:
    cfg = ModelConfig()
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, "float32", tp_size=2,
                      axis_order=VLLM_AXIS_ORDER, num_blocks=8)
    info = PoolInfo(name="gen1", kind="host", device=-1, layout=layout, rank=1)
    assert pool_layout(cfg, "float32", 2, 1, info) == layout  # tokens/block, order, blocks: the pool's
    with pytest.raises(IncompatibleLayout, match="pool 'gen1' serves rank 1"):
        pool_layout(cfg, "float32", 2, 0, info)
    with pytest.raises(IncompatibleLayout, match="pool 'gen1'"):
        pool_layout(cfg, "bfloat16", 2, 1, info)
    with pytest.raises(IncompatibleLayout, match="pool 'gen1'"):
        pool_layout(ModelConfig(num_layers=2), "float32", 2, 1, info)
    with pytest.raises(IncompatibleLayout, match="no model layout"):
        pool_layout(cfg, "float32", 2, 1, msgspec.structs.replace(info, layout=None))


def test_tp_sizes_that_do_not_split_the_heads_are_refused() -> None:
    with pytest.raises(ValueError, match="tp_size=3"):
        ModelConfig().check_tp(3)


# -- the comparison --------------------------------------------------------------------------
def _as_run() -> tuple[c.Published, dict[str, c.GenDone], ReferenceResult]:
    """A run that reproduced the reference exactly (two gen ranks), to be altered by the tests."""
    cfg = ModelConfig()
    prompts = (c.Prompt("r-0", (1, 2, 3)), c.Prompt("r-1", tuple(range(20))))
    result = reference_run(cfg, "float32", "cpu", prompts, 4)
    published = c.Published("ctx0", dict(result.first_tokens), {}, dict(result.prefill_logits), {})
    gens = {f"gen{r}": c.GenDone(f"gen{r}", {k: list(v) for k, v in result.tokens.items()},
                                 {k: v.copy() for k, v in result.logits.items()} if r == 0 else {}, {}, 0.0)
            for r in range(2)}
    return published, gens, result


def test_compare_accepts_identical_and_names_request_and_step_of_each_difference() -> None:
    published, gens, ref = _as_run()
    assert compare(ref, published, gens, 1e-3).token_identical

    gens["gen0"].tokens["r-1"][2] += 1
    gens["gen1"].tokens["r-1"][2] += 1
    gens["gen0"].logits["r-0"][3, 5] += 0.01
    found = compare(ref, published, gens, 1e-3)
    assert not found.token_identical
    assert any(m.startswith("r-1 step 2: token ") for m in found.mismatches), found.mismatches
    assert any(m.startswith("r-0 step 3: logits differ by 0.01") for m in found.mismatches), found.mismatches
    assert found.max_logit_diff == pytest.approx(0.01, rel=1e-3)

    published, gens, ref = _as_run()
    gens["gen1"].tokens["r-0"][0] += 1
    published.first_tokens["r-1"] += 1
    found = compare(ref, published, gens, 1e-3)
    assert "r-1 prefill: first token" in " ".join(found.mismatches)
    assert any("gen1 decoded" in m and "TP ranks diverged" in m for m in found.mismatches), found.mismatches


def test_decode_from_a_corrupted_block_is_caught() -> None:
    # the check has teeth: one wrong K/V block of a request's prompt changes its decode
    cfg = ModelConfig()
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, "float32", num_blocks=4)
    pool = torch.zeros(layout.pool_shape(0))
    paged = PagedKV(pool, layout, rank=0)
    seq = paged.add([0, 1, 2, 3])
    model = TPDecoder(cfg, full_weights(cfg))
    prompt = c.Prompt("r-0", tuple(range(3, 23)))
    ref = reference_run(cfg, "float32", "cpu", [prompt], 4)
    model.forward(torch.tensor(prompt.tokens), [Segment(seq, 0, 20)], paged)
    pool[1] = torch.randn(pool[1].shape, generator=torch.Generator().manual_seed(5))
    token, tokens, logits = ref.first_tokens["r-0"], [], []
    for step in range(4):
        out = model.forward(torch.tensor([token]), [Segment(seq, 20 + step, 1)], paged)[0]
        token = int(out.argmax())
        tokens.append(token)
        logits.append(out.numpy())
    published = c.Published("ctx0", dict(ref.first_tokens), {}, dict(ref.prefill_logits), {})
    gen = c.GenDone("gen0", {"r-0": tokens}, {"r-0": np.stack(logits)}, {}, 0.0)
    found = compare(ref, published, {"gen0": gen}, 1e-3)
    assert found.mismatches and found.mismatches[0].startswith("r-0 step 0:"), found.mismatches


# -- real executors through real daemons -----------------------------------------------------
@pytest.fixture(scope="module")
def daemons() -> Iterator[tuple[Path, DaemonProcess, DaemonProcess]]:
    """One daemon pair over NIXL for every case, regrouped through the bounce buffer: the ctx
    pool in TensorRT-LLM's axis order with 8 tokens a block; gen pools for TP2 in vLLM's order
    (8 tokens a block) and for TP4 in TensorRT-LLM's with 16 tokens a block."""
    workdir = Path(tempfile.mkdtemp(prefix="kvdm-", dir="/tmp"))
    ctx, gen = start_daemons(workdir, SMALL, {2: ("vllm", 8), 4: ("trtllm", 16)})
    try:
        yield workdir, ctx, gen
    finally:
        ctx.stop()
        gen.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.parametrize("order", ["gen-first", "ctx-first"])
@pytest.mark.parametrize("gen_tp", [2, 4])
def test_ctx_tp1_to_gen_tp_decodes_token_identical(
    daemons: tuple[Path, DaemonProcess, DaemonProcess], gen_tp: int, order: Order
) -> None:
    workdir, ctx, gen = daemons
    opts = dataclasses.replace(SMALL, gen_tp=gen_tp, order=order, request_prefix=f"tp{gen_tp}-{order}")
    report = run_on_daemons(workdir, opts, ctx, gen)
    assert report.token_identical, report.comparison.mismatches
    assert report.comparison.max_logit_diff < report.tolerance
    assert set(report.gens) == {f"gen{r}" for r in range(gen_tp)}
    for p in report.prompts:
        assert report.ctx_done.completions[p.request_id].path == "bounce"  # a regroup over NIXL
        assert report.ctx_done.completions[p.request_id].bytes > 0
        for g in report.gens.values():
            assert len(g.tokens[p.request_id]) == SMALL.new_tokens
            assert g.completions[p.request_id].path == "bounce"


def test_a_gen_rank_that_fails_is_reported_and_no_executor_is_left(
    daemons: tuple[Path, DaemonProcess, DaemonProcess],
) -> None:
    workdir, ctx, gen = daemons
    # ctx publishes first, then every gen rank asks for more blocks than its pool has
    opts = dataclasses.replace(SMALL, gen_tp=2, order="ctx-first", new_tokens=10_000, request_prefix="too-long")
    with pytest.raises(c.WorkerFailed, match=r"gen\d failed: OutOfBlocks"):
        run_on_daemons(workdir, opts, ctx, gen)
    assert not multiprocessing.active_children()
    # the daemons are still serving: the next run on them decodes token-identical
    again = run_on_daemons(workdir, dataclasses.replace(SMALL, gen_tp=2, request_prefix="after"), ctx, gen)
    assert again.token_identical, again.comparison.mismatches


def test_kvd_demo_model_prints_figures_and_token_identical(capsys: pytest.CaptureFixture[str]) -> None:
    # the command line, on the default same-node mapped path
    rc = main(["--gen-tp", "2", "--prompts", "4,19", "--new-tokens", "3", "--tokens-per-block", "8",
               "--order", "ctx-first"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "token-identical" in out
    assert "mapped" in out
    assert "tokens/s" in out


@pytest.mark.parametrize("argv", [["--prompts", "3,0"], ["--prompts", "3,x"], ["--new-tokens", "0"],
                                  ["--gen-tp", "3"]])
def test_kvd_demo_model_refuses_bad_arguments_before_starting_anything(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "kvd demo --model: error:" in capsys.readouterr().err
