"""Every startup failure of ``kvd serve`` is one line on stderr, one structured log line and a
non-zero exit status — never a traceback. Each case runs a real ``kvd serve`` subprocess."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvd.config import config_from_dict, load_config, table_keys
from kvd.demo.launch import write_config
from kvd.startup import EX_CONFIG, StartupError, config_error, explain
from protocol.errors import BadRequest
from tests.conftest import host_pool


def base_config(tmp: Path, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "node": "n",
        "socket_path": str(tmp / "kvd.sock"),
        "log_format": "json",
        "pools": [host_pool(num_blocks=4, num_layers=1)],
        "transfer": {"bounce_size_mb": 4, "chunk_mb": 2},
    }
    cfg.update(extra)
    return cfg


def secret(tmp: Path, mode: int = 0o600) -> str:
    path = tmp / "peer.secret"
    path.write_text("0123456789abcdef0123456789abcdef\n")
    os.chmod(path, mode)
    return str(path)


def serve(config_path: str | None, *, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``kvd serve --config PATH``: expected to fail before it is ready (bounded by a timeout)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    full_env.update({"UCX_NET_DEVICES": "lo", **(env or {})})
    cmd = [sys.executable, "-m", "kvd", "serve"] + (["--config", config_path] if config_path else [])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=full_env, stdin=subprocess.DEVNULL)


def check_failure(run: subprocess.CompletedProcess[str], *, exit_code: int, setting: str | None,
                  contains: list[str]) -> str:
    """One ``kvd: error:`` line naming what and what to do; exactly one ``daemon.startup_failed``
    log line with the same reason; the expected exit status; no traceback anywhere."""
    assert run.returncode == exit_code, (run.returncode, run.stdout, run.stderr)
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    line = lines[0]
    assert line.startswith("kvd: error: "), line
    for text in contains:
        assert text in line, (text, line)
    assert "Traceback" not in run.stdout + run.stderr
    events = [json.loads(raw) for raw in run.stdout.splitlines()]
    failed = [e for e in events if e["event"] == "daemon.startup_failed"]
    assert len(failed) == 1, run.stdout
    assert failed[0]["reason"] == line.removeprefix("kvd: error: ")
    assert failed[0]["setting"] == setting
    assert failed[0]["level"] == "error" and failed[0]["code"] == "startup_failed"
    assert "daemon.ready" not in {e["event"] for e in events}
    # the failure is the last word: nothing (no "daemon.stopped") reads as if it came after
    assert events[-1]["event"] == "daemon.startup_failed", [e["event"] for e in events]
    assert "daemon.stopped" not in {e["event"] for e in events}
    return line


# --- the peer secret -----------------------------------------------------------------------------


def test_peer_secret_missing(short_tmp: Path) -> None:
    missing = str(short_tmp / "nope.secret")
    run = serve(write_config(short_tmp, "kvd", base_config(short_tmp, peer_secret_file=missing)))
    check_failure(run, exit_code=EX_CONFIG, setting="peer_secret_file",
                  contains=[f"peer_secret_file: peer secret file {missing} does not exist",
                            f"`(umask 077 && openssl rand -hex 32 > {missing})`"])
    # nothing was allocated or bound: the configuration alone decided
    assert not (short_tmp / "kvd.sock").exists()
    assert '"pool.created"' not in run.stdout


def test_peer_secret_world_readable(short_tmp: Path) -> None:
    path = secret(short_tmp, mode=0o644)
    run = serve(write_config(short_tmp, "kvd", base_config(short_tmp, peer_secret_file=path)))
    check_failure(run, exit_code=EX_CONFIG, setting="peer_secret_file",
                  contains=[f"peer secret file {path} has mode 0644", f"chmod 600 {path}"])


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run kvd as another user")
def test_peer_secret_of_another_user_says_whose_it_must_be(short_tmp: Path) -> None:
    """The README's install creates the secret as root, then chowns it to kvd: without the
    chown, kvd (another user) cannot open it, and the line said only 'Permission denied'."""
    path = secret(short_tmp)  # root's, mode 600
    os.chmod(short_tmp, 0o777)  # the socket directory: the daemon must fail on the secret alone
    cfg = base_config(short_tmp, peer_secret_file=path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    env.update({"UCX_NET_DEVICES": "lo", "PYTHONPATH": os.pathsep.join(sys.path), "HOME": str(short_tmp)})
    cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
           sys.executable, "-m", "kvd", "serve", "--config", write_config(short_tmp, "kvd", cfg)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    check_failure(run, exit_code=EX_CONFIG, setting="peer_secret_file",
                  contains=[f"cannot open peer secret file {path}: Permission denied; kvd runs as ",
                            "(uid 65534): the file must be that user's, mode 600 (for the systemd unit: "
                            f"chown kvd:kvd {path})"])
    assert not (short_tmp / "kvd.sock").exists()


def test_peers_without_a_secret(short_tmp: Path) -> None:
    cfg = base_config(short_tmp, peers=[{"name": "gen", "host": "127.0.0.1", "port": 1}])
    run = serve(write_config(short_tmp, "kvd", cfg))
    check_failure(run, exit_code=EX_CONFIG, setting="peer_secret_file",
                  contains=["peer_secret_file: not set, but [[peers]] lists gen", "set peer_secret_file"])


# --- ports and the socket ------------------------------------------------------------------------


@pytest.fixture
def busy_port() -> Any:
    """A TCP port on 127.0.0.1 that another process (this one) listens on."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    try:
        yield holder.getsockname()[1]
    finally:
        holder.close()


def test_peer_port_busy(short_tmp: Path, busy_port: int) -> None:
    cfg = base_config(short_tmp, peer_secret_file=secret(short_tmp), peer_port=busy_port)
    run = serve(write_config(short_tmp, "kvd", cfg))
    check_failure(run, exit_code=1, setting="peer_port",
                  contains=[f"peer_port: peer-link port {busy_port} on 127.0.0.1 is already in use",
                            "set another peer_port (KVD_PEER_PORT)"])
    assert not (short_tmp / "kvd.sock").exists()  # the socket taken before it was released


def test_peer_port_busy_from_the_environment(short_tmp: Path, busy_port: int) -> None:
    cfg = base_config(short_tmp, peer_secret_file=secret(short_tmp))
    run = serve(write_config(short_tmp, "kvd", cfg), env={"KVD_PEER_PORT": str(busy_port)})
    check_failure(run, exit_code=1, setting="peer_port", contains=[f"peer-link port {busy_port}", "KVD_PEER_PORT"])


def test_metrics_port_busy(short_tmp: Path, busy_port: int) -> None:
    run = serve(write_config(short_tmp, "kvd", base_config(short_tmp, metrics_port=busy_port)))
    check_failure(run, exit_code=1, setting="metrics_port",
                  contains=[f"metrics_port: metrics port {busy_port} on 127.0.0.1 is already in use",
                            "set another metrics_port (KVD_METRICS_PORT; 0 = off)"])


def test_metrics_port_is_the_peer_port(short_tmp: Path) -> None:
    """One port for both listeners: it said 'already in use; stop the process that holds it',
    the process being this daemon. The configuration alone decides now (exit 78, nothing bound);
    the same port on two distinct addresses stays allowed."""
    cfg = base_config(short_tmp, peer_secret_file=secret(short_tmp), peer_port=27400, metrics_port=27400)
    run = serve(write_config(short_tmp, "kvd", cfg))
    check_failure(run, exit_code=EX_CONFIG, setting="metrics_port",
                  contains=["metrics_port: metrics_port 27400 is peer_port too; this daemon listens on both: "
                            "give metrics_port another port (0 = off)"])
    assert not (short_tmp / "kvd.sock").exists()
    ok = config_from_dict({"peer_host": "10.0.0.1", "peer_port": 7400, "metrics_port": 7400}, env={})
    assert (ok.peer_port, ok.metrics_port, ok.metrics_host) == (7400, 7400, "127.0.0.1")


def test_socket_path_busy(short_tmp: Path) -> None:
    path = short_tmp / "kvd.sock"
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(path))
    live.listen(1)
    try:
        run = serve(write_config(short_tmp, "kvd", base_config(short_tmp)))
        check_failure(run, exit_code=1, setting="socket_path",
                      contains=[f"socket_path: another kvd is already serving on {path} (pid {os.getpid()}: ",
                                "another socket_path (KVD_SOCKET)"])
        assert path.is_socket()  # the live socket is left alone
        assert '"pool.created"' not in run.stdout  # refused before any memory was allocated
    finally:
        live.close()


def test_socket_directory_missing(short_tmp: Path) -> None:
    cfg = base_config(short_tmp, socket_path=str(short_tmp / "no-such-dir" / "kvd.sock"))
    run = serve(write_config(short_tmp, "kvd", cfg))
    check_failure(run, exit_code=EX_CONFIG, setting="socket_path",
                  contains=[f"socket directory {short_tmp / 'no-such-dir'} does not exist", "KVD_SOCKET"])


@pytest.mark.skipif(os.path.isdir("/run/kvd"), reason="/run/kvd exists here: the built-in defaults could start a daemon")
def test_no_configuration_file_says_the_setting_is_a_built_in_default(short_tmp: Path) -> None:
    """``kvd serve`` typed with no --config and no KVD_CONFIG: the default socket directory
    does not exist, and the line says that no configuration was given (not a broken install);
    a setting that came from a variable names the variable instead."""
    run = serve(None)
    check_failure(run, exit_code=EX_CONFIG, setting="socket_path",
                  contains=["socket directory /run/kvd does not exist",
                            "kvd serve was given no configuration file (--config FILE, or KVD_CONFIG), so socket_path "
                            "is the built-in default"])
    run = serve(None, env={"KVD_SOCKET": str(short_tmp / "no-such-dir" / "kvd.sock")})
    line = check_failure(run, exit_code=EX_CONFIG, setting="socket_path", contains=["KVD_SOCKET"])
    assert "built-in default" not in line


# --- the configuration ---------------------------------------------------------------------------


def test_config_file_missing(short_tmp: Path) -> None:
    path = str(short_tmp / "absent.toml")
    run = serve(path, env={"KVD_LOG_FORMAT": "json"})
    check_failure(run, exit_code=EX_CONFIG, setting=None,
                  contains=[f"cannot read configuration {path}: No such file or directory; give --config "
                            "(or KVD_CONFIG) a readable TOML file; systemd/kvd.toml is an example of one"])


def test_config_file_missing_relative(short_tmp: Path) -> None:
    """A relative --config is read from the working directory, which the line names (a service's
    working directory is /, not where the file was written)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    run = subprocess.run([sys.executable, "-m", "kvd", "serve", "--config", "gen.tmol"], cwd=short_tmp,
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                         env={**full_env, "KVD_LOG_FORMAT": "json", "UCX_NET_DEVICES": "lo"})
    check_failure(run, exit_code=EX_CONFIG, setting=None,
                  contains=[f"kvd: error: cannot read configuration gen.tmol (relative to the working directory: "
                            f"{short_tmp / 'gen.tmol'}): No such file or directory; give --config"])


def test_config_not_toml(short_tmp: Path) -> None:
    path = short_tmp / "broken.toml"
    path.write_text('node = "a"\npools = [\n')
    run = serve(str(path), env={"KVD_LOG_FORMAT": "json"})
    check_failure(run, exit_code=EX_CONFIG, setting=None, contains=[f"configuration {path} is not valid TOML"])


def test_config_wrong_type_names_the_setting(short_tmp: Path) -> None:
    cfg = base_config(short_tmp)
    cfg["pools"] = [host_pool(num_blocks="many")]
    path = write_config(short_tmp, "kvd", cfg)
    run = serve(path, env={"KVD_LOG_FORMAT": "json"})
    line = check_failure(run, exit_code=EX_CONFIG, setting="pools[0].num_blocks",
                         contains=[f"pools[0].num_blocks: expected `int`, got `str` (in {path}); fix the configuration"])
    assert line.startswith("kvd: error: pools[0].num_blocks: "), line  # <setting>: first, as README says


def test_config_unknown_key(short_tmp: Path) -> None:
    path = write_config(short_tmp, "kvd", base_config(short_tmp, peer_prot=5))
    run = serve(path, env={"KVD_LOG_FORMAT": "json"})
    check_failure(run, exit_code=EX_CONFIG, setting="peer_prot",
                  contains=[f"kvd: error: peer_prot: unknown key in the top level of {path} (did you mean peer_port?); "
                            "fix the configuration (systemd/kvd.toml shows and explains every key)"])


def test_config_unknown_key_in_a_table(short_tmp: Path) -> None:
    """A typo under [transfer]: the line names the key with its table, and the key meant."""
    cfg = base_config(short_tmp, transfer={"bounce_sise_mb": 4})
    path = write_config(short_tmp, "kvd", cfg)
    run = serve(path, env={"KVD_LOG_FORMAT": "json"})
    check_failure(run, exit_code=EX_CONFIG, setting="transfer.bounce_sise_mb",
                  contains=[f"kvd: error: transfer.bounce_sise_mb: unknown key in [transfer] of {path} "
                            "(did you mean bounce_size_mb?); fix the configuration"])


POOL = ('[[pools]]\nname = "a"\nmemory = "host"\nnum_layers = 2\nnum_kv_heads = 8\nhead_dim = 64\n'
        'tokens_per_block = 16\nnum_blocks = 4\n{extra}\n')


@pytest.mark.parametrize(("toml", "line"), [
    ('[[pools]]\nname = "a"\nnum_block = 4\n',
     "pools[0].num_block: unknown key in [[pools]] table 1 of {path} (did you mean num_blocks?)"),
    ('[[peers]]\nname = "g"\nhost = "h"\nport = 1\n[[peers]]\nname = "h"\nhost = "h"\nprot = 1\n',
     "peers[1].prot: unknown key in [[peers]] table 2 of {path} (did you mean port?)"),
    ("[tranfser]\nchunk_mb = 4\n", "tranfser: unknown key in the top level of {path} (did you mean transfer?)"),
    ("[access]\nzzz = 1\n", "access.zzz: unknown key in [access] of {path}; fix"),
    ('[[pools]]\nmemory = "host"\n', "pools[0].name: required key missing from [[pools]] table 1 of {path}"),
    ('[[pools]]\nname = "a"\nmemory = "hots"\n',
     "pools[0].memory: invalid enum value 'hots' (one of: auto, device, fabric, host, posix_fd; did you mean host?) "
     "(in {path})"),
    ('log_level = "verbose"\n', "log_level: invalid enum value 'verbose' (one of: debug, error, info, warning) (in {path})"),
    ('[transfer]\nbusy_poll = true\n', "transfer.busy_poll: expected `str`, got `bool` (in {path})"),
    ('[transfer]\nbusy_poll = "always"\n', "transfer.busy_poll: invalid enum value 'always' (one of: auto, off, on) (in {path})"),
    # what the pool's layout refuses is located too (it was "configuration PATH: KVLayout.dtype ...", no setting)
    (POOL.format(extra='dtype = "bf16"'), "pools[0].dtype: 'bf16' is not one of ['bfloat16', 'float16', "),
    (POOL.format(extra="tp_size = 3"), "pools[0].num_kv_heads: num_kv_heads=8 is not divisible by tp_size=3 (in {path})"),
    (POOL.format(extra='axis_order = ["block", "layer", "kv", "head", "dim", "token"]'),
     "pools[0].axis_order: must end with 'dim' (a head vector is contiguous) (in {path})"),
    (POOL.format(extra="tp_size = 2\nrank = 2"), "pools[0].rank: rank 2 outside world size 2 (in {path})"),
    (POOL.format(extra="").replace("num_blocks = 4\n", ""), "pools[0].num_blocks: give num_blocks or budget_mb (in {path})"),
    (POOL.format(extra="") + POOL.format(extra=""),
     "pools[1].name: duplicate pool name 'a' (each [[pools]] table needs its own name) (in {path})"),
    # mistakes the daemon used to find only later, and report as something else
    ('[[peers]]\nname = "g"\nport = 7400\n[[peers]]\nname = "g"\nhost = "10.0.0.2"\nport = 7400\n',
     "peers[1].name: duplicate peer name 'g' (one [[peers]] table per peer daemon) (in {path})"),
    ('node = "ctx"\n[[peers]]\nname = "gen"\nport = 7400\n[[peers]]\nname = "ctx"\nport = 7401\n',
     "peers[1].name: peer name 'ctx' is this daemon's own node: a [[peers]] entry names another daemon, "
     "by that daemon's node (in {path})"),
    ("peer_port = 7400\nmetrics_port = 7400\n",
     "metrics_port: metrics_port 7400 is peer_port too; this daemon listens on both: give metrics_port another "
     "port (0 = off) (in {path})"),
    ('peer_host = "0.0.0.0"\npeer_port = 7400\nmetrics_port = 7400\n', "metrics_port: metrics_port 7400 is peer_port too"),
])
def test_config_errors_start_with_the_setting(short_tmp: Path, toml: str, line: str) -> None:
    """The shapes of configuration mistakes, through the same load_config -> config_error as
    ``kvd serve`` (the subprocess cases above check the rest of the way out)."""
    path = short_tmp / "kvd.toml"
    path.write_text(toml)
    with pytest.raises(BadRequest) as info:
        load_config(path, env={})
    error = config_error(str(path), info.value, table_keys)
    assert error.message.startswith(line.format(path=path)), error.message
    assert error.message.endswith("fix the configuration (systemd/kvd.toml shows and explains every key)")
    assert error.exit_code == EX_CONFIG and error.message.startswith(f"{error.setting}: ")


def test_config_pool_layout_error_names_the_setting(short_tmp: Path) -> None:
    """A dtype the layout does not know, through a real ``kvd serve``: the line starts with the
    key (``pools[0].dtype``), the log line's ``setting`` names it, exit 78."""
    path = write_config(short_tmp, "kvd", base_config(short_tmp, pools=[host_pool(dtype="bf16")]))
    run = serve(path, env={"KVD_LOG_FORMAT": "json"})
    check_failure(run, exit_code=EX_CONFIG, setting="pools[0].dtype",
                  contains=["kvd: error: pools[0].dtype: 'bf16' is not one of ['bfloat16', ",
                            f"(in {path}); fix the configuration"])


def test_config_bad_limit(short_tmp: Path) -> None:
    cfg = base_config(short_tmp, limits={"max_sessions": 0})
    run = serve(write_config(short_tmp, "kvd", cfg), env={"KVD_LOG_FORMAT": "json"})
    check_failure(run, exit_code=EX_CONFIG, setting=None,
                  contains=["[limits] max_sessions must be at least 1, got 0"])


def test_config_bad_environment_value(short_tmp: Path) -> None:
    run = serve(write_config(short_tmp, "kvd", base_config(short_tmp)),
                env={"KVD_METRICS_PORT": "ninety", "KVD_LOG_FORMAT": "json"})
    check_failure(run, exit_code=EX_CONFIG, setting=None,
                  contains=["environment KVD_METRICS_PORT='ninety' is not a valid int"])


# --- explain(): what is reported when several errors arrive at once -----------------------------


def test_explain_prefers_the_startup_error_inside_a_group() -> None:
    inner = StartupError("peer_port: busy", setting="peer_port")
    group = BaseExceptionGroup("nursery", [ValueError("noise"), ExceptionGroup("inner", [inner])])
    assert explain(group) is inner
    assert explain(ExceptionGroup("g", [BadRequest("pool 'x' is bad")])).message == "pool 'x' is bad"
    oops = explain(ExceptionGroup("g", [ZeroDivisionError("boom")]))
    assert oops.internal and oops.message.startswith("internal error: ZeroDivisionError: boom")
    assert StartupError("two\nlines").message == "two; lines"


def test_pool_that_cannot_be_created(short_tmp: Path) -> None:
    """GPU 99 exists nowhere, and this CPU machine has no CUDA driver at all: the configuration
    must change (exit 78, so systemd does not restart into the same refusal); the line names
    the pool's setting and what to set, without the driver message's own full stop doubled."""
    cfg = base_config(short_tmp, pools=[host_pool("gpu99", memory="device", device=99, num_blocks=4)])
    run = serve(write_config(short_tmp, "kvd", cfg))
    line = check_failure(run, exit_code=EX_CONFIG, setting="pools[0].memory",
                         contains=["pools[0].memory / pools[0].device: pool 'gpu99': cannot create device memory "
                                   "on GPU 99",
                                   'this machine has no CUDA driver: set pools[0].memory = "host" and '
                                   "pools[0].device = -1"])
    assert ".;" not in line
    assert not (short_tmp / "kvd.sock").exists()  # the socket bound first is released again
