"""Configuration mistakes a newcomer makes writing a kvd.toml from the docs, and what ``kvd serve``
says about them. Each was found by starting a real daemon on such a file; before, they started a
daemon that misbehaved later, or ended in a traceback:

- a port above 65535 was taken modulo 65536 (``peer_port = 70000`` listened on 4464), a
  ``[[peers]]`` port of 0 or 70000 was dialled for ever;
- ``[transfer] chunk_mb = 0`` (or negative) was ``internal error: ZeroDivisionError`` with a
  traceback; ``gpu_chunk_mb``, ``descs_per_write`` of 0 and a negative ``bounce_size_mb`` started;
- ``socket_mode = 660`` (decimal in TOML) gave the socket mode 0o1224;
- a top-level key appended at the end of the file (after a ``[[pools]]`` table, where TOML puts
  it) was "unknown key in [[pools]] table 1", with no word of why;
- a host pool larger than the machine's memory started (its pages are taken only when written),
  for the executors to run the machine out of memory later.

Every case runs ``kvd serve`` as a subprocess (one line on stderr, one log line, exit 78, nothing
bound or allocated); the shapes of the lines are checked through the same ``load_config`` ->
``config_error`` path as the daemon's, as in ``test_startup_errors.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvd.config import config_from_dict, load_config, table_keys
from kvd.demo.launch import write_config
from kvd.startup import EX_CONFIG, StartupError, check_host_pools, config_error, host_memory
from protocol.errors import BadRequest
from tests.conftest import host_pool
from tests.test_startup_errors import base_config, check_failure, secret, serve

FIX = "; fix the configuration (systemd/kvd.toml shows and explains every key)"

POOL = ('[[pools]]\nname = "a"\nmemory = "host"\nnum_layers = 2\nnum_kv_heads = 8\nhead_dim = 64\n'
        'tokens_per_block = 16\nnum_blocks = 4\n')


def test_a_peer_port_above_65535_is_refused_not_wrapped(short_tmp: Path) -> None:
    cfg = base_config(short_tmp, peer_secret_file=secret(short_tmp), peer_port=70000)
    run = serve(write_config(short_tmp, "kvd", cfg))
    check_failure(run, exit_code=EX_CONFIG, setting="peer_port",
                  contains=["kvd: error: peer_port: peer_port (or KVD_PEER_PORT) must be a TCP port from 1 to 65535 "
                            "(0 = any free port), got 70000 (in "])
    assert not (short_tmp / "kvd.sock").exists()
    assert '"peer.listening"' not in run.stdout


def test_a_peer_port_above_65535_from_the_environment(short_tmp: Path) -> None:
    run = serve(write_config(short_tmp, "kvd", base_config(short_tmp)), env={"KVD_PEER_PORT": "65536"})
    check_failure(run, exit_code=EX_CONFIG, setting="peer_port",
                  contains=["peer_port (or KVD_PEER_PORT) must be a TCP port from 1 to 65535", "got 65536"])


def test_a_chunk_size_of_zero_is_a_configuration_error_not_a_traceback(short_tmp: Path) -> None:
    cfg = base_config(short_tmp, transfer={"bounce_size_mb": 4, "chunk_mb": 0})
    path = write_config(short_tmp, "kvd", cfg)
    run = serve(path)
    check_failure(run, exit_code=EX_CONFIG, setting="transfer.chunk_mb",
                  contains=[f"kvd: error: transfer.chunk_mb: chunk_mb must be at least 1, got 0 (in {path}){FIX}"])
    assert '"pool.created"' not in run.stdout


def test_a_decimal_socket_mode_says_to_write_it_in_octal(short_tmp: Path) -> None:
    path = short_tmp / "kvd.toml"
    path.write_text(f'socket_path = "{short_tmp / "kvd.sock"}"\nlog_format = "json"\nsocket_mode = 660\n{POOL}')
    run = serve(str(path))
    check_failure(run, exit_code=EX_CONFIG, setting="socket_mode",
                  contains=["kvd: error: socket_mode: socket_mode must be a permission mode from 0o000 to 0o777, "
                            "got 660, which TOML reads as a decimal number (0o1224): write the octal mode as "
                            f"socket_mode = 0o660 (in {path}){FIX}"])
    assert not (short_tmp / "kvd.sock").exists()


def test_a_top_level_key_after_a_pools_table_says_where_it_belongs(short_tmp: Path) -> None:
    """``metrics_port = 9464`` appended to a file that ends with a [[pools]] table: TOML puts it
    in that table. The line says it is a top-level key and where to move it."""
    path = short_tmp / "kvd.toml"
    path.write_text(f'socket_path = "{short_tmp / "kvd.sock"}"\nlog_format = "json"\n{POOL}metrics_port = 9464\n')
    run = serve(str(path))
    check_failure(run, exit_code=EX_CONFIG, setting="pools[0].metrics_port",
                  contains=[f"kvd: error: pools[0].metrics_port: unknown key in [[pools]] table 1 of {path}: "
                            "metrics_port is a top-level key; TOML puts every key after a [[pools]] header into "
                            "that table: move metrics_port above the first [table] or [[table]] header of the "
                            f"file{FIX}"])


def test_a_host_pool_larger_than_the_machine_is_refused(short_tmp: Path) -> None:
    """A host pool of twice the machine's memory (``budget_mb``): refused before anything is
    allocated, naming the pool, its size, the machine's and what to lower."""
    limit, source = host_memory()
    if not limit:
        pytest.skip("this machine says nothing of its memory (no /proc/meminfo, no cgroup limit)")
    pool = host_pool("big", num_blocks=0, budget_mb=2 * limit / 2**20)
    run = serve(write_config(short_tmp, "kvd", base_config(short_tmp, pools=[pool])))
    check_failure(run, exit_code=EX_CONFIG, setting="pools[0].budget_mb",
                  contains=["kvd: error: pools[0].budget_mb: pool 'big' needs ",
                            f" of host memory, more than this machine has ({limit / 2**30:.1f} GiB, {source}); "
                            "lower num_blocks or budget_mb"])
    assert '"pool.created"' not in run.stdout
    assert not (short_tmp / "kvd.sock").exists()


@pytest.mark.parametrize(("toml", "line"), [
    ("peer_port = -1\n", "peer_port: peer_port (or KVD_PEER_PORT) must be a TCP port from 1 to 65535 (0 = any free "
                         "port), got -1 (in {path})"),
    ("metrics_port = 70000\n", "metrics_port: metrics_port (or KVD_METRICS_PORT) must be a TCP port from 1 to 65535 "
                               "(0 = off), got 70000 (in {path})"),
    ("socket_mode = 0o7777\n", "socket_mode: socket_mode must be a permission mode from 0o000 to 0o777, got 4095 "
                               "(0o7777) (in {path})"),
    ('node = ""\n', "node: node must name this daemon"),
    ('[[peers]]\nname = "g"\nport = 70000\n', "peers[0].port: port of peer 'g' must be the peer daemon's peer_port, "
                                            "from 1 to 65535, got 70000 (in {path})"),
    ('[[peers]]\nname = "g"\nport = 0\n', "peers[0].port: port of peer 'g' must be the peer daemon's peer_port"),
    ('[[peers]]\nname = "g"\nhost = ""\nport = 7400\n',
     "peers[0].host: host of peer 'g' is empty: give the address the peer daemon's peer_host listens on"),
    ("[transfer]\nchunk_mb = -1\n", "transfer.chunk_mb: chunk_mb must be at least 1, got -1 (in {path})"),
    ("[transfer]\ngpu_chunk_mb = 0\n", "transfer.gpu_chunk_mb: gpu_chunk_mb must be at least 1, got 0 (in {path})"),
    ("[transfer]\ndescs_per_write = 0\n", "transfer.descs_per_write: descs_per_write must be at least 1, got 0"),
    ("[transfer]\nbounce_size_mb = -1\n", "transfer.bounce_size_mb: bounce_size_mb must be 0 or more"),
    (POOL.replace("num_blocks = 4", "num_blocks = -5"),
     "pools[0].num_blocks: num_blocks must be positive (or 0: as many blocks as budget_mb holds), got -5 (in {path})"),
    (POOL.replace("num_blocks = 4", "budget_mb = -3.0"),
     "pools[0].budget_mb: budget_mb must be a positive number of MiB, got -3.0 (in {path})"),
    # a key right but in the wrong table: where it belongs, not a guess at a typo
    (POOL + "deadline_s = 5.0\n", "pools[0].deadline_s: unknown key in [[pools]] table 1 of {path}: deadline_s is a "
                                  "key of [transfer]; TOML puts every key after a [[pools]] header into that table: "
                                  "move deadline_s under [transfer]"),
    ("[transfer]\nmax_sessions = 5\n", "transfer.max_sessions: unknown key in [transfer] of {path}: max_sessions is a "
                                       "key of [limits]; TOML puts every key after a [transfer] header into that "
                                       "table: move max_sessions under [limits]"),
    ("chunk_mb = 4\n", "chunk_mb: unknown key in the top level of {path}: chunk_mb is a key of [transfer]; put it "
                       "under a [transfer] header"),
    ('[[peers]]\nname = "g"\nport = 1\nnum_blocks = 4\n',
     "peers[0].num_blocks: unknown key in [[peers]] table 1 of {path}: num_blocks is a key of [[pools]]; "
     "TOML puts every key after a [[peers]] header into that table: move num_blocks under [[pools]]"),
    # a typo still gets its guess, and a key of several tables (name) gets none of this
    (POOL + "num_block = 4\n", "pools[0].num_block: unknown key in [[pools]] table 1 of {path} (did you mean "
                               "num_blocks?); fix"),
])
def test_config_mistakes_start_with_the_setting(short_tmp: Path, toml: str, line: str) -> None:
    path = short_tmp / "kvd.toml"
    path.write_text(toml)
    with pytest.raises(BadRequest) as info:
        load_config(path, env={})
    error = config_error(str(path), info.value, table_keys)
    assert error.message.startswith(line.format(path=path)), error.message
    assert error.message.endswith(FIX.removeprefix("; "))
    assert error.exit_code == EX_CONFIG and error.message.startswith(f"{error.setting}: ")


def test_values_at_the_edges_of_their_ranges_are_accepted() -> None:
    cfg = config_from_dict({"peer_port": 65535, "metrics_port": 1, "socket_mode": 0o777,
                            "peers": [{"name": "g", "port": 65535}],
                            "transfer": {"chunk_mb": 1, "gpu_chunk_mb": 1, "descs_per_write": 1, "bounce_size_mb": 0},
                            "pools": [host_pool(num_blocks=0, budget_mb=1.0)]}, env={})
    assert (cfg.peer_port, cfg.metrics_port, cfg.socket_mode, cfg.peers[0].port) == (65535, 1, 0o777, 65535)
    assert cfg.transfer.bounce_size_mb == 0
    assert config_from_dict({"peer_port": 0, "metrics_port": 0, "socket_mode": 0}, env={}).socket_mode == 0


def test_host_pools_that_fit_alone_but_not_together(short_tmp: Path) -> None:
    """Two pools of 3 GiB under a 4 GiB limit: the setting is ``pools`` and the line lists both."""
    gib = 2**30
    with pytest.raises(StartupError) as info:
        check_host_pools([("pools[0].num_blocks", "a", 3 * gib), ("pools[1].budget_mb", "b", 3 * gib)],
                         (4 * gib, "the cgroup's limit, memory.max"))
    assert info.value.exit_code == EX_CONFIG and info.value.setting == "pools"
    assert info.value.message.startswith("pools: the host pools need 6.0 GiB (a 3.0 GiB, b 3.0 GiB) of host memory, "
                                         "more than this machine has (4.0 GiB, the cgroup's limit, memory.max)")
    check_host_pools([("pools[0].num_blocks", "a", 2 * gib), ("pools[1].num_blocks", "b", 2 * gib)], (4 * gib, "x"))
    check_host_pools([("pools[0].num_blocks", "a", 100 * gib)], (0, ""))  # unknown memory: nothing checked
    check_host_pools([], (4 * gib, "x"))


def test_host_memory_takes_the_lower_of_the_machine_and_its_cgroup(short_tmp: Path) -> None:
    meminfo = short_tmp / "meminfo"
    meminfo.write_text("MemTotal:       8388608 kB\nMemFree:        1024 kB\n")
    cgroup = short_tmp / "memory.max"
    cgroup.write_text("max\n")
    assert host_memory(str(meminfo), str(cgroup)) == (8 * 2**30, f"MemTotal in {meminfo}")
    cgroup.write_text(f"{2**30}\n")
    assert host_memory(str(meminfo), str(cgroup)) == (2**30, f"the cgroup's limit, {cgroup}")
    assert host_memory(str(short_tmp / "absent"), str(short_tmp / "absent")) == (0, "")
