"""Startup failures: one line for people, one structured line for the log, an exit code.

Whatever stops ``kvd serve`` before it is ready — a bad configuration, a peer secret that is
missing or readable by others, a peer or metrics port or the socket path already in use, a pool
that cannot be created — ends as

- ONE line on stderr, ``kvd: error: <setting>: <what is wrong>; <what to do>``;
- ONE structured log line, ``daemon.startup_failed`` with ``reason``, ``setting`` and ``code``;
- a non-zero exit status: :data:`EX_CONFIG` (78, sysexits.h) when the configuration itself must
  change (the unit's ``RestartPreventExitStatus=78`` then stops systemd from restarting a
  daemon that cannot start), 1 otherwise (a busy port may be free on the next try).

The places that can fail raise :class:`StartupError` naming the setting; :func:`explain` turns
whatever arrived (a trio exception group, a ``KvdError`` from deeper down, a bug) into one
:class:`StartupError`.
"""

from __future__ import annotations

import difflib
import errno
import re
from collections.abc import Callable
from pathlib import Path

from protocol.errors import KvdError

__all__ = [
    "EX_CONFIG", "StartupError", "bind_failed", "check_host_pools", "config_error", "explain", "host_memory",
    "one_line",
]

#: Exit status for "the configuration must change" (sysexits.h ``EX_CONFIG``).
EX_CONFIG = 78


class StartupError(KvdError):
    """The daemon cannot start; ``setting`` names the configuration key to look at."""

    code = "startup_failed"

    def __init__(self, message: str, *, setting: str = "", exit_code: int = 1, internal: bool = False) -> None:
        super().__init__(one_line(message))
        self.setting = setting
        self.exit_code = exit_code
        self.internal = internal  # a bug, not a condition: the log line carries the traceback


def one_line(text: str) -> str:
    """``text`` with its line breaks folded (an error message must stay one line)."""
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


def bind_failed(exc: OSError, *, what: str, host: str, port: int, setting: str, env: str) -> StartupError:
    """A TCP listener could not bind: say which setting and what to do."""
    if exc.errno == errno.EADDRINUSE:
        why = f"{what} port {port} on {host} is already in use"
        todo = f"stop the process that holds it (ss -ltnp 'sport = :{port}') or set another {setting} ({env})"
    elif exc.errno == errno.EADDRNOTAVAIL:
        why = f"{what} address {host} is not an address of this machine"
        todo = f"set {setting.replace('port', 'host')} to one of its addresses"
    elif exc.errno == errno.EACCES:
        why = f"{what} port {port} on {host} needs privileges this daemon does not have"
        todo = f"choose a port above 1023 for {setting} ({env})"
    else:
        why = f"cannot listen on {host}:{port} for the {what}: {exc.strerror or exc}"
        todo = f"check {setting} ({env})"
    return StartupError(f"{setting}: {why}; {todo}", setting=setting)


_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(?P<key>[^`]*)`$")
_MISSING_FIELD = re.compile(r"^Object missing required field `(?P<key>[^`]*)`$")


def config_error(path: str | None, exc: KvdError, keys_of: Callable[[str], list[str]] | None = None) -> StartupError:
    """A configuration that cannot be read or is invalid (exit :data:`EX_CONFIG`).

    When the error names where it is (msgspec's ``... - at `$.transfer.chunk_mb```), the line
    starts with that setting, as every startup error does; an unknown key comes with the known
    key it most resembles (a typo is the usual cause), among ``keys_of(table)``
    (:func:`kvd.config.table_keys`: passed in, as the layer below this one must not import the
    configuration)."""
    where = path or "(no file: defaults and KVD_* variables)"
    todo = "fix the configuration (systemd/kvd.toml shows and explains every key)"
    # msgspec: "<what> - at `$.pools[0].num_blocks`"; no location when <what> is at the top level
    what, _, at = exc.message.removeprefix("invalid configuration: ").partition(" - at `$")
    table = at.removeprefix(".").removesuffix("`")
    if unknown := _UNKNOWN_FIELD.match(what):
        key = unknown.group("key")
        setting = f"{table}.{key}" if table else key
        home = _home_table(key, table, keys_of) if keys_of else None
        close = difflib.get_close_matches(key, keys_of(table) if keys_of else [], n=1)
        hint = f" (did you mean {close[0]}?)" if close and home is None else ""
        problem = f"unknown key in {_table_name(table)} of {where}{hint}"
        if home is not None:
            problem += f": {key} is {_key_of(home)}; {_move_hint(key, table, home)}"
    elif missing := _MISSING_FIELD.match(what):
        setting = f"{table}.{missing.group('key')}" if table else missing.group("key")
        problem = f"required key missing from {_table_name(table)} of {where}"
    elif table:
        setting = table
        problem = f"{what[:1].lower()}{what[1:]} (in {where})"
        if table in ("pools", "peers") and what.startswith("Expected `array`, got `object`"):
            # [pools] (one bracket) is a single table; kvd wants an array of them
            problem += f": write each entry as its own [[{table}]] table (two brackets)"
    else:  # not located (unreadable file, bad TOML, a limit out of range): the message says what
        message = exc.message if path is None or path in exc.message else f"configuration {where}: {exc.message}"
        if message.startswith("cannot read configuration "):  # the path, not the contents, is wrong
            todo = "give --config (or KVD_CONFIG) a readable TOML file; systemd/kvd.toml is an example of one"
        return StartupError(f"{message}; {todo}", setting="", exit_code=EX_CONFIG)
    return StartupError(f"{setting}: {problem}; {todo}", setting=setting, exit_code=EX_CONFIG)


#: The tables of the configuration, by the name ``keys_of`` takes (one entry stands for an array).
_TABLES = ("", "transfer", "limits", "access", "pools[0]", "peers[0]")


def _home_table(key: str, table: str, keys_of: Callable[[str], list[str]]) -> str | None:
    """The other table ``key`` belongs to, if it is a key of exactly one (``None`` otherwise):
    a key right but in the wrong place. The usual cause is TOML's scoping: every key after a
    ``[[pools]]`` or ``[transfer]`` header belongs to that table, so ``metrics_port = 9464``
    appended at the end of a file lands in its last ``[[pools]]`` table."""
    here = re.sub(r"\[\d+\]$", "[0]", table)
    homes = [other for other in _TABLES if other != here and key in keys_of(other)]
    return homes[0] if len(homes) == 1 else None


def _key_of(home: str) -> str:
    """``""`` -> ``a top-level key``, ``transfer`` -> ``a key of [transfer]``, ``pools[0]`` -> ``... [[pools]]``."""
    if not home:
        return "a top-level key"
    return f"a key of [[{home[:-3]}]]" if home.endswith("[0]") else f"a key of [{home}]"


def _move_hint(key: str, table: str, home: str) -> str:
    """Where to move a key that is in the wrong table (see :func:`_home_table`)."""
    if not table:
        return f"put it under a {_key_of(home).removeprefix('a key of ')} header"
    header = _key_of(re.sub(r"\[\d+\]$", "[0]", table)).removeprefix("a key of ")
    scope = f"TOML puts every key after a {header} header into that table"
    if not home:
        return f"{scope}: move {key} above the first [table] or [[table]] header of the file"
    return f"{scope}: move {key} under {_key_of(home).removeprefix('a key of ')}"


def _table_name(table: str) -> str:
    """``pools[0]`` -> ``[[pools]] table 1``, ``transfer`` -> ``[transfer]``, ``""`` -> the top level."""
    if not table:
        return "the top level"
    if array := re.fullmatch(r"(\w+)\[(\d+)\]", table):
        return f"[[{array.group(1)}]] table {int(array.group(2)) + 1}"
    return f"[{table}]"


def host_memory(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup/memory.max") -> tuple[int, str]:
    """The most memory this process may ever have, in bytes, and where that figure comes from:
    the machine's ``MemTotal``, or the cgroup's ``memory.max`` when it is lower (a container or a
    unit with ``MemoryMax=``). ``(0, "")`` when neither can be read (then nothing is checked)."""
    best, source = 0, ""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemTotal:"):
                best, source = int(line.split()[1]) * 1024, f"MemTotal in {meminfo}"
                break
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path(cgroup).read_text().strip()
    except OSError:
        limit = ""
    if limit.isdigit() and (not best or int(limit) < best):
        best, source = int(limit), f"the cgroup's limit, {cgroup}"
    return best, source


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def check_host_pools(pools: list[tuple[str, str, int]], memory: tuple[int, str]) -> None:
    """Refuse host pools that together exceed this machine's memory (``memory``: bytes and where
    the figure comes from, :func:`host_memory`); ``pools``: ``(setting, name, bytes)`` per host pool.

    A host pool is a memfd whose pages are taken only when written, so a pool of any size
    starts; it is the executors filling it that later run the machine out of memory, with the
    OOM killer picking a process. Exit :data:`EX_CONFIG`: the pool sizes must change."""
    limit, source = memory
    total = sum(nbytes for _, _, nbytes in pools)
    if not limit or total <= limit:
        return
    biggest = max(pools, key=lambda pool: pool[2])
    alone = biggest[2] > limit
    setting = biggest[0] if alone or len(pools) == 1 else "pools"
    sizes = ", ".join(f"{name} {_gib(nbytes)}" for _, name, nbytes in pools)
    what = f"pool {biggest[1]!r} needs {_gib(biggest[2])}" if alone else f"the host pools need {_gib(total)} ({sizes})"
    raise StartupError(
        f"{setting}: {what} of host memory, more than this machine has ({_gib(limit)}, {source}); "
        "lower num_blocks or budget_mb (a host pool's pages are taken as executors write them: an "
        "oversized pool starts, then runs the machine out of memory)",
        setting=setting, exit_code=EX_CONFIG,
    )


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def explain(exc: BaseException) -> StartupError:
    """The one error to report for ``exc`` (which may be an exception group of several).

    Preference: a :class:`StartupError`, then any other :class:`KvdError`, then an
    ``OSError``; anything else is reported as an internal error (the log line carries the
    traceback).
    """
    leaves = [e for e in _leaves(exc) if isinstance(e, Exception)]
    for kind in (StartupError, KvdError, OSError):
        for leaf in leaves:
            if isinstance(leaf, kind):
                if isinstance(leaf, StartupError):
                    return leaf
                if isinstance(leaf, KvdError):
                    return StartupError(leaf.message or str(leaf))
                return StartupError(f"{leaf.strerror or leaf}" + (f": {leaf.filename}" if leaf.filename else ""))
    first = leaves[0] if leaves else exc
    return StartupError(
        f"internal error: {type(first).__name__}: {first} (the log line has the traceback)", internal=True
    )
