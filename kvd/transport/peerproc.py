"""A passive NIXL peer in a separate process, for the tests and the raw bench.

NIXL must run its two agents in two processes to measure (and exercise) the real paths, so
:class:`PeerProcess` spawns a child (``multiprocessing`` "spawn": no forked NIXL/UCX state)
that owns one agent and one host buffer, registers it, and then polls its agent
continuously (as the daemon's notification poller does) while answering commands from the
parent over a pipe: load the parent's metadata, report notifications, hash/read/fill its
buffer, send a notification, pause (stop progressing its agent) and resume. The parent is
typically a :class:`~kvd.transport.NixlAgent` writing into ``PeerProcess.addr``.

Commands are blocking pipe round trips; from trio, call them through
``trio.to_thread.run_sync`` if other tasks must run meanwhile.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

from protocol.errors import NixlError

__all__ = ["PeerProcess"]


def _wait_for_resume(conn: Connection) -> bool:  # pragma: no cover - runs in the child process
    """Block on the pipe (not on the agent) until "resume"; False if the parent went away."""
    while True:
        try:
            cmd = conn.recv()[0]
        except EOFError:
            return False
        if cmd == "resume":
            conn.send(("ok", None))
            return True
        conn.send(("error", f"paused: {cmd!r} refused until 'resume'"))


def _peer_main(
    conn: Connection, name: str, nbytes: int, progress_thread: bool, env: dict[str, str], spin: bool
) -> None:  # pragma: no cover - runs in the child process
    import numpy as np

    from kvd.transport.nixl_agent import NixlAgent, Region, ensure_loopback_ucx

    ensure_loopback_ucx()
    try:
        agent = NixlAgent(name, progress_thread=progress_thread, env=env)
        buf = np.zeros(nbytes, dtype=np.uint8)
        buf.fill(0)  # touch every page now, not inside the first transfer
        agent.register([Region(buf.ctypes.data, nbytes)])
        conn.send(("ready", agent.metadata(), buf.ctypes.data))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    notifs: list[tuple[str, bytes]] = []
    last = time.monotonic()
    while True:
        for remote, msgs in agent.notifications().items():
            for m in msgs:
                notifs.append((remote, m))
                last = time.monotonic()
        # spin (or, if not spinning, only right after activity); else block ~1 ms in the pipe's poll
        if not conn.poll(0 if spin or time.monotonic() - last < 0.001 else 0.0005):
            continue
        try:
            cmd, *args = conn.recv()
        except EOFError:
            break
        try:
            if cmd == "stop":
                conn.send(("ok", None))
                break
            if cmd == "add_remote":
                conn.send(("ok", agent.add_remote(args[0])))
            elif cmd == "notifs":
                out, notifs = notifs, []
                conn.send(("ok", out))
            elif cmd == "digest":
                off, length = args
                conn.send(("ok", hashlib.sha256(buf[off : off + length].tobytes()).hexdigest()))
            elif cmd == "read":
                off, length = args
                conn.send(("ok", buf[off : off + length].tobytes()))
            elif cmd == "fill":
                buf.fill(args[0])
                conn.send(("ok", None))
            elif cmd == "send_notif":
                agent.send_notif(args[0], args[1])
                conn.send(("ok", None))
            elif cmd == "pause":
                # stop calling into the agent until "resume": UCX makes no progress here, so a
                # write into this peer that needs the target's progress (tcp) cannot complete
                conn.send(("ok", None))
                if not _wait_for_resume(conn):
                    break
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    agent.close()


class PeerProcess:
    """Parent-side handle of a passive NIXL peer process (see the module docstring)."""

    def __init__(
        self,
        name: str,
        nbytes: int,
        *,
        progress_thread: bool = False,
        env: Mapping[str, str] | None = None,
        spin: bool = True,
        timeout: float = 60.0,
    ) -> None:
        """Start the peer. ``spin``: poll the agent without pause (the writer's completion
        latency depends on how often the target progresses: ≈0.2 ms per 1 MiB write when
        spinning, ≈3 ms when polling every millisecond)."""
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.name = name
        self.nbytes = nbytes
        self.timeout = timeout
        self.proc = ctx.Process(
            target=_peer_main,
            args=(child, name, nbytes, progress_thread, dict(env or {}), spin),
            name=f"nixl-peer-{name}",
            daemon=True,
        )
        self.proc.start()
        child.close()
        try:
            msg = self._recv(timeout)
            if msg[0] != "ready":
                raise NixlError(f"NIXL peer process {name!r} failed to start: {msg[1]}")
        except BaseException:
            self.kill()
            raise
        self.metadata: bytes = msg[1]
        self.addr: int = msg[2]

    def _recv(self, timeout: float) -> tuple[Any, ...]:
        if not self._conn.poll(timeout):
            raise NixlError(f"NIXL peer process {self.name!r} did not answer within {timeout} s")
        try:
            msg: tuple[Any, ...] = self._conn.recv()
        except EOFError:
            raise NixlError(f"NIXL peer process {self.name!r} exited (code {self.proc.exitcode})") from None
        return msg

    def _call(self, *cmd: Any) -> Any:
        try:
            self._conn.send(cmd)
        except (BrokenPipeError, OSError):
            raise NixlError(f"NIXL peer process {self.name!r} is gone (code {self.proc.exitcode})") from None
        status, value = self._recv(self.timeout)
        if status != "ok":
            raise NixlError(f"NIXL peer process {self.name!r}: {cmd[0]} failed: {value}")
        return value

    def add_remote(self, metadata: bytes) -> str:
        """Let the peer load our metadata (it needs it to notify us)."""
        return str(self._call("add_remote", metadata))

    def notifications(self) -> list[tuple[str, bytes]]:
        """Notifications the peer received since the last call: (sender agent, message)."""
        return list(self._call("notifs"))

    def wait_notifs(self, count: int, timeout: float = 30.0) -> list[tuple[str, bytes]]:
        """Collect notifications until at least ``count`` arrived (or raise after ``timeout``)."""
        got: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            got += self.notifications()
            if len(got) >= count:
                break
            if time.monotonic() > deadline:
                raise NixlError(
                    f"peer {self.name!r} got {len(got)} of {count} notifications in {timeout} s: {got}"
                )
            time.sleep(0.001)
        return got

    def digest(self, offset: int, length: int) -> str:
        """sha256 (hex) of the peer's buffer ``[offset, offset+length)``."""
        return str(self._call("digest", offset, length))

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self._call("read", offset, length))

    def fill(self, value: int) -> None:
        self._call("fill", value)

    def send_notif(self, remote_agent: str, msg: bytes) -> None:
        self._call("send_notif", remote_agent, msg)

    def pause(self) -> None:
        """Stop progressing the peer's agent until :meth:`resume` (the passive side of a write
        over ``tcp`` then never completes it: a transfer that is certain to be in flight)."""
        self._call("pause")

    def resume(self) -> None:
        """Poll the agent again after :meth:`pause`."""
        self._call("resume")

    def kill(self) -> None:
        """Kill the process at once (what a crashed peer looks like)."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        self._conn.close()

    def close(self) -> None:
        """Stop the process cleanly (kill it if it does not stop)."""
        if self.proc.is_alive() and not self._conn.closed:
            with contextlib.suppress(NixlError):
                self._call("stop")
            self.proc.join(10)
        self.kill()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
