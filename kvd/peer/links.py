"""Peer links: the authenticated TCP connections to other kvd daemons, one per peer node.

The daemon listens on ``peer_host:peer_port`` and connects to every ``[[peers]]`` entry,
reconnecting with backoff whenever a link drops (a restarted peer is picked up again). The
handshake (:mod:`kvd.peer`) exchanges NIXL metadata and the receive region; after it the
link carries the transfer-control messages of :mod:`protocol.transfer` and heartbeats.
A peer without the shared secret is refused (``peer.auth_failed``) and never gets a link.

Two daemons may list each other: the pair settles on one link, the one dialled by the node
whose name sorts first. When both links are up, both daemons keep that one and close the other
(``peer.duplicate_link``); the node that sorts last does not dial while a link the other one
dialled is up, and dials again once it drops. A link from another instance of the peer (it
restarted) always replaces the old one (``peer.replaced``).
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import structlog
import trio

from kvd.ops.accept import accept_loop
from kvd.ops.throttle import Throttle
from kvd.peer import (
    HandshakeTimeout,
    NodeNameMismatch,
    OwnNodeName,
    PeerVersionMismatch,
    accept_peer,
    connect_with_backoff,
    load_secret,
    open_peer,
    run_heartbeats,
)
from kvd.peer.attach import PeerWords, attach_peer_pools, attach_peer_words, retire_peer_words
from kvd.peer.kept_agents import CONNECTION_FAILED, Forget, KeptAgents
from kvd.peer.retry import Backoff
from kvd.startup import bind_failed
from protocol import transfer as x
from protocol.errors import AuthFailed, BadRequest, KvdError, PeerUnavailable, VersionMismatch
from protocol.limits import clip_text
from protocol.peer import PeerWelcome, PoolDesc, RegionDesc, register_peer_messages

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping

    from kvd.config import Config
    from kvd.mapping.attach import MappedPool
    from kvd.peer import PeerConnection
    from kvd.pool import Pool
    from kvd.transport.setup import Transport

log = structlog.get_logger("kvd.peer")

register_peer_messages(*x.XFER_MESSAGES)

#: Why a link was closed as the second link between one pair (the other one is kept).
DUPLICATE_LINK = "a duplicate link: both daemons dialled, the one the node first in name order dialled is kept"

#: Failures on the peer port that anyone who can reach it can cause: rate-limited lines.
_throttle = Throttle(log)


def _remote(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
    except (OSError, ValueError):
        return ""
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def host_identity() -> str:
    """Boot id + hostname: two daemons that report the same value share a node (and memory)."""
    import socket as _socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{boot}/{_socket.gethostname()}"


class PeerLink:
    """One live, authenticated link and what the peer told us in its welcome."""

    def __init__(self, node: str, conn: PeerConnection, welcome: PeerWelcome, agent: str, dialled_by: str) -> None:
        self.node = node
        self.conn = conn
        #: the node that connected this link (this daemon, or the peer)
        self.dialled_by = dialled_by
        #: the peer's instance: its NIXL agent name, new at every start of that daemon
        self.instance = welcome.nixl_agent
        #: why we closed it for another link to the same peer ("" while it is not)
        self.superseded = ""
        self.agent = agent  # the peer's NIXL agent name, as loaded into ours
        if not welcome.bounce:
            raise BadRequest(f"peer {node} offered no receive region")
        region = welcome.bounce[0]
        self.bounce = x.RemoteRegion(addr=region.addr, nbytes=region.nbytes, device=region.device)
        self.slot_bytes = region.slot_bytes
        self.slots = region.slots
        self.closed = trio.Event()
        #: The peer's pools mapped into this process (same node only), by pool name.
        self.mapped: dict[str, MappedPool] = {}
        #: The peer's completion page mapped here for our GPU (same node, GPU pools), or None.
        self.words: PeerWords | None = None

    @property
    def takes_nowait(self) -> bool:
        """Whether :meth:`send_nowait` takes a message now (False just after the link came up,
        before its writer runs, and once it ended)."""
        return self.conn.takes_nowait

    def send_nowait(self, msg: x.XferMessage) -> bool:
        """Queue a transfer-control message for the link's writer (no waiting, in order with
        :meth:`send`); False when it cannot be queued now (use :meth:`send`)."""
        return self.conn.send_nowait(msg)

    def send_soon(self, msg: x.XferMessage) -> bool:
        """Queue a message the peer needs soon, not at once: the writer writes it after this
        step (:meth:`PeerConnection.send_soon`); False as :meth:`send_nowait`."""
        return self.conn.send_soon(msg)

    def cork(self) -> None:
        """Hold the messages :meth:`send_nowait` takes until :meth:`uncork` (same step), which
        writes them together (:meth:`PeerConnection.cork`)."""
        self.conn.cork()

    def uncork(self) -> None:
        """Write what :meth:`cork` held."""
        self.conn.uncork()

    async def send(self, msg: x.XferMessage) -> None:
        """Send a transfer-control message; a broken link raises ``PeerUnavailable``."""
        try:
            await self.conn.send(msg)
        except (KvdError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise PeerUnavailable(f"link to peer {self.node} is broken: {exc}") from None


@dataclass(frozen=True)
class LostLink:
    """A peer's link that went down and has not come back (for ``kvctl peers``)."""

    last_received: float  # trio clock of its last frame
    reason: str  # why it went down
    remote: str  # host:port it had
    incoming: bool  # the peer had dialled it


#: why a link whose NIXL connection failed is closed (it comes back with the agent loaded afresh)
NIXL_DISCONNECTED = "the NIXL connection to the peer failed (remote disconnect)"


class PeerLinks:
    """Owns every peer link of the daemon; delivers what arrives to the handlers it was given."""

    def __init__(
        self,
        config: Config,
        transport: Transport,
        pools: Mapping[str, Pool],
        version: str,
        *,
        deliver: Callable[[PeerLink, x.XferMessage], Awaitable[None]],
        link_up: Callable[[PeerLink], None],
        link_lost: Callable[[str, str], None],
    ) -> None:
        self.transport = transport
        self.config = config
        self.pools = pools
        self.version = version
        self._deliver = deliver
        self._link_up = link_up
        self._link_lost = link_lost
        self.links: dict[str, PeerLink] = {}
        #: every peer that ever linked since start (a known peer even while its link is down)
        self.seen: set[str] = set()
        #: failure notices a transfer could not send while the link was down, sent on the next one
        self.owed: dict[str, deque[x.XferMessage]] = {}
        self.secret: bytes | None = None
        self.last_error: dict[str, str] = {}  # peer -> why its last connect failed
        #: peer -> the error code of that failure (e.g. ``auth_failed``; absent: the TCP connect
        #: failed), which decides the advice of :meth:`down_hint`
        self.last_code: dict[str, str] = {}
        #: peer -> that failure itself, when its advice needs more than the code (the versions of
        #: a version mismatch, the names of a node-name mismatch)
        self.last_failure: dict[str, KvdError] = {}
        #: peers whose link went down and has not come back: what ``kvctl peers`` shows for them
        #: (a lost incoming link would otherwise vanish from the list, an outgoing one say
        #: "last heard: never"); only peers that authenticated get here, so it stays small
        self.lost: dict[str, LostLink] = {}
        self.attempts: dict[str, int] = {}  # peer -> failed connection attempts since its link was up
        self.pending = 0  # accepted peer-port connections not yet authenticated
        self._changed = trio.Event()  # set (and replaced) whenever a link comes up
        #: per peer: decide, load its agent and register one link at a time (see :meth:`_serve`)
        self._settling: dict[str, trio.Lock] = {}
        #: per peer: the cancel scope of our dialler's TCP connect or backoff sleep, cancelled
        #: when a link the peer dialled comes up (we stop dialling while it is up)
        self._dialing: dict[str, trio.CancelScope] = {}
        #: peers' NIXL agents left loaded while their link is down (see kvd.peer.kept_agents)
        self.kept_agents = KeptAgents()

    def get(self, node: str) -> PeerLink:
        link = self.links.get(node)
        if link is None:
            known = sorted(self.links)
            raise PeerUnavailable(f"no link to peer {node!r} (connected peers: {known or 'none'})")
        return link

    async def wait_for(self, node: str) -> PeerLink:
        """The link to ``node``, waiting for it to come up (the caller's deadline applies)."""
        while node not in self.links:
            if self.secret is None:
                raise PeerUnavailable(f"no link to peer {node!r}: peer links are disabled (no peer_secret_file)")
            await self._changed.wait()
        return self.links[node]

    def node_of_agent(self, agent: str) -> str:
        """The node whose NIXL agent is ``agent`` ("" if none is linked)."""
        for node, link in self.links.items():
            if link.agent == agent:
                return node
        return ""

    def owe(self, node: str, msg: x.XferMessage) -> None:
        """Send ``msg`` as soon as a link to ``node`` is up again. At most
        ``max_ended_requests`` notices wait per peer (each is an ended request's): beyond, the
        oldest is dropped and logged, so a peer down for long cannot grow the daemon."""
        owed = self.owed.get(node)
        if owed is None:
            owed = self.owed[node] = deque()
        owed.append(msg)
        limit = self.config.limits.max_ended_requests
        if len(owed) > limit:
            old = owed.popleft()
            log.warning("peer.owed_dropped", node=node, request_id=old.request_id, type=type(old).__name__,
                        limit=limit)

    def describe_missing(self, node: str) -> str:
        """Why there is no link to ``node`` (for error messages)."""
        why = self.last_error.get(node)
        return f"no link to peer {node!r}" + (f" (last attempt: {why})" if why else " (it never connected)")

    def down_hint(self, node: str) -> str:
        """What an operator does about a link to ``node`` that is down (for error messages): it
        depends on why the last attempt failed. A peer that refused the handshake (or that we
        refused) runs, at the configured address: the two daemons read different secrets, run
        incompatible kvd versions, or the daemon there has another node name than the entry's,
        or this daemon's own. One that accepted but never completed the handshake is not a kvd
        peer port, or a stalled daemon."""
        failure = self.last_failure.get(node)
        if isinstance(failure, PeerVersionMismatch):
            theirs = (f"the peer speaks peer protocol {failure.theirs}" if failure.theirs is not None else
                      "the peer refused that protocol (its refusal above, or its log, says which one it speaks)")
            return (f"both daemons must run compatible kvd versions: this daemon runs kvd {self.version} (peer "
                    f"protocol {failure.ours}), {theirs}; install the same kvd release on both nodes and restart "
                    "the daemon that changed")
        if isinstance(failure, NodeNameMismatch):
            return (f"the daemon at that address announced the node name {failure.found!r}, but this daemon's "
                    f"[[peers]] entry expects {failure.expected!r}: if it is the peer meant, rename the entry to "
                    f"{failure.found!r} (and name that peer in requests) or set that daemon's node to "
                    f"{failure.expected!r}; otherwise fix the entry's host/port")
        address = next((f"{p.host}:{p.port}" for p in self.config.peers if p.name == node), "")
        if isinstance(failure, OwnNodeName):
            return (f"the daemon at {address or 'the peer address'} announced this daemon's own node name "
                    f"{failure.node!r}: every daemon needs a node name of its own (two configurations copied from "
                    "one?): set node (KVD_NODE) in one of them and restart that daemon")
        if isinstance(failure, HandshakeTimeout):
            return (f"something at {address or 'the peer address'} accepted the connection but did not complete "
                    f"the peer handshake within {failure.timeout_s:g} s: check that this is the peer daemon's "
                    "peer_port (not another service's) and that the daemon there is not stalled (kvctl status on "
                    "that node)")
        if self.last_code.get(node) == AuthFailed.code:
            return ("both daemons must read the same secret: the file each one's peer_secret_file names must "
                    f"hold identical bytes on both nodes (this daemon reads {self.config.peer_secret_file}); "
                    "copy one node's file to the other (mode 600, owned by the daemon's user) and restart the "
                    "daemon whose file changed: a daemon reads its secret when it starts")
        for peer in self.config.peers:
            if peer.name == node:
                return (f"start the peer daemon, or check its [[peers]] host/port ({peer.host}:{peer.port}) "
                        "in this daemon's configuration")
        return ("start the peer daemon (it dials this one: check the [[peers]] entry naming this daemon in its "
                "configuration)")

    def welcome(self) -> PeerWelcome:
        t = self.transport
        st = t.staging
        assert st is not None, "peer links start after the staging exists"
        return PeerWelcome(
            node=self.config.node,
            software=f"kvd {self.version}",
            nixl_agent=t.agent.name,
            nixl_metadata=t.agent.metadata(),
            bounce=[
                RegionDesc(name="recv", addr=st.recv.addr, nbytes=st.recv.nbytes, device=st.recv.device,
                           slot_bytes=st.recv.slot_bytes, slots=st.recv.slot_count)
            ],
            pools=[
                PoolDesc(name=name, addr=p.ptr, nbytes=p.nbytes, device=p.device, kind=p.kind,
                         block_bytes=p.block_bytes, num_blocks=p.layout.num_blocks, layout=p.layout, rank=p.rank)
                for name, p in self.pools.items()
            ],
            host_id=host_identity(),
            socket_path=self.config.socket_path,
        )

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen for peers, connect to the configured ones; ``started(port)``."""
        cfg = self.config
        if cfg.peer_secret_file:
            self.secret = load_secret(cfg.peer_secret_file)
        elif cfg.peers:
            raise BadRequest("peers are configured but peer_secret_file is not: peer links need the shared secret")
        if self.secret is None:
            log.info("peer.disabled", reason="no peer_secret_file: this daemon only serves local transfers")
            task_status.started(0)
            return
        # the bounce staging exists only on daemons with peers (allocated and registered once)
        await trio.to_thread.run_sync(self.transport.ensure_staging)
        try:
            listeners = await trio.open_tcp_listeners(cfg.peer_port, host=cfg.peer_host)
        except OSError as exc:
            raise bind_failed(
                exc, what="peer-link", host=cfg.peer_host, port=cfg.peer_port, setting="peer_port", env="KVD_PEER_PORT"
            ) from None
        port = int(listeners[0].socket.getsockname()[1])
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(partial(accept_loop, listener, self._accept, nursery, what="peer"))
            for peer in cfg.peers:
                nursery.start_soon(self._connect_forever, peer.name, peer.host, peer.port)
            log.info("peer.listening", host=cfg.peer_host, port=port)
            task_status.started(port)

    async def _accept(self, stream: trio.SocketStream) -> None:
        """Authenticate one connection on the peer port, then serve it as a link.

        Nothing a connecting party sends may take the daemon down: every failure before the
        link is up is one (rate-limited) warning line and a closed connection. Connections not
        yet authenticated are bounded by ``[limits] max_pending_peers`` and must authenticate
        within ``handshake_timeout_s``.
        """
        assert self.secret is not None
        limits = self.config.limits
        remote = _remote(stream)
        if self.pending >= limits.max_pending_peers:
            _throttle.warning("peer.pending_limit", remote=remote, max_pending_peers=limits.max_pending_peers)
            await trio.aclose_forcefully(stream)
            return
        self.pending += 1
        try:
            conn = await accept_peer(stream, node=self.config.node, secret=self.secret, welcome=self.welcome,
                                     handshake_timeout=limits.handshake_timeout_s,
                                     max_frame_size=limits.max_frame_size, warn=_throttle.warning)
        except (AuthFailed, VersionMismatch):
            return  # logged (rate-limited) by the handshake: peer.auth_failed, peer.version_mismatch; closed
        except KvdError as exc:
            _throttle.warning("peer.handshake_failed", remote=remote, reason=clip_text(exc.message))
            return  # the stream is closed
        except Exception as exc:  # a bug in the handshake: this connection ends, the daemon does not
            log.exception("peer.handshake_crashed", remote=remote, error=clip_text(f"{type(exc).__name__}: {exc}"))
            return
        finally:
            self.pending -= 1
        await self._serve(conn, dialled_by=conn.remote_node)

    async def _connect_forever(self, node: str, host: str, port: int) -> None:
        """Keep a link to ``node`` up: connect with backoff, serve, reconnect when it drops.

        A peer that refuses us (wrong secret, another version, another node at that address)
        is retried after ``[transfer] reconnect_initial_s``, doubling up to ``reconnect_max_s``
        (reset once a link came up); each distinct failure is logged at once, its repeats at
        most once per 10 s with ``suppressed=N`` (a rate limiter per peer and reason).
        When ``node`` lists us too and its name sorts before ours, we do not dial while a link
        it dialled is up (that link is the one the pair keeps): a pending connect or backoff
        wait is cancelled when such a link comes up, and dialling starts again once it drops.
        """
        assert self.secret is not None
        t = self.config.transfer
        backoff = Backoff(t.reconnect_initial_s, t.reconnect_max_s)
        failures = Throttle(log)

        def warn(event: str, **fields: object) -> None:
            reason = fields.get("reason") or fields.get("error") or ""
            failures.warning(event, throttle_key=f"{event}|{reason}", **fields)

        def tcp_failed(reason: str) -> None:  # the TCP connect itself (retried inside, 2 s at most)
            self.last_error[node] = reason
            self.last_code.pop(node, None)
            self.last_failure.pop(node, None)
            self.attempts[node] = self.attempts.get(node, 0) + 1

        while True:
            if await self._wait_while_peer_dialled(node):
                backoff.reset()
                self.attempts.pop(node, None)
                await trio.sleep(0.1)  # the same pause as after our own link dropped
                continue
            stream: trio.SocketStream | None = None
            with trio.CancelScope() as dialing:
                self._dialing[node] = dialing
                stream = await connect_with_backoff(host, port, maximum=2.0, on_retry=tcp_failed)
            self._dialing.pop(node, None)
            if stream is None:
                continue  # a link the peer dialled came up meanwhile
            try:
                conn = await open_peer(stream, node=self.config.node, secret=self.secret, welcome=self.welcome(),
                                       expect_node=node, max_frame_size=self.config.limits.max_frame_size,
                                       handshake_timeout=self.config.limits.handshake_timeout_s, warn=warn)
            except KvdError as exc:
                self.last_error[node] = str(exc)
                self.last_code[node] = exc.code
                self.last_failure[node] = exc
                self.attempts[node] = self.attempts.get(node, 0) + 1
                delay = backoff.failed()
                failures.warning("peer.connect_failed", throttle_key=f"peer.connect_failed|{exc}", node=node,
                                 host=host, port=port, error=str(exc), attempt=self.attempts[node],
                                 retry_in_s=round(delay, 3))
                with trio.CancelScope() as dialing:
                    self._dialing[node] = dialing
                    await trio.sleep(delay)
                self._dialing.pop(node, None)
                continue
            backoff.reset()
            self.attempts.pop(node, None)
            await self._serve(conn, dialled_by=self.config.node)
            await trio.sleep(0.1)

    async def flush(self) -> None:
        """Write out what every link has queued (see :meth:`PeerConnection.flush`): a stopping
        daemon's last transfer messages (a data-done, a failure) reach its peers."""
        for link in list(self.links.values()):
            with contextlib.suppress(KvdError):  # a link that broke meanwhile has no one to tell
                await link.conn.flush()

    def _yields_to(self, node: str) -> bool:
        """Whether a link ``node`` dialled is the one kept over ours (its name sorts first)."""
        return node < self.config.node

    async def _wait_while_peer_dialled(self, node: str) -> bool:
        """Wait while the kept link, ``node`` dialled, is up; whether there was one."""
        link = self.links.get(node)
        if link is None or link.dialled_by != node or not self._yields_to(node):
            return False
        await link.closed.wait()
        return True

    def _keeps_new(self, old: PeerLink, dialled_by: str, instance: str) -> bool:
        """Whether a new link (``dialled_by``, to the peer instance whose NIXL agent is
        ``instance``) replaces ``old``, logging why. Both daemons of a pair decide alike."""
        node = old.node
        if old.instance != instance:  # the peer restarted (or reconnected) before we noticed
            log.info("peer.replaced", node=node, reason="a new instance of the peer")
            return True
        if old.dialled_by == dialled_by:  # the dialler gave up the old one (e.g. a half-open link)
            log.info("peer.replaced", node=node, reason=f"{dialled_by} dialled again")
            return True
        # both dialled: keep the link dialled by the node whose name sorts first
        keep = node if self._yields_to(node) else self.config.node
        log.info("peer.duplicate_link", node=node, kept=f"dialled by {keep}",
                 closed=f"dialled by {old.dialled_by if dialled_by == keep else dialled_by}")
        return dialled_by == keep

    async def _serve(self, conn: PeerConnection, *, dialled_by: str) -> None:
        node = conn.remote_node
        welcome = conn.welcome
        assert welcome is not None
        nixl = self.transport.agent
        # one link per peer at a time from the decision to its registration: two links to one
        # peer instance load the same NIXL agent name, so the loser must be gone (its agent
        # kept, see KeptAgents) before the winner loads it again
        async with self._settling.setdefault(node, trio.Lock()):
            old = self.links.get(node)
            if old is not None:
                if not self._keeps_new(old, dialled_by, welcome.nixl_agent):
                    await conn.aclose(DUPLICATE_LINK)
                    return
                duplicate = old.instance == welcome.nixl_agent and old.dialled_by != dialled_by
                old.superseded = DUPLICATE_LINK if duplicate else "replaced by a new link"
                await old.conn.aclose(old.superseded)
                await old.closed.wait()
            kept = self.kept_agents.agent_of(node) == welcome.nixl_agent
            try:
                agent, mended = await trio.to_thread.run_sync(self._load_agent, welcome.nixl_metadata, kept)
                if agent != welcome.nixl_agent:
                    self._unload_stray(agent)
                    raise BadRequest(f"peer {node!r} named NIXL agent {welcome.nixl_agent!r} in its welcome, but its "
                                     f"metadata is agent {agent!r}: its link and its notifications would not match")
                link = PeerLink(node, conn, welcome, agent, dialled_by)
            except KvdError as exc:  # whatever was kept for the node stays kept, as it was
                log.warning("peer.rejected", node=node, error=str(exc))
                await conn.aclose(str(exc))
                return
            # only now that the link is good: an older instance's kept agent goes
            self._forget(self.kept_agents.link_up(node, agent))
            if mended:
                log.info("peer.agent_forgotten", node=node, nixl_agent=agent, reason=CONNECTION_FAILED)
            kept = kept and not mended
            if (self.config.transfer.mapped and welcome.host_id == host_identity() and welcome.socket_path
                    and welcome.pools):
                try:
                    link.mapped = await trio.to_thread.run_sync(
                        attach_peer_pools, welcome.socket_path, [p.name for p in welcome.pools], self.config.node
                    )
                    log.info("peer.pools_mapped", node=node, pools=sorted(link.mapped))
                except KvdError as exc:  # e.g. another mount namespace: fall back to NIXL, say so
                    log.warning("peer.pools_not_mapped", node=node, error=str(exc))
                await self._attach_words(link, welcome.socket_path)
            self.links[node] = link
        self.seen.add(node)
        self.last_error.pop(node, None)
        self.last_code.pop(node, None)
        self.last_failure.pop(node, None)
        self.lost.pop(node, None)
        self._changed.set()
        self._changed = trio.Event()
        log.info("peer.connected", node=node, remote=conn.remote_addr, nixl_agent=agent, dialled_by=dialled_by,
                 nixl_agent_kept=kept)
        if dialled_by == node and self._yields_to(node):  # the kept link: we stop dialling
            dialing = self._dialing.get(node)
            if dialing is not None:
                dialing.cancel()
        self._link_up(link)
        owed = self.owed.pop(node, deque())
        reasons: list[str] = []
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._heartbeats, conn, reasons)
                nursery.start_soon(self._watch_nixl, conn, agent, reasons)
                nursery.start_soon(conn.run_writer)
                try:
                    for notice in owed:
                        await link.send(notice)
                    while True:
                        msg = await conn.receive()
                        if isinstance(msg, x.XferMessage):
                            await self._deliver(link, msg)
                        else:
                            log.debug("peer.ignored_message", node=node, type=type(msg).__name__)
                except (KvdError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    if conn.write_error:  # the writer failed and closed the stream under us
                        reasons.append(f"write failed: {conn.write_error}")
                    reasons.append(exc.message if isinstance(exc, KvdError) else str(exc) or type(exc).__name__)
                except Exception as exc:  # a bug handling a peer message: the link ends, the daemon does not
                    log.exception("peer.link_crashed", node=node)
                    reasons.append(f"internal error: {type(exc).__name__}")
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                reason = link.superseded or (reasons[0] if reasons else "daemon shutting down")
                if self.links.get(node) is link:
                    del self.links[node]
                    self.lost[node] = LostLink(last_received=conn.last_received, reason=clip_text(reason),
                                               remote=conn.remote_addr,
                                               incoming=link.dialled_by == node)
                # a duplicate closed by either side is the pair settling, not a fault
                level = log.info if DUPLICATE_LINK in reason else log.warning
                level("peer.disconnected", node=node, reason=clip_text(reason))
                self._link_lost(node, reason)
                # the peer may live on and link again: keep its agent loaded (forgetting and
                # reloading a live agent leaks a UCX connection), release what was prepared for
                # it; unless an operation with it failed: a broken UCX endpoint mends only when
                # the agent is forgotten, so the next link loads it afresh
                if nixl.failed_with(agent):
                    self._forget([Forget(node, agent, CONNECTION_FAILED)])
                else:
                    with contextlib.suppress(KvdError):
                        nixl.release_prepared(agent)
                    self._forget(self.kept_agents.link_down(node, agent))
                await conn.aclose()
                for pool in link.mapped.values():
                    pool.close()
                if link.words is not None:
                    retire_peer_words(link.words)
                link.closed.set()

    async def _attach_words(self, link: PeerLink, socket_path: str) -> None:
        """The peer's completion page, when its pools are mapped here on a GPU: our kernel
        stream then stores gen's completion tokens there (speed only: without it, gen's
        executors wait for their replies)."""
        devices = sorted({p.device for p in link.mapped.values() if p.device >= 0})
        if not devices:
            return
        try:
            link.words = await trio.to_thread.run_sync(attach_peer_words, socket_path, self.config.node, devices[0])
        except Exception as exc:  # an older kvd, a driver that will not register it: say so
            log.warning("peer.completion_page_not_mapped", node=link.node, error=str(exc),
                        fallback="gen executors wait for their replies")

    def _load_agent(self, metadata: bytes, kept: bool) -> tuple[str, bool]:
        """Load a linking peer's agent (in a worker thread); ``kept``: an agent of that name is
        still loaded from an earlier link. A kept agent whose UCX endpoint failed meanwhile (the
        network broke along with the link) is forgotten and loaded afresh: reloading metadata
        over it does not mend the endpoint. Returns the agent's name and whether it was mended."""
        nixl = self.transport.agent
        agent = nixl.add_remote(metadata)
        if not kept or (not nixl.failed_with(agent) and nixl.probe_remote(agent)):
            return agent, False
        nixl.remove_remote(agent)
        return nixl.add_remote(metadata), True

    def _agents_in_use(self) -> set[str]:
        """The NIXL agents of the live links."""
        return {link.agent for link in self.links.values()}

    def _unload_stray(self, agent: str) -> None:
        """Forget ``agent``, just loaded for a link that is refused, unless a live link or a
        kept one uses that name (loading it again changed nothing for them)."""
        if agent in self._agents_in_use() or agent in self.kept_agents.agents():
            return
        with contextlib.suppress(KvdError):
            self.transport.agent.remove_remote(agent)

    def _forget(self, forget: list[Forget]) -> None:
        """Forget the kept agents :class:`KeptAgents` gave up (their peers are gone)."""
        in_use = self._agents_in_use()
        for f in forget:
            if f.agent in in_use:  # the name is a live link's now (a peer reusing it): keep it loaded
                log.warning("peer.agent_forgotten", node=f.node, nixl_agent=f.agent, reason=f.reason,
                            error="not unloaded: a live link uses that agent name")
                continue
            try:
                self.transport.agent.remove_remote(f.agent)
            except KvdError as exc:  # NIXL refused: the agent may stay loaded, say so
                log.warning("peer.agent_forgotten", node=f.node, nixl_agent=f.agent, reason=f.reason,
                            error=str(exc))
            else:
                log.info("peer.agent_forgotten", node=f.node, nixl_agent=f.agent, reason=f.reason)

    async def _watch_nixl(self, conn: PeerConnection, agent: str, reasons: list[str]) -> None:
        """Close the link once NIXL found its connection to the peer's agent broken (the network
        broke UCX's connections while the link stayed up): every transfer with the peer would
        fail until the agent is loaded afresh, which the link's end and its return do."""
        nixl = self.transport.agent
        period = max(0.05, self.config.transfer.heartbeat_interval_s / 4)
        while not nixl.disconnected(agent):
            await trio.sleep(period)
        reasons.append(NIXL_DISCONNECTED)
        await conn.aclose(NIXL_DISCONNECTED)

    async def _heartbeats(self, conn: PeerConnection, reasons: list[str]) -> None:
        """Beat until the peer falls silent; then close the link (the receive loop ends)."""
        t = self.config.transfer
        try:
            await run_heartbeats(conn, t.heartbeat_interval_s, t.heartbeat_timeout_s)
        except (KvdError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            reasons.append(exc.message if isinstance(exc, KvdError) else str(exc))
            await conn.aclose("heartbeat timeout")
