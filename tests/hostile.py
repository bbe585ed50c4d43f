"""Helpers for the hostile-input tests: raw executor/peer connections and the daemon's health.

An attack test takes a :class:`Baseline` of a real daemon after warm-up, attacks it, then
:meth:`Baseline.check` proves that the daemon still serves a normal client, holds no extra
lease, session or file descriptor, and logged no traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from clients import Client
from kvd.demo.launch import DaemonProcess
from kvd.peer.auth import handshake_mac, new_nonce
from protocol import messages as m
from protocol.codec import decode_reply, encode
from protocol.framing import FrameBuffer, frame
from protocol.peer import (
    PEER_PROTOCOL_VERSION,
    PeerAuth,
    PeerChallenge,
    PeerHello,
    PeerWelcome,
    decode_peer,
    encode_peer,
)

IO_TIMEOUT = 15.0  # a read that waits longer is a hang: the test fails


def events(d: DaemonProcess, event: str | None = None) -> list[dict[str, Any]]:
    """The daemon's JSON log records (of one event)."""
    out = []
    for line in d.log().splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if event is None or rec.get("event") == event:
                out.append(rec)
    return out


def warnings(d: DaemonProcess) -> list[dict[str, Any]]:
    return [r for r in events(d) if r.get("level") in ("warning", "error", "critical")]


def wait_until(predicate: Any, what: str, timeout: float = IO_TIMEOUT) -> None:
    """Poll ``predicate`` until true (the condition, not a time window, is what we wait for)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_targets(pid: int) -> dict[int, str]:
    """The process's descriptors and what each refers to (for a failure message)."""
    out: dict[int, str] = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            out[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
    return out


def _receive_frame(sock: socket.socket, frames: FrameBuffer, ready: list[Any], decode: Callable[[bytes], Any]) -> Any:
    """The next decoded frame from ``sock`` (frames already read first), or None once it closed."""
    while not ready:
        try:
            data = sock.recv(1 << 20)
        except ConnectionResetError:
            data = b""
        if not data:
            return None
        ready.extend(decode(p) for p in frames.feed(data))
    return ready.pop(0)


class Raw:
    """A raw executor-socket connection speaking frames (no client library checks)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(IO_TIMEOUT)
        self.sock.connect(path)
        self.frames = FrameBuffer(1 << 25)
        self.ready: list[m.Message] = []

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def hello(self, client: str = "raw") -> m.Welcome:
        self.send(encode(m.Hello(id=1, version=m.PROTOCOL_VERSION, client=client)))
        reply = self.receive()
        assert isinstance(reply, m.Welcome), reply
        return reply

    def send_body(self, body: dict[str, Any]) -> None:
        self.send(frame(msgspec.msgpack.encode(body)))

    def receive(self) -> m.Message | None:
        msg: m.Message | None = _receive_frame(self.sock, self.frames, self.ready, decode_reply)
        return msg

    def error(self) -> m.Error:
        reply = self.receive()
        assert isinstance(reply, m.Error), reply
        return reply

    def ping(self, rid: int = 99) -> None:
        self.send(encode(m.Ping(id=rid, payload=b"still")))
        assert self.receive() == m.Pong(id=rid, payload=b"still")

    def close(self) -> None:
        self.sock.close()


class RawPeer:
    """A raw TCP connection to a daemon's peer port."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT)
        self.frames = FrameBuffer(1 << 25)
        self.ready: list[msgspec.Struct] = []

    def send(self, data: bytes) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.sock.sendall(data)  # the daemon may have closed: what it sent is still readable

    def receive(self) -> msgspec.Struct | None:
        msg: msgspec.Struct | None = _receive_frame(self.sock, self.frames, self.ready, decode_peer)
        return msg

    def rest(self) -> list[msgspec.Struct]:
        """Everything until the daemon closes (after our EOF)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)
        out = []
        while (msg := self.receive()) is not None:
            out.append(msg)
        return out

    def authenticate(self, secret: bytes, node: str = "attacker") -> PeerChallenge:
        """The client half of the handshake up to (and including) our PeerAuth."""
        nonce = new_nonce()
        self.send(encode_peer(PeerHello(version=PEER_PROTOCOL_VERSION, node=node, nonce=nonce)))
        ch = self.receive()
        assert isinstance(ch, PeerChallenge), ch
        mac = handshake_mac(
            secret,
            "client",
            version=PEER_PROTOCOL_VERSION,
            client_node=node,
            server_node=ch.node,
            client_nonce=nonce,
            server_nonce=ch.nonce,
        )
        self.send(encode_peer(PeerAuth(mac=mac)))
        welcome = self.receive()
        assert isinstance(welcome, PeerWelcome), welcome
        return ch

    def close(self) -> None:
        self.sock.close()


@dataclass
class Baseline:
    """What a healthy, idle daemon looks like after warm-up."""

    daemon: DaemonProcess
    fds: int
    log_lines: int
    #: the descriptors when ``fds`` was counted (the probe's connection among them)
    fd_map: dict[int, str] = field(default_factory=dict)

    @classmethod
    def take(cls, d: DaemonProcess) -> Baseline:
        with Client(d.socket_path, client="warmup", timeout=IO_TIMEOUT) as c:
            ids = c.alloc(c.pools()[0].name, 1)
            c.free(c.pools()[0].name, ids)
        fds, fd_map = _idle(d)
        return cls(d, fds, len(d.log().splitlines()), fd_map)

    def new_log(self) -> list[dict[str, Any]]:
        """Log records written since the baseline."""
        lines = self.daemon.log().splitlines()[self.log_lines :]
        return [json.loads(line) for line in lines if line.startswith("{")]

    def new_warnings(self) -> list[dict[str, Any]]:
        return [r for r in self.new_log() if r.get("level") in ("warning", "error", "critical")]

    def check(self) -> None:
        """Alive, serving, nothing held, no traceback in the log."""
        d = self.daemon
        assert d.proc.poll() is None, f"the daemon died:\n{d.log()[-4000:]}"
        with Client(d.socket_path, client="after", timeout=IO_TIMEOUT) as c:
            assert c.ping(b"after") == b"after"
            pool = c.pools()[0].name
            ids = c.alloc(pool, 2)
            assert c.free(pool, ids) == 2
        _idle(d)
        deadline = time.monotonic() + IO_TIMEOUT
        while len(now := fd_targets(d.pid)) > self.fds:
            if time.monotonic() > deadline:
                new = {fd: what for fd, what in now.items() if self.fd_map.get(fd) != what}
                gone = {fd: what for fd, what in self.fd_map.items() if now.get(fd) != what}
                raise AssertionError(f"fd count not back to {self.fds} within {IO_TIMEOUT} s (is {len(now)}): "
                                     f"new since the baseline {new}, gone since {gone}")
            time.sleep(0.01)
        text = d.log()
        assert "Traceback" not in text and '"exception"' not in text, text[-4000:]


def _idle(d: DaemonProcess) -> tuple[int, dict[int, str]]:
    """Wait until only our probe's session is left and no block is leased.

    Returns the daemon's descriptors without the probe's connection, counted while the probe
    is the only session (a session's descriptor is closed in the same step that ends it), and
    what they were then (the probe's among them).
    """
    fds: list[tuple[int, dict[int, str]]] = []

    def idle() -> bool:
        with Client(d.socket_path, client="probe", timeout=IO_TIMEOUT) as c:
            st = c.stats()
            if st.sessions == 1 and st.blocks_leased == 0:
                targets = fd_targets(d.pid)
                fds.append((len(targets) - 1, targets))
                return True
            return False

    wait_until(idle, "the daemon to be idle")
    return fds[-1]
