"""A cuttable TCP relay for peer-link tests: the test process stands between two daemons.

A daemon dials the proxy's port instead of its peer's; :meth:`Proxy.cut` ends every relayed
connection at once (both daemons see their link close, the dialler dials again), and
:meth:`Proxy.hold` keeps the link down until :meth:`Proxy.release`: connections made meanwhile
are closed as soon as they are accepted (the dialler's handshake fails and it retries).
:meth:`Proxy.stall` makes the relay drop what it reads instead of passing it on, as a network
that fails silently would, until the link is cut: what was sent then never arrives.
"""

from __future__ import annotations

import trio


class Proxy:
    """A TCP relay on 127.0.0.1 to ``target``'s port; :meth:`cut` ends every relayed connection."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._live: set[trio.CancelScope] = set()
        self._held = False
        self._stalled = False
        #: bytes read and dropped while stalled
        self.dropped = bytearray()
        self._dropping = trio.Event()  # set (and replaced) whenever bytes are dropped

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._relay, listeners)

    async def _relay(self, inbound: trio.SocketStream) -> None:
        if self._held:
            await trio.aclose_forcefully(inbound)  # the link stays down: the dialler tries again
            return
        with trio.CancelScope() as scope:
            self._live.add(scope)
            try:
                outbound = await trio.open_tcp_stream("127.0.0.1", self.target_port)
                async with inbound, outbound, trio.open_nursery() as n:
                    n.start_soon(self._pump, inbound, outbound, n.cancel_scope)
                    n.start_soon(self._pump, outbound, inbound, n.cancel_scope)
            except OSError:
                pass  # the target is down (a restarting daemon): the dialler tries again
            finally:
                self._live.discard(scope)

    async def _pump(self, src: trio.SocketStream, dst: trio.SocketStream, done: trio.CancelScope) -> None:
        try:
            while data := await src.receive_some(65536):
                if self._stalled:
                    self.dropped += data
                    self._dropping.set()
                    self._dropping = trio.Event()
                    continue
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        done.cancel()  # one direction ended: end the other (the daemons see the link close)

    def cut(self) -> int:
        """End every connection relayed now (and a stall); how many there were."""
        self._stalled = False
        live = list(self._live)
        for scope in live:
            scope.cancel()
        return len(live)

    def hold(self) -> None:
        """Close every connection accepted from now on, until :meth:`release`."""
        self._held = True

    def release(self) -> None:
        """Relay new connections again (the dialler's next attempt links)."""
        self._held = False

    def stall(self) -> None:
        """Drop everything read from now on, both ways, until :meth:`cut` (which ends the stall)."""
        self._stalled = True

    async def wait_dropped(self, needle: bytes) -> None:
        """Until bytes containing ``needle`` were dropped (while stalled)."""
        while needle not in self.dropped:
            await self._dropping.wait()
