"""``kvd bench regroup`` (its figures are in docs/performance.md): a small run on the CPU, and a
``--device`` this machine lacks refused with one line that says so, not a torch traceback."""

from __future__ import annotations

import pytest
import torch

from kvd.cli import main


def test_small_run_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "regroup", "--device", "cpu", "--blocks", "4", "--pool-blocks", "16", "--repeats", "1",
            "--plan-runs", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "check                ok" in out


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_gpu_this_machine_lacks_is_refused(device: str, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    have = 0 if device == "cuda" else 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: have > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: have)
    assert main(["bench", "regroup", "--device", device]) == 2
    err = capsys.readouterr().err
    index = device.partition(":")[2] or "0"
    assert err.startswith(f"kvd bench regroup: error: --device {device} needs CUDA device {index}: this machine "
                          f"has {have} CUDA GPU(s)"), err
