"""Registration of a request's blocks by the executors of one side (ctx or gen).

Every rank of a side registers its own pool and blocks (``Expect`` on gen, ``Publish`` on
ctx). A side is *complete* when every participating rank has registered; only then can the
engine plan. Registration checks what can be checked locally: the pool exists and matches
the layout's geometry for that rank, the blocks are leased to the registering session, the
rank takes part, and all ranks agree on layout, participants and peer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import msgspec
import structlog
import trio

from protocol import messages as m
from protocol.errors import BadRequest, DuplicateRequest, IncompatibleLayout, KvdError
from protocol.layout import KVLayout

if TYPE_CHECKING:
    from kvd.executor.session import Session
    from kvd.pool import Pool

Role = Literal["ctx", "gen"]

log = structlog.get_logger("kvd.transfer")


@dataclass(eq=False)
class RankPart:
    """One rank's registration: its pool and the request's blocks in it."""

    rank: int
    pool: Pool
    block_ids: list[int]
    session: Session
    session_gone: bool = False  # the session waited for the outcome, or ended


@dataclass(eq=False)
class Side:
    """This daemon's side of one request."""

    request_id: str
    role: Role
    layout: KVLayout
    ranks: tuple[int, ...]
    peer: str
    deadline: float  # trio clock
    parts: dict[int, RankPart] = field(default_factory=dict)
    done: trio.Event = field(default_factory=trio.Event)
    completion: m.Completion | None = None
    created: float = field(default_factory=time.monotonic)
    #: the side's slot of the completion page and the token it holds once done (-1: none)
    word: int = -1
    token: int = 0
    # progress, for `kvctl transfers`
    state: str = "waiting"
    bytes_total: int = 0
    bytes_done: int = 0
    chunks_total: int = 0
    chunks_done: int = 0
    path: str = ""
    started: float = 0.0
    #: when the last rank registered (monotonic; 0 while ranks are missing)
    complete_at: float = 0.0
    #: stage name -> seconds since ``started`` when it ended (logged with the transfer)
    stages: dict[str, float] = field(default_factory=dict)
    #: called once the outcome is reported (after the daemon logged and released it), in the
    #: reporting step: a waiting executor's reply goes out there, not a scheduler pass later
    on_reported: list[Callable[[], None]] = field(default_factory=list)

    def mark(self, stage: str) -> None:
        """Record that ``stage`` just ended (for the per-transfer log line)."""
        self.stages[stage] = round(time.monotonic() - self.started, 6)

    @property
    def complete(self) -> bool:
        return len(self.parts) == len(self.ranks)

    def blocks_by_rank(self) -> dict[int, list[int]]:
        return {r: p.block_ids for r, p in self.parts.items()}

    def sessions(self) -> set[int]:
        return {p.session.id for p in self.parts.values()}

    def read_by_page(self) -> bool:
        """Whether an executor of this side maps the completion page (``AttachWords``): only
        then is its token worth a GPU store (a reply answers everyone else)."""
        return any(p.session.reads_page for p in self.parts.values())

    def finish(self, completion: m.Completion) -> bool:
        """Record the outcome once; returns False if it was already finished."""
        if self.completion is not None:
            return False
        self.completion = completion
        self.state = "done" if completion.ok else "failed"
        self.done.set()
        return True

    def reported(self) -> None:
        """Run (once) what waits for the reported outcome; one that raises does not stop the rest."""
        callbacks, self.on_reported = self.on_reported, []
        for cb in callbacks:
            try:
                cb()
            except Exception:  # a waiter's own failure (its executor's socket): its task sees it
                log.exception("transfer.waiter_failed", request_id=self.request_id, role=self.role)

    def fail(self, exc: KvdError, peer: str = "") -> bool:
        return self.finish(
            m.Completion(
                request_id=self.request_id,
                ok=False,
                peer=peer or self.peer,
                path=self.path,
                bytes=self.bytes_done,
                chunks=self.chunks_done,
                duration_s=time.monotonic() - self.created,
                error_code=exc.code,
                error_message=exc.message,
            )
        )

    def info(self) -> m.TransferInfo:
        return m.TransferInfo(
            request_id=self.request_id,
            role=self.role,
            # a gen side that named no peer: the daemon whose offer matched it
            peer=self.peer or (self.completion.peer if self.completion is not None else ""),
            state=self.state,
            bytes_total=self.bytes_total,
            bytes_done=self.bytes_done,
            chunks_total=self.chunks_total,
            chunks_done=self.chunks_done,
            path=self.path,
            started_s=self.started,
            duration_s=time.monotonic() - self.created,
            error=self.completion.error_message if self.completion and not self.completion.ok else "",
        )


def _same_but_blocks(a: KVLayout, b: KVLayout) -> bool:
    """``a`` and ``b`` agree on everything but ``num_blocks`` (the pools' counts may differ)."""
    return a == b or msgspec.structs.replace(a, num_blocks=0) == msgspec.structs.replace(b, num_blocks=0)


#: Pool/layout/rank combinations already found to match, with the resolved layout: every
#: request of a serving engine registers the same layout on the same pools, and the check
#: (two pool shapes, a layout copy) is a few microseconds of each registration. The key holds
#: every value the answer depends on (the pool's name, rank and layout, the given layout and
#: rank), so a hit is the answer the check would give; only matches enter, and the cache is
#: emptied when full: layouts sent at will cost a check each, as without it, and no memory.
_MATCHED: dict[tuple[str, int, KVLayout, KVLayout, int], KVLayout] = {}
MATCHED_CACHE_SIZE = 256


def check_pool_matches(pool: Pool, layout: KVLayout, rank: int) -> KVLayout:
    """The layout with the pool's block count; raises if the pool cannot hold ``rank``."""
    key = (pool.name, pool.rank, pool.layout, layout, rank)
    try:
        resolved = _MATCHED.get(key)
    except TypeError:  # an unhashable field (a list built in Python; decoded layouts hold tuples)
        return _check_pool_matches(pool, layout, rank)
    if resolved is None:
        resolved = _check_pool_matches(pool, layout, rank)
        if len(_MATCHED) >= MATCHED_CACHE_SIZE:
            _MATCHED.clear()
        _MATCHED[key] = resolved
    return resolved


def _check_pool_matches(pool: Pool, layout: KVLayout, rank: int) -> KVLayout:
    """:func:`check_pool_matches` without its cache."""
    if not 0 <= rank < layout.world_size:
        raise BadRequest(f"rank {rank} is outside the layout's world size {layout.world_size}")
    if pool.rank != rank:
        raise BadRequest(f"pool {pool.name!r} is configured as rank {pool.rank}; it cannot be registered as rank {rank}")
    resolved = msgspec.structs.replace(layout, num_blocks=pool.layout.num_blocks)
    if layout.num_blocks not in (0, pool.layout.num_blocks):
        raise IncompatibleLayout(
            f"layout says num_blocks={layout.num_blocks}, pool {pool.name!r} has {pool.layout.num_blocks}; "
            "leave the layout's num_blocks at 0 (it then takes the pool's)"
        )
    want = resolved.pool_shape(rank)
    have = pool.layout.pool_shape(pool.rank)
    if want != have or resolved.dtype != pool.layout.dtype or resolved.axis_order != pool.layout.axis_order:
        differ = layout_differences(pool.layout, resolved)
        raise IncompatibleLayout(
            f"pool {pool.name!r} does not match rank {rank} of the given layout: "
            + (f"{differ}; " if differ else "")
            + f"the pool holds shape {list(have)} {pool.layout.dtype} in axis order "
            f"{list(pool.layout.axis_order)}; rank {rank} of the given layout needs shape {list(want)} "
            f"{resolved.dtype} in {list(resolved.axis_order)}"
        )
    return resolved


def layout_differences(pool: KVLayout, request: KVLayout) -> str:
    """The fields in which ``request`` differs from the ``pool``'s configured layout, as
    ``"tp_size: pool has 2, request has 4"`` joined by ``", "`` ("" if none): the first thing an
    :class:`IncompatibleLayout` message names. Only built when a check already failed."""
    out = []
    for name in pool.__struct_fields__:
        if name == "num_blocks":  # checked (and named) on its own
            continue
        mine, theirs = getattr(pool, name), getattr(request, name)
        if mine != theirs:
            out.append(f"{name}: pool has {_show(mine)}, request has {_show(theirs)}")
    return ", ".join(out)


def _show(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


def rank_registered(request_id: str, role: str, part: RankPart, session: Session, *, pair: str = "",
                    ended: str = "") -> DuplicateRequest:
    """The refusal of a registration whose rank ``part`` holds already: which session holds it
    (the caller's own or another one), and what to do. ``pair`` names the pair of daemons the id
    is unique among (e.g. "this daemon and peer 'gen'"), ``ended`` the final state of a request
    that ended ("": it is live)."""
    holder = part.session
    mine = holder.id == session.id
    by = f"by this session ({holder.describe()})" if mine else f"by another session, {holder.describe()}"
    head = f"request {request_id!r}: {role} rank {part.rank} {'was' if ended else 'is already'} registered {by}"
    if ended:
        return DuplicateRequest(f"{head}, and that request ended here ({ended}); use a new request id")
    where = f" (here: {pair})" if pair else ""
    todo = ("use a new request id, or wait for the live one (or cancel it)" if mine else
            f"use a new request id, or leave the live one to session {holder.id}, which waits for it or cancels it")
    return DuplicateRequest(f"{head}, and that request is live: request ids must be unique among the live "
                            f"requests of a pair of daemons{where}; {todo}")


def add_registration(
    side: Side | None,
    session: Session,
    msg: m.Expect | m.Publish,
    pool: Pool,
    role: Role,
    deadline: float,
) -> Side:
    """Validate ``msg`` and add it to ``side`` (or start a new side); returns the side. The
    caller checked already that the blocks are leased to ``session``, each listed once
    (``pool.blocks.check_leased``, the registration's first check).

    Nothing changes when it raises.
    """
    layout = check_pool_matches(pool, msg.layout, msg.rank)
    if not msg.block_ids:
        raise BadRequest(f"request {msg.request_id!r}: no blocks given")
    ranks = tuple(sorted(set(msg.ranks))) if msg.ranks is not None else tuple(range(layout.world_size))
    if msg.ranks is not None:
        if len(ranks) != len(msg.ranks) or not ranks:
            raise BadRequest(f"request {msg.request_id!r}: ranks {msg.ranks} must be distinct and non-empty")
        if any(not 0 <= r < layout.world_size for r in ranks):
            raise BadRequest(f"request {msg.request_id!r}: ranks {msg.ranks} outside world size {layout.world_size}")
        if not layout.attention_dp and len(ranks) != layout.world_size:
            raise BadRequest(
                f"request {msg.request_id!r}: without attention DP every rank takes part; got ranks {msg.ranks}: "
                "leave ranks out, and have every rank of the layout register"
            )
    if msg.rank not in ranks:
        raise BadRequest(f"request {msg.request_id!r}: rank {msg.rank} is not among participants {list(ranks)}")
    peer = msg.peer
    if side is None:
        side = Side(msg.request_id, role, layout, ranks, peer, deadline)
        side.parts[msg.rank] = RankPart(msg.rank, pool, list(msg.block_ids), session)
        return side
    if side.completion is not None:
        raise DuplicateRequest(f"request {msg.request_id!r} ({role}) already ran; use a new request id")
    if not _same_but_blocks(side.layout, layout):
        raise IncompatibleLayout(f"request {msg.request_id!r}: rank {msg.rank} gives a different layout than earlier ranks")
    if side.ranks != ranks:
        raise BadRequest(f"request {msg.request_id!r}: participants {list(ranks)} differ from earlier {list(side.ranks)}")
    if side.peer != peer:
        raise BadRequest(f"request {msg.request_id!r}: peer {peer!r} differs from earlier ranks' {side.peer!r}; "
                         "every rank of a side names the same peer (the other side's node), or none")
    part = side.parts.get(msg.rank)
    if part is not None:
        raise rank_registered(msg.request_id, role, part, session)
    side.parts[msg.rank] = RankPart(msg.rank, pool, list(msg.block_ids), session)
    side.deadline = min(side.deadline, deadline)
    return side
