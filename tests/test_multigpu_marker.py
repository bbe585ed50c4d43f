"""The ``multigpu(n)`` marker: tests that need more GPUs than the machine has skip cleanly."""

from __future__ import annotations

import pytest

from tests.conftest import multigpu_skip_reason


def test_reason_names_what_is_missing() -> None:
    assert multigpu_skip_reason(4, 2) == "needs 4 CUDA GPUs, 2 here"
    assert multigpu_skip_reason(2, 2) is None
    assert multigpu_skip_reason(8, 0) == "needs 8 CUDA GPUs, 0 here"


@pytest.mark.multigpu(1 << 20)
def test_more_gpus_than_any_machine_is_skipped() -> None:
    pytest.fail("a multigpu(n) test ran with fewer than n GPUs")


def test_marked_tests_are_gpu_tests(request: pytest.FixtureRequest) -> None:
    """The hook adds ``gpu`` to every ``multigpu`` item, so ``-m 'not gpu'`` leaves them out."""
    items = [i for i in request.session.items if i.get_closest_marker("multigpu") is not None]
    if not items:
        pytest.skip("no multigpu test selected in this session")
    assert all(i.get_closest_marker("gpu") is not None for i in items)
