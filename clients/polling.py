"""Completions a serving framework's step loop collects without blocking.

A framework's worker runs a step loop that asks, every few milliseconds, which requests
finished their KV transfer (vLLM's ``get_finished``, TensorRT-LLM's
``check_*_transfer_status``). :class:`PollingClient` is the blocking :class:`~clients.Client`
plus that question:

    kvd = PollingClient("/run/kvd/kvd.sock", client="gen-rank1")
    kvd.expect_and_watch("req-42", "gen1", layout, 1, block_ids)   # sends, reads nothing
    ...
    for done in kvd.get_finished():        # never blocks: what the socket holds already
        if done.ok: ...                    # the KV is in the blocks
        # ok or not, kvd no longer reads or writes the request's blocks: reuse them

A watch is a ``Wait`` with no timeout, sent on the session that registered the request; the
daemon answers it in the step that reports the request, and :meth:`get_finished` reads every
answer the socket holds with ``MSG_DONTWAIT`` (one ``recvmsg`` when nothing came). Failures are
returned, not raised: a :class:`~protocol.messages.Completion` with ``ok=False`` and the
daemon's ``error_code`` / ``error_message`` (``protocol.errors.error_from_code`` turns them
into the exception :meth:`~clients.Client.wait` would raise). Exactly one completion comes
per watched request.

With ``completion_page=True`` the client maps the daemon's completion page read-only
(``kvd.mapping.words``; a daemon that has none to give: as without) and notes each watched
request's slot and token from its ``Registered`` reply; :meth:`get_finished` first reads every
watched slot (no syscall: about 1 us for up to 8, one numpy gather of about 4 us beyond) and
returns a request whose token is there as done, without waiting for the ``Completion`` reply. The watch's wait is still answered (it
collects the request in the daemon): that reply is dropped when it comes. Only success shows
in the page; failures come from the replies, as without.
"""

from __future__ import annotations

import os
import socket

from clients._wire import (
    ANCILLARY_SIZE,
    connection_lost,
    encode_request,
    expect_request,
    fds_from_ancillary,
    publish_request,
)
from clients.blocking import Client
from protocol import messages as m
from protocol.codec import decode_reply, encode
from protocol.errors import BadRequest, ConnectionClosed
from protocol.layout import KVLayout

#: Errors of a wait that are not the request's outcome: the request goes on, so the watch is
#: sent again (``limit_exceeded``: the session had ``max_inflight_per_session`` waits pending
#: while an earlier reply was still being written).
_WAIT_AGAIN = frozenset({"limit_exceeded", "wait_timeout"})


class PollingClient(Client):
    """A blocking session whose requests' outcomes are collected with :meth:`get_finished`.

    Every method of :class:`~clients.Client` works as there; replies to watches that come
    while another call reads the socket are kept for :meth:`get_finished`. Like ``Client``,
    one call is on the wire at a time (a lock serialises threads). ``completion_page``: take
    watched requests that the daemon's completion page says are done from the page (module
    docstring; off by default, as for ``Client``); :attr:`page_completions` counts them."""

    def __init__(self, path: str | None = None, *, client: str = "", timeout: float | None = None,
                 completion_page: bool = False) -> None:
        # wait message id -> its request id ("": its registration was refused, drop its reply)
        self._watches: dict[int, str] = {}
        # registration message id -> its watch's wait id and the peer it named
        self._registrations: dict[int, tuple[int, str]] = {}
        # wait message id -> its request id, returned from the completion page: the wait's reply
        # is dropped (sent again if refused for now: it still collects the request)
        self._paged: dict[int, str] = {}
        self._finished: list[m.Completion] = []
        self._again: list[int] = []  # wait ids to send again (see _WAIT_AGAIN)
        self._cancels: set[int] = set()  # ids of cancel_nowait's Cancel, whose replies are dropped
        # the connection ended (what get_finished raises once it returned what came before)
        self._lost: ConnectionClosed | None = None
        super().__init__(path, client=client, timeout=timeout, completion_page=completion_page)

    def __enter__(self) -> PollingClient:
        return self

    @property
    def watching(self) -> int:
        """How many watched requests have not been returned by :meth:`get_finished` yet."""
        return sum(1 for request_id in self._watches.values() if request_id)

    def watch(self, request_id: str) -> None:
        """Have :meth:`get_finished` return ``request_id``'s completion (registered by this
        session with :meth:`expect` or :meth:`publish`); sends one frame, reads nothing."""
        self._send_watched(None, request_id)

    def expect_and_watch(
        self,
        request_id: str,
        pool: str,
        layout: KVLayout,
        rank: int,
        block_ids: list[int],
        *,
        ranks: list[int] | None = None,
        deadline_s: float | None = None,
        peer: str = "",
    ) -> None:
        """:meth:`~clients.Client.expect` and :meth:`watch` in one write, waiting for no reply: a
        refused registration (``IncompatibleLayout``, ``BlockNotLeased``, ``DuplicateRequest``, …)
        comes back from :meth:`get_finished` as the request's failed completion. Arguments the
        client can check (request id, ``deadline_s``, the layout's type, ``peer``, block ids in a
        set) raise ``BadRequest`` here, nothing sent."""
        msg = expect_request(self._id(), request_id, pool, layout, rank, block_ids, ranks, deadline_s, peer)
        self._send_watched(msg, request_id)

    def publish_and_watch(
        self,
        request_id: str,
        pool: str,
        layout: KVLayout,
        rank: int,
        block_ids: list[int],
        peer: str,
        *,
        ranks: list[int] | None = None,
        deadline_s: float | None = None,
    ) -> None:
        """:meth:`~clients.Client.publish` and :meth:`watch` in one write, waiting for no reply
        (a refused registration is a failed completion, as for :meth:`expect_and_watch`)."""
        msg = publish_request(self._id(), request_id, pool, layout, rank, block_ids, peer, ranks, deadline_s)
        self._send_watched(msg, request_id)

    def cancel_nowait(self, request_id: str) -> None:
        """Cancel a watched request without waiting for the daemon's reply (one frame sent).

        Its outcome comes from :meth:`get_finished` as for any watched request: a failed
        completion (``transfer_cancelled``) once no write into its blocks can land, or ``ok``
        if it finished first (the cancel's reply, ``Ok`` or ``NotFound`` then, is dropped).
        ``BadRequest`` if this client does not watch ``request_id``: the cancel's reply would
        be the only word on it, use :meth:`~clients.Client.cancel`."""
        if request_id not in self._watches.values():
            raise BadRequest(f"request {request_id!r} is not watched by this client (or its completion was "
                             "returned already); cancel() cancels an unwatched request and says how it went")
        msg = m.Cancel(id=self._id(), request_id=request_id)
        with self._lock:
            self._send(encode(msg))
            self._cancels.add(msg.id)

    def get_finished(self) -> list[m.Completion]:
        """The completions of watched requests that the daemon has sent, without blocking (none
        yet: ``[]``). Each watched request comes exactly once, ``ok`` or not; either way its
        blocks are no longer read or written by kvd. Raises ``ConnectionClosed`` if the daemon
        went away (its leases and requests went with it) and nothing it sent before is left to
        return: a stopping daemon answers watched requests (``daemon_stopping``) before it
        closes the session, and those answers come first, even when read with the close.

        With the completion page, the watched requests whose tokens it holds come first, read
        there without a syscall; then every reply the socket holds."""
        with self._lock:
            self._from_page()
            if self._lost is None:
                self._read_available()
            while self._ready:
                reply, fds = self._ready.pop(0)
                if not self._route(reply):
                    for fd in fds:
                        os.close(fd)
            if self._lost is not None and not self._finished:
                raise self._lost
            if self._again and self._lost is None:
                again, self._again = self._again, []
                self._send(b"".join(encode(m.Wait(id=i, request_id=self._watches.get(i) or self._paged[i]))
                                    for i in again))
            finished, self._finished = self._finished, []
        return finished

    # -- plumbing ---------------------------------------------------------------------------
    def _reads_page(self) -> bool:
        return True  # get_finished reads it, spinning or not

    def _from_page(self) -> None:
        """Move the watched requests the completion page says are done into ``_finished``; their
        waits' replies are dropped when they come (called with the lock held)."""
        page = self._page
        if page is None:
            return
        for wait_id, done in page.finished():
            self._paged[wait_id] = self._watches.pop(wait_id)
            self._finished.append(done)

    def _track(self, wait_id: int, request_id: str) -> None:
        """Have :meth:`_from_page` look at the watched request's slot (once its ``Registered``
        reply named it)."""
        if self._page is not None:
            self._page.track(request_id, wait_id)

    def _unwatch(self, wait_id: int, request_id: str) -> None:
        """The watch's reply was its outcome: the page need not be looked at for it any more."""
        if self._page is not None:
            self._page.untrack(wait_id)
            self._page.forget(request_id)

    def _read_available(self) -> None:
        """Move every frame the socket holds now into ``_ready``, without blocking; the end of
        the connection is noted in ``_lost`` (raised once what came before it was returned:
        before, the completions read together with the close were lost with it)."""
        # a socket with a timeout polls for it before recvmsg, whatever the flags: none here
        blocking = self._timeout is not None
        if blocking:
            self._sock.settimeout(0.0)
        try:
            while True:
                try:
                    data, anc, _flags, _addr = self._sock.recvmsg(65536, ANCILLARY_SIZE, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return
                except OSError as exc:
                    self._lost = connection_lost(f"connection to the daemon broke: {exc}", closed=self._closed)
                    return
                for fd in fds_from_ancillary(anc):  # no reply to a watch carries fds
                    os.close(fd)
                if not data:
                    self._lost = connection_lost("the daemon closed the connection")
                    return
                for payload in self._frames.feed(data):
                    self._ready.append((decode_reply(payload), []))
        finally:
            if blocking:
                self._sock.settimeout(self._timeout)

    def _send_watched(self, registration: m.Expect | m.Publish | None, request_id: str) -> None:
        wait = m.Wait(id=self._id(), request_id=request_id)
        data = encode(wait) if registration is None else encode_request(registration) + encode(wait)
        with self._lock:
            self._send(data)
            self._watches[wait.id] = request_id
            if registration is not None:
                self._registrations[registration.id] = (wait.id, registration.peer)
            else:  # registered by an earlier call: its slot is noted already, if it has one
                self._track(wait.id, request_id)

    def _route(self, reply: m.Message) -> bool:
        """Take a reply to a watch or to a registration sent with one; False if it is neither."""
        if reply.id in self._cancels:
            self._cancels.discard(reply.id)
            return True
        registration = self._registrations.pop(reply.id, None)
        if registration is not None:  # the daemon answers a registration before reading its wait
            wait_id, peer = registration
            if isinstance(reply, m.Error):  # refused: that is the outcome; the wait's NotFound is dropped
                self._finished.append(m.Completion(request_id=self._watches[wait_id], ok=False,
                                                   error_code=reply.code, error_message=reply.message))
                self._watches[wait_id] = ""
            elif isinstance(reply, m.Registered) and self._page is not None:
                self._page.note(reply, peer)
                self._track(wait_id, reply.request_id)
            return True
        paged = self._paged.get(reply.id)
        if paged is not None:  # returned from the completion page already: the reply is dropped
            if isinstance(reply, m.Error) and reply.code in _WAIT_AGAIN:
                self._again.append(reply.id)  # not answered: the daemon has not collected it yet
            else:
                del self._paged[reply.id]
            return True
        request_id = self._watches.get(reply.id)
        if request_id is None:
            return False
        if not request_id:  # the refused registration's wait
            del self._watches[reply.id]
        elif isinstance(reply, m.Completion):
            del self._watches[reply.id]
            self._unwatch(reply.id, request_id)
            self._finished.append(reply)
        elif isinstance(reply, m.Error) and reply.code in _WAIT_AGAIN:
            self._again.append(reply.id)
        else:
            del self._watches[reply.id]
            self._unwatch(reply.id, request_id)
            code, text = (reply.code, reply.message) if isinstance(reply, m.Error) else (
                "protocol", f"expected Completion, daemon sent {type(reply).__name__}")
            self._finished.append(m.Completion(request_id=request_id, ok=False, error_code=code,
                                               error_message=text))
        return True
