"""Start kvd daemons as real subprocesses and wait until they are ready.

Used by ``kvd demo``, the benchmarks and the integration tests. Readiness is observed the
way systemd observes it: the launcher binds an ``AF_UNIX`` datagram socket, passes it as
``NOTIFY_SOCKET`` and waits for ``READY=1`` (never a sleep). The ready ``STATUS=`` line
carries the peer-link port the daemon bound.

With :func:`use_warm_interpreters` (the test suite turns it on) a daemon is started in an
interpreter that has already imported torch (:mod:`kvd.demo.warm`), where its environment and
working directory allow: READY=1 comes ~1 s sooner, the daemon itself being the same
``kvd serve`` run from its first line of configuration on.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import msgspec

from protocol.errors import KvdError


class LaunchError(KvdError):
    """A daemon subprocess did not become ready."""

    code = "launch_failed"


@dataclass
class DaemonProcess:
    """A running kvd subprocess."""

    proc: subprocess.Popen[bytes]
    socket_path: str
    peer_port: int
    config_path: str
    notify: socket.socket
    log_path: str
    messages: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read_notify(self, timeout: float = 0.0) -> list[str]:
        """Datagrams received since the last call (each a newline-joined message)."""
        self.notify.settimeout(timeout if timeout > 0 else 0.0001)
        out: list[str] = []
        while True:
            try:
                data = self.notify.recv(4096)
            except (TimeoutError, BlockingIOError):
                break
            out.append(data.decode())
            self.notify.settimeout(0.0001)
        self.messages.extend(out)
        return out

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def logged(self, event: str, count: int = 1, timeout: float = 30.0,
               **fields: object) -> list[dict[str, Any]]:
        """The daemon's JSON log records of ``event`` (with every key of ``fields`` equal to its
        value) once there are at least ``count`` of them.

        A daemon answers its executors before it logs the request's outcome
        (``transfer.done`` follows the completion reply), so a caller that has its replies
        reads the log through this, never right away. Raises :class:`LaunchError` after
        ``timeout`` seconds, or at once if the daemon exited with fewer."""
        needle = f'"{event}"'
        t_end = time.monotonic() + timeout
        while True:
            exited = self.proc.poll() is not None  # read after: the last lines are written by then
            recs = [r for r in (msgspec.json.decode(line) for line in self.log().splitlines()
                                if needle in line and line.startswith("{"))
                    if isinstance(r, dict) and r.get("event") == event
                    and all(r.get(k) == v for k, v in fields.items())]
            if len(recs) >= count:
                return recs
            if exited or time.monotonic() > t_end:
                raise LaunchError(f"{self.config_path}: {len(recs)} {event} lines logged, {count} expected")
            time.sleep(0.005)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait, SIGKILL if needed; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.close_notify()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.close_notify()

    def close_notify(self) -> None:
        """Close the notify socket and remove its file (else ``kvd demo --keep`` leaves one
        stale ``NAME-notify-*.sock`` per daemon among the configs and logs it keeps)."""
        close_notify(self.notify)


def close_notify(notify: socket.socket) -> None:
    """Close a bound ``AF_UNIX`` notify socket and unlink its path (idempotent)."""
    if notify.fileno() != -1:
        path = notify.getsockname()
        notify.close()
        if isinstance(path, str) and path:
            Path(path).unlink(missing_ok=True)


def write_config(directory: str | Path, name: str, config: Mapping[str, Any]) -> str:
    """Write ``config`` as ``<directory>/<name>.toml``; returns the path."""
    path = Path(directory) / f"{name}.toml"
    path.write_text(to_toml(config))
    return str(path)


def to_toml(data: Mapping[str, Any], prefix: str = "") -> str:
    """Serialize the nested dict/list/scalar subset kvd's config uses into TOML."""
    lines: list[str] = []
    tables: list[tuple[str, Mapping[str, Any]]] = []
    arrays: list[tuple[str, list[Mapping[str, Any]]]] = []
    for key, value in data.items():
        if isinstance(value, Mapping):
            tables.append((key, value))
        elif isinstance(value, list | tuple) and value and all(isinstance(v, Mapping) for v in value):
            arrays.append((key, list(value)))
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    for key, table in tables:
        lines.append(f"\n[{prefix}{key}]")
        lines.append(to_toml(table, f"{prefix}{key}."))
    for key, items in arrays:
        for item in items:
            lines.append(f"\n[[{prefix}{key}]]")
            lines.append(to_toml(item, f"{prefix}{key}."))
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


#: Environment keys only read once ``kvd serve`` runs (by the configuration, the notifier,
#: UCX and NIXL when the agent is made; pytest's own marker), never by the interpreter or by
#: ``import torch``: a warm interpreter takes them from the request. Any other difference from
#: the environment it was started with, and the daemon gets a fresh interpreter.
LATE_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "KVD_", "UCX_", "NIXL_", "PYTEST_CURRENT_TEST")


def _early(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(LATE_ENV)}


def _base_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """The environment :func:`start_daemon` gives a daemon, less ``NOTIFY_SOCKET``."""
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("UCX_NET_DEVICES", "lo")
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    return full_env


@dataclass
class _Warm:
    proc: subprocess.Popen[bytes]
    early_env: dict[str, str]
    cwd: str


class WarmInterpreters:
    """Up to ``size`` interpreters started ahead (``python -m kvd.demo.warm``, torch imported),
    each waiting to become the next daemon :func:`start_daemon` starts.

    They are started once a daemon has been asked for, and again once two are taken
    (:meth:`refill`): a run that starts no daemon starts none. ``size=2`` covers a ctx/gen pair;
    the test suite keeps 4, a pair warming behind the pair taken next. :meth:`close` ends the
    idle ones (they also end by themselves when their stdin closes)."""

    def __init__(self, size: int = 2) -> None:
        self.size = size
        self._idle: list[_Warm] = []

    def _spawn(self) -> None:
        env = _base_env(None)
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvd.demo.warm"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._idle.append(_Warm(proc, _early(env), os.getcwd()))

    def take(self, env: Mapping[str, str]) -> subprocess.Popen[bytes] | None:
        """An interpreter started with ``env`` (up to :data:`LATE_ENV`) in this working
        directory: an idle one, else one started now if this process's environment is ``env``
        (it imports torch first, as a fresh daemon would); None if neither."""
        early, cwd = _early(env), os.getcwd()
        now = _early(_base_env(None))
        taken: subprocess.Popen[bytes] | None = None
        for warm in list(self._idle):
            if warm.proc.poll() is not None:  # died while warming: never hand it out
                self._idle.remove(warm)
                _end(warm.proc)
            elif taken is None and warm.early_env == early and warm.cwd == cwd:
                self._idle.remove(warm)
                taken = warm.proc
        for warm in [w for w in self._idle if w.early_env != now or w.cwd != cwd]:
            self._idle.remove(warm)  # started under an environment this process no longer has
            _end(warm.proc)
        if taken is None and early == now:
            self._spawn()
            taken = self._idle.pop().proc
        return taken

    def refill(self) -> None:
        """Once two are taken (or all, where ``size`` < 2), start as many as are missing.
        :func:`start_daemon` calls it once its daemon is ready (or failed), so that the next
        ones' ``import torch`` does not compete with this daemon's start-up for the CPU; and
        only once two are taken, so that the second daemon of a pair does not compete with the
        replacement of the first. With ``size`` 4 the replacements have a whole test (one
        pair's or two single daemons') to warm before one of them is taken: the two idle ones
        are taken first, oldest first."""
        if len(self._idle) <= max(0, self.size - 2):
            while len(self._idle) < self.size:
                self._spawn()

    def close(self) -> None:
        for warm in self._idle:
            _end(warm.proc)
        self._idle.clear()


def _end(proc: subprocess.Popen[bytes]) -> None:
    """End an idle interpreter: it holds nothing (it may still be importing torch, and reads
    its stdin only after that, so closing stdin alone could take a second)."""
    proc.kill()
    proc.wait()
    if proc.stdin is not None:
        proc.stdin.close()


_warm: WarmInterpreters | None = None


def use_warm_interpreters(size: int) -> None:
    """Start daemons in warm interpreters (``size`` kept ready) from now on; 0 ends the ones
    idle and goes back to a fresh ``python -m kvd serve`` per daemon."""
    global _warm
    if _warm is not None:
        _warm.close()
    _warm = WarmInterpreters(size) if size > 0 else None


def _spawn_daemon(argv: list[str], env: dict[str, str], log_path: str,
                  stdout: IO[bytes] | None) -> subprocess.Popen[bytes]:
    """``python -m kvd <argv>`` with its output in ``log_path`` (or ``stdout``): in a warm
    interpreter when one matches, else a fresh one."""
    log_file = open(log_path, "wb")  # noqa: SIM115 - handed to the child
    try:
        if _warm is not None and stdout is None:
            proc = _warm.take(env)
            if proc is not None and proc.stdin is not None:
                request = {"argv": argv, "env": env, "log": log_path, "late": list(LATE_ENV)}
                try:
                    proc.stdin.write(json.dumps(request).encode() + b"\n")
                    proc.stdin.close()
                    return proc
                except OSError:  # it died between the check and the write: a fresh one
                    proc.kill()
                    proc.wait()
        return subprocess.Popen(
            [sys.executable, "-m", "kvd", *argv],
            env=env,
            stdout=stdout or log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    finally:
        log_file.close()


def start_daemon(
    config: Mapping[str, Any],
    *,
    workdir: str | Path,
    name: str = "kvd",
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    stdout: IO[bytes] | None = None,
) -> DaemonProcess:
    """Write ``config``, start ``python -m kvd serve``, wait for READY=1."""
    workdir = Path(workdir)
    cfg = dict(config)
    cfg.setdefault("node", name)
    cfg.setdefault("socket_path", str(workdir / f"{name}.sock"))
    cfg.setdefault("log_format", "json")
    config_path = write_config(workdir, name, cfg)
    notify_path = tempfile.mktemp(prefix=f"{name}-notify-", suffix=".sock", dir=workdir)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    full_env = _base_env(env)
    full_env["NOTIFY_SOCKET"] = notify_path
    log_path = str(workdir / f"{name}.log")
    proc = _spawn_daemon(["serve", "--config", config_path], full_env, log_path, stdout)
    daemon = DaemonProcess(proc, str(cfg["socket_path"]), 0, config_path, notify, log_path)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for msg in daemon.read_notify(0.05):
                if "READY=1" in msg.split("\n"):
                    match = re.search(r"peer port (\d+)", msg)
                    daemon.peer_port = int(match.group(1)) if match else 0
                    return daemon
            if proc.poll() is not None:
                close_notify(notify)
                raise LaunchError(f"kvd {name} exited with {proc.returncode} before READY:\n{daemon.log()[-4000:]}")
        daemon.kill()
        raise LaunchError(f"kvd {name} not ready within {timeout}s:\n{daemon.log()[-4000:]}")
    finally:
        if _warm is not None:
            _warm.refill()
