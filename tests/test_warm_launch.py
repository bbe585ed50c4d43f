"""Daemons started in warm interpreters (kvd.demo.warm, as the suite starts them) are the same
``kvd serve`` as from a fresh ``python -m kvd``: they serve, take the environment they were
asked for, and fail at start-up with the same status and message; an environment that differs
where a warm interpreter cannot follow gets a fresh interpreter."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients import Client
from kvd.demo import launch
from kvd.demo.launch import LaunchError, start_daemon
from tests.conftest import host_pool


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:-1]


@pytest.fixture
def warm() -> Iterator[launch.WarmInterpreters]:
    """Warm interpreters on (they are in the suite unless KVD_TEST_WARM=0; here always)."""
    before = launch._warm
    launch._warm = pool = launch.WarmInterpreters(2)
    try:
        yield pool
    finally:
        pool.close()
        launch._warm = before


def test_a_warm_daemon_serves_with_the_environment_it_was_asked_for(
        warm: launch.WarmInterpreters, short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the interpreter starts with KVD_NODE set; the daemon is asked for without it
    monkeypatch.setenv("KVD_NODE", "from-the-interpreter")
    warm.refill()
    monkeypatch.delenv("KVD_NODE")
    d = start_daemon({"pools": [host_pool()]}, workdir=short_tmp, name="w1")
    try:
        assert _cmdline(d.pid)[1:] == ["-m", "kvd.demo.warm"]  # it did come from a warm interpreter
        with Client(d.socket_path, client="t", timeout=30) as kvd:
            assert kvd.ping(b"warm") == b"warm"
        assert d.logged("daemon.ready", node="w1")  # the request's environment, not the interpreter's
        # and a late key the request sets is the daemon's
        e = start_daemon({"pools": [host_pool()]}, workdir=short_tmp, name="w2",
                         env={**os.environ, "KVD_NODE": "asked-for"})
        try:
            assert _cmdline(e.pid)[1:] == ["-m", "kvd.demo.warm"]
            assert e.logged("daemon.ready", node="asked-for")
        finally:
            assert e.stop() == 0
    finally:
        assert d.stop() == 0


def test_an_environment_a_warm_interpreter_cannot_take_gets_a_fresh_one(warm: launch.WarmInterpreters, short_tmp: Path) -> None:
    env = {**os.environ, "MALLOC_ARENA_MAX": "2"}  # read by glibc when the process starts
    d = start_daemon({"pools": [host_pool()]}, workdir=short_tmp, name="fresh", env=env)
    try:
        assert _cmdline(d.pid)[1:3] == ["-m", "kvd"]
    finally:
        d.stop()


def test_a_start_up_failure_reads_the_same_either_way(short_tmp: Path) -> None:
    """A configuration kvd refuses: the same exit status and the same log, warm or fresh."""
    said: dict[str, str] = {}
    before = launch._warm
    try:
        for how in ("warm", "fresh"):
            launch._warm = launch.WarmInterpreters(1) if how == "warm" else None
            workdir = short_tmp / how
            workdir.mkdir()
            with pytest.raises(LaunchError) as info:
                start_daemon({"pools": [host_pool(num_blocks=-3)]}, workdir=workdir, name="bad")
            if launch._warm is not None:
                launch._warm.close()
            text = str(info.value).replace(str(workdir), "WORKDIR")
            said[how] = re.sub(r'"timestamp":"[^"]+"', "", text)
    finally:
        launch._warm = before
    assert "exited with 78 before READY" in said["fresh"], said["fresh"]
    assert said["warm"] == said["fresh"]
