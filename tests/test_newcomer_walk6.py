"""Mistakes found walking the README, docs/getting-started.md and docs/integration.md as a
newcomer (sixth walk), each run for real: daemons in subprocesses on loopback, real sockets;
the tests synchronise on processes (their exit, kvctl's answer), never on time.

- ``kvd serve ... & kvctl ping --wait 60 --pid $!`` answered "pong" when the new daemon had
  exited because an older one still served its socket: the older one's answer was taken for
  the new one's, and the newcomer went on against a daemon with the old configuration;
- ``kvd demo --model --tokens-per-block 0`` ended in a ZeroDivisionError traceback,
  ``--threads 0`` and a ``--gen-tokens-per-block`` that does not divide the ctx pool's (or
  that the ctx pool's does not divide) started both daemons and five executors before failing;
- an executor of the model demo that the daemon refused (``IncompatibleLayout``) had its
  traceback flattened into the one error line, burying the daemon's message;
- ``KVD_SOCKET`` exported for kvctl (as the README's table allows) gave the ctx daemon the gen
  daemon's socket: "another kvd is already serving on /tmp/x.sock", with ``socket_path =
  "ctx.sock"`` in the file the newcomer then reads. A startup error about a setting that came
  from a ``KVD_*`` variable now says so.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from clients import Client
from kvd.demo.launch import DaemonProcess, write_config
from kvd.demo.model import control as c
from kvd.demo.model.daemons import start_daemons
from kvd.demo.model.options import DemoOptions
from kvd.demo.model.run import run_on_daemons
from kvd.startup import EX_CONFIG
from tests.test_demo_cli import kvd, usage_error
from tests.test_kvctl import kvctl
from tests.test_startup_errors import base_config, check_failure, secret, serve


def _clean_env() -> dict[str, str]:
    """This process's environment without the ``KVD_*`` variables a developer may have set."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("KVD_")}, "UCX_NET_DEVICES": "lo"}


def test_the_client_names_the_daemons_pid(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory({}, name="who")
    with Client(d.socket_path, client="t") as kvd_client:
        assert kvd_client.daemon_pid == d.pid


def test_ping_wait_pid_is_not_answered_by_an_older_daemon_on_the_socket(
        daemon_factory: Callable[..., DaemonProcess], short_tmp: Path) -> None:
    """A second ``kvd serve`` on the socket of one that runs exits (exit 1, "another kvd is
    already serving"); ``kvctl ping --wait --pid`` of the second one used to print the first
    one's pong and exit 0. Now it says that its daemon exited, which daemon serves the socket,
    and what to do, exit 3."""
    old = daemon_factory({}, name="old")
    config = write_config(short_tmp, "new", {"node": "new", "socket_path": old.socket_path, "log_format": "json"})
    with open(short_tmp / "new.log", "wb") as log:
        new = subprocess.Popen([sys.executable, "-m", "kvd", "serve", "--config", config], stdout=log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_clean_env())
    try:
        run = kvctl("ping", "--wait", "3600", "--pid", str(new.pid), socket=old.socket_path, timeout=120)
        assert run.returncode == 3, (run.stdout, run.stderr)
        assert run.stdout == ""
        assert run.stderr == (
            f"kvctl: kvd (pid {new.pid}) exited before it answered on {old.socket_path}, and another kvd "
            f"(pid {old.pid}) serves that socket: pid {new.pid}'s stderr (or log) ends with the `kvd: error:` "
            f"line that says why; stop the daemon of pid {old.pid} first, or give the new one another "
            "socket_path\n")
        assert new.wait(timeout=60) == 1
        last = (short_tmp / "new.log").read_text().splitlines()[-1]
        assert last.startswith(f"kvd: error: socket_path: another kvd is already serving on {old.socket_path}")
    finally:
        new.kill()
        new.wait()
    # the older daemon is untouched, and a ping naming its own pid is answered
    run = kvctl("ping", "--wait", "60", "--pid", str(old.pid), socket=old.socket_path)
    assert run.returncode == 0 and run.stdout.startswith("pong from old in "), (run.stdout, run.stderr)


def test_ping_wait_pid_of_a_wrapper_is_answered_by_the_daemon_it_started(short_tmp: Path) -> None:
    """``$!`` of ``sudo kvd serve ... &`` (or of a shell wrapper) is not the daemon's pid but its
    parent's: a daemon the named process started counts as that process's answer."""
    socket = str(short_tmp / "wrapped.sock")
    config = write_config(short_tmp, "wrapped", {"node": "wrapped", "socket_path": socket, "log_format": "json"})
    log = short_tmp / "wrapped.log"
    # `; exit $?` keeps bash from exec'ing the daemon: the daemon is bash's child, another pid
    wrapper = subprocess.Popen(
        ["bash", "-c", f'"{sys.executable}" -m kvd serve --config "{config}" > "{log}" 2>&1; exit $?'],
        stdin=subprocess.DEVNULL, env=_clean_env(), start_new_session=True)
    try:
        run = kvctl("ping", "--wait", "120", "--pid", str(wrapper.pid), socket=socket, timeout=180)
        assert run.returncode == 0, (run.stdout, run.stderr, log.read_text())
        assert run.stdout.startswith("pong from wrapped in ")
        with Client(socket, client="t") as kvd_client:
            assert kvd_client.daemon_pid != wrapper.pid  # it was the child that answered
        assert kvctl("drain", socket=socket).returncode == 0
        assert wrapper.wait(timeout=60) == 0
    finally:
        if wrapper.poll() is None:
            os.killpg(wrapper.pid, signal.SIGKILL)
            wrapper.wait()


@pytest.mark.parametrize(("args", "says"), [
    (["--tokens-per-block", "0"], "argument --tokens-per-block: must be at least 1, got 0"),
    (["--threads", "0"], "argument --threads: must be at least 1, got 0"),
    (["--new-tokens", "-1"], "argument --new-tokens: must be at least 1, got -1"),
    (["--gen-tokens-per-block", "x"], "argument --gen-tokens-per-block: not an integer: 'x'"),
    (["--gen-tokens-per-block", "7"], "--gen-tokens-per-block 7 and --tokens-per-block 16: one must divide the other"),
    (["--tokens-per-block", "12", "--gen-tokens-per-block", "8"],
     "--gen-tokens-per-block 8 and --tokens-per-block 12: one must divide the other"),
])
def test_demo_model_refuses_bad_block_and_thread_options(args: list[str], says: str) -> None:
    """Each used to start the daemons (or to divide by zero); now a usage error, exit 2."""
    usage_error(kvd("demo", "--model", *args, timeout=120), "kvd demo --model", says)


def test_a_refused_executor_is_reported_without_its_traceback_and_a_bug_with_it(short_tmp: Path) -> None:
    """Real daemons whose gen pools have 7 tokens a block against the ctx pool's 16: the daemons
    refuse the request, and the error names the refusal, not the executor's stack. An executor
    that fails on its own (a bug: here ``threads=0``) keeps its traceback: that is what finds it."""
    opts = DemoOptions(gen_tp=2, prompt_lengths=(3, 20), new_tokens=2, tokens_per_block=16, pool_blocks=16,
                       mapped=False, timeout_s=60.0)
    ctx_d, gen_d = start_daemons(short_tmp, opts, {2: ("trtllm", 7)})
    try:
        with pytest.raises(c.WorkerFailed) as refused:
            run_on_daemons(short_tmp, dataclasses.replace(opts, request_prefix="mix"), ctx_d, gen_d)
        said = refused.value.message
        assert "tokens_per_block" in said and "one must divide the other" in said, said
        assert "IncompatibleLayout" in said or "TransferCancelled" in said, said
        assert "Traceback" not in said and "\n" not in said, said
        assert not multiprocessing.active_children()

        with pytest.raises(c.WorkerFailed) as bug:
            run_on_daemons(short_tmp, dataclasses.replace(opts, threads=0, request_prefix="bug"), ctx_d, gen_d)
        said = bug.value.message
        assert "failed: RuntimeError: set_num_threads expects a positive integer" in said, said
        assert "\nTraceback (most recent call last):" in said, said
        assert not multiprocessing.active_children()
    finally:
        ctx_d.stop()
        gen_d.stop()


def test_a_socket_from_the_environment_says_so_when_it_is_taken(
        daemon_factory: Callable[..., DaemonProcess], short_tmp: Path) -> None:
    """The first daemon serves the socket KVD_SOCKET names; a second daemon, its file naming
    another socket, gets the same one from the environment and exits (1, another daemon holds
    it: not a configuration to fix)."""
    first = daemon_factory({}, name="gen")
    config = write_config(short_tmp, "ctx", base_config(short_tmp, node="ctx", socket_path=str(short_tmp / "ctx.sock")))
    run = serve(config, env={"KVD_SOCKET": first.socket_path, "KVD_LOG_FORMAT": "json"})
    check_failure(run, exit_code=1, setting="socket_path", contains=[
        f"kvd: error: socket_path: another kvd is already serving on {first.socket_path} (pid {first.pid}: "
        f"'systemctl stop kvd' where systemd runs it, else 'kill {first.pid}'); stop that daemon first",
        f"; socket_path came from the environment (KVD_SOCKET={first.socket_path}), which overrides the "
        "configuration file: unset it to use the file's value"])
    assert not (short_tmp / "ctx.sock").exists()


def test_a_bad_value_from_the_environment_is_not_blamed_on_the_file(short_tmp: Path) -> None:
    """``KVD_LOG_FORMAT=text``: the error used to read as if the file said so ("(in kvd.toml)")."""
    config = write_config(short_tmp, "kvd", base_config(short_tmp))
    run = serve(config, env={"KVD_LOG_FORMAT": "text"})
    check_failure(run, exit_code=EX_CONFIG, setting="log_format", contains=[
        "kvd: error: log_format: invalid enum value 'text' (one of: auto, console, json)",
        "; log_format came from the environment (KVD_LOG_FORMAT=text), which overrides the configuration file"])


def test_a_setting_the_file_gives_is_not_said_to_come_from_the_environment(short_tmp: Path) -> None:
    """The note is for values the environment set, not for every error about an overridable key."""
    config = write_config(short_tmp, "kvd", base_config(short_tmp, peer_port=70000))
    run = serve(config, env={"KVD_LOG_FORMAT": "json"})
    line = check_failure(run, exit_code=EX_CONFIG, setting="peer_port", contains=["must be a TCP port from 1 to 65535"])
    assert "came from the environment" not in line, line


def test_a_node_from_the_environment_is_named_when_a_peer_has_that_name(short_tmp: Path) -> None:
    """``KVD_NODE=gen`` exported while the ctx daemon's file lists peer ``gen``: the error is
    about ``peers[0].name``, and the cause is the node the environment gave."""
    config = write_config(short_tmp, "ctx", base_config(
        short_tmp, node="ctx", peer_secret_file=secret(short_tmp),
        peers=[{"name": "gen", "host": "127.0.0.1", "port": 17601}]))
    run = serve(config, env={"KVD_NODE": "gen", "KVD_LOG_FORMAT": "json"})
    check_failure(run, exit_code=EX_CONFIG, setting="peers[0].name", contains=[
        "kvd: error: peers[0].name: peer name 'gen' is this daemon's own node",
        "; node came from the environment (KVD_NODE=gen), which overrides the configuration file"])
