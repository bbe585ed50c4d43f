"""Client-side wire helpers shared by the async and the blocking client (no I/O here).

Both clients build the same request messages and interpret replies the same way; only
the socket calls differ. Replies of type ``Error`` become the daemon's exception class.
"""

from __future__ import annotations

import array
import math
import operator
import os
import socket
import stat
from collections.abc import Sequence
from typing import TypeVar

from protocol import messages as m
from protocol.codec import encode
from protocol.errors import BadRequest, ConnectionClosed, ProtocolError, error_from_code
from protocol.layout import KVLayout
from protocol.limits import MAX_DEADLINE_S, MAX_REQUEST_ID_LEN

T = TypeVar("T", bound=m.Message)

#: Room for the fds that may come with one frame (Attached carries at most a few).
MAX_FDS = 16
ANCILLARY_SIZE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)


def default_socket_path() -> str:
    """``$KVD_SOCKET`` or the systemd unit's socket path. An empty ``KVD_SOCKET`` counts as unset,
    as the daemon counts it (a client used to try to connect to "" instead)."""
    return os.environ.get("KVD_SOCKET") or "/run/kvd/kvd.sock"


#: How a library caller gives the socket (kvctl says ``--socket PATH or KVD_SOCKET``).
CLIENT_GIVE = "Client(path) / open_client(path) or KVD_SOCKET"


#: Longest Unix socket path, in bytes (``sun_path`` is 108 bytes with its terminating NUL).
MAX_SOCKET_PATH = 107


def socket_path_too_long(path: str) -> str:
    """Why ``path`` cannot be a Unix socket ("" if it can): Python's own error says only
    "AF_UNIX path too long", with no errno and no limit."""
    size = len(os.fsencode(path))
    if size <= MAX_SOCKET_PATH:
        return ""
    return (f"the path is {size} bytes long, and a Unix socket path holds at most {MAX_SOCKET_PATH}: no "
            "daemon can listen there; give the daemon's real socket_path (a short one, e.g. under /run)")


def unreachable_hint(path: str, give: str = CLIENT_GIVE) -> str:
    """What to do when the socket at ``path`` cannot be opened (connect() says only errno).

    ``give`` names how the caller passes the socket path (an argument, an option)."""
    if too_long := socket_path_too_long(path):
        return too_long
    if not os.path.exists(path):
        return f"is kvd running with this socket_path? Give its socket with {give} (default /run/kvd/kvd.sock)"
    if not stat.S_ISSOCK(os.stat(path).st_mode):
        # connect() on a regular file or a directory also says "Connection refused", which
        # reads like a dead daemon; the usual cause is the configuration file given as the socket
        what = "a directory" if os.path.isdir(path) else "not a socket"
        return (f"{path} is {what}: give the daemon's socket_path (from its configuration, e.g. "
                f"/run/kvd/kvd.sock), not its configuration file, with {give}")
    if not os.access(path, os.R_OK | os.W_OK):
        return ("this user may not open the socket: kvd lets in root, its own user and members of "
                "its group ([access] in its configuration widens that)")
    return ("a socket file is there but no daemon answers: a killed daemon leaves it behind; one "
            "that is starting answers soon (kvctl ping --wait SECONDS)")


#: What an executor does when its daemon went away in the middle of a session.
LOST_HINT = ("the daemon stopped or was killed (its log or `journalctl -u kvd` says why); this session's "
             "leases and requests ended with it: open a new Client once kvd answers again "
             "(kvctl ping --wait SECONDS)")


#: What a call on a Client after its ``with`` block (or ``close()``) raises: the daemon is fine.
CLOSED_HINT = ("this client is closed (its `with` block ended, or close() was called): the daemon is "
               "not at fault; open a new Client (or open_client) for more calls")


def client_closed() -> ConnectionClosed:
    """A call on a client this process closed itself."""
    return ConnectionClosed(CLOSED_HINT, by_peer=False)


def id_list(values: Sequence[int], what: str = "block_ids") -> list[int]:
    """Block ids as the plain list the message holds: a numpy array or a torch tensor (a
    serving engine's block table) through its ``tolist()``, anything else through ``list()``;
    ``BadRequest`` for a single value. Elements that are not ints are caught by
    :func:`encode_request` or the daemon."""
    tolist = getattr(values, "tolist", None)
    if callable(tolist):
        listed = tolist()
        if isinstance(listed, list):
            # an array is of one dtype: its first element says whether they are ids at all
            if listed and type(listed[0]) is not int:
                raise BadRequest(f"{what} must be integers; this array holds {type(listed[0]).__name__}s "
                                 f"(dtype {getattr(values, 'dtype', '?')}): pass the int64 block table")
            return listed
    try:
        return list(values)
    except TypeError:
        raise BadRequest(f"{what} must be a sequence of block ids (the list alloc returned, or a slice of "
                         f"it), got {type(values).__name__} {values!r:.40}") from None


def count_arg(count: int) -> int:
    """A block count as the message holds it: any integer (a numpy one too) as a Python int;
    ``BadRequest`` for anything else (a string, a float, a bool), before anything is sent."""
    if isinstance(count, bool):
        raise BadRequest(f"count must be a number of blocks, got {count!r}")
    try:
        return operator.index(count)
    except TypeError:
        raise BadRequest(f"count must be an integer number of blocks, got {type(count).__name__} "
                         f"{count!r:.40}") from None


def pool_arg(pool: str) -> str:
    """A pool argument as the message holds it: the pool's name. ``BadRequest`` for anything
    else before anything is sent; for the object ``attach`` returned, it names its ``.name``."""
    if isinstance(pool, str):
        return pool
    name = getattr(pool, "name", None)
    hint = f": pass its name, {name!r} (.name)" if isinstance(name, str) else ""
    raise BadRequest(f"pool must be the pool's name (a str), got {type(pool).__name__}{hint}")


def encode_request(msg: m.Message) -> bytes:
    """``encode(msg)``, with msgspec's ``TypeError`` for a value it cannot write (a numpy
    integer among the block ids, a tensor as the rank) turned into a ``BadRequest`` that says
    what to pass instead: nothing has been sent, the session goes on."""
    try:
        return encode(msg)
    except TypeError as exc:
        raise BadRequest(f"{type(msg).__name__} cannot be sent: {exc}; block ids, ranks and counts must be "
                         "Python ints (a numpy array or a tensor of ids is taken whole; for its single "
                         "elements use int(x), or .tolist() on the array)") from None


def connection_lost(what: str, *, closed: bool = False) -> ConnectionClosed:
    """The daemon's end of a session went away: ``what`` happened, and what to do about it; or,
    when this client was ``closed`` by its own process (the socket op failed because of that),
    :func:`client_closed`."""
    if closed:
        return client_closed()
    return ConnectionClosed(f"{what}; {LOST_HINT}", by_peer=True)


class SocketUnreachable(ConnectionClosed):
    """connect() to the daemon's socket failed: ``path`` and ``reason`` (errno's text) say where
    and why, and the message says what to do. A :class:`ConnectionClosed`, as before."""

    def __init__(self, path: str, reason: str, give: str = CLIENT_GIVE) -> None:
        super().__init__(f"cannot connect to kvd at {path}: {reason}; {unreachable_hint(path, give)}", by_peer=True)
        self.path = path
        self.reason = reason


def check_reply(reply: m.Message, expected: type[T]) -> T:
    """Return ``reply`` as ``expected`` or raise the error it carries."""
    if isinstance(reply, m.Error):
        raise error_from_code(reply.code, reply.message)
    if not isinstance(reply, expected):
        raise ProtocolError(f"expected {expected.__name__}, daemon sent {type(reply).__name__}")
    return reply


def fds_from_ancillary(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    """Extract SCM_RIGHTS fds from ``recvmsg`` ancillary data."""
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[: len(data) - (len(data) % arr.itemsize)])
            fds.extend(arr)
    return fds


def check_arguments(request_id: str, *, deadline_s: float | None = None, timeout_s: float | None = None) -> None:
    """Refuse, before anything is sent, the arguments the daemon's decoder would refuse as a
    malformed message (a ``protocol`` error, which reads like a broken wire): ``BadRequest``
    naming the argument, its bounds and what leaving it out means."""
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_LEN:
        raise BadRequest(f"request_id must be a non-empty string of at most {MAX_REQUEST_ID_LEN} characters, "
                         f"got {request_id!r:.80}")
    for name, value, positive, unset in (
        ("deadline_s", deadline_s, True, "None takes the daemon's [transfer] deadline_s"),
        ("timeout_s", timeout_s, False, "None waits until the request ends"),
    ):
        if value is None:
            continue
        number = isinstance(value, int | float) and math.isfinite(value)
        if not number or not (value > 0 if positive else value >= 0) or value > MAX_DEADLINE_S:
            raise BadRequest(f"{name} must be a number of seconds {'> 0' if positive else '>= 0'} and at most "
                             f"{MAX_DEADLINE_S:g}, got {value!r}; {unset}")


def registration_args(layout: KVLayout, block_ids: Sequence[int], peer: str, *, publish: bool) -> list[int]:
    """Refuse, before anything is sent, the registration arguments that the daemon's decoder
    would refuse as a malformed message (a ``protocol`` error) or that it would take wrongly:
    a layout that is not a ``KVLayout``, a ``peer`` that is not a string (or, to ``publish``,
    is empty), block ids in a set (no token order). Returns the block ids as a list."""
    if not isinstance(layout, KVLayout):
        raise BadRequest(f"layout must be a protocol.layout.KVLayout, got {type(layout).__name__}; build one "
                         "with KVLayout(num_layers=..., num_kv_heads=..., ...), or take the pool's: "
                         "attach(pool).info.layout")
    if not isinstance(peer, str):
        raise BadRequest(f"peer must be a node name (a str), got {type(peer).__name__} {peer!r:.40}"
                         + ("" if publish else "; leave it out (\"\") when the ctx node is not known"))
    if publish and not peer:
        raise BadRequest("publish needs peer=, the gen daemon's node name (its [[peers]] name here or on the "
                         "gen daemon; kvctl peers lists the linked ones), or this daemon's own node for a "
                         "transfer between its own pools")
    if isinstance(block_ids, set | frozenset | dict):
        raise BadRequest(f"block_ids must be in the request's token order (a list, an array, a tensor), got a "
                         f"{type(block_ids).__name__}, which has no order: token t lives in block_ids[t // "
                         "tokens_per_block]")
    return id_list(block_ids)


def wait_request(id: int, request_id: str, timeout_s: float | None) -> m.Wait:
    """The ``Wait`` both clients send."""
    check_arguments(request_id, timeout_s=timeout_s)
    return m.Wait(id=id, request_id=request_id, timeout_s=timeout_s)


def expect_request(
    id: int,
    request_id: str,
    pool: str,
    layout: KVLayout,
    rank: int,
    block_ids: Sequence[int],
    ranks: list[int] | None,
    deadline_s: float | None,
    peer: str = "",
) -> m.Expect:
    """The ``Expect`` both clients send (gen side registration)."""
    check_arguments(request_id, deadline_s=deadline_s)
    ids = registration_args(layout, block_ids, peer, publish=False)
    return m.Expect(id=id, request_id=request_id, pool=pool_arg(pool), layout=layout, rank=rank,
                    block_ids=ids, ranks=ranks, deadline_s=deadline_s, peer=peer)


def publish_request(
    id: int,
    request_id: str,
    pool: str,
    layout: KVLayout,
    rank: int,
    block_ids: Sequence[int],
    peer: str,
    ranks: list[int] | None,
    deadline_s: float | None,
) -> m.Publish:
    """The ``Publish`` both clients send (ctx side registration)."""
    check_arguments(request_id, deadline_s=deadline_s)
    ids = registration_args(layout, block_ids, peer, publish=True)
    return m.Publish(id=id, request_id=request_id, pool=pool_arg(pool), layout=layout, rank=rank,
                     block_ids=ids, peer=peer, ranks=ranks, deadline_s=deadline_s)


def completion_or_raise(reply: m.Completion) -> m.Completion:
    """A failed completion raises its error; a successful one is returned."""
    if not reply.ok:
        raise error_from_code(reply.error_code or "transfer_failed", reply.error_message)
    return reply
