"""``python -m kvd.bench.copy_engines`` on host pools (its GPU figures are in docs/performance.md):
every row is a real transfer between two daemons, reported with its path and stages."""

from __future__ import annotations

import json

import pytest

from kvd.bench.copy_engines import main


def test_rows_on_host_pools(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device", "cpu", "--blocks", "2", "--repeat", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["shuffled"], r["copy_engine"]) for r in rows] == [(False, True), (False, False), (True, True),
                                                                 (True, False)]
    for r in rows:
        # host pools: the local movers, never the copy engines
        assert r["path"] == "mapped" and r["copy_runs"] == [0] and r["blocks"] == 2 and r["e2e_best_ms"] > 0


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--device", "cpu", "--blocks", "0"])
    assert exc.value.code == 2 and "positive sizes" in capsys.readouterr().err


def test_too_few_gpus_is_refused_before_any_daemon_starts(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The default ``--device cuda`` needs GPUs 0 and 1: with fewer, one usage line that names
    ``--device cpu``, not a daemon's startup error about a pool the user never configured."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit) as exc:
        main(["--blocks", "2", "--repeat", "1"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "this machine has 1 CUDA GPU(s)" in err and "--device cpu" in err
