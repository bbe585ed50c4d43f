"""``kvd bench transfer --layout/--ctx-gpus/--gen-gpus/--concurrent`` on host pools.

Every layout kind runs through two real daemons with tiny sizes; the assertions are about what
the bench checked and reported (verification, JSON fields, byte counts), never about timings.
The placement rules and option errors are checked as one error line and a non-zero exit.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest

from kvd.bench.layout_rig import Request, Rig, ctx_pool_name
from kvd.bench.layout_spec import KINDS, Side, SpecError, load_layout, parse_gpus, place
from kvd.bench.layouts import failure
from kvd.cli import main as kvd_main
from kvd.demo.pair import pool_entry, start_pools_pair

MiB = 1 << 20
BLOCK = 36 * 2 * 8 * 32 * 64 * 2  # GPT-OSS-120B KV, one block, all heads: 2.25 MiB


def bench(tmp: Path, *args: str) -> tuple[int, dict[str, Any]]:
    out = tmp / "report.json"
    rc = kvd_main(["bench", "transfer", "--device", "cpu", "--repeat", "1", "--json-out", str(out), *args])
    return rc, json.loads(out.read_text()) if out.exists() else {}


def rows(report: dict[str, Any], path: str) -> list[dict[str, Any]]:
    res = report["paths"][path]
    return [*res["sweep"], *(res[k] for k in ("concurrent", "ctx_instances") if k in res)]


RUNS: dict[str, tuple[list[str], list[str]]] = {
    # layout: (extra options, paths run)
    "tp1-tp4": (["--concurrent", "2", "--concurrent-blocks", "1"], ["mapped", "nixl"]),
    "tp2-tp4": (["--ctx-gpus", "0,1", "--gen-gpus", "2,3,4,5", "--paths", "mapped", "--concurrent", "2",
                 "--concurrent-blocks", "1"],
                ["mapped"]),
    "tp4-tp1": (["--paths", "nixl"], ["nixl"]),
    "pp2-pp1": (["--paths", "nixl"], ["nixl"]),
    "tp1-dp4": (["--paths", "mapped", "--concurrent", "2", "--concurrent-blocks", "1"], ["mapped"]),
}


@pytest.mark.parametrize("layout", sorted(RUNS))
def test_every_layout_kind_runs_verified(layout: str, short_tmp: Path) -> None:
    extra, paths = RUNS[layout]
    rc, report = bench(short_tmp, "--layout", layout, "--sizes", "1,2", *extra)
    assert rc == 0 and report["verified"] is True
    assert sorted(report["paths"]) == sorted(paths)
    assert report["ceilings"] is None and "needs CUDA GPUs" in report["ceiling_note"] and report["ratios"] == {}
    assert report["scenario"]["layout"] == layout and report["scenario"]["block_bytes_tp1"] == BLOCK
    ctx, gen = KINDS[layout]
    assert len(report["placement"]["gen_ranks"]) == gen.world_size
    assert len(report["placement"]["ctx_ranks"]) == ctx.world_size * report["placement"]["ctx_instances"]
    for path in paths:
        sweep = report["paths"][path]["sweep"]
        assert [r["blocks_each"] for r in sweep] == [1, 2]
        for r in rows(report, path):
            assert r["verified"] and r["checks"] == {"exact": True, "untouched": True}
            # every layout here moves each request's whole KV once: 2.25 MiB a block
            assert r["bytes"] == r["requests"] * r["blocks_each"] * BLOCK == r["daemon_bytes"]
            assert sum(v["bytes"] for v in r["per_gen_gpu"].values()) == r["bytes"]
            assert r["gbps"] > 0 and r["best_s"] > 0 and r["median_s"] >= r["best_s"]
            assert r["path"] == ("mapped" if path == "mapped" else "direct" if gen.attention_dp else "bounce")


def test_concurrency_and_ctx_instances_are_reported(short_tmp: Path) -> None:
    """tp1-tp4 with ctx GPUs 0,2: two ctx instances; gen ranks wrap over GPUs 1,3."""
    rc, report = bench(short_tmp, "--layout", "tp1-tp4", "--sizes", "1", "--paths", "mapped", "--concurrent", "3",
                       "--concurrent-blocks", "2", "--ctx-gpus", "0,2", "--gen-gpus", "1,3")
    assert rc == 0
    pl = report["placement"]
    assert pl["ctx_instances"] == 2
    assert [(c["instance"], c["gpu"]) for c in pl["ctx_ranks"]] == [(0, 0), (1, 2)]
    assert [g["gpu"] for g in pl["gen_ranks"]] == [1, 3, 1, 3]
    res = report["paths"]["mapped"]
    assert res["concurrent"]["requests"] == 3 and res["concurrent"]["bytes"] == 3 * 2 * BLOCK
    assert res["ctx_instances"]["requests"] == 2 and res["ctx_instances"]["bytes"] == 2 * 2 * BLOCK
    # two gen ranks per gen GPU: each GPU gets half of every request
    assert {d: v["bytes"] for d, v in res["concurrent"]["per_gen_gpu"].items()} == {"1": 3 * BLOCK, "3": 3 * BLOCK}


def test_attention_dp_requests_spread_over_dp_ranks(short_tmp: Path) -> None:
    rc, report = bench(short_tmp, "--layout", "tp1-dp4", "--sizes", "1", "--paths", "nixl", "--gen-gpus", "1,2,3,4",
                       "--concurrent", "4", "--concurrent-blocks", "1")
    assert rc == 0
    res = report["paths"]["nixl"]
    assert list(res["sweep"][0]["per_gen_gpu"]) == ["1"]  # one request: one DP rank, all heads
    assert {d: v["bytes"] for d, v in res["concurrent"]["per_gen_gpu"].items()} == {str(g): BLOCK for g in (1, 2, 3, 4)}


def test_layout_file_with_uneven_pp(short_tmp: Path) -> None:
    f = short_tmp / "tp2-pp2.toml"
    f.write_text("[ctx]\ntp_size = 2\n\n[gen]\npp_size = 2\nlayer_split = [20, 16]\n\n[geometry]\nnum_layers = 36\n")
    rc, report = bench(short_tmp, "--layout", str(f), "--sizes", "1", "--paths", "mapped")
    assert rc == 0 and report["verified"]
    assert report["scenario"]["gen_side"] == {"tp_size": 1, "pp_size": 2, "attention_dp": False,
                                              "layer_split": [20, 16]}
    per = report["paths"]["mapped"]["sweep"][0]["per_gen_gpu"]
    assert per == {"1": {"bytes": BLOCK, "gbps": per["1"]["gbps"]}}


def test_table_output(short_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = kvd_main(["bench", "transfer", "--device", "cpu", "--layout", "pp2-pp1", "--sizes", "1", "--repeat", "1",
                   "--paths", "mapped"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "pp2-pp1 (ctx PP2 -> gen TP1)" in out and "ceiling: not measured" in out
    assert "verification (every request byte-exact, untouched bytes intact): True" in out


# -- the checks themselves see what a wrong transfer would leave ------------------------------

async def test_verify_sees_a_wrong_byte_a_stray_byte_and_a_missing_write(short_tmp: Path) -> None:
    spec = load_layout("tp1-tp4")
    placement = place((0,), (1,), spec, None)
    ctx_l, gen_l = spec.layouts()
    ctx_d, gen_d = start_pools_pair(
        short_tmp, ctx_pools=[pool_entry(ctx_pool_name(0, 0), ctx_l, 0, memory="host", device=-1, num_blocks=4)],
        gen_pools=[pool_entry(f"gen{g}", gen_l, g, memory="host", device=-1, num_blocks=4) for g in range(4)],
        bounce_mb=16, chunk_mb=4)
    try:
        rig = Rig(ctx_d, gen_d, spec, placement)
        async with contextlib.AsyncExitStack() as stack:
            await rig.open(stack)
            reqs = [Request(0, 0, [0], [0, 1, 2, 3], 2)]
            await rig.prepare(reqs, seed=5)
            rig.reset()
            wall = await rig.run(reqs, "v")
            assert wall > 0 and rig.verify(reqs) == {"exact": True, "untouched": True}
            block = reqs[0].gen_ids[2][1]
            view = rig._blocks(rig.gen_pools[2], gen_l, 2)
            view[block, 3, 1, 0, 5, 7] ^= 1  # one bit of one request byte
            assert rig.verify(reqs) == {"exact": False, "untouched": True}
            view[block, 3, 1, 0, 5, 7] ^= 1
            spare = next(b for b in range(4) if b not in reqs[0].gen_ids[3])
            rig._blocks(rig.gen_pools[3], gen_l, 3)[spare, 0, 0, 0, 0, 0] = 0  # a byte outside the request
            assert rig.verify(reqs) == {"exact": True, "untouched": False}
            rig.reset()  # as if the transfer had written nothing
            assert rig.verify(reqs) == {"exact": False, "untouched": True}
            await rig.release(reqs)
            # a request the ctx daemon refuses (a block id its session does not hold) ends the run
            # with the daemon's reason as one line
            bad = [Request(1, 0, [0], [0, 1, 2, 3], 1)]
            await rig.prepare(bad, seed=6)
            held = bad[0].ctx_ids[0][0]
            bad[0].ctx_ids[0] = [next(b for b in range(4) if b != held)]
            with pytest.raises(BaseExceptionGroup) as caught:
                await rig.run(bad, "bad")
            why = failure(caught.value)
            # the rig's session is not always the daemon's first (a readiness probe may come first)
            sid = next(s.session_id for s in await rig.ctx[0, 0].sessions() if s.client == "bench-ctx0r0")
            assert why == (f"BlockNotLeased: pool 'ctx0r0': block {bad[0].ctx_ids[0][0]} is not leased to session {sid}: it is free; "
                           "name only ids alloc returned to this session and it has not freed since")
            # the gen side still expects it: cancelling it from one of its sessions ends it for all
            # (the daemons then stop at once)
            await rig.gen[0].cancel(bad[0].rid)
    finally:
        ctx_d.stop()
        gen_d.stop()


# -- placement rules and bad options: one error line, non-zero exit ------------------------------

def test_failure_lines() -> None:
    from protocol.errors import BadRequest

    assert failure(BadRequest("no\nsuch block")) == "BadRequest: no; such block"
    nested = BaseExceptionGroup("tasks", [ExceptionGroup("inner", [BadRequest("refused")]), KeyboardInterrupt()])
    assert failure(nested) == "BadRequest: refused"
    assert failure(ExceptionGroup("tasks", [ValueError("a bug")])) is None
    assert failure(ValueError("a bug")) is None


def test_gpu_lists() -> None:
    assert parse_gpus("--gen-gpus", "1,2,3,4") == (1, 2, 3, 4)
    for text, msg in (("1,1", "names GPU 1 twice"), ("", "comma-separated"), ("1,,2", "comma-separated"),
                      ("a", "'a' is not a GPU ordinal"), ("-1", "'-1' is not a GPU ordinal")):
        with pytest.raises(SpecError, match=msg):
            parse_gpus("--gen-gpus", text)


def test_placement_rules() -> None:
    tp1_tp4, tp2_tp4 = load_layout("tp1-tp4"), load_layout("tp2-tp4")
    p = place((0,), (1,), tp1_tp4, 2)  # the two-GPU dry run: every gen rank on GPU 1
    assert p.instances == 1 and [p.gen_gpu(g) for g in range(4)] == [1, 1, 1, 1]
    p = place((0, 1), (2, 3, 4, 5), tp2_tp4, 8)
    assert [p.ctx_gpu(0, r) for r in range(2)] == [0, 1] and [p.gen_gpu(g) for g in range(4)] == [2, 3, 4, 5]
    p = place((0, 1, 2, 3), (4, 5, 6, 7), tp1_tp4, 8)  # four ctx instances, one per ctx GPU
    assert p.instances == 4 and [p.ctx_gpu(k, 0) for k in range(4)] == [0, 1, 2, 3]
    p = place((0,), (1,), tp2_tp4, None)  # shorter ctx list wraps
    assert p.instances == 1 and [p.ctx_gpu(0, r) for r in range(2)] == [0, 0]
    bad = [
        ((0,), (1, 2), tp1_tp4, 2, r"--gen-gpus names GPU 2; this machine has 2 CUDA GPU\(s\) \(0-1\)"),
        ((0,), (1,), tp1_tp4, 0, r"--ctx-gpus names GPU 0; this machine has 0 CUDA GPU\(s\)$"),
        ((0, 1), (1, 2), tp1_tp4, None, "share GPU 1: ctx and gen pools on one GPU"),
        ((0,), (1, 2, 3, 4, 5), tp1_tp4, None, r"--gen-gpus lists 5 GPUs for gen TP4's 4 rank\(s\): give at most 4"),
        ((0, 1, 2), (4,), tp2_tp4, None, r"--ctx-gpus lists 3 GPUs for ctx TP2's 2 rank\(s\): give at most 2 "
                                         r"\(shorter lists wrap\) or a multiple of 2"),
    ]
    for ctx, gen, spec, have, msg in bad:
        with pytest.raises(SpecError, match=msg):
            place(ctx, gen, spec, have)


def test_request_ranks() -> None:
    assert Side(tp_size=4).request_ranks(3) == [0, 1, 2, 3]
    dp = Side(tp_size=4, pp_size=2, attention_dp=True)
    assert [dp.request_ranks(i) for i in range(5)] == [[0, 4], [1, 5], [2, 6], [3, 7], [0, 4]]


def test_layout_errors(short_tmp: Path) -> None:
    with pytest.raises(SpecError, match=r"--layout 'tp1-tp3' is neither a layout kind \(tp1-tp4, "):
        load_layout("tp1-tp3")
    cases = {
        "[ctx]\ntp_size = 3\n[gen]\n": "layout TP3: num_kv_heads=8 is not divisible by tp_size=3",
        "[ctx]\npp_size = 2\nlayer_split = [20, 10]\n[gen]\n": r"layer_split \[20, 10\] must be positive and sum",
        "[ctx]\n[gen]\ntp = 2\n": r"\[gen\]: unknown key\(s\) \['tp'\]",
        "[ctx]\n": r"needs tables \[ctx\] and \[gen\]",
        "[ctx]\n[gen]\n[geometry]\nlayers = 4\n": r"\[geometry\] may set",
        "[ctx]\ntp_size = 2\nattention_dp = true\n[gen]\n": "attention DP on the gen side only",
        "[ctx\n": "Expected ']'",
    }
    for i, (text, msg) in enumerate(cases.items()):
        f = short_tmp / f"l{i}.toml"
        f.write_text(text)
        with pytest.raises(SpecError, match=msg):
            load_layout(str(f))


@pytest.mark.parametrize(("args", "msg"), [
    (["--layout", "tp1-tp3"], "--layout 'tp1-tp3' is neither a layout kind"),
    (["--ctx-gpus", "0,0"], "--ctx-gpus '0,0' names GPU 0 twice"),
    (["--ctx-gpus", "1", "--gen-gpus", "1"], "--ctx-gpus and --gen-gpus share GPU 1"),
    (["--layout", "tp4-tp1", "--gen-gpus", "1,2"], "--gen-gpus lists 2 GPUs for gen TP1's 1 rank(s)"),
    (["--layout", "tp1-tp4", "--sizes", "1,x"], "--sizes '1,x': give comma-separated block counts"),
    (["--layout", "tp1-tp4", "--sizes", "0"], "--sizes '0': block counts must be in [1, "),
    (["--paths", "mapped,rdma"], "--paths 'mapped,rdma': give mapped and/or nixl"),
    (["--concurrent", "-1"], "--concurrent must be positive"),
])
def test_bad_options_are_one_line(args: list[str], msg: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = kvd_main(["bench", "transfer", "--device", "cpu", *args])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith(f"kvd bench transfer: error: {msg}")


def test_more_gpus_than_present_on_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    """``--device cuda`` checks the lists against the GPUs present (none or two here: one line)."""
    rc = kvd_main(["bench", "transfer", "--device", "cuda", "--ctx-gpus", "0", "--gen-gpus", "99"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "needs two or more CUDA GPUs" in err or "--gen-gpus names GPU 99" in err


def test_a_usage_error_is_told_before_torch_is_imported() -> None:
    """``kvd bench transfer --layout ...`` with a bad value answers at once: torch (about 2 s
    to import) comes in only once the options are known to be good. In a fresh interpreter,
    as a user's command runs."""
    import subprocess
    import sys

    code = ("import sys\nfrom kvd.bench.transfer import main\n"
            "rc = main(['--layout', 'tp1-tp4', '--sizes', 'x'])\n"
            "print(rc, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["2", "False"], out
    assert "--sizes 'x': give comma-separated block counts" in out.stderr
