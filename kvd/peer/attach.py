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
from collections import deque
from dataclasses import dataclass

from kvd.mapping.attach import MappedPool, map_pool
from kvd.mapping.words import SLOT_WORDS, WordsView
from kvd.regroup import signal
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
        # fds ride on the first byte of their frame: those received with bytes that completed
        # no frame yet belong to the next frame completed
        self.pending_fds: list[int] = []
        self.next_id = 1
        try:
            self.sock.connect(path)
        except OSError as exc:
            self.sock.close()
            raise ConnectionClosed(f"cannot connect to the peer's socket {path}: {exc.strerror}") from None

    def hello(self, me: str) -> None:
        """The session's handshake, as the peer daemon ``me``."""
        welcome, stray = self.call(m.Hello(id=self.id(), version=m.PROTOCOL_VERSION, client=f"kvd-peer:{me}",
                                           pid=os.getpid()))
        _close(stray)  # a Welcome carries none: a peer's stray fds are not kept open
        if not isinstance(welcome, m.Welcome):
            raise ProtocolError(f"peer answered Hello with {type(welcome).__name__}")

    def call(self, msg: m.Message) -> tuple[m.Message, list[int]]:
        try:
            self.sock.sendall(encode(msg))
            while not self.ready:
                data, anc, _flags, _addr = self.sock.recvmsg(65536, _ANCILLARY)
                fds = _fds(anc)
                if not data:
                    _close(fds)
                    raise ConnectionClosed("the peer daemon closed its socket")
                self.pending_fds.extend(fds)
                for payload in self.frames.feed(data):
                    got, self.pending_fds = self.pending_fds, []
                    try:
                        self.ready.append((decode_reply(payload), got))
                    except BaseException:
                        _close(got)
                        raise
        except OSError as exc:
            raise ConnectionClosed(f"peer socket: {exc}") from None
        reply, fds = self.ready.pop(0)
        if isinstance(reply, m.Error):
            _close(fds)
            raise error_from_code(reply.code, reply.message)
        return reply, fds

    def close(self) -> None:
        """Close the socket and every received fd nobody took."""
        _close(self.pending_fds)
        for _reply, fds in self.ready:
            _close(fds)
        self.pending_fds, self.ready = [], []
        self.sock.close()

    def id(self) -> int:
        self.next_id += 1
        return self.next_id


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


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
        s.hello(me)
        for name in names:
            reply, fds = s.call(m.AttachPool(id=s.id(), pool=name))
            if not isinstance(reply, m.Attached):
                _close(fds)
                raise ProtocolError(f"peer answered AttachPool with {type(reply).__name__}")
            mapped[name] = map_pool(reply, fds)
    except BaseException:
        for pool in mapped.values():
            pool.close()
        raise
    finally:
        s.close()
    return mapped


@dataclass
class PeerWords:
    """A same-node peer's completion page, mapped here writable and registered with CUDA: the
    mapped path's kernel stream stores gen's completion tokens into it (:mod:`kvd.regroup.signal`)."""

    view: WordsView
    device_ptr: int

    @property
    def slots(self) -> int:
        return self.view.slots


#: Pages of ended links kept registered: a store enqueued for one may still be pending when
#: its link ends, so a page is unregistered only after this many later ones ended.
_RETIRED_KEEP = 32
_retired: deque[PeerWords] = deque()


def attach_peer_words(socket_path: str, me: str, device: int, timeout: float = 10.0) -> PeerWords:
    """Map the peer's completion page (writable: this daemon runs as an operator there) and
    register it with CUDA on ``device``. Blocking (a worker thread's); raises
    :class:`~protocol.errors.KvdError` (or the driver's :class:`KernelError`) when it cannot."""
    s = _Session(socket_path, timeout)
    try:
        s.hello(me)
        reply, fds = s.call(m.AttachWords(id=s.id(), writable=True))
        try:
            if not isinstance(reply, m.WordsAttached) or len(fds) != 1 or reply.slot_words != SLOT_WORDS:
                raise ProtocolError(f"peer answered AttachWords with {type(reply).__name__} and {len(fds)} fds")
            view = WordsView(fds[0], reply.slots, writable=True)
        finally:
            _close(fds)
    finally:
        s.close()
    try:
        return PeerWords(view, signal.register_host(view.address, view.nbytes, device))
    except BaseException:
        view.close()
        raise


def retire_peer_words(words: PeerWords) -> None:
    """A link that used ``words`` ended: unregistered and unmapped later (see :data:`_RETIRED_KEEP`)."""
    _retired.append(words)
    while len(_retired) > _RETIRED_KEEP:
        old = _retired.popleft()
        signal.unregister_host(old.view.address)
        old.view.close()
