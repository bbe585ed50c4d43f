"""``kvd bench transfer``'s latency table on host pools through two real daemons: every row is
there with its fields, and what it reports follows from the run (no timing is asserted)."""

from __future__ import annotations

from pathlib import Path

from kvd.bench import latency


def test_latency_rows_for_both_orders(tmp_path: Path) -> None:
    rows = latency.run(tmp_path, [1], 3, mapped=True)
    assert [(r["blocks"], r["order"]) for r in rows] == [(1, "gen-first"), (1, "ctx-first")]
    for r in rows:
        assert r["bytes"] == 36 * 2 * 8 * 32 * 64 * 2  # one GPT-OSS-120B block, all four gen ranks
        assert r["path"] == "mapped"
        assert r["ctx_p50_s"] > 0
        assert 0 < r["p50_s"] <= r["p99_s"]
        assert {"queued", "planned", "data_out", "reported"} <= set(r["ctx_stages_s"])
    gen_first, ctx_first = rows
    assert gen_first["round_trips"] == [0]  # gen announced its destination before publish
    assert ctx_first["round_trips"] == [1]  # offer, then accept
