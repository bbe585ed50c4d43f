"""The ``multigpu(n)`` marker: tests that need more GPUs than the machine has skip cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import multigpu_skip_reason

ROOT = Path(__file__).resolve().parents[1]


def test_reason_names_what_is_missing() -> None:
    assert multigpu_skip_reason(4, 2) == "needs 4 CUDA GPUs, 2 here"
    assert multigpu_skip_reason(2, 2) is None
    assert multigpu_skip_reason(8, 0) == "needs 8 CUDA GPUs, 0 here"


def test_more_gpus_than_any_machine_is_skipped(tmp_path: Path) -> None:
    """A real pytest run of a file with a ``multigpu(2**20)`` test, under this suite's hooks:
    it is skipped, naming what it needs. (In a run of its own, so that this suite's summary
    does not list a skip that is not about this machine.)"""
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F403 (the suite's hooks)\n")
    (tmp_path / "test_many.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.multigpu(1 << 20)\n"
        "def test_many():\n"
        "    pytest.fail('a multigpu(n) test ran with fewer than n GPUs')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVD_TEST_WARM": "0"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                          str(tmp_path / "test_many.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 skipped" in run.stdout, run.stdout
    assert "needs 1048576 CUDA GPUs" in run.stdout, run.stdout


def test_marked_tests_are_gpu_tests(request: pytest.FixtureRequest) -> None:
    """The hook adds ``gpu`` to every ``multigpu`` item, so ``-m 'not gpu'`` leaves them out."""
    items = [i for i in request.session.items if i.get_closest_marker("multigpu") is not None]
    if not items:
        pytest.skip("no multigpu test selected in this session")
    assert all(i.get_closest_marker("gpu") is not None for i in items)
