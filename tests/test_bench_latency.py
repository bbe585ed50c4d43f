"""``kvd bench transfer``'s latency table on host pools through two real daemons: every row is
there with its fields, and what it reports follows from the run (no timing is asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

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


def test_gen_executors_run_in_their_own_processes_and_report_failures(tmp_path: Path) -> None:
    """Each gen rank is a process of its own; a rank whose registration is refused (a request
    id over the protocol's length limit) makes the bench raise that rank's error instead of
    hanging, and closing the executors leaves no process behind."""
    from kvd.demo.pair import start_pair

    ctx_d, gen_d = start_pair(tmp_path, gen_tp=latency.GEN_TP, blocks=2, bounce_mb=64, chunk_mb=16,
                              extra_transfer={"mapped": True})
    try:
        latency._wait_for_link(gen_d)
        ex = latency._Executors(ctx_d, gen_d, 1)
        try:
            pids = {p.pid for p in ex.procs}
            assert len(pids) == latency.GEN_TP and all(p.is_alive() for p in ex.procs)
            wall, ctx_wall, nbytes = ex.once("r-once", gen_first=True)
            assert 0 < ctx_wall <= wall and nbytes > 0
            with pytest.raises(RuntimeError, match=r"gen rank 0: "):
                ex.once("r" * 300, gen_first=True)  # refused by the daemon, in the rank's process
        finally:
            ex.close()
        assert not any(p.is_alive() for p in ex.procs)
    finally:
        ctx_d.stop()
        gen_d.stop()


def test_tiny_geometry_moves_small_blocks_of_the_same_structure(tmp_path: Path) -> None:
    """``--geometry tiny``: the same layouts (36 layers, 8 heads, ctx TP1 -> gen TP4) with
    9 KiB blocks, through the same daemons and path: what is left is the control path."""
    rows = latency.run(tmp_path, [2], 2, mapped=True, geometry=latency.TINY_GEOMETRY)
    assert [r["order"] for r in rows] == ["gen-first", "ctx-first"]
    for r in rows:
        assert r["bytes"] == 2 * 36 * 2 * 8 * 1 * 8 * 2  # two tiny blocks: 1 token of head_dim 8, bf16
        assert r["path"] == "mapped"
        assert {"planned", "data_out", "reported"} <= set(r["ctx_stages_s"])
    assert rows[0]["round_trips"] == [0] and rows[1]["round_trips"] == [1]


def test_bench_transfer_options_for_the_control_path() -> None:
    """``--geometry`` knows its presets; ``--latency-paths`` refuses what is not a path."""
    import argparse

    from kvd.bench.transfer import _paths, build_parser

    args = build_parser().parse_args(["--geometry", "tiny", "--latency-paths", "mapped"])
    assert latency.GEOMETRIES[args.geometry] == latency.TINY_GEOMETRY
    assert args.latency_paths == ["mapped"]
    assert build_parser().parse_args([]).latency_paths == ["mapped", "nixl"]
    with pytest.raises(argparse.ArgumentTypeError, match="mapped and/or nixl"):
        _paths("mapped,bounce")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--geometry", "huge"])


def test_latency_ab_alternates_two_trees_and_prints_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m kvd.bench.latency_ab OLD NEW``: each round runs under its own tree (here the
    same tree twice), old then new, and the summary gives each figure old -> new with its ratio."""
    from kvd.bench import latency_ab

    tree = str(Path(__file__).resolve().parent.parent)
    before = set(Path("/tmp").glob("kvd-ab-*"))
    assert latency_ab.main([tree, tree, "--rounds", "1", "--repeat", "2", "--geometry", "tiny",
                            "--orders", "gen-first"]) == 0
    assert set(Path("/tmp").glob("kvd-ab-*")) <= before  # each round removed its daemons' directory
    out = capsys.readouterr().out
    assert out.index("round 0 old: gen-first p50") < out.index("round 0 new: gen-first p50")
    summary = [line for line in out.splitlines() if line.startswith("gen-first, medians over 1 rounds")]
    assert len(summary) == 1 and "p50" in summary[0] and "gen cpu/req" in summary[0], out


def test_latency_ab_refuses_a_tree_without_kvd(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A directory that is not a source tree is refused up front (the editable install would
    otherwise measure whatever kvd it finds)."""
    from kvd.bench import latency_ab

    tree = str(Path(__file__).resolve().parent.parent)
    with pytest.raises(SystemExit):
        latency_ab.main([str(tmp_path), tree])
    assert "holds no kvd/ package" in capsys.readouterr().err


def test_latency_ab_sets_each_sides_variables_in_its_rounds(capsys: pytest.CaptureFixture[str]) -> None:
    """``--env-old`` / ``--env-new KEY=VALUE`` go into that side's rounds only (the daemons
    inherit the round's environment): one tree A/B'd with and without a setting. A value that
    is not KEY=VALUE is refused before anything runs."""
    from kvd.bench import latency_ab

    tree = str(Path(__file__).resolve().parent.parent)
    args = latency_ab.build_parser().parse_args([tree, tree, "--env-new", "KVD_KERNEL_PARAM_TABLES=1",
                                                 "--env-new", "KVD_X=a=b", "--pythonpath", "/wheels"])
    new, old = latency_ab.round_env(args, "new", tree), latency_ab.round_env(args, "old", tree)
    assert new["KVD_KERNEL_PARAM_TABLES"] == "1" and new["KVD_X"] == "a=b"
    assert "KVD_X" not in old and old["PYTHONPATH"] == new["PYTHONPATH"] == f"/wheels:{tree}"
    # a relative tree is made absolute: the rounds run in another directory
    rel = latency_ab.build_parser().parse_args([".", "."])
    assert latency_ab.round_env(rel, "old", ".")["PYTHONPATH"] == str(Path.cwd())
    with pytest.raises(SystemExit):
        latency_ab.main([tree, tree, "--env-old", "NO_EQUALS_SIGN"])
    assert "take KEY=VALUE" in capsys.readouterr().err
