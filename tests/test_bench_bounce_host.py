"""``python -m kvd.bench.bounce_host`` on a small request: real daemons, real NIXL, the bounce
path; its figures (in docs/performance.md) come from longer runs."""

from __future__ import annotations

import json

import pytest

from kvd.bench.bounce_host import main


def test_one_round_reports_per_chunk_figures(capsys: pytest.CaptureFixture[str]) -> None:
    # 4 blocks = 9 MiB, 2.25 MiB per gen rank: 3 chunks of 1 MiB per pair against 1 of 4 MiB
    assert main(["--blocks", "4", "--repeat", "1", "--rounds", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["chunks_many"], r["chunks_one"]) == (12, 4)
    assert len(r["per_round_us"]) == 1 and r["wall_ms_many"] > 0 and r["wall_ms_one"] > 0
    for key in ("wall_us", "ctx_cpu_us", "gen_cpu_us", "ctx_loop_us", "gen_loop_us", "ctx_steps", "gen_steps"):
        assert isinstance(r[f"{key}_per_chunk"], float)


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--rounds", "0"])
    assert exc.value.code == 2 and "must be positive" in capsys.readouterr().err
