"""``python -m kvd.bench.launch_cost`` refuses what it cannot measure, saying why; its GPU
figures are in docs/performance.md (it needs a CUDA GPU and the regroup kernel)."""

from __future__ import annotations

import pytest
import torch

from kvd.bench.launch_cost import main


def test_no_launches_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--launches", "0"]) == 2
    assert "--launches must be at least 1" in capsys.readouterr().err


def test_a_device_this_machine_lacks_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    missing = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert main(["--device", str(missing)]) == 2
    assert f"needs CUDA device {missing}" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_figures_on_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert main(["--launches", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["launch_host_us"]) == {"back to back", "after a 2 ms sleep", "after a 20 ms sleep",
                                             "after 2 ms of spinning", "after other Python work",
                                             "after 2 ms of stream queries", "after a 2 ms sleep and one stream query"}
    assert all(v > 0 for v in report["launch_host_us"].values())
    assert report["driver_calls_back_to_back_us"].keys() == report["driver_calls_after_2ms_sleep_us"].keys()
