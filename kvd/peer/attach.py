"""Map a same-node peer daemon's pools into this daemon (the mapped path's destination).

Daemon-side code over the executor protocol: one short session on the peer's Unix socket
(``Hello``, then ``AttachPool`` per pool; host and POSIX-fd pools arrive as file descriptors,
CUDA pools as IPC/fabric handles), each pool mapped with the :mod:`kvd.mapping` leaf that the
clients use too. Blocking: run it in a worker thread.
"""

from __future__ import annotations

import array
import os
import socket

from kvd.mapping.attach import MappedPool, map_pool
from protocol import messages as m
from protocol.codec import decode_reply, encode
from protocol.errors import ConnectionClosed, ProtocolError, error_from_code
from protocol.framing import DEFAULT_MAX_FRAME_SIZE, FrameBuffer

_MAX_FDS = 16
_ANCILLARY = socket.CMSG_SPACE(_MAX_FDS * array.array("i").itemsize)


class _Session:
    def __init__(self, path: str, timeout: float) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.frames = FrameBuffer(DEFAULT_MAX_FRAME_SIZE)
        self.ready: list[tuple[m.Message, list[int]]] = []
        self.next_id = 1
        try:
            self.sock.connect(path)
        except OSError as exc:
            self.sock.close()
            raise ConnectionClosed(f"cannot connect to the peer's socket {path}: {exc.strerror}") from None

    def call(self, msg: m.Message) -> tuple[m.Message, list[int]]:
        try:
            self.sock.sendall(encode(msg))
            while not self.ready:
                data, anc, _flags, _addr = self.sock.recvmsg(65536, _ANCILLARY)
                fds = _fds(anc)
                if not data:
                    for fd in fds:
                        os.close(fd)
                    raise ConnectionClosed("the peer daemon closed its socket")
                for i, payload in enumerate(self.frames.feed(data)):
                    self.ready.append((decode_reply(payload), fds if i == 0 else []))
        except OSError as exc:
            raise ConnectionClosed(f"peer socket: {exc}") from None
        reply, fds = self.ready.pop(0)
        if isinstance(reply, m.Error):
            for fd in fds:
                os.close(fd)
            raise error_from_code(reply.code, reply.message)
        return reply, fds

    def id(self) -> int:
        self.next_id += 1
        return self.next_id


def _fds(anc: list[tuple[int, int, bytes]]) -> list[int]:
    out: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[: len(data) - (len(data) % arr.itemsize)])
            out.extend(arr)
    return out


def attach_peer_pools(socket_path: str, names: list[str], me: str, timeout: float = 10.0) -> dict[str, MappedPool]:
    """Map the peer's pools ``names`` through its executor socket; all or nothing."""
    s = _Session(socket_path, timeout)
    mapped: dict[str, MappedPool] = {}
    try:
        welcome, _ = s.call(m.Hello(id=s.id(), version=m.PROTOCOL_VERSION, client=f"kvd-peer:{me}", pid=os.getpid()))
        if not isinstance(welcome, m.Welcome):
            raise ProtocolError(f"peer answered Hello with {type(welcome).__name__}")
        for name in names:
            reply, fds = s.call(m.AttachPool(id=s.id(), pool=name))
            if not isinstance(reply, m.Attached):
                for fd in fds:
                    os.close(fd)
                raise ProtocolError(f"peer answered AttachPool with {type(reply).__name__}")
            mapped[name] = map_pool(reply, fds)
    except BaseException:
        for pool in mapped.values():
            pool.close()
        raise
    finally:
        s.sock.close()
    return mapped
