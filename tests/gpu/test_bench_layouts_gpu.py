"""``kvd bench transfer --layout ... --device cuda``: every rank's pool on its GPU, verified.

Tiny sizes; the assertions are about placement, verification and the report's fields (the
ceilings among them), never about timings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvd.cli import main as kvd_main

BLOCK = 36 * 2 * 8 * 32 * 64 * 2  # GPT-OSS-120B KV, one block, all heads


def bench(tmp: Path, *args: str) -> dict[str, Any]:
    out = tmp / "report.json"
    rc = kvd_main(["bench", "transfer", "--device", "cuda", "--repeat", "1", "--sizes", "1,4", "--json-out", str(out),
                   *args])
    report: dict[str, Any] = json.loads(out.read_text())
    assert rc == 0 and report["verified"] is True
    return report


@pytest.mark.multigpu(2)
@pytest.mark.parametrize("layout", ["tp1-tp4", "tp2-tp4", "tp4-tp1", "pp2-pp1", "tp1-dp4"])
def test_two_gpu_dry_run(layout: str, short_tmp: Path) -> None:
    """Every ctx pool on GPU 0, every gen pool on GPU 1 (the lists wrap)."""
    r = bench(short_tmp, "--layout", layout, "--ctx-gpus", "0", "--gen-gpus", "1", "--concurrent", "2",
              "--concurrent-blocks", "2")
    ceil = r["ceilings"]
    assert ceil["single"]["copies"][0]["src"] == 0 and ceil["single"]["copies"][0]["dst"] == 1
    assert [c["dst"] for c in ceil["fanout"]["copies"]] == [1] and "all_pairs" not in ceil
    for path in ("mapped", "nixl"):
        res = r["paths"][path]
        assert res["concurrent"]["bytes"] == 2 * 2 * BLOCK
        assert set(res["sweep"][-1]["per_gen_gpu"]) == {"1"}
        assert r["ratios"][path]["largest_vs_fanout_egress"] > 0


@pytest.mark.multigpu(5)
def test_tp1_to_tp4_on_five_gpus(short_tmp: Path) -> None:
    r = bench(short_tmp, "--layout", "tp1-tp4", "--ctx-gpus", "0", "--gen-gpus", "1,2,3,4")
    assert [c["dst"] for c in r["ceilings"]["fanout"]["copies"]] == [1, 2, 3, 4]
    for path in ("mapped", "nixl"):
        per = r["paths"][path]["sweep"][-1]["per_gen_gpu"]
        assert {d: v["bytes"] for d, v in per.items()} == {str(g): 4 * BLOCK // 4 for g in (1, 2, 3, 4)}
        assert set(r["ratios"][path]["largest_per_gen_gpu_vs_fanout_dst"]) == {"1", "2", "3", "4"}


@pytest.mark.multigpu(8)
def test_four_ctx_instances_into_four_gen_gpus(short_tmp: Path) -> None:
    r = bench(short_tmp, "--layout", "tp1-tp4", "--ctx-gpus", "0,1,2,3", "--gen-gpus", "4,5,6,7", "--paths", "mapped")
    assert r["placement"]["ctx_instances"] == 4
    assert len(r["ceilings"]["all_pairs"]["copies"]) == 16
    inst = r["paths"]["mapped"]["ctx_instances"]
    assert inst["requests"] == 4 and inst["bytes"] == 4 * 32 * BLOCK
    assert r["ratios"]["mapped"]["ctx_instances_vs_all_pairs"] > 0
