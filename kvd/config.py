"""Daemon configuration: one frozen msgspec struct decoded from TOML, plus ``KVD_*`` overrides.

Environment overrides (documented in the README; an explicit env setting wins over the file):

- ``KVD_SOCKET``: Unix socket path.
- ``KVD_NODE``: node name announced to peers.
- ``KVD_LOG_FORMAT``: ``auto`` | ``json`` | ``console``.
- ``KVD_LOG_LEVEL``: ``debug`` | ``info`` | ``warning`` | ``error``.
- ``KVD_PEER_PORT``: TCP port of the peer link listener (0 = ephemeral).
- ``KVD_METRICS_PORT``: Prometheus port (0 = off).
- ``KVD_POOL_USE_FABRIC_MEMORY`` / ``TRTLLM_KVCACHE_POOL_USE_FABRIC_MEMORY``: "1" try fabric
  memory on GPU pools, "0" don't (read by the pool policy, :mod:`kvd.pool.policy`).
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import msgspec
import msgspec.inspect

from protocol.errors import BadRequest
from protocol.framing import DEFAULT_MAX_FRAME_SIZE
from protocol.layout import TRTLLM_AXIS_ORDER, KVLayout

MemoryKind = Literal["auto", "fabric", "device", "posix_fd", "host"]


class PoolConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One KV pool the daemon owns: memory policy + block geometry of the rank it serves.

    The pool holds the blocks of ONE rank of ``layout`` (``rank``): its tensor shape is
    ``layout.pool_shape(rank)``. Give ``num_blocks`` or ``budget_mb`` (blocks that fit).
    """

    name: str
    memory: MemoryKind = "auto"
    require_fabric: bool = False
    device: int = -1  # CUDA ordinal; -1 = host memory
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: str = "bfloat16"
    tp_size: int = 1
    pp_size: int = 1
    attention_dp: bool = False
    layer_split: tuple[int, ...] | None = None
    axis_order: tuple[str, ...] = TRTLLM_AXIS_ORDER
    rank: int = 0
    num_blocks: int = 0
    budget_mb: float = 0.0

    def layout(self) -> KVLayout:
        """The :class:`KVLayout` of this pool with its block count resolved."""
        base = KVLayout(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.tokens_per_block,
            self.dtype,
            tp_size=self.tp_size,
            pp_size=self.pp_size,
            attention_dp=self.attention_dp,
            layer_split=self.layer_split,
            axis_order=self.axis_order,
            num_blocks=1,
        )
        if not 0 <= self.rank < base.world_size:
            raise BadRequest(f"pool {self.name!r}: rank {self.rank} outside world size {base.world_size}")
        if self.num_blocks < 0:
            raise BadRequest(f"pool {self.name!r}: num_blocks must be positive (or 0: as many blocks as "
                             f"budget_mb holds), got {self.num_blocks}")
        blocks = self.num_blocks
        if blocks <= 0:
            if self.budget_mb < 0 or not math.isfinite(self.budget_mb):
                raise BadRequest(f"pool {self.name!r}: budget_mb must be a positive number of MiB, "
                                 f"got {self.budget_mb}")
            if self.budget_mb <= 0:
                raise BadRequest(f"pool {self.name!r}: give num_blocks or budget_mb")
            blocks = int(self.budget_mb * 2**20) // base.block_bytes(self.rank)
            if blocks < 1:
                raise BadRequest(f"pool {self.name!r}: budget_mb={self.budget_mb} holds no block")
        return msgspec.structs.replace(base, num_blocks=blocks)


class PeerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A peer daemon this one connects to."""

    name: str
    host: str = "127.0.0.1"
    port: int


class TransferConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Transfer engine tuning."""

    bounce_size_mb: int = 512  # receive region per peer link (and send staging)
    chunk_mb: int = 64  # bounce slot size: the largest bounce chunk (one NIXL write each)
    gpu_chunk_mb: int = 128  # chunk of the GPU-to-GPU mapped pipeline (fewer, larger: host-bound)
    deadline_s: float = 60.0  # default per-transfer deadline
    bounce_wait_s: float = 5.0  # how long to wait for credits before per-fragment fallback
    descs_per_write: int = 8192  # NIXL descriptors per write on the direct/fragment paths
    nixl_progress_thread: bool = False  # off is faster on small hosts (measured on 2 cores)
    # While any request is unfinished, the event loop spins (never sleeps in the kernel) so a
    # frame is handled as soon as it arrives: a wake-up from a blocking poll costs ~0.3 ms per
    # hop on some hosts. One core busy per daemon while requests are pending; idle daemons
    # sleep. "auto" = on with at least BUSY_POLL_AUTO_CPUS usable cores.
    busy_poll: Literal["auto", "on", "off"] = "auto"
    heartbeat_interval_s: float = 2.0  # peer-link heartbeat period
    heartbeat_timeout_s: float = 10.0  # silence after which a peer is declared gone
    # A configured peer that refuses the handshake (wrong secret, another version) is retried
    # after reconnect_initial_s, doubling up to reconnect_max_s; back to the start once linked.
    reconnect_initial_s: float = 1.0
    reconnect_max_s: float = 30.0
    # Fault injection for tests and drills: a receiver that never grants bounce credit
    # (senders then fall back to per-fragment writes after bounce_wait_s, or time out).
    grant_credits: bool = True
    # Bounce credits (the peer's receive slots) come back as NIXL notifications; false: as
    # XferGrant messages over the peer link, as older daemons send them.
    credit_notifs: bool = True
    # Same-node peers: attach the peer's pools over its Unix socket and regroup straight into
    # them (path "mapped": no NIXL, no bounce). Off = always go through NIXL.
    mapped: bool = True
    # An ended request that a late rank or message may still ask about (a side ended before
    # all its ranks registered, or failed before the peer spoke) is remembered until its
    # deadline, and at least this many seconds after it ended (docs/design.md, "A transfer").
    remember_ended_s: float = 10.0

    def busy_poll_on(self) -> bool:
        """Whether the event loop spins while requests are pending (``busy_poll`` resolved)."""
        if self.busy_poll == "auto":
            return usable_cpus() >= BUSY_POLL_AUTO_CPUS
        return self.busy_poll == "on"


#: ``busy_poll = "auto"`` spins on hosts with at least this many usable cores: a serving node
#: has dozens, where one busy core per daemon is cheap; on a small host the spinning daemons
#: would take the cores the executors need.
BUSY_POLL_AUTO_CPUS = 8


def usable_cpus() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


class LimitsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Per-daemon and per-session limits; exceeding one is a clear ``LimitExceeded``.

    See ``docs/security.md`` for what each one defends against.
    """

    max_sessions: int = 1024
    max_inflight_per_session: int = 256
    max_blocks_per_session: int = 1 << 30
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    #: A connection (executor socket or peer port) must finish its handshake within this.
    handshake_timeout_s: float = 10.0
    #: Executor connections accepted but not yet through Hello (they are not sessions yet).
    max_pending_connections: int = 256
    #: Peer-port connections not yet authenticated.
    max_pending_peers: int = 16
    #: Extra sessions and pending connections only operators may use beyond the limits above,
    #: so an operator can always connect (``kvctl``), whatever the other clients do.
    operator_reserve: int = 4
    #: Ranks one request may name on this daemon (its participants; each registers here).
    max_ranks_per_request: int = 256
    #: Ended requests remembered for late ranks and messages (until their deadlines); beyond
    #: this, the one due to be forgotten first is forgotten now (``transfer.forgotten_early``).
    max_ended_requests: int = 16384
    #: Requests one peer may start here that no local executor has registered yet (its offers
    #: and announcements waiting for our ranks): beyond, the peer's next one is refused with
    #: ``limit_exceeded`` (``transfer.unclaimed_limit``), so a peer cannot grow our memory
    #: without bound while its link lives.
    max_unclaimed_per_peer: int = 4096


class AccessConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Who may connect to the Unix socket (SO_PEERCRED). Empty lists = the daemon's own group.

    ``operator_gids``: members of these groups are operators (besides root and the daemon's
    own uid): they may use the verbs that change the daemon itself (``drain``) and the
    ``operator_reserve`` of connection slots.
    """

    allowed_uids: tuple[int, ...] = ()
    allowed_gids: tuple[int, ...] = ()
    operator_gids: tuple[int, ...] = ()


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole daemon configuration. Passed explicitly; there is no global config."""

    node: str = "kvd"
    socket_path: str = "/run/kvd/kvd.sock"
    socket_mode: int = 0o660
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    peer_host: str = "127.0.0.1"
    peer_port: int = 0  # peer-link TCP port; 0 = ephemeral (printed at startup)
    peer_secret_file: str = ""
    metrics_port: int = 0  # 0 = off
    metrics_host: str = "127.0.0.1"
    drain_timeout_s: float = 30.0
    pools: tuple[PoolConfig, ...] = ()
    peers: tuple[PeerConfig, ...] = ()
    transfer: TransferConfig = TransferConfig()
    limits: LimitsConfig = LimitsConfig()
    access: AccessConfig = AccessConfig()


_ENV_OVERRIDES: dict[str, tuple[str, type]] = {
    "KVD_SOCKET": ("socket_path", str),
    "KVD_NODE": ("node", str),
    "KVD_LOG_FORMAT": ("log_format", str),
    "KVD_LOG_LEVEL": ("log_level", str),
    "KVD_PEER_PORT": ("peer_port", int),
    "KVD_METRICS_PORT": ("metrics_port", int),
}


def env_source(setting: str, env: Mapping[str, str] | None = None) -> str:
    """``VAR=value`` when the top-level ``setting`` (``socket_path``, ``peer_port``, ...) takes
    its value from a ``KVD_*`` variable of ``env`` (default: this process's), else ``""``.

    A startup error names the setting; when the value came from the environment, the file the
    reader then opens shows another value, and the error alone does not explain itself."""
    env = os.environ if env is None else env
    for var, (field, _typ) in _ENV_OVERRIDES.items():
        if field == setting and env.get(var, "") != "":
            return f"{var}={env[var]}"
    return ""


def env_sources(setting: str, message: str, env: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """``(key, "VAR=value")`` for each top-level key a startup error is about that took its
    value from the environment: ``setting`` itself, and any overridable key ``message`` names
    as a word (a peer named as "this daemon's own node" is about ``node`` as much as about
    ``peers[0].name``)."""
    keys = [setting, *(f for f, _t in _ENV_OVERRIDES.values() if f != setting and re.search(rf"\b{f}\b", message))]
    return [(key, source) for key in keys if (source := env_source(key, env))]


def config_from_dict(data: Mapping[str, object], env: Mapping[str, str] | None = None) -> Config:
    """Build a :class:`Config` from a dict (parsed TOML) and apply env overrides."""
    env = os.environ if env is None else env
    merged = dict(data)
    for var, (field, typ) in _ENV_OVERRIDES.items():
        if var in env and env[var] != "":
            try:
                merged[field] = typ(env[var])
            except ValueError:
                raise BadRequest(f"environment {var}={env[var]!r} is not a valid {typ.__name__}") from None
    try:
        cfg = msgspec.convert(merged, Config)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid configuration: {_with_choices(str(exc))}") from None
    seen: set[str] = set()
    for i, pool in enumerate(cfg.pools):
        if pool.name in seen:
            raise BadRequest(f"invalid configuration: duplicate pool name {pool.name!r} (each [[pools]] table "
                             f"needs its own name) - at `$.pools[{i}].name`")
        seen.add(pool.name)
        try:
            pool.layout()  # validates geometry and block count
        except BadRequest as exc:
            raise BadRequest(f"invalid configuration: {_pool_problem(i, exc.message)}") from None
    _check_peers_and_ports(cfg)
    _check_ranges(cfg)
    return cfg


#: ``[transfer]`` sizes and counts that must be at least 1: 0 or less crashed the daemon at
#: startup (``ZeroDivisionError`` from chunk_mb = 0) or later, on the first transfer that used them.
_AT_LEAST_ONE = ("chunk_mb", "gpu_chunk_mb", "descs_per_write")


def _check_ranges(cfg: Config) -> None:
    """Values msgspec accepts as integers but nothing can use. A port above 65535 used to be
    taken modulo 65536 (peer_port = 70000 listened on 4464), a negative chunk_mb was an internal
    error with a traceback, and ``socket_mode = 660`` (decimal in TOML) gave the socket mode
    0o1224. Each is refused, located (``- at `$.key```) so that the line begins with the key."""
    for key, env in (("peer_port", "KVD_PEER_PORT"), ("metrics_port", "KVD_METRICS_PORT")):
        port = getattr(cfg, key)
        if not 0 <= port <= 65535:
            off = "any free port" if key == "peer_port" else "off"
            raise BadRequest(f"invalid configuration: {key} (or {env}) must be a TCP port from 1 to 65535 "
                             f"(0 = {off}), got {port} - at `$.{key}`")
    if not 0 <= cfg.socket_mode <= 0o777:
        got = f"got {cfg.socket_mode} ({cfg.socket_mode:#o})"
        if set(str(cfg.socket_mode)) <= set("01234567") and int(str(cfg.socket_mode), 8) <= 0o777:
            got = (f"got {cfg.socket_mode}, which TOML reads as a decimal number ({cfg.socket_mode:#o}): "
                   f"write the octal mode as socket_mode = 0o{cfg.socket_mode}")
        raise BadRequest(f"invalid configuration: socket_mode must be a permission mode from 0o000 to 0o777, "
                         f"{got} - at `$.socket_mode`")
    if not cfg.node:
        raise BadRequest("invalid configuration: node must name this daemon (peers and executors' publish(..., "
                         "peer=NODE) use it), got an empty string - at `$.node`")
    for i, peer in enumerate(cfg.peers):
        if not 1 <= peer.port <= 65535:
            raise BadRequest(f"invalid configuration: port of peer {peer.name!r} must be the peer daemon's "
                             f"peer_port, from 1 to 65535, got {peer.port} - at `$.peers[{i}].port`")
        if not peer.host:
            raise BadRequest(f"invalid configuration: host of peer {peer.name!r} is empty: give the address "
                             f"the peer daemon's peer_host listens on - at `$.peers[{i}].host`")
    t = cfg.transfer
    for key in _AT_LEAST_ONE:
        if getattr(t, key) < 1:
            raise BadRequest(f"invalid configuration: {key} must be at least 1, got {getattr(t, key)} "
                             f"- at `$.transfer.{key}`")
    if t.bounce_size_mb < 0:
        raise BadRequest(f"invalid configuration: bounce_size_mb must be 0 or more (below chunk_mb: one slot), "
                         f"got {t.bounce_size_mb} - at `$.transfer.bounce_size_mb`")


_ANY_ADDRESS = frozenset({"", "0.0.0.0", "::"})


def _check_peers_and_ports(cfg: Config) -> None:
    """What the daemon would otherwise find out later, and report as something else: two
    [[peers]] of one name started two links to 'one' peer; a peer named as this daemon's own node
    failed only at the handshake; metrics_port = peer_port failed at startup as 'already in use;
    stop the process that holds it', the process being this daemon."""
    names: set[str] = set()
    for i, peer in enumerate(cfg.peers):
        if peer.name == cfg.node:
            raise BadRequest(f"invalid configuration: peer name {peer.name!r} is this daemon's own node: a "
                             f"[[peers]] entry names another daemon, by that daemon's node - at `$.peers[{i}].name`")
        if peer.name in names:
            raise BadRequest(f"invalid configuration: duplicate peer name {peer.name!r} (one [[peers]] table "
                             f"per peer daemon) - at `$.peers[{i}].name`")
        names.add(peer.name)
    same_host = cfg.peer_host == cfg.metrics_host or {cfg.peer_host, cfg.metrics_host} & _ANY_ADDRESS
    if cfg.metrics_port and cfg.metrics_port == cfg.peer_port and same_host:
        raise BadRequest(f"invalid configuration: metrics_port {cfg.metrics_port} is peer_port too; this daemon "
                         "listens on both: give metrics_port another port (0 = off) - at `$.metrics_port`")


_POOL_FIELDS = frozenset(f.name for f in msgspec.structs.fields(PoolConfig))


def _pool_problem(index: int, message: str) -> str:
    """A pool's layout error located as msgspec locates its own (``<what> - at `$.pools[i].key```),
    so that the startup line begins with the key to change, as every configuration error does.

    The layout's messages name the field first (``KVLayout.dtype 'bf16' is not one of ...``,
    ``num_kv_heads=8 is not divisible by tp_size=3``, ``pool 'p': give num_blocks or budget_mb``):
    the first pool key the message mentions is the setting."""
    what = re.sub(r"^(KVLayout[.:] ?|pool '[^']*': )", "", message)
    key = next((word for word in re.findall(r"[a-z_]+", what) if word in _POOL_FIELDS), "")
    if message.startswith(f"KVLayout.{key} "):
        what = what[len(key) + 1:]  # "pools[0].dtype: 'bf16' is not ...", not "...dtype: dtype 'bf16'"
    return f"{what} - at `$.pools[{index}]" + (f".{key}`" if key else "`")


_BAD_ENUM = re.compile(r"^Invalid enum value (?P<value>'[^']*'|-?\d+) - at `\$\.(?P<path>[^`]*)`$")


def _with_choices(message: str) -> str:
    """msgspec's ``Invalid enum value 'hots' - at `$.pools[0].memory``` with the values the key
    takes, and the one the typo most resembles: ``... 'hots' (one of: auto, fabric, device,
    posix_fd, host; did you mean host?) - at ...``."""
    bad = _BAD_ENUM.match(message)
    choices = _choices(bad.group("path")) if bad else []
    if not bad or not choices:
        return message
    close = difflib.get_close_matches(bad.group("value").strip("'"), choices, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"Invalid enum value {bad.group('value')} (one of: {', '.join(choices)}{hint}) - at `$.{bad.group('path')}`"


def _choices(path: str) -> list[str]:
    """The values a ``Literal`` key at ``path`` (``pools[0].memory``, ``log_format``) accepts."""
    table, _, key = path.rpartition(".")
    info = _field_types(table).get(key)
    return [str(v) for v in info.values] if isinstance(info, msgspec.inspect.LiteralType) else []


def _field_types(table: str) -> dict[str, msgspec.inspect.Type]:
    """The keys of the configuration table at ``table`` with their types (``{}``: no table)."""
    info: msgspec.inspect.Type = msgspec.inspect.type_info(Config)
    for part in re.findall(r"[A-Za-z_]\w*", table):  # the names; an index picks one table of an array
        if not isinstance(info, msgspec.inspect.StructType):
            return {}
        fields = {f.name: f.type for f in info.fields}
        if part not in fields:
            return {}
        info = fields[part]
        if isinstance(info, msgspec.inspect.VarTupleType | msgspec.inspect.ListType):
            info = info.item_type
    return {f.name: f.type for f in info.fields} if isinstance(info, msgspec.inspect.StructType) else {}


def table_keys(table: str) -> list[str]:
    """The keys the configuration table at ``table`` accepts: ``""`` (the top level),
    ``"transfer"``, ``"pools[0]"`` (one table of an array); ``[]`` for a path that is no table."""
    return list(_field_types(table))


def load_config(path: str | Path | None, env: Mapping[str, str] | None = None) -> Config:
    """Read a TOML file (or nothing) and apply env overrides."""
    data: dict[str, object] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            where = "" if Path(path).is_absolute() else f" (relative to the working directory: {Path(path).absolute()})"
            raise BadRequest(f"cannot read configuration {path}{where}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise BadRequest(f"configuration {path} is not valid TOML: {exc}") from None
    return config_from_dict(data, env)


def config_to_json(cfg: Config) -> str:
    """The effective configuration as JSON (for ``kvctl config``)."""
    return msgspec.json.encode(cfg).decode()
