"""Executor ↔ daemon wire messages.

One tagged, frozen ``msgspec.Struct`` base (:class:`Message`); the tag field is ``type`` and
every message carries ``id``, the request id chosen by the client: a reply (or an ``Error``)
carries the id of the request it answers. Requests and replies are separate unions with one
decoder each (see :mod:`protocol.codec`). Rules for evolving the protocol: new fields get
defaults; a field's type never changes; new messages get new tags; ``PROTOCOL_VERSION`` is
bumped only for incompatible changes.

Every request field is bounded (:mod:`protocol.limits`): strings by length, lists by count,
floats finite and in range; the request decoder refuses anything outside with a
:class:`~protocol.errors.ProtocolError`. Replies are written by the daemon and bounded by
it (``List*`` requests page with ``offset``/``limit``; a reply that still does not fit a
frame fails that request with ``reply_too_large``).
"""

from __future__ import annotations

import msgspec

from protocol.layout import KVLayout
from protocol.limits import BlockIds, Count, DeadlineS, Name, OptionalRanks, RequestId, TimeoutS

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
    state: str  # "waiting", "running" or a finer stage ("offered", "streaming", ...); "done" | "failed" at the end
    bytes_total: int = 0
    bytes_done: int = 0
    chunks_total: int = 0
    chunks_done: int = 0
    path: str = ""
    started_s: float = 0.0
    duration_s: float = 0.0  # in progress: since registration; finished: the Completion's duration_s
    error: str = ""


class PeerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One peer daemon: a live link, or a configured peer not connected (yet)."""

    node: str
    state: str  # "up" (authenticated link) | "connecting" (configured, no link: retrying) | "down"
    # (an unconfigured peer that had dialled us: its link went down, it has not dialled again)
    direction: str  # "outgoing" (this daemon dialled the link, or dials it) | "incoming" (the peer dialled it)
    remote: str = ""  # host:port
    last_heard_s: float = -1.0  # seconds since the last frame (heartbeat or any message); -1 = never
    transfers_active: int = 0  # transfers with this peer not finished yet
    mapped: bool = False  # the peer's pools are mapped here (same node: path "mapped")
    error: str = ""  # why the last connection attempt failed
    attempts: int = 0  # failed connection attempts since the link was last up (outgoing links)


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
    busy_poll: bool = False  # the event loop spins while requests are pending (transfer.busy_poll)
    busy_poll_passes: int = 0  # scheduler passes spun so far (stays put while nothing is pending)
    # tasks the transfers started so far: actors (a request whose events or actions had to
    # wait) and data-path tasks; a request handled in its callers' steps starts neither
    transfer_actors: int = 0
    transfer_tasks: int = 0


# --- requests (client → daemon) ----------------------------------------------------------


class Hello(Message, frozen=True, tag="hello"):
    """First message of every connection."""

    version: int
    client: Name = ""
    pid: int = 0


class AttachPool(Message, frozen=True, tag="attach_pool"):
    """Ask for a pool's memory handle; host/posix_fd pools answer with fds (SCM_RIGHTS)."""

    pool: Name


class Alloc(Message, frozen=True, tag="alloc"):
    """Lease ``count`` blocks of ``pool`` to this session (all or nothing)."""

    pool: Name
    count: int


class Free(Message, frozen=True, tag="free"):
    """Return leased blocks (all or nothing: one bad id frees none)."""

    pool: Name
    block_ids: BlockIds


class Expect(Message, frozen=True, tag="expect"):
    """gen side: rank ``rank`` of ``layout`` will receive ``request_id`` into ``block_ids``."""

    request_id: RequestId
    pool: Name
    layout: KVLayout
    rank: int
    block_ids: BlockIds
    ranks: OptionalRanks = None  # participating ranks; None = every rank of the layout
    deadline_s: DeadlineS | None = None
    # the ctx daemon's node: once every gen rank registered, the destination goes to it
    # unasked, so the ctx side's publish moves bytes without a round trip ("" = wait for an offer)
    peer: Name = ""


class Publish(Message, frozen=True, tag="publish"):
    """ctx side: rank ``rank`` has written ``request_id`` into ``block_ids``; send it to ``peer``."""

    request_id: RequestId
    pool: Name
    layout: KVLayout
    rank: int
    block_ids: BlockIds
    peer: Name
    ranks: OptionalRanks = None
    deadline_s: DeadlineS | None = None


class Wait(Message, frozen=True, tag="wait"):
    """Block until ``request_id`` completes (or fails); answered by ``Completion``."""

    request_id: RequestId
    timeout_s: TimeoutS | None = None


class Cancel(Message, frozen=True, tag="cancel"):
    """Cancel a registered request/transfer by id (only the session that registered it may,
    unless ``force``: an operator — root, the daemon's uid, ``[access] operator_gids`` — cancelling
    someone else's)."""

    request_id: RequestId
    force: bool = False


class Ping(Message, frozen=True, tag="ping"):
    payload: bytes = b""


class Stats(Message, frozen=True, tag="stats"):
    pass


class ListPools(Message, frozen=True, tag="pools"):
    pass


class ListSessions(Message, frozen=True, tag="sessions"):
    """List sessions ``offset`` .. ``offset + limit`` (``limit`` 0 = as many as fit a frame)."""

    offset: Count = 0
    limit: Count = 0


class ListTransfers(Message, frozen=True, tag="transfers"):
    """Transfers in progress, then recently finished ones with their outcome (newest last),
    ``offset`` .. ``offset + limit`` of them (``limit`` 0 = as many as fit a frame)."""

    offset: Count = 0
    limit: Count = 0


class ListPeers(Message, frozen=True, tag="peers"):
    """Peer daemons: live links and configured peers not connected."""


class Drain(Message, frozen=True, tag="drain"):
    """Stop taking new work; finish in-flight transfers, then exit."""


class GetConfig(Message, frozen=True, tag="get_config"):
    pass


class AttachWords(Message, frozen=True, tag="attach_words"):
    """Map the daemon's completion page (answered by ``WordsAttached`` with its fd): a
    spinning executor, or a polling one, sees its request done there before the ``Completion``
    reply comes (``kvd.mapping.words``). ``writable``: for a same-node peer daemon whose GPU stores
    tokens into it (operators only: root, the daemon's uid, ``[access] operator_gids``)."""

    writable: bool = False


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
    | ListPeers
    | Drain
    | GetConfig
    | AttachWords
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
    """The registration was taken. ``word``/``token``: the request side's slot of the
    completion page and the token it will hold once the side is done (-1: no slot)."""

    request_id: str
    word: int = -1
    token: int = 0


class WordsAttached(Message, frozen=True, tag="words_attached"):
    """The completion page: its fd arrives with this frame (SCM_RIGHTS); ``slots`` slots of
    ``slot_words`` uint64 words each."""

    slots: int
    slot_words: int


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
    """One page of sessions; ``total`` is how many there are (page on with ``offset``)."""

    sessions: list[SessionInfo]
    total: int = 0


class TransfersReply(Message, frozen=True, tag="transfers_reply"):
    """One page of transfers; ``total`` is how many there are (page on with ``offset``)."""

    transfers: list[TransferInfo]
    total: int = 0


class PeersReply(Message, frozen=True, tag="peers_reply"):
    peers: list[PeerInfo]


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
    | WordsAttached
    | Completion
    | Pong
    | StatsReply
    | PoolsReply
    | SessionsReply
    | TransfersReply
    | PeersReply
    | ConfigReply
    | Ok
    | Error
)
