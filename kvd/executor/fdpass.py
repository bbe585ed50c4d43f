"""Sending file descriptors with a frame over a trio Unix socket (SCM_RIGHTS).

``socket.send_fds(trio_sock, ...)`` silently does nothing on a trio socket; this
uses ``sendmsg`` with the ancillary data, as the trio socket supports it.
"""

from __future__ import annotations

import array
import socket

import trio


async def send_with_fds(sock: trio.socket.SocketType, data: bytes, fds: list[int]) -> None:
    """Send ``data`` with ``fds`` attached to its first byte; then the rest, if any."""
    if not fds:
        await send_rest(sock, data)
        return
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
    sent = await sock.sendmsg([data], ancillary)
    if sent < len(data):
        await send_rest(sock, data[sent:])


async def send_rest(sock: trio.socket.SocketType, data: bytes) -> None:
    """Write all of ``data`` (no fds), awaiting the socket as needed."""
    view = memoryview(data)
    while view:
        n = await sock.send(view)
        view = view[n:]
