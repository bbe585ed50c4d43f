"""Client-side wire helpers shared by the async and the blocking client (no I/O here).

Both clients build the same request messages and interpret replies the same way; only
the socket calls differ. Replies of type ``Error`` become the daemon's exception class.
"""

from __future__ import annotations

import array
import os
import socket
import stat
from collections.abc import Sequence
from typing import TypeVar

from protocol import messages as m
from protocol.errors import ConnectionClosed, ProtocolError, error_from_code
from protocol.layout import KVLayout

T = TypeVar("T", bound=m.Message)

#: Room for the fds that may come with one frame (Attached carries at most a few).
MAX_FDS = 16
ANCILLARY_SIZE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)


def default_socket_path() -> str:
    """``$KVD_SOCKET`` or the systemd unit's socket path."""
    return os.environ.get("KVD_SOCKET", "/run/kvd/kvd.sock")


#: How a library caller gives the socket (kvctl says ``--socket PATH or KVD_SOCKET``).
CLIENT_GIVE = "Client(path) / open_client(path) or KVD_SOCKET"


def unreachable_hint(path: str, give: str = CLIENT_GIVE) -> str:
    """What to do when the socket at ``path`` cannot be opened (connect() says only errno).

    ``give`` names how the caller passes the socket path (an argument, an option)."""
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
    return m.Expect(id=id, request_id=request_id, pool=pool, layout=layout, rank=rank,
                    block_ids=list(block_ids), ranks=ranks, deadline_s=deadline_s, peer=peer)


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
    return m.Publish(id=id, request_id=request_id, pool=pool, layout=layout, rank=rank,
                     block_ids=list(block_ids), peer=peer, ranks=ranks, deadline_s=deadline_s)


def completion_or_raise(reply: m.Completion) -> m.Completion:
    """A failed completion raises its error; a successful one is returned."""
    if not reply.ok:
        raise error_from_code(reply.error_code or "transfer_failed", reply.error_message)
    return reply
