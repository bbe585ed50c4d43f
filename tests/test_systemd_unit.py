"""systemd/: the unit file, the sysusers entry and the example configuration.

`systemd-analyze verify` and `systemd-sysusers` come from Debian's ``systemd`` package, which
``.ci/run`` installs (``apt-get install -y systemd``). Where a binary is genuinely absent, the
three tests that run it skip with the reason ``systemd-analyze not installed: apt-get install
systemd`` (``pytest -ra`` prints it in the summary; the README says so); under CI (``CI=true``)
a missing binary FAILS them instead, so a broken CI image cannot skip them unnoticed. Every
other test here needs nothing but Python.

How the unit is verified: ``systemd-analyze verify`` insists that ``ExecStart``'s binary exists
(``Command /usr/bin/kvd is not executable`` otherwise), and kvd is not installed system-wide in
CI. ``--root=DIR`` with a stub ``DIR/usr/bin/kvd`` does not work either: verify then also looks
for ``sysinit.target`` & co under DIR. So we verify a temporary copy named ``kvd.service`` whose
``ExecStart`` points at ``true(1)`` with the same arguments; everything else is checked as
shipped. verify exits 0 even for settings it could not parse (it logs "..., ignoring"), so any
output at all counts as a failure — the self-check below proves that a broken copy is caught.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest

from kvd.config import (
    AccessConfig,
    Config,
    LimitsConfig,
    PeerConfig,
    PoolConfig,
    TransferConfig,
    config_from_dict,
    load_config,
)
from kvd.startup import EX_CONFIG

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "kvd.service"
SYSUSERS = ROOT / "systemd" / "kvd.sysusers"
EXAMPLE = ROOT / "systemd" / "kvd.toml"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A systemd unit as {section: {key: [values in order]}} (keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert not line.endswith("\\"), f"no continuation lines expected: {raw!r}"
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"setting outside a section: {raw!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


@pytest.fixture(scope="module")
def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT.read_text())


def one(unit: dict[str, dict[str, list[str]]], key: str, section: str = "Service") -> str:
    values = unit[section].get(key, [])
    assert len(values) == 1, f"{section}.{key}: {values}"
    return values[0]


def require_binary(name: str) -> str:
    """The path of ``name``; skip visibly where systemd is not installed (fail under CI)."""
    path = shutil.which(name)
    if path is None:
        reason = f"{name} not installed: apt-get install systemd"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI=true: .ci/run installs it, so it must be there)")
        pytest.skip(reason)
    return path


def test_require_binary_skips_or_fails_only_when_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    assert require_binary("sh") == shutil.which("sh")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="kvd-absent not installed: apt-get install systemd"):
        require_binary("kvd-absent")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        require_binary("kvd-absent")


# --- the unit file ---------------------------------------------------------------------------


def test_unit_service_settings(unit: dict[str, dict[str, list[str]]]) -> None:
    assert one(unit, "Type") == "notify"
    assert one(unit, "NotifyAccess") == "main"
    assert one(unit, "WatchdogSec") == "30"
    assert one(unit, "Restart") == "on-failure"
    assert one(unit, "RestartPreventExitStatus") == str(EX_CONFIG)  # kvd serve's "fix the config first"
    assert one(unit, "ExecStart") == "/usr/bin/kvd serve --config /etc/kvd/kvd.toml"
    assert "ExecReload" not in unit["Service"], "kvd cannot reload its configuration in place"
    assert one(unit, "KillSignal") == "SIGTERM"
    assert one(unit, "TimeoutStopSec") == "60"
    assert one(unit, "User") == "kvd"
    assert one(unit, "Group") == "kvd"
    assert one(unit, "RuntimeDirectory") == "kvd"
    assert one(unit, "LimitMEMLOCK") == "infinity"
    assert one(unit, "WantedBy", "Install") == "multi-user.target"


def test_unit_documentation_is_installed_by_the_readme(unit: dict[str, dict[str, list[str]]]) -> None:
    """Documentation= names a file of this repository that the README's install steps put there."""
    doc = one(unit, "Documentation", "Unit")
    assert doc == "file:/usr/share/doc/kvd/README.md"
    readme = (ROOT / "README.md").read_text()
    assert "sudo install -D -m 0644 -t /usr/share/doc/kvd README.md docs/*.md" in readme
    assert (ROOT / "README.md").is_file()


def test_unit_hardening(unit: dict[str, dict[str, list[str]]]) -> None:
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "DevicePolicy": "closed",
    }.items():
        assert one(unit, key) == value, key
    families = set(one(unit, "RestrictAddressFamilies").split())
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= families
    assert not {"AF_PACKET", "AF_BLUETOOTH"} & families
    # CUDA JIT needs W+X pages; PrivateDevices would hide the GPUs.
    assert "MemoryDenyWriteExecute" not in unit["Service"]
    assert "PrivateDevices" not in unit["Service"]
    allowed = {v.split()[0]: v.split()[1] for v in unit["Service"]["DeviceAllow"]}
    for dev in ("char-nvidia", "char-nvidiactl", "char-nvidia-uvm", "char-nvidia-caps-imex-channels"):
        assert allowed.get(dev) == "rw", dev


def test_unit_matches_example_config(unit: dict[str, dict[str, list[str]]]) -> None:
    cfg = load_config(EXAMPLE, env={})
    # The socket lives in the unit's RuntimeDirectory, and the drain fits in the stop timeout.
    assert Path(cfg.socket_path).parent == Path("/run") / one(unit, "RuntimeDirectory")
    from kvd.server import DRAIN_ABORT_GRACE_S, DRAIN_REPLY_GRACE_S

    stop = cfg.drain_timeout_s + DRAIN_ABORT_GRACE_S + DRAIN_REPLY_GRACE_S  # the longest a drain takes
    assert stop < float(one(unit, "TimeoutStopSec"))
    assert one(unit, "ExecStart").endswith(f"--config /etc/kvd/{EXAMPLE.name}")


def test_kernel_cache_is_writable_under_the_unit(unit: dict[str, dict[str, list[str]]],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the daemon caches its compiled regroup kernel when systemd starts it: the unit's
    environment (Environment=, %C = /var/cache for a system unit; HOME = the kvd user's home
    from the sysusers entry) must lead kvd.regroup.kernel.cache_dir() into the CacheDirectory=
    the unit creates, as ProtectSystem=strict leaves nothing else writable (with the default,
    ~/.cache/kvd = /nonexistent/.cache/kvd, every start compiled the kernel again)."""
    from kvd.regroup.kernel import cache_dir

    home = next(shlex.split(line)[4] for line in SYSUSERS.read_text().splitlines() if line.startswith("u "))
    assert home == "/nonexistent"
    for var in ("KVD_KERNEL_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", home)
    for assignment in unit["Service"].get("Environment", []):
        name, _, value = assignment.partition("=")
        monkeypatch.setenv(name, value.replace("%C", "/var/cache"))
    writable = Path("/var/cache") / one(unit, "CacheDirectory")
    assert cache_dir() == writable or writable in cache_dir().parents, cache_dir()
    assert one(unit, "ProtectSystem") == "strict"  # why nothing else would do


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = require_binary("systemd-analyze")
    true = shutil.which("true") or "/bin/true"
    text = UNIT.read_text()
    assert "ExecStart=/usr/bin/kvd " in text
    copy = tmp_path / "kvd.service"  # the unit name must stay kvd.service
    copy.write_text(text.replace("ExecStart=/usr/bin/kvd ", f"ExecStart={true} "))
    result = subprocess.run(
        [analyze, "verify", "--man=no", str(copy)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0, output
    assert output == "", f"systemd-analyze verify complained:\n{output}"


def test_systemd_analyze_verify_catches_bad_settings(tmp_path: Path) -> None:
    """Self-check of the criterion above: a typo is reported (on output, exit status 0)."""
    analyze = require_binary("systemd-analyze")
    true = shutil.which("true") or "/bin/true"
    bad = UNIT.read_text().replace("ExecStart=/usr/bin/kvd ", f"ExecStart={true} ")
    bad = bad.replace("WatchdogSec=30", "WatchdogSec=thirty")
    copy = tmp_path / "kvd.service"
    copy.write_text(bad)
    result = subprocess.run(
        [analyze, "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=120, check=False
    )
    assert "thirty" in result.stdout + result.stderr


def test_sysusers_creates_kvd_user_and_group(tmp_path: Path) -> None:
    sysusers = require_binary("systemd-sysusers")
    (tmp_path / "etc").mkdir()
    result = subprocess.run(
        [sysusers, f"--root={tmp_path}", str(SYSUSERS)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    passwd = {
        line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines()
    }
    group = {
        line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/group").read_text().splitlines()
    }
    user = passwd["kvd"]
    assert int(user[2]) < 1000, "a system uid"
    assert user[3] == group["kvd"][2], "primary group kvd"
    assert user[6] == "/usr/sbin/nologin"


# --- the example configuration -----------------------------------------------------------------


def test_example_config_parses() -> None:
    cfg = load_config(EXAMPLE, env={})
    assert isinstance(cfg, Config)
    assert cfg.socket_path == "/run/kvd/kvd.sock"
    assert cfg.socket_mode == 0o660
    assert cfg.metrics_host == "127.0.0.1"
    (pool,) = cfg.pools
    assert pool.layout().block_bytes(pool.rank) == 36 * 2 * 8 * 32 * 64 * 2  # 2.25 MiB
    assert pool.layout().num_blocks == 65536 * 2**20 // pool.layout().block_bytes(0)


def test_example_defaults_are_the_real_defaults() -> None:
    """Sections the example shows without changing them equal the struct defaults."""
    cfg = load_config(EXAMPLE, env={})
    assert cfg.transfer == TransferConfig()
    assert cfg.limits == LimitsConfig()
    assert cfg.access == AccessConfig()


STRUCTS: list[type[msgspec.Struct]] = [
    Config,
    PoolConfig,
    PeerConfig,
    TransferConfig,
    LimitsConfig,
    AccessConfig,
]


@pytest.mark.parametrize("struct", STRUCTS, ids=lambda s: s.__name__)
def test_example_documents_every_field(struct: type[msgspec.Struct]) -> None:
    """Every field of the configuration appears in the example, set or commented out, so the
    example cannot drift from kvd/config.py unnoticed."""
    text = EXAMPLE.read_text()
    shown = set(re.findall(r"^(?:# )?([a-z_][a-z0-9_]*) = ", text, re.MULTILINE))
    sections = set(re.findall(r"^(?:# )?\[{1,2}([a-z_]+)\]{1,2}$", text, re.MULTILINE))
    for field in msgspec.structs.fields(struct):
        assert field.name in shown | sections, f"{struct.__name__}.{field.name} missing from {EXAMPLE.name}"


def _commented_block(text: str, header: str) -> str:
    """Lines of a commented-out example starting at ``# <header>``, uncommented."""
    lines = text.splitlines()
    start = lines.index(f"# {header}")
    out = []
    for line in lines[start:]:
        if not line.startswith("# "):
            break
        out.append(line[2:])
    return "\n".join(out)


def test_commented_examples_are_valid() -> None:
    import tomllib

    text = EXAMPLE.read_text()
    extra = _commented_block(text, "[[pools]]") + "\n" + _commented_block(text, "[[peers]]")
    data = tomllib.loads(text + "\n" + extra + "\n")
    cfg = config_from_dict(data, env={})
    assert [p.name for p in cfg.pools] == ["gpu0", "host"]
    assert cfg.pools[1].memory == "host" and cfg.pools[1].device == -1
    assert [p.name for p in cfg.peers] == ["gen-node-0"]
