"""Limits: every ``[limits]`` value is enforced by a real daemon with a clear error,
and hitting a limit in one session has no effect on the others.

One daemon (a subprocess) with small limits serves the whole module; each test cleans up
its own sessions and leases, and checks that a bystander session keeps working while (and
after) another one hits the limit.
"""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import trio
import trio.testing

from clients import Client, open_client
from clients.client import AsyncClient
from kvd.config import config_from_dict
from kvd.daemon import check_limits
from kvd.demo.launch import DaemonProcess, LaunchError, start_daemon
from protocol import messages as m
from protocol.codec import encode
from protocol.errors import BadRequest, FrameTooLarge, LimitExceeded
from tests.conftest import host_pool

MAX_SESSIONS = 4
MAX_INFLIGHT = 2
MAX_BLOCKS = 8
MAX_FRAME = 65536
POOL = "host0"


def _config(**limits: Any) -> dict[str, Any]:
    return {
        "pools": [host_pool(POOL)],
        "transfer": {"bounce_size_mb": 16, "chunk_mb": 2},
        "limits": {
            "max_sessions": MAX_SESSIONS,
            "max_inflight_per_session": MAX_INFLIGHT,
            "max_blocks_per_session": MAX_BLOCKS,
            "max_frame_size": MAX_FRAME,
            # the tests run as root, an operator: no reserve, so the limits apply to them too
            "operator_reserve": 0,
            **limits,
        },
    }


@pytest.fixture(scope="module")
def limited() -> Iterator[DaemonProcess]:
    workdir = tempfile.mkdtemp(prefix="kvdl-", dir="/tmp")
    d = start_daemon(_config(), workdir=workdir, name="limited")
    try:
        yield d
    finally:
        d.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def _events(d: DaemonProcess, event: str) -> list[dict[str, Any]]:
    out = []
    for line in d.log().splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec.get("event") == event:
                out.append(rec)
    return out


async def _until(predicate: Any, what: str, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not await predicate():
            await trio.sleep(0.02)


async def _until_logged(d: DaemonProcess, event: str, client: str, *, count: int, timeout: float = 10.0) -> None:
    """Wait until ``d`` logged ``event`` for ``count`` sessions of ``client``."""
    with trio.fail_after(timeout):
        while len([r for r in _events(d, event) if r.get("client") == client]) < count:
            await trio.sleep(0.02)


async def _idle(path: str) -> None:
    """Wait until the daemon holds no leases and no session but the probe's own."""

    async def check() -> bool:
        async with open_client(path, client="probe") as probe:
            st = await probe.stats()
            return st.sessions == 1 and st.blocks_leased == 0

    await _until(check, "daemon idle")


async def _sessions_are(kvd: AsyncClient, n: int) -> bool:
    return (await kvd.stats()).sessions == n


async def _bystander_works(kvd: AsyncClient) -> None:
    assert await kvd.ping(b"still here") == b"still here"
    ids = await kvd.alloc(POOL, 1)
    assert await kvd.free(POOL, ids) == 1


def _layout(kvd_pools: list[m.PoolInfo]) -> Any:
    layout = kvd_pools[0].layout
    assert layout is not None
    return layout


async def test_max_sessions(limited: DaemonProcess) -> None:
    path = limited.socket_path
    await _idle(path)
    async with open_client(path, client="bystander") as bystander:
        # _idle's probe has hung up, but the daemon ends its session when it reads that: the
        # counts below need every session but the bystander gone
        await _until(lambda: _sessions_are(bystander, 1), "the probe's session to end")
        held: list[Client] = []
        try:
            for i in range(MAX_SESSIONS - 1):
                held.append(Client(path, client=f"held{i}", timeout=10))
            assert (await bystander.stats()).sessions == MAX_SESSIONS
            # one more: refused at connect, with the limit named
            with pytest.raises(LimitExceeded, match=f"max_sessions={MAX_SESSIONS} reached"):
                async with open_client(path, client="one-too-many"):
                    pass  # pragma: no cover
            with pytest.raises(LimitExceeded, match="max_sessions"):
                Client(path, client="one-too-many-blocking", timeout=10)
            # the sessions already in are untouched
            await _bystander_works(bystander)
            assert all(c.ping(b"x") == b"x" for c in held)
        finally:
            for c in held:
                c.close()
        # room again once sessions end
        async def one_fits() -> bool:
            try:
                async with open_client(path, client="after") as kvd:
                    return await kvd.ping(b"in") == b"in"
            except LimitExceeded:
                return False

        await _until(one_fits, "a session fits again")
        await _bystander_works(bystander)
    limit_lines = _events(limited, "session.limit")
    assert limit_lines and f"max_sessions={MAX_SESSIONS}" in limit_lines[-1]["reason"]
    assert {"pid", "uid", "session"} <= set(limit_lines[-1])


async def test_max_blocks_per_session(limited: DaemonProcess) -> None:
    path = limited.socket_path
    await _idle(path)
    async with open_client(path, client="greedy") as greedy, open_client(path, client="bystander") as other:
        first = await greedy.alloc(POOL, 5)
        with pytest.raises(LimitExceeded, match=f"max_blocks_per_session={MAX_BLOCKS}: session holds 5, asked for 4"):
            await greedy.alloc(POOL, 4)
        assert (await greedy.stats()).blocks_leased == 5  # all or nothing: the failed alloc took none
        # the limit is per session: the bystander gets its full quota
        theirs = await other.alloc(POOL, MAX_BLOCKS)
        assert len(theirs) == MAX_BLOCKS
        # the greedy session may top up to exactly the limit, and again after freeing
        more = await greedy.alloc(POOL, MAX_BLOCKS - 5)
        with pytest.raises(LimitExceeded):
            await greedy.alloc(POOL, 1)
        await greedy.free(POOL, first)
        assert len(await greedy.alloc(POOL, 5)) == 5
        await greedy.free(POOL, more)
        await other.free(POOL, theirs)
        await _bystander_works(other)


async def test_max_inflight_registrations_and_waits(limited: DaemonProcess) -> None:
    path = limited.socket_path
    await _idle(path)
    async with open_client(path, client="busy") as busy, open_client(path, client="bystander") as other:
        layout = _layout(await busy.pools())
        ids = await busy.alloc(POOL, 3)
        # registrations: MAX_INFLIGHT requests may be registered at once
        for i in range(MAX_INFLIGHT):
            await busy.expect(f"inflight-{i}", POOL, layout, 0, [ids[i]], deadline_s=30)
        with pytest.raises(LimitExceeded, match=f"max_inflight_per_session={MAX_INFLIGHT}"):
            await busy.expect("inflight-x", POOL, layout, 0, [ids[2]], deadline_s=30)
        # waits: MAX_INFLIGHT Waits may be pending at once; one more is refused at once
        async with trio.open_nursery() as nursery:
            for i in range(MAX_INFLIGHT):
                nursery.start_soon(_wait_quietly, busy, f"inflight-{i}")
            # both Wait frames are sent once their tasks block on the reply; the daemon reads a
            # session's frames in order, so the Pong proves it took both Waits in flight
            await trio.testing.wait_all_tasks_blocked()
            assert await busy.ping(b"after the waits") == b"after the waits"
            with pytest.raises(LimitExceeded, match=f"max_inflight_per_session={MAX_INFLIGHT} reached"):
                await busy.wait("inflight-0", timeout_s=5)
            # the session itself still answers quick requests, and other sessions are unaffected
            assert await busy.ping(b"quick") == b"quick"
            await _bystander_works(other)
            other_ids = await other.alloc(POOL, MAX_INFLIGHT)
            for i in range(MAX_INFLIGHT):
                await other.expect(f"other-{i}", POOL, layout, 0, [other_ids[i]], deadline_s=30)
            for i in range(MAX_INFLIGHT):
                await other.cancel(f"other-{i}")
            for i in range(MAX_INFLIGHT):
                await busy.cancel(f"inflight-{i}")  # the pending Waits return (cancelled)
        # collected requests free the slots again
        await busy.expect("inflight-again", POOL, layout, 0, [ids[2]], deadline_s=30)
        await busy.cancel("inflight-again")


async def _wait_quietly(kvd: AsyncClient, request_id: str) -> None:
    try:
        await kvd.wait(request_id, timeout_s=20)
    except Exception as exc:
        assert "cancel" in str(exc)


async def test_max_frame_size(limited: DaemonProcess) -> None:
    path = limited.socket_path
    await _idle(path)
    async with open_client(path, client="bystander") as other:
        assert other.welcome is not None and other.welcome.max_frame_size == MAX_FRAME
        # a frame just under the limit is fine
        fits = b"x" * (MAX_FRAME - 64)
        assert await other.ping(fits) == fits
        # one over it: FrameTooLarge, and that session (only) is disconnected
        with pytest.raises(FrameTooLarge, match=f"exceeds the maximum frame size {MAX_FRAME}"):
            async with open_client(path, client="oversized") as big:
                await big.ping(b"y" * (MAX_FRAME + 1))
        await _bystander_works(other)
    # the same through the blocking client, with a much larger frame than the socket buffer
    with Client(path, client="bystander-blocking", timeout=10) as c:
        with pytest.raises(FrameTooLarge), Client(path, client="huge", timeout=10) as huge:
            huge.ping(b"z" * (2 << 20))
        assert c.ping(b"ok") == b"ok"
    assert _events(limited, "session.frame_too_large")
    await _idle(path)


async def test_client_vanishing_mid_reply_does_not_take_the_daemon_down(limited: DaemonProcess) -> None:
    """Regression: a reply to a client that is already gone (EPIPE inside the session's
    nursery, i.e. an ExceptionGroup) used to escape the session and stop the whole daemon."""
    path = limited.socket_path
    await _idle(path)
    async with open_client(path, client="bystander") as other:
        for n in range(5):
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            raw.connect(path)
            pings = b"".join(encode(m.Ping(id=i + 2, payload=b"p" * 1000)) for i in range(50))
            raw.sendall(encode(m.Hello(id=1, version=m.PROTOCOL_VERSION, client="vanishing")) + pings)
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            raw.close()  # RST while the daemon writes 50 Pongs
            # the daemon reads queued data before the reset, so it took the Hello and must end
            # the session; one at a time, so that max_sessions never refuses one of them
            await _until_logged(limited, "session.closed", "vanishing", count=n + 1)
        assert limited.proc.poll() is None, limited.log()[-3000:]
        await _bystander_works(other)
    await _idle(path)
    assert not _events(limited, "session.crashed")


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"max_sessions": 0}, "max_sessions must be at least 1"),
        ({"max_inflight_per_session": 0}, "max_inflight_per_session must be at least 1"),
        ({"max_blocks_per_session": -1}, "max_blocks_per_session must be at least 1"),
        ({"max_frame_size": 100}, "max_frame_size must be at least 4096"),
    ],
)
def test_invalid_limits_are_refused(limits: dict[str, int], message: str) -> None:
    cfg = config_from_dict(_config(**limits), env={})
    with pytest.raises(BadRequest, match=message):
        check_limits(cfg.limits)


def test_invalid_limits_stop_the_daemon_at_startup(short_tmp: Any) -> None:
    with pytest.raises(LaunchError, match=r"\[limits\] max_frame_size must be at least 4096"):
        start_daemon(_config(max_frame_size=100), workdir=short_tmp, name="badlimits", timeout=30)
