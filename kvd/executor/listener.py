"""The daemon's Unix-socket listener.

trio has no ``serve_unix``; this builds one from ``trio.socket`` bind/listen and
``trio.SocketListener``. Rules:

- the socket is created with mode ``socket_mode`` (0660 by default: owner + group);
- a stale socket left by a dead daemon (connect → ECONNREFUSED) is replaced;
- a live one (connect succeeds) is refused: two daemons never share a path;
- on exit the path is unlinked only if it is still *our* socket (same inode), so a newer
  daemon that replaced it is not broken.
"""

from __future__ import annotations

import errno
import os
import socket as stdsocket
import stat
from dataclasses import dataclass

import trio

from kvd.executor.peercred import peer_credentials
from protocol.errors import BadRequest, KvdError


class SocketInUse(KvdError):
    """Another live daemon already listens on the socket path."""

    code = "socket_in_use"


@dataclass
class UnixListener:
    """A bound, listening Unix socket and the identity of its path."""

    listener: trio.SocketListener
    path: str
    inode: int

    def still_ours(self) -> bool:
        """True when ``path`` is still the socket we created."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return False
        return stat.S_ISSOCK(st.st_mode) and st.st_ino == self.inode

    async def aclose(self) -> None:
        """Close the listener and unlink the path if it is still ours."""
        if self.still_ours():
            os.unlink(self.path)
        await self.listener.aclose()


def _probe_existing(path: str) -> None:
    """Remove a stale socket at ``path``; refuse when a live daemon answers there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise BadRequest(f"socket path {path} exists and is not a socket; refusing to replace it")
    probe = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            os.unlink(path)  # stale: nobody listens there
            return
        raise SocketInUse(f"cannot probe existing socket {path}: {exc.strerror}") from None
    else:
        who = _holder(probe)
    finally:
        probe.close()
    raise SocketInUse(f"another kvd is already serving on {path}{who}")


def _holder(probe: stdsocket.socket) -> str:
    """`` (pid N, ...)``: the process that listens where ``probe`` is connected, and how to stop
    it ("" when the kernel cannot say: pid 0 is a process in another pid namespace)."""
    try:
        pid = peer_credentials(probe).pid
    except OSError:
        return ""
    if pid <= 0:
        return " (a process in another pid namespace, e.g. a container)"
    return f" (pid {pid}: 'systemctl stop kvd' where systemd runs it, else 'kill {pid}')"


async def open_unix_listener(path: str, mode: int = 0o660, backlog: int = 512) -> UnixListener:
    """Bind and listen on ``path`` with permissions ``mode``."""
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        raise BadRequest(f"socket directory {parent} does not exist")
    _probe_existing(path)
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    try:
        # Bind under a restrictive umask so the socket is never briefly world-accessible.
        old_umask = os.umask(0o777 & ~mode)
        try:
            await sock.bind(path)
        finally:
            os.umask(old_umask)
        os.chmod(path, mode)
        sock.listen(backlog)
        inode = os.lstat(path).st_ino
    except BaseException:
        sock.close()
        raise
    return UnixListener(trio.SocketListener(sock), path, inode)
