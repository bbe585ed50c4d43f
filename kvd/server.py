"""``serve()``: the daemon's root nursery.

One nursery holds every actor: the signal watcher, the systemd watchdog, the Unix listener
with its session actors, the transfer engine (peer links, NIXL progress poller) and the
optional metrics endpoint. Startup is reported with ``task_status.started(daemon)`` (and
``READY=1`` to systemd) only after every actor said it is up; nothing waits with a sleep.
What the configuration alone decides (the peer secret, the socket path) is checked before any
memory is allocated; every startup failure is a :class:`~kvd.startup.StartupError` naming
its setting. Shutdown (SIGTERM/SIGINT or an operator's ``Drain``): ``STOPPING=1``, refuse new
work (``Draining``) while sessions stay connected, let in-flight transfers finish up to
``drain_timeout_s`` (``STATUS=`` names what it waits for), cancel the rest, release
everything, unlink the socket if it is still ours.
"""

from __future__ import annotations

import gc
import os
import resource
import signal
import socket
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING

import structlog
import trio

from kvd.config import Config
from kvd.daemon import Daemon, check_config
from kvd.executor.listener import SocketInUse, UnixListener, open_unix_listener
from kvd.executor.peercred import AccessPolicy
from kvd.executor.session import handle_connection
from kvd.ops.accept import accept_loop
from kvd.ops.metrics import Metrics, serve_metrics
from kvd.ops.notify import Notifier, run_watchdog
from kvd.startup import EX_CONFIG, StartupError
from kvd.transfer.stopping import QuietSides, live_roles
from protocol import messages as m
from protocol.codec import encode
from protocol.errors import BadRequest, DaemonStopping, KvdError, LimitExceeded

if TYPE_CHECKING:
    from kvd.pool import Pool
    from kvd.transfer.engine import Engine

log = structlog.get_logger("kvd.server")


async def _watch_signals(daemon: Daemon) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            daemon.request_stop(f"signal {signal.Signals(signum).name}")


#: How often the sampled gauges (bounce chunks in use, peer agents kept) are refreshed for /metrics.
GAUGE_SAMPLE_S = 0.5


async def _sample_gauges(daemon: Daemon) -> None:
    """Refresh the gauges no actor updates on change (bounce chunks in use, peer agents kept)."""
    while True:
        engine = daemon.engine
        links = engine.links if engine is not None else None
        daemon.metrics.set_bounce_in_use(engine.bounce_chunks_in_use() if engine is not None else 0)
        daemon.metrics.set_agents_kept(len(links.kept_agents) if links is not None else 0)
        await trio.sleep(GAUGE_SAMPLE_S)


def _check_peer_secret(config: Config) -> None:
    """Refuse a missing, unsafe or short peer secret (and peers without one) at once."""
    from kvd.peer import load_secret

    if config.peer_secret_file:
        try:
            load_secret(config.peer_secret_file)
        except KvdError as exc:
            raise StartupError(f"peer_secret_file: {exc.message}", setting="peer_secret_file",
                               exit_code=EX_CONFIG) from None
    elif config.peers:
        raise StartupError(
            f"peer_secret_file: not set, but [[peers]] lists {', '.join(p.name for p in config.peers)}; "
            "peer links need the shared secret: set peer_secret_file, or remove [[peers]]",
            setting="peer_secret_file",
            exit_code=EX_CONFIG,
        )


#: Longest Unix socket path, in bytes (``sun_path`` is 108 bytes with its terminating NUL).
MAX_SOCKET_PATH = 107


async def _open_socket(config: Config) -> UnixListener:
    """Bind the executor socket first (connections wait in the backlog until ready)."""
    size = len(os.fsencode(config.socket_path))
    if size > MAX_SOCKET_PATH:  # bind() would say only "AF_UNIX path too long", with no errno
        raise StartupError(
            f"socket_path: {config.socket_path} is {size} bytes long, and a Unix socket path holds at most "
            f"{MAX_SOCKET_PATH}; choose a shorter socket_path (KVD_SOCKET)",
            setting="socket_path",
            exit_code=EX_CONFIG,
        )
    try:
        return await open_unix_listener(config.socket_path, config.socket_mode)
    except SocketInUse as exc:
        raise StartupError(
            f"socket_path: {exc.message}; stop that daemon first, or give this one another "
            "socket_path (KVD_SOCKET)",
            setting="socket_path",
        ) from None
    except (BadRequest, OSError) as exc:
        message = exc.message if isinstance(exc, BadRequest) else f"cannot listen on {config.socket_path}: {exc.strerror or exc}"
        raise StartupError(
            f"socket_path: {message}; choose a socket_path in an existing directory this user may write "
            "(KVD_SOCKET)",
            setting="socket_path",
            exit_code=EX_CONFIG,
        ) from None
#: How often the drain refreshes its ``STATUS=`` line (what it still waits for).
DRAIN_STATUS_S = 1.0
#: A request that waits for the peer daemon's answer fails in a drain once it waited this long
#: in the same state (the answer may be on its way); one nothing can complete fails at once.
DRAIN_QUIET_S = 1.0
#: After the drain's deadline: how long the transfers then failed get to confirm that their
#: writes stopped (the no-write-after-failure rule) before what is left is cancelled.
DRAIN_ABORT_GRACE_S = 5.0
#: After the transfers: how long pending Waits may take to deliver their completions.
DRAIN_REPLY_GRACE_S = 1.0
DRAIN_REPLY_POLL_S = 0.01


def _stopping(daemon: Daemon, why: str) -> DaemonStopping:
    return DaemonStopping(f"kvd on node {daemon.config.node!r} is stopping ({daemon.stop_reason or 'drain'}) {why}")


def _fail_waiting(daemon: Daemon, engine: Engine, quiet: QuietSides) -> None:
    """Requests whose other side never came cannot complete while we stop: fail them (now, or
    once the peer stayed silent for ``DRAIN_QUIET_S``), so their executors' waits get
    ``daemon_stopping`` instead of a closed connection later."""
    exc = _stopping(daemon, "and the request's other side never came, so it cannot complete; "
                            "register it again with a running daemon")
    failed = engine.stop_requests(exc, lambda key, machine: quiet.due(key, machine, trio.current_time()))
    if failed:
        log.info("daemon.drain_unmatched", requests=len(failed), request_ids=failed[:16])


async def _drain(daemon: Daemon, engine: Engine, notifier: Notifier) -> None:
    """Let in-flight transfers finish, up to ``drain_timeout_s``; say what we wait for.

    New work (Alloc, Expect, Publish) is already refused (``Draining``); sessions stay
    connected so executors can collect their completions, and ``kvctl`` can watch. Requests
    that wait for their other side fail at once (``daemon_stopping``: no executor may register
    any more); so do, at the deadline, the transfers still running. Every completion is sent
    before the sessions close.
    """
    timeout = daemon.config.drain_timeout_s
    deadline = trio.current_time() + timeout
    quiet = QuietSides(DRAIN_QUIET_S)
    _fail_waiting(daemon, engine, quiet)
    notifier.status(f"draining: {len(engine.inflight())} transfer(s) in flight, new work refused")
    with trio.move_on_at(deadline):
        while inflight := engine.inflight():
            left = max(0.0, deadline - trio.current_time())
            shown = ", ".join(inflight[:8]) + (", ..." if len(inflight) > 8 else "")
            notifier.status(f"draining: waiting for {len(inflight)} transfer(s) ({shown}), at most {left:.0f} s more")
            with trio.move_on_after(DRAIN_STATUS_S):
                await engine.wait_idle()
            _fail_waiting(daemon, engine, quiet)  # the quiet ones; a peer's offer that came meanwhile
    left_over = engine.inflight()
    if left_over:
        log.warning(
            "daemon.drain_timeout",
            drain_timeout_s=timeout,
            transfers_failing=len(left_over),
            request_ids=left_over[:16],
        )
        engine.stop_requests(_stopping(daemon, f"and drain_timeout_s={timeout:g} passed before the transfer finished"),
                             lambda _key, machine: live_roles(machine))
        with trio.move_on_after(DRAIN_ABORT_GRACE_S):
            await engine.wait_idle()
        left_over = engine.inflight()
    # Executors blocked in Wait get their completions before the sessions close, and peers the
    # last messages queued for them before the links close (a gen side whose data is out hears
    # so: cancelled with a data-done taken but unwritten, its link's writer would drop it, and
    # the gen side, its link lost, could not tell whether a write was still on its way). Every
    # side here has reported by now; bounded all the same: a slow reader does not hold the stop.
    with trio.move_on_after(DRAIN_REPLY_GRACE_S):
        while any(s.inflight for s in daemon.sessions.values()):
            await trio.sleep(DRAIN_REPLY_POLL_S)
        await engine.flush_links()
    notifier.status(f"stopping: {len(left_over)} transfer(s) cancelled" if left_over else "stopping: drained")
    log.info("daemon.stopping", transfers_active=len(left_over))


def _tell_fd_limit(sock: socket.socket) -> None:
    """A connection shed at the fd limit: tell the client why (best effort, never blocks)."""
    err = LimitExceeded("kvd is at its file-descriptor limit; try again later")
    sock.send(encode(m.Error(code=err.code, message=err.message)), socket.MSG_DONTWAIT)


def _raise_fd_limit(config: Config) -> None:
    """Raise the soft RLIMIT_NOFILE toward the hard limit so the configured limits fit."""
    lim = config.limits
    need = lim.max_sessions + lim.max_pending_connections + lim.max_pending_peers + 2 * lim.operator_reserve
    need += FD_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning(
            "daemon.fd_limit_low",
            nofile=soft,
            needed=need,
            reason="the [limits] need more descriptors than RLIMIT_NOFILE allows; raise LimitNOFILE",
        )


#: Descriptors besides connections: pools, NIXL/UCX, peers, logs, the spare of the accept loop.
FD_HEADROOM = 256


async def serve(
    config: Config,
    *,
    env: Mapping[str, str] | None = None,
    handle_signals: bool = True,
    task_status: trio.TaskStatus[Daemon] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the daemon until it is asked to stop."""
    from kvd.pool import PoolSettingError, create_pools
    from kvd.transfer.engine import Engine

    env = os.environ if env is None else env
    check_config(config)
    # What the configuration alone decides fails now, before any memory is allocated.
    _check_peer_secret(config)
    _raise_fd_limit(config)
    notifier = Notifier(env)
    listener = await _open_socket(config)
    pools: dict[str, Pool] = {}
    ready = stopped = False
    try:
        notifier.status("starting: creating pools")
        try:
            pools = await trio.to_thread.run_sync(partial(create_pools, config.pools, env))
        except PoolSettingError as exc:  # exit 78: systemd must not restart into the same refusal
            raise StartupError(exc.message, setting=exc.setting, exit_code=EX_CONFIG) from None
        metrics = Metrics()
        daemon = Daemon(config, pools, AccessPolicy.from_config(config.access), metrics)
        async with trio.open_nursery() as root:
            if handle_signals:
                root.start_soon(_watch_signals, daemon)
            await root.start(run_watchdog, notifier)
            if config.metrics_port:
                await root.start(serve_metrics, metrics, config.metrics_host, config.metrics_port)
            engine = Engine(daemon)
            daemon.engine = engine
            await root.start(engine.run)
            daemon.update_pool_metrics()  # the gauges start at the pools' real size
            if config.metrics_port:
                root.start_soon(_sample_gauges, daemon)
            # Sessions run in the root nursery, not under the accept loop: a drain keeps serving
            # them (executors wait for their transfers) while no new work is taken.
            root.start_soon(
                partial(
                    accept_loop,
                    listener.listener,
                    partial(handle_connection, daemon),
                    root,
                    what="executor",
                    on_overflow=_tell_fd_limit,
                )
            )
            pool_kinds = {name: p.kind for name, p in pools.items()}
            if not pools:
                # legal (a daemon that only relays, or a configuration still being written) but
                # almost always a mistake: every Alloc, Expect and Publish will be refused
                log.warning("daemon.no_pools", reason="the configuration has no [[pools]]: executors can "
                            "allocate no blocks and register no requests; add a [[pools]] table")
            # Everything made so far (torch, NIXL, the pools) lives as long as the daemon: keep
            # it out of the collector's generations, so no collection walks it again (with torch
            # loaded a full collection walked ~1e6 objects in the middle of a transfer).
            gc.freeze()
            log.info(
                "daemon.ready",
                node=config.node,
                socket=config.socket_path,
                pools=pool_kinds,
                peer_port=engine.peer_port,
                version=daemon.version,
            )
            notifier.ready(f"serving {len(pools)} pool(s) on {config.socket_path}; peer port {engine.peer_port}")
            task_status.started(daemon)
            ready = True

            await daemon.stop_requested.wait()
            notifier.stopping()
            await _drain(daemon, engine, notifier)
            root.cancel_scope.cancel()
        stopped = True
    finally:
        with trio.CancelScope(shield=True):
            await listener.aclose()
            for pool in pools.values():
                pool.close()
            # only a daemon that was ready and stopped cleanly says so: a failed start (or a
            # failure while running) ends with its daemon.startup_failed (daemon.failed) line,
            # which the caller logs after this cleanup; "stopped" before it would read as the cause
            if ready and stopped:
                log.info("daemon.stopped")
