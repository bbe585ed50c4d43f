"""Prometheus metrics of one daemon, and a tiny trio HTTP responder that serves them.

Each daemon owns a :class:`Metrics` with its **own** ``CollectorRegistry`` (never the process-wide
default), so several daemons in one process (tests, the demo) never collide and nothing leaks
between them. The actors update it through plain method calls (no I/O, no locks: everything
runs on the trio thread).

:func:`serve_metrics` answers ``GET /metrics`` with the text exposition format. It is a task
in the daemon's root nursery — not prometheus_client's thread server — with bounded request
size, a per-connection deadline and a cap on concurrent connections; one request per
connection (``Connection: close``), which every Prometheus scraper handles.
"""

from __future__ import annotations

from typing import NoReturn

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest as _generate_latest
from prometheus_client.process_collector import ProcessCollector

from kvd.ops.logs import get_logger
from kvd.startup import bind_failed

__all__ = [
    "CONTENT_TYPE_LATEST",
    "TRANSFER_SECONDS_BUCKETS",
    "Metrics",
    "serve_metrics",
]

_log = get_logger(__name__)

#: Histogram buckets for transfer durations: 1 ms .. 60 s (+Inf).
TRANSFER_SECONDS_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    float("inf"),
)


#: Label children kept per metric family: the labels of the per-request calls (role, path, pool
#: name) come from small fixed sets; past this many combinations a call looks its child up
#: again (prometheus_client's own lookup), so no input makes the cache grow without bound.
MAX_CACHED_CHILDREN = 64


class Metrics:
    """The daemon's metrics, in a dedicated registry (``self.registry``).

    ``process_metrics`` adds the standard ``process_*`` series (RSS, CPU, open fds) of this
    process to the registry.
    """

    def __init__(self, *, process_metrics: bool = True) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._transfers = Counter(
            "kvd_transfers_total",
            "Transfers completed, by role (ctx sends, gen receives) and path taken.",
            ["role", "path"],
            registry=r,
        )
        self._transfer_bytes = Counter(
            "kvd_transfer_bytes_total", "Bytes moved by completed transfers.", ["role"], registry=r
        )
        self._failures = Counter(
            "kvd_transfer_failures_total",
            "Transfers that failed, by kvd error code.",
            ["code"],
            registry=r,
        )
        self._fallbacks = Counter(
            "kvd_fallbacks_total",
            "Slow-path fallbacks taken (fabric memory unavailable, no bounce region, ...).",
            ["kind"],
            registry=r,
        )
        self._pool_used = Gauge("kvd_pool_blocks_used", "Blocks leased, per pool.", ["pool"], registry=r)
        self._pool_free = Gauge("kvd_pool_blocks_free", "Blocks free, per pool.", ["pool"], registry=r)
        self._sessions = Gauge("kvd_sessions", "Executor sessions connected.", registry=r)
        self._bounce = Gauge(
            "kvd_bounce_chunks_in_use", "Bounce-buffer chunks currently reserved.", registry=r
        )
        self._agents_kept = Gauge(
            "kvd_peer_agents_kept", "Peers' NIXL agents kept loaded while their link is down.", registry=r
        )
        self._seconds = Histogram(
            "kvd_transfer_seconds",
            "Duration of completed transfers, by role.",
            ["role"],
            buckets=TRANSFER_SECONDS_BUCKETS,
            registry=r,
        )
        if process_metrics:
            ProcessCollector(registry=r)
        # the children of the per-request calls, looked up once: ``labels()`` checks and
        # locks on every call (a few microseconds per transfer and pool update)
        self._done_children: dict[tuple[str, str], tuple[Counter, Counter, Histogram]] = {}
        self._pool_children: dict[str, tuple[Gauge, Gauge]] = {}

    def transfer_done(self, role: str, path: str, nbytes: int, seconds: float) -> None:
        """A transfer finished: count it, its bytes, and its duration."""
        children = self._done_children.get((role, path))
        if children is None:
            children = (self._transfers.labels(role=role, path=path), self._transfer_bytes.labels(role=role),
                        self._seconds.labels(role=role))
            if len(self._done_children) < MAX_CACHED_CHILDREN:
                self._done_children[(role, path)] = children
        count, moved, duration = children
        count.inc()
        if nbytes > 0:
            moved.inc(nbytes)
        duration.observe(max(0.0, seconds))

    def transfer_failed(self, code: str) -> None:
        """A transfer failed with kvd error ``code`` (``KvdError.code``)."""
        self._failures.labels(code=code).inc()

    def fallback(self, kind: str) -> None:
        """A fallback was taken (stable kind, e.g. ``pool.fabric_unavailable``)."""
        self._fallbacks.labels(kind=kind).inc()

    def set_pool(self, pool: str, used: int, free: int) -> None:
        """Current occupancy of pool ``pool``."""
        children = self._pool_children.get(pool)
        if children is None:
            children = (self._pool_used.labels(pool=pool), self._pool_free.labels(pool=pool))
            if len(self._pool_children) < MAX_CACHED_CHILDREN:
                self._pool_children[pool] = children
        children[0].set(used)
        children[1].set(free)

    def set_sessions(self, n: int) -> None:
        """Number of connected executor sessions."""
        self._sessions.set(n)

    def set_bounce_in_use(self, n: int) -> None:
        """Number of bounce chunks reserved right now."""
        self._bounce.set(n)

    def set_agents_kept(self, n: int) -> None:
        """Number of peers' NIXL agents kept loaded while their link is down."""
        self._agents_kept.set(n)

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format (``CONTENT_TYPE_LATEST``)."""
        return bytes(_generate_latest(self.registry))


# --- HTTP ----------------------------------------------------------------------------------

MAX_REQUEST_BYTES = 8192  # request line + headers; more → 431
REQUEST_TIMEOUT_S = 10.0  # whole connection: read request, write response
MAX_CONNECTIONS = 16  # concurrent scrapes; more → 503
_LINGER_S = 1.0  # after replying, drain what the client still sends (avoids an RST)
_LINGER_BYTES = 65536

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def _response(status: int, body: bytes, *, content_type: str, head: bool = False, extra: str = "") -> bytes:
    header = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"Connection: close\r\n"
        f"{extra}"
        "\r\n"
    ).encode("ascii")
    return header if head else header + body


def _plain(status: int, text: str, *, head: bool = False, extra: str = "") -> bytes:
    return _response(
        status, (text + "\n").encode(), content_type="text/plain; charset=utf-8", head=head, extra=extra
    )


def _end_of_headers(buf: bytearray) -> bool:
    return b"\r\n\r\n" in buf or b"\n\n" in buf


async def _read_request(stream: trio.SocketStream) -> bytes | None:
    """The request head (up to the blank line), b"" when too large, None on EOF."""
    buf = bytearray()
    while not _end_of_headers(buf):
        if len(buf) > MAX_REQUEST_BYTES:
            return b""
        data = await stream.receive_some(4096)
        if not data:
            return None
        buf += data
    return bytes(buf)


def _answer(metrics: Metrics, head: bytes) -> tuple[int, bytes]:
    """The response to a request head: (status, bytes to send)."""
    line, _, _ = head.partition(b"\n")
    try:
        parts = line.rstrip(b"\r").decode("ascii").split(" ")
    except UnicodeDecodeError:
        return 400, _plain(400, "bad request")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[1].startswith("/"):
        return 400, _plain(400, "bad request")
    method, target, _version = parts
    path = target.split("?", 1)[0]
    if path != "/metrics":
        return 404, _plain(404, "not found; try /metrics", head=method == "HEAD")
    if method not in ("GET", "HEAD"):
        return 405, _plain(405, "method not allowed", extra="Allow: GET, HEAD\r\n")
    return 200, _response(200, metrics.render(), content_type=CONTENT_TYPE_LATEST, head=method == "HEAD")


async def _linger(stream: trio.SocketStream) -> None:
    """Half-close and drain what the client still sends, so closing does not reset the
    connection before it has read our response."""
    await stream.send_eof()
    drained = 0
    with trio.move_on_after(_LINGER_S):
        while drained < _LINGER_BYTES:
            data = await stream.receive_some(4096)
            if not data:
                return
            drained += len(data)


class _Responder:
    def __init__(self, metrics: Metrics, max_connections: int, timeout: float) -> None:
        self.metrics = metrics
        self.max_connections = max_connections
        self.timeout = timeout
        self.active = 0

    async def __call__(self, stream: trio.SocketStream) -> None:
        self.active += 1
        try:
            async with stream:
                with trio.move_on_after(self.timeout) as scope:
                    await self._serve(stream)
                if scope.cancelled_caught:
                    _log.debug("metrics.request_timeout", timeout_s=self.timeout)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            _log.debug("metrics.connection_error", error=str(exc))
        except Exception:
            # A bug in the responder must not take the daemon's nursery down.
            _log.exception("metrics.handler_failed")
        finally:
            self.active -= 1

    async def _serve(self, stream: trio.SocketStream) -> None:
        if self.active > self.max_connections:
            await stream.send_all(_plain(503, "too many connections"))
            await _linger(stream)
            return
        head = await _read_request(stream)
        if head is None:
            return  # client closed without a request
        if head == b"":
            status, reply = 431, _plain(431, "request too large")
        else:
            status, reply = _answer(self.metrics, head)
        await stream.send_all(reply)
        if status != 200:
            _log.debug("metrics.rejected", status=status)
        await _linger(stream)


async def serve_metrics(
    metrics: Metrics,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    max_connections: int = MAX_CONNECTIONS,
    request_timeout: float = REQUEST_TIMEOUT_S,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Serve ``GET /metrics`` on ``host:port`` until cancelled.

    ``port=0`` picks an ephemeral port. ``task_status.started(port)`` reports the bound port
    (of the first listener when ``host`` resolves to several addresses). Bind errors raise
    :class:`~kvd.startup.StartupError` (naming ``metrics_port``) before ``started()``.
    """
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise bind_failed(
            exc, what="metrics", host=host, port=port, setting="metrics_port", env="KVD_METRICS_PORT; 0 = off"
        ) from None
    actual = int(listeners[0].socket.getsockname()[1])
    _log.info("metrics.listening", host=host, port=actual)
    task_status.started(actual)
    await trio.serve_listeners(_Responder(metrics, max_connections, request_timeout), listeners)
