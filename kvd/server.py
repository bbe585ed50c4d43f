"""``serve()``: the daemon's root nursery.

One nursery holds every actor: the signal watcher, the systemd watchdog, the Unix listener
with its session actors, the transfer engine (peer links, NIXL progress poller) and the
optional metrics endpoint. Startup is reported with ``task_status.started(daemon)`` (and
``READY=1`` to systemd) only after every actor said it is up; nothing waits with a sleep.
Shutdown (SIGTERM/SIGINT or a client's ``Drain``): ``STOPPING=1``, stop accepting, let
in-flight transfers finish up to ``drain_timeout_s``, cancel the rest, release everything,
unlink the socket if it is still ours.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from functools import partial

import structlog
import trio

from kvd.config import Config
from kvd.daemon import Daemon, check_limits
from kvd.executor.listener import open_unix_listener
from kvd.executor.peercred import AccessPolicy
from kvd.executor.session import handle_connection
from kvd.ops.metrics import Metrics, serve_metrics
from kvd.ops.notify import Notifier, run_watchdog

log = structlog.get_logger("kvd.server")


async def _watch_signals(daemon: Daemon) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            daemon.request_stop(f"signal {signal.Signals(signum).name}")


#: How often the sampled gauges (bounce chunks in use) are refreshed for /metrics.
GAUGE_SAMPLE_S = 0.5


async def _sample_gauges(daemon: Daemon) -> None:
    """Refresh the gauges no actor updates on change (bounce chunks in use)."""
    while True:
        engine = daemon.engine
        daemon.metrics.set_bounce_in_use(engine.bounce_chunks_in_use() if engine is not None else 0)
        await trio.sleep(GAUGE_SAMPLE_S)


async def serve(
    config: Config,
    *,
    env: Mapping[str, str] | None = None,
    handle_signals: bool = True,
    task_status: trio.TaskStatus[Daemon] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the daemon until it is asked to stop."""
    from kvd.pool import create_pools
    from kvd.transfer.engine import Engine

    env = os.environ if env is None else env
    check_limits(config.limits)
    notifier = Notifier(env)
    notifier.status("starting: creating pools")
    pools = await trio.to_thread.run_sync(partial(create_pools, config.pools, env))
    metrics = Metrics()
    daemon = Daemon(config, pools, AccessPolicy.from_config(config.access), metrics)
    listener = None
    try:
        listener = await open_unix_listener(config.socket_path, config.socket_mode)
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
            accept_scope = trio.CancelScope()

            async def accept_loop() -> None:
                with accept_scope:
                    await trio.serve_listeners(partial(handle_connection, daemon), [listener.listener])

            root.start_soon(accept_loop)
            pool_kinds = {name: p.kind for name, p in pools.items()}
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

            await daemon.stop_requested.wait()
            notifier.stopping()
            notifier.status("draining")
            accept_scope.cancel()  # no new sessions
            with trio.move_on_after(config.drain_timeout_s):
                await engine.drained()
            log.info("daemon.stopping", transfers_active=engine.active_count())
            root.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            if listener is not None:
                await listener.aclose()
            for pool in pools.values():
                pool.close()
            log.info("daemon.stopped")
