"""``kvctl ping --wait SECONDS --pid PID``: the wait a script runs after ``kvd serve ... &``
ends as soon as the daemon has exited, instead of sitting out SECONDS.

Found following docs/getting-started.md with a mistake in a configuration: the daemon exited at
once with its one ``kvd: error:`` line in its log, and ``kvctl ping --wait 60`` waited the full
minute before saying "cannot connect". Real daemons, real sockets; the tests synchronise on the
processes (their exit, kvctl's answer), never on time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvd.demo.launch import DaemonProcess, write_config
from tests.test_kvctl import kvctl


def test_ping_wait_stops_when_the_daemon_exits_before_it_answers(short_tmp: Path) -> None:
    """A daemon that cannot start (an unknown key) exits; kvctl, told its pid and a wait far
    longer than the test's own timeout, returns exit 3 saying that the daemon exited and where
    the reason is. The daemon is left unreaped (a zombie, as a shell's background job is until
    ``wait``): that counts as exited."""
    socket = str(short_tmp / "kvd.sock")
    config = write_config(short_tmp, "kvd", {"socket_path": socket, "log_format": "json", "peer_prot": 1})
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    with open(short_tmp / "kvd.log", "wb") as log:
        daemon = subprocess.Popen([sys.executable, "-m", "kvd", "serve", "--config", config], stdout=log,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        run = kvctl("ping", "--wait", "3600", "--pid", str(daemon.pid), socket=socket, timeout=120)
        assert run.returncode == 3, (run.stdout, run.stderr)
        assert run.stderr == (f"kvctl: kvd (pid {daemon.pid}) exited before it answered on {socket}: its stderr "
                              "(or log) ends with the one `kvd: error:` line that says why\n")
        assert daemon.wait(timeout=60) == 78
        assert (short_tmp / "kvd.log").read_text().splitlines()[-1].startswith("kvd: error: peer_prot: unknown key")
    finally:
        daemon.kill()
        daemon.wait()


def test_ping_wait_with_the_pid_of_a_running_daemon_answers(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory({}, name="alive")
    run = kvctl("ping", "--wait", "60", "--pid", str(d.pid), socket=d.socket_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("pong from alive in ")


def test_ping_wait_with_the_pid_of_a_process_that_is_gone(short_tmp: Path) -> None:
    """A pid that names no process (one that has exited and been reaped): exit 3 at once."""
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    run = kvctl("ping", "--wait", "3600", "--pid", str(gone.pid), socket=str(short_tmp / "never.sock"), timeout=120)
    assert run.returncode == 3 and f"kvd (pid {gone.pid}) exited before it answered" in run.stderr


def test_pid_without_wait_is_a_usage_error(short_tmp: Path) -> None:
    run = kvctl("ping", "--pid", "1", socket=str(short_tmp / "never.sock"))
    assert run.returncode == 2
    assert "kvctl ping: error: --pid needs --wait SECONDS (it ends the wait early)" in run.stderr
    assert run.stderr.startswith("usage: kvctl ping "), run.stderr  # ping's usage, not kvctl's
    run = kvctl("ping", "--wait", "1", "--pid", "0", socket=str(short_tmp / "never.sock"))
    assert run.returncode == 2 and "must be at least 1" in run.stderr


@pytest.mark.parametrize(("args", "says"), [
    (["peers", "--watch"], "kvctl peers: error: unrecognized arguments: --watch (--watch is an option of kvctl "
                           "transfers, not of kvctl peers)"),
    (["pools", "--limit=3"], "kvctl pools: error: unrecognized arguments: --limit=3 (--limit is an option of kvctl "
                             "sessions and transfers, not of kvctl pools)"),
    (["status", "--wait", "3"], "kvctl status: error: unrecognized arguments: --wait 3 (--wait is an option of "
                                "kvctl ping, not of kvctl status)"),
    (["cancel", "req-1", "req-2"], "kvctl cancel: error: unrecognized arguments: req-2"),
])
def test_an_option_of_another_command_says_which(short_tmp: Path, args: list[str], says: str) -> None:
    """An argument the command does not take is reported with that command's usage (not
    kvctl's), and an option that belongs to another command names it."""
    run = kvctl(*args, socket=str(short_tmp / "never.sock"))
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert run.stderr.startswith(f"usage: kvctl {args[0]} "), run.stderr
    assert run.stderr.splitlines()[-1] == says, run.stderr
