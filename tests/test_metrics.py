"""kvd.ops.metrics: a dedicated registry per daemon, scraped over real HTTP on 127.0.0.1."""

from __future__ import annotations

import contextlib
import math

import pytest
import trio
import trio.testing
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from kvd.ops.metrics import CONTENT_TYPE_LATEST, Metrics, serve_metrics
from kvd.startup import StartupError


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def http(port: int, request: bytes, *, read_limit: int = 1 << 22) -> bytes:
    """Send raw bytes to 127.0.0.1:port and read until the server closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        # The server may close on us mid-request (oversize); then read what it said.
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(request)
        data = bytearray()
        with trio.fail_after(5):
            while len(data) < read_limit:
                try:
                    chunk = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    break  # reset after the server closed: what we read is what we got
                if not chunk:
                    break
                data += chunk
    return bytes(data)


def split(response: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("ascii").split("\r\n")
    headers = {}
    for line in header_lines:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(status_line.split(" ")[1]), headers, body


async def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, headers, body = split(await http(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert status == 200
    assert headers["content-type"] == CONTENT_TYPE_LATEST
    assert int(headers["content-length"]) == len(body)
    assert headers["connection"] == "close"
    return samples(body.decode())


def test_methods_move_the_series() -> None:
    m = Metrics(process_metrics=False)
    m.transfer_done("ctx", "bounce", 4096, 0.003)
    m.transfer_done("ctx", "bounce", 1024, 0.5)
    m.transfer_done("gen", "direct", 2048, 0.0)
    m.transfer_failed("transfer_timeout")
    m.fallback("pool.fabric_unavailable")
    m.set_pool("gpu0", used=10, free=90)
    m.set_sessions(3)
    m.set_bounce_in_use(2)
    m.set_agents_kept(1)
    s = samples(m.render().decode())
    assert s[("kvd_transfers_total", (("path", "bounce"), ("role", "ctx")))] == 2
    assert s[("kvd_transfers_total", (("path", "direct"), ("role", "gen")))] == 1
    assert s[("kvd_transfer_bytes_total", (("role", "ctx"),))] == 5120
    assert s[("kvd_transfer_failures_total", (("code", "transfer_timeout"),))] == 1
    assert s[("kvd_fallbacks_total", (("kind", "pool.fabric_unavailable"),))] == 1
    assert s[("kvd_pool_blocks_used", (("pool", "gpu0"),))] == 10
    assert s[("kvd_pool_blocks_free", (("pool", "gpu0"),))] == 90
    assert s[("kvd_sessions", ())] == 3
    assert s[("kvd_bounce_chunks_in_use", ())] == 2
    assert s[("kvd_peer_agents_kept", ())] == 1
    assert s[("kvd_transfer_seconds_count", (("role", "ctx"),))] == 2
    assert s[("kvd_transfer_seconds_bucket", (("le", "0.001"), ("role", "ctx")))] == 0
    assert s[("kvd_transfer_seconds_bucket", (("le", "0.005"), ("role", "ctx")))] == 1
    assert s[("kvd_transfer_seconds_bucket", (("le", "60.0"), ("role", "ctx")))] == 2
    assert s[("kvd_transfer_seconds_sum", (("role", "ctx"),))] == pytest.approx(0.503)


def test_cached_children_move_the_same_series_and_stay_bounded() -> None:
    """The per-request calls keep their label children; past the bound they look them up again
    (the series still move) and the cache does not grow."""
    from kvd.ops.metrics import MAX_CACHED_CHILDREN

    m = Metrics(process_metrics=False)
    for _ in range(3):
        m.transfer_done("gen", "mapped", 100, 0.002)
    m.set_pool("gen0", used=1, free=7)
    m.set_pool("gen0", used=2, free=6)
    for n in range(MAX_CACHED_CHILDREN * 2):
        m.set_pool(f"p{n}", used=n, free=1)
        m.transfer_done("ctx", f"path{n}", 1, 0.001)
    m.set_pool("p100", used=5, free=0)  # past the bound: looked up again, still the right series
    m.transfer_done("ctx", "path100", 1, 0.001)
    assert len(m._pool_children) <= MAX_CACHED_CHILDREN
    assert len(m._done_children) <= MAX_CACHED_CHILDREN
    s = samples(m.render().decode())
    assert s[("kvd_transfers_total", (("path", "mapped"), ("role", "gen")))] == 3
    assert s[("kvd_transfer_bytes_total", (("role", "gen"),))] == 300
    assert s[("kvd_transfer_seconds_count", (("role", "gen"),))] == 3
    assert s[("kvd_pool_blocks_used", (("pool", "gen0"),))] == 2
    assert s[("kvd_pool_blocks_free", (("pool", "gen0"),))] == 6
    assert s[("kvd_pool_blocks_used", (("pool", "p100"),))] == 5
    assert s[("kvd_transfers_total", (("path", "path100"), ("role", "ctx")))] == 2


def test_buckets_cover_1ms_to_60s() -> None:
    text = Metrics(process_metrics=False)
    text.transfer_done("ctx", "direct", 1, 0.01)
    les = [
        float(dict(labels)["le"])
        for (name, labels) in samples(text.render().decode())
        if name == "kvd_transfer_seconds_bucket"
    ]
    assert min(les) == 0.001
    assert max(x for x in les if not math.isinf(x)) == 60.0
    assert math.isinf(max(les))


def test_registries_are_per_daemon_and_not_the_global_one() -> None:
    a, b = Metrics(), Metrics()
    a.set_sessions(5)
    assert samples(b.render().decode())[("kvd_sessions", ())] == 0
    assert a.registry is not REGISTRY
    assert REGISTRY.get_sample_value("kvd_sessions") is None
    assert ("process_open_fds", ()) in samples(a.render().decode())


async def test_scrape_over_http_sees_counters_move() -> None:
    m = Metrics()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_metrics, m, "127.0.0.1", 0)
        assert isinstance(port, int) and port > 0
        before = await scrape(port)
        assert before.get(("kvd_transfers_total", (("path", "bounce"), ("role", "ctx"))), 0) == 0
        m.transfer_done("ctx", "bounce", 1 << 20, 0.02)
        m.fallback("transfer.bounce_fallback")
        m.set_pool("host", 3, 5)
        after = await scrape(port)
        assert after[("kvd_transfers_total", (("path", "bounce"), ("role", "ctx")))] == 1
        assert after[("kvd_transfer_bytes_total", (("role", "ctx"),))] == 1 << 20
        assert after[("kvd_fallbacks_total", (("kind", "transfer.bounce_fallback"),))] == 1
        assert after[("kvd_pool_blocks_used", (("pool", "host"),))] == 3
        # Query strings are ignored; HTTP/1.0 works; bare LF line endings are tolerated.
        status, _, _ = split(await http(port, b"GET /metrics?x=1 HTTP/1.0\n\n".replace(b"\n", b"\r\n")))
        assert status == 200
        raw = await http(port, b"GET /metrics HTTP/1.0\n\n")
        assert raw.startswith(b"HTTP/1.1 200 OK\r\n")
        nursery.cancel_scope.cancel()


async def test_head_404_405_400_431() -> None:
    m = Metrics(process_metrics=False)
    with capture_logs() as logs:
        await _bad_requests(m)
    assert "metrics.handler_failed" not in [e["event"] for e in logs]
    assert [e["status"] for e in logs if e["event"] == "metrics.rejected"][:2] == [404, 404]


async def _bad_requests(m: Metrics) -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_metrics, m)
        status, headers, body = split(await http(port, b"HEAD /metrics HTTP/1.1\r\n\r\n"))
        assert status == 200 and body == b"" and int(headers["content-length"]) > 0

        status, _, body = split(await http(port, b"GET /other HTTP/1.1\r\n\r\n"))
        assert status == 404
        status, _, _ = split(await http(port, b"GET / HTTP/1.1\r\n\r\n"))
        assert status == 404

        status, headers, _ = split(await http(port, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n"))
        assert status == 405
        assert headers["allow"] == "GET, HEAD"

        for garbage in (b"\x00\xff\xfe garbage\r\n\r\n", b"hello\r\n\r\n", b"GET /metrics\r\n\r\n"):
            status, _, _ = split(await http(port, garbage))
            assert status == 400

        # Oversize: a header without an end. The server answers 431 and closes; the client
        # may see the reply or a reset (when it is still sending), but never a hang.
        for size in (9000, 65536, 1 << 20):
            oversize = b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * size
            with trio.fail_after(5):
                reply = await http(port, oversize)
            assert reply == b"" or split(reply)[0] == 431

        # The server is still healthy afterwards.
        assert ("kvd_sessions", ()) in await scrape(port)
        nursery.cancel_scope.cancel()


async def test_client_that_closes_or_stalls_is_dropped() -> None:
    m = Metrics(process_metrics=False)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            lambda task_status: serve_metrics(m, request_timeout=0.3, task_status=task_status)
        )
        # Connect and close without a request.
        s = await trio.open_tcp_stream("127.0.0.1", port)
        await s.aclose()
        # Connect, send half a request, and stall: the server gives up after request_timeout.
        s = await trio.open_tcp_stream("127.0.0.1", port)
        await s.send_all(b"GET /metr")
        with trio.fail_after(3):
            assert await s.receive_some(100) == b""
        await s.aclose()
        assert ("kvd_sessions", ()) in await scrape(port)
        nursery.cancel_scope.cancel()


async def test_connection_cap() -> None:
    m = Metrics(process_metrics=False)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            lambda task_status: serve_metrics(m, max_connections=2, task_status=task_status)
        )
        idle = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
        # The server took both idle connections once a third is refused (503).
        assert await _status_once_settled(port, 503) == 503
        for s in idle:
            await s.aclose()
        # ... and has seen them close once a request is served again (200).
        assert await _status_once_settled(port, 200) == 200
        assert ("kvd_sessions", ()) in await scrape(port)
        nursery.cancel_scope.cancel()


async def _status_once_settled(port: int, want: int) -> int:
    """Request /metrics until the server answers ``want``; returns that status.

    The server's accept loop and handlers run in this process: each try first waits until
    every task is blocked, i.e. the server has handled what the kernel delivered so far. The
    kernel may hand over a loopback connect or close a moment after our call returned, so an
    answer other than ``want`` is retried (bounded); a server that never answers ``want``
    fails the test.
    """
    with trio.fail_after(10):
        while True:
            await trio.testing.wait_all_tasks_blocked()
            status, _, _ = split(await http(port, b"GET /metrics HTTP/1.1\r\n\r\n"))
            if status == want:
                return status


async def test_bind_error_raises_before_started() -> None:
    m = Metrics(process_metrics=False)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_metrics, m, "127.0.0.1", 0)
        with pytest.raises(StartupError, match=rf"metrics_port: metrics port {port} on 127.0.0.1 is already in use"):
            await nursery.start(serve_metrics, m, "127.0.0.1", port)
        nursery.cancel_scope.cancel()
