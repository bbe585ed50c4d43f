"""What an executor's client says when it cannot do what it was asked: a socket it cannot
reach (nothing there, the configuration file given instead, a daemon that is gone), and a
blocking ``wait`` longer than the ``Client``'s own ``timeout``. Real sockets, a real daemon."""

from __future__ import annotations

import re
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from clients import Client, PollingClient, open_client
from kvd.demo.launch import DaemonProcess
from protocol.errors import BadRequest, ConnectionClosed, WaitTimeout

GIVE = "Give its socket with Client(path) / open_client(path) or KVD_SOCKET (default /run/kvd/kvd.sock)"


def _unreachable(tmp: Path, kind: str) -> tuple[str, str]:
    """A socket path no daemon answers on, and what the client must say about it."""
    if kind == "missing":
        return str(tmp / "kvd.sock"), f"No such file or directory; is kvd running with this socket_path? {GIVE}"
    if kind == "config-file":
        path = tmp / "kvd.toml"
        path.write_text('socket_path = "kvd.sock"\n')
        return str(path), (f"Connection refused; {path} is not a socket: give the daemon's socket_path (from its "
                           "configuration, e.g. /run/kvd/kvd.sock), not its configuration file, with "
                           "Client(path) / open_client(path) or KVD_SOCKET")
    stale = socket.socket(socket.AF_UNIX)  # what a killed daemon leaves behind: bound, not listening
    stale.bind(str(tmp / "stale.sock"))
    stale.close()
    return str(tmp / "stale.sock"), "Connection refused; a socket file is there but no daemon answers"


@pytest.mark.parametrize("kind", ["missing", "config-file", "stale"])
def test_blocking_client_says_what_to_check(short_tmp: Path, kind: str) -> None:
    path, said = _unreachable(short_tmp, kind)
    with pytest.raises(ConnectionClosed) as caught:
        Client(path, client="t")
    assert str(caught.value).startswith(f"[connection_closed] cannot connect to kvd at {path}: {said}")


def test_blocking_client_names_the_socket_it_took_from_the_environment(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(short_tmp / "from-env.sock")
    monkeypatch.setenv("KVD_SOCKET", path)
    with pytest.raises(ConnectionClosed, match=re.escape(f"cannot connect to kvd at {path}: No such file")):
        Client(client="t")


@pytest.mark.parametrize("kind", ["missing", "config-file", "stale"])
async def test_async_client_says_what_to_check(short_tmp: Path, kind: str) -> None:
    path, said = _unreachable(short_tmp, kind)
    with pytest.raises(ConnectionClosed) as caught:
        async with open_client(path, client="t"):
            pass
    assert str(caught.value).startswith(f"[connection_closed] cannot connect to kvd at {path}: {said}")


def test_a_wait_longer_than_the_client_timeout_is_a_wait_timeout(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """``Client(timeout=1.5)`` and ``wait(timeout_s=2.5)``: the daemon answers the wait after
    2.5 s (WaitTimeout, the request goes on). The client used to give up after its own timeout
    with "connection to the daemon broke: timed out", although nothing had broken. (The
    waits outlast the client's timeout by 1 s and 0.5 s, either enough for the old failure
    to show; the timeout itself is the room a loaded machine gets to answer: it was 3 s and
    waits of 5 s and 4 s, 9 s of waiting.)"""
    d = daemon_factory(name="waits")
    with Client(d.socket_path, client="gen-rank0", timeout=1.5) as kvd:
        layout = kvd.pools()[0].layout
        assert layout is not None
        ids = kvd.alloc("host0", 2)
        kvd.expect("never-published", "host0", layout, 0, ids, deadline_s=600)
        with pytest.raises(WaitTimeout, match=r"still running after wait timeout 2\.5s; it goes on"):
            kvd.wait("never-published", timeout_s=2.5)
        # the same session goes on, with its own timeout back for the other calls
        assert kvd.ping(b"still here") == b"still here"
        [info] = [t for t in kvd.transfers() if t.request_id == "never-published"]
        assert info.state not in ("done", "failed")
        # registration and wait in one go are given the same patience
        with pytest.raises(WaitTimeout, match=r"after wait timeout 2\.0s"):
            kvd.expect_and_wait("also-never", "host0", layout, 0, kvd.alloc("host0", 2), deadline_s=600,
                                timeout_s=2)
        kvd.cancel("never-published")
        kvd.cancel("also-never")


@pytest.mark.parametrize("spin_s", [-0.001, float("nan"), float("inf"), 2.0, True, "0.001"])
def test_a_bad_spin_is_refused_before_connecting(short_tmp: Path, spin_s: object) -> None:
    with pytest.raises(BadRequest, match=r"spin_s must be a number of seconds >= 0 and at most 1, got .*; 0 sleeps at once"):
        Client(str(short_tmp / "nothing-here.sock"), spin_s=spin_s)  # type: ignore[arg-type]


def test_a_completion_page_without_a_spin_is_refused_before_connecting(short_tmp: Path) -> None:
    """Only a spinning wait reads the page: a Client that would never read it says so instead of
    mapping nothing silently; a PollingClient reads it in get_finished, without a spin."""
    with pytest.raises(BadRequest, match=r"completion_page=True needs spin_s > 0 on a Client: .*PollingClient"):
        Client(str(short_tmp / "nothing-here.sock"), completion_page=True)
    # past the check: the missing socket is what is refused
    with pytest.raises(ConnectionClosed, match="cannot connect to kvd"):
        PollingClient(str(short_tmp / "nothing-here.sock"), completion_page=True)
    with pytest.raises(ConnectionClosed, match="cannot connect to kvd"):
        Client(str(short_tmp / "nothing-here.sock"), spin_s=0.001, completion_page=True)


def test_a_spinning_client_takes_quick_replies_and_sleeps_through_long_waits(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """``spin_s`` polls for a reply before sleeping: replies that come within it and waits
    that outlast it both arrive, and the socket keeps the Client's own timeout afterwards."""
    d = daemon_factory(name="spins")
    with Client(d.socket_path, client="spinner", timeout=30, spin_s=0.05) as kvd:
        assert kvd.ping(b"quick") == b"quick"
        layout = kvd.pools()[0].layout
        assert layout is not None
        kvd.expect("never-published", "host0", layout, 0, kvd.alloc("host0", 2), deadline_s=600)
        with pytest.raises(WaitTimeout, match=r"after wait timeout 0\.3s"):  # outlasts the spin: a blocking read
            kvd.wait("never-published", timeout_s=0.3)
        assert kvd._sock.gettimeout() == 30
        assert kvd.ping(b"after") == b"after"
        kvd.cancel("never-published")
    with Client(d.socket_path, client="spinner-untimed", spin_s=0.05) as kvd:  # a blocking socket stays blocking
        assert kvd.ping(b"x") == b"x"
        assert kvd._sock.gettimeout() is None


def test_the_attached_pool_object_as_a_pool_argument_says_to_pass_its_name(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """``attach`` returns a mapped pool; passing that object where a pool's name goes (alloc,
    free, expect, publish, attach) is refused before anything is sent, naming ``.name``; the
    session goes on and the name works."""
    d = daemon_factory(name="poolarg")
    with Client(d.socket_path, client="newcomer") as kvd:
        pool = kvd.attach("host0")
        layout = pool.info.layout
        assert layout is not None
        said = re.escape("pool must be the pool's name (a str), got MappedPool: pass its name, 'host0' (.name)")
        calls: list[Callable[[], object]] = [
            lambda: kvd.alloc(pool, 1),  # type: ignore[arg-type]
            lambda: kvd.free(pool, [0]),  # type: ignore[arg-type]
            lambda: kvd.attach(pool),  # type: ignore[arg-type]
            lambda: kvd.expect("r1", pool, layout, 0, [0]),  # type: ignore[arg-type]
            lambda: kvd.publish("r2", pool, layout, 0, [0], peer="x"),  # type: ignore[arg-type]
        ]
        for call in calls:
            with pytest.raises(BadRequest, match=said):
                call()
        with pytest.raises(BadRequest, match=re.escape("pool must be the pool's name (a str), got int")):
            kvd.alloc(3, 1)  # type: ignore[arg-type]
        ids = kvd.alloc(pool.name, 2)
        assert kvd.free(pool.name, ids) == 2
        assert kvd.transfers() == []
        pool.close()


async def test_the_async_client_refuses_a_pool_object_too(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory(name="poolarg-async")
    async with open_client(d.socket_path, client="newcomer") as kvd:
        with pytest.raises(BadRequest, match=re.escape("pool must be the pool's name (a str), got list")):
            await kvd.alloc(["host0"], 1)  # type: ignore[arg-type]
        assert len(await kvd.alloc("host0", 1)) == 1
