"""Executor ↔ daemon wire messages.

One tagged, frozen ``msgspec.Struct`` base (:class:`Message`); the tag field is ``type`` and
every message carries ``id``, the request id chosen by the client: a reply (or an ``Error``)
carries the id of the request it answers. Requests and replies are separate unions with one
decoder each (see :mod:`protocol.codec`). Rules for evolving the protocol: new fields get
defaults; a field's type never changes; new messages get new tags; ``PROTOCOL_VERSION`` is
bumped only for incompatible changes.
"""

from __future__ import annotations

import msgspec

from protocol.layout import KVLayout

PROTOCOL_VERSION = 1


class Message(msgspec.Struct, frozen=True, tag_field="type", kw_only=True):
    """Base of every wire message. ``id`` pairs a reply with its request."""

    id: int = 0


# --- data carried inside replies ---------------------------------------------------------


class PoolInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a pool is: its memory kind, geometry and occupancy."""

    name: str
    kind: str  # "fabric" | "device" | "posix_fd" | "host"
    device: int  # CUDA ordinal, -1 for host memory
    fallback_reason: str = ""  # why this kind and not the preferred one ("" = no fallback)
    num_blocks: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    sessions: int = 0
    block_bytes: int = 0
    pool_bytes: int = 0
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()
    axis_order: tuple[str, ...] = ()
    layout: KVLayout | None = None  # the model layout + rank this pool serves, when configured
    rank: int = 0


class SessionInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One executor connection."""

    session_id: int
    client: str
    pid: int
    uid: int
    blocks_leased: int
    requests: int
    connected_s: float


class TransferInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A transfer in progress or recently finished."""

    request_id: str
    role: str  # "ctx" (sender) | "gen" (receiver)
    peer: str
    state: str  # "waiting" | "running" | "done" | "failed"
    bytes_total: int = 0
    bytes_done: int = 0
    chunks_total: int = 0
    chunks_done: int = 0
    path: str = ""
    started_s: float = 0.0
    duration_s: float = 0.0
    error: str = ""


class DaemonStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counters an operator (and the tests) read through ``Stats``."""

    version: str
    node: str
    uptime_s: float
    draining: bool
    sessions: int
    requests_registered: int
    transfers_active: int
    transfers_done: int
    transfers_failed: int
    bytes_sent: int
    bytes_received: int
    blocks_leased: int
    bounce_chunks_total: int
    bounce_chunks_in_use: int
    peers_connected: int
    pools: list[PoolInfo] = []


# --- requests (client → daemon) ----------------------------------------------------------


class Hello(Message, frozen=True, tag="hello"):
    """First message of every connection."""

    version: int
    client: str = ""
    pid: int = 0


class AttachPool(Message, frozen=True, tag="attach_pool"):
    """Ask for a pool's memory handle; host/posix_fd pools answer with fds (SCM_RIGHTS)."""

    pool: str


class Alloc(Message, frozen=True, tag="alloc"):
    """Lease ``count`` blocks of ``pool`` to this session (all or nothing)."""

    pool: str
    count: int


class Free(Message, frozen=True, tag="free"):
    """Return leased blocks (all or nothing: one bad id frees none)."""

    pool: str
    block_ids: list[int]


class Expect(Message, frozen=True, tag="expect"):
    """gen side: rank ``rank`` of ``layout`` will receive ``request_id`` into ``block_ids``."""

    request_id: str
    pool: str
    layout: KVLayout
    rank: int
    block_ids: list[int]
    ranks: list[int] | None = None  # participating ranks; None = every rank of the layout
    deadline_s: float | None = None
    # the ctx daemon's node: once every gen rank registered, the destination goes to it
    # unasked, so the ctx side's publish moves bytes without a round trip ("" = wait for an offer)
    peer: str = ""


class Publish(Message, frozen=True, tag="publish"):
    """ctx side: rank ``rank`` has written ``request_id`` into ``block_ids``; send it to ``peer``."""

    request_id: str
    pool: str
    layout: KVLayout
    rank: int
    block_ids: list[int]
    peer: str
    ranks: list[int] | None = None
    deadline_s: float | None = None


class Wait(Message, frozen=True, tag="wait"):
    """Block until ``request_id`` completes (or fails); answered by ``Completion``."""

    request_id: str
    timeout_s: float | None = None


class Cancel(Message, frozen=True, tag="cancel"):
    """Cancel a registered request/transfer by id (only the session that registered it may,
    unless ``force``: an operator, root or the daemon's uid, cancelling someone else's)."""

    request_id: str
    force: bool = False


class Ping(Message, frozen=True, tag="ping"):
    payload: bytes = b""


class Stats(Message, frozen=True, tag="stats"):
    pass


class ListPools(Message, frozen=True, tag="pools"):
    pass


class ListSessions(Message, frozen=True, tag="sessions"):
    pass


class ListTransfers(Message, frozen=True, tag="transfers"):
    pass


class Drain(Message, frozen=True, tag="drain"):
    """Stop taking new work; finish in-flight transfers, then exit."""


class GetConfig(Message, frozen=True, tag="get_config"):
    pass


Request = (
    Hello
    | AttachPool
    | Alloc
    | Free
    | Expect
    | Publish
    | Wait
    | Cancel
    | Ping
    | Stats
    | ListPools
    | ListSessions
    | ListTransfers
    | Drain
    | GetConfig
)


# --- replies (daemon → client) -----------------------------------------------------------


class Welcome(Message, frozen=True, tag="welcome"):
    version: int
    server: str
    node: str
    session_id: int
    max_frame_size: int


class Attached(Message, frozen=True, tag="attached"):
    """Pool handle: ``handle_kind`` says how to map it ("fd", "cuda_ipc", "fabric").

    For "fd" the fd arrives with this frame as SCM_RIGHTS ancillary data.
    """

    pool: PoolInfo
    handle_kind: str
    handle: bytes = b""
    map_bytes: int = 0  # bytes to map (may exceed pool_bytes: VMM granularity)


class Allocated(Message, frozen=True, tag="allocated"):
    pool: str
    block_ids: list[int]


class Freed(Message, frozen=True, tag="freed"):
    pool: str
    count: int


class Registered(Message, frozen=True, tag="registered"):
    request_id: str


class Completion(Message, frozen=True, tag="completion"):
    """How a transfer ended, as seen by this side."""

    request_id: str
    ok: bool
    bytes: int = 0
    duration_s: float = 0.0
    path: str = ""  # "local" | "mapped" | "direct" | "bounce" | "fragment"
    chunks: int = 0
    fallback: str = ""  # "" or the fallback kind taken
    peer: str = ""
    error_code: str = ""
    error_message: str = ""


class Pong(Message, frozen=True, tag="pong"):
    payload: bytes = b""


class StatsReply(Message, frozen=True, tag="stats_reply"):
    stats: DaemonStats


class PoolsReply(Message, frozen=True, tag="pools_reply"):
    pools: list[PoolInfo]


class SessionsReply(Message, frozen=True, tag="sessions_reply"):
    sessions: list[SessionInfo]


class TransfersReply(Message, frozen=True, tag="transfers_reply"):
    transfers: list[TransferInfo]


class ConfigReply(Message, frozen=True, tag="config_reply"):
    config_json: str


class Ok(Message, frozen=True, tag="ok"):
    pass


class Error(Message, frozen=True, tag="error"):
    """Failure reply. ``code`` is a :class:`protocol.errors.KvdError` code."""

    code: str
    message: str


Reply = (
    Welcome
    | Attached
    | Allocated
    | Freed
    | Registered
    | Completion
    | Pong
    | StatsReply
    | PoolsReply
    | SessionsReply
    | TransfersReply
    | ConfigReply
    | Ok
    | Error
)
