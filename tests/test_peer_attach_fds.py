"""The ctx daemon's attach to a peer's executor socket closes every fd it is sent and does
not keep: fds riding on a Welcome (which carries none), and fds that arrived with bytes that
completed no frame yet (they belong to the frame completed next; they were dropped open)."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from kvd.peer.attach import attach_peer_pools
from protocol import messages as m
from protocol.codec import encode
from protocol.errors import NotFound
from protocol.framing import FrameBuffer


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _serve(listener: socket.socket, split_error: bool) -> None:
    """A fake peer executor socket: Welcome with a stray fd, then an error for AttachPool
    (split in two writes, the fd on the first, when ``split_error``)."""
    conn, _ = listener.accept()
    frames = FrameBuffer(1 << 20)
    with conn:
        def next_frame() -> None:
            while not frames.feed(conn.recv(65536)):
                pass
        next_frame()
        r, w = os.pipe()
        try:
            welcome = m.Welcome(id=1, version=m.PROTOCOL_VERSION, server="fake", node="n", session_id=1,
                                max_frame_size=1 << 20)
            socket.send_fds(conn, [encode(welcome)], [r])
            next_frame()
            err = encode(m.Error(id=2, code="not_found", message="no pool 'p'"))
            if split_error:
                socket.send_fds(conn, [err[:3]], [w])
                conn.sendall(err[3:])
            else:
                conn.sendall(err)
        finally:
            os.close(r)
            os.close(w)
        conn.recv(1)  # until the client closes


@pytest.mark.parametrize("split_error", [False, True])
def test_fds_a_peer_sends_unasked_are_closed(short_tmp: Path, split_error: bool) -> None:
    path = str(short_tmp / "fake.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    server = threading.Thread(target=_serve, args=(listener, split_error), daemon=True)
    before = _open_fds()
    server.start()
    with pytest.raises(NotFound, match="no pool"):
        attach_peer_pools(path, ["p"], "me")
    server.join(10)
    assert not server.is_alive()
    listener.close()
    assert _open_fds() == before - 1  # (the listener, closed)
