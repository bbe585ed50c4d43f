"""kvd.executor.peercred: SO_PEERCRED on real Unix sockets, the access policy, a real foreign uid."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

import pytest
import trio

from kvd.config import AccessConfig
from kvd.executor.peercred import AccessPolicy, Creds, peer_credentials, supplementary_groups
from protocol.errors import PermissionDenied

NOBODY = 65534  # the overflow uid/gid; "nobody"/"nogroup" on Debian

# --- SO_PEERCRED on our own sockets --------------------------------------------------------


def test_stdlib_socketpair_gives_our_creds() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert peer_credentials(a) == Creds(os.getpid(), os.geteuid(), os.getegid())
        assert peer_credentials(b) == Creds(os.getpid(), os.geteuid(), os.getegid())


async def test_trio_socketpair_gives_our_creds() -> None:
    a, b = trio.socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        creds = peer_credentials(a)
    assert creds == Creds(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid())


async def test_trio_listener_accepted_connection(tmp_path: Path) -> None:
    path = str(tmp_path / "kvd.sock")
    listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with listener:
        await listener.bind(path)
        listener.listen()
        client = await trio.open_unix_socket(path)
        conn, _ = await listener.accept()
        with conn:
            assert peer_credentials(conn).pid == os.getpid()
        await client.aclose()


# --- policy decisions ------------------------------------------------------------------------

DAEMON_UID, DAEMON_GID = 990, 990
# A fake user database: uid → supplementary groups (getgrouplist).
GROUPS: dict[int, set[int]] = {
    1000: {1000, DAEMON_GID},  # alice: in the daemon's group as a supplementary group
    1001: {1001},  # bob: in no interesting group
    1002: {1002, 2000},  # carol: in group 2000
}


def fake_groups(uid: int, gid: int) -> Collection[int]:
    return GROUPS.get(uid, set()) | {gid}


def policy(uids: Collection[int] = (), gids: Collection[int] = ()) -> AccessPolicy:
    return AccessPolicy(uids, gids, DAEMON_UID, DAEMON_GID, group_lookup=fake_groups)


@pytest.mark.parametrize(
    ("make", "creds", "reason"),
    [
        # default rule: daemon uid, root, the daemon's group (primary or supplementary)
        (policy, Creds(1, 0, 0), "root"),
        (policy, Creds(1, DAEMON_UID, 5), "daemon uid"),
        (policy, Creds(1, 1001, DAEMON_GID), "primary group"),
        (policy, Creds(1, 1000, 1000), "supplementary group"),
        (policy, Creds(1, 1001, 1001), None),
        (policy, Creds(1, 4242, 4242), None),  # no passwd entry, not in the group
        (policy, Creds(0, NOBODY, NOBODY), None),  # unmapped user of another namespace
        (policy, Creds(0, -1, -1), None),  # "no credentials"
        # explicit lists replace the daemon's group
        (lambda: policy(uids=[1001]), Creds(1, 1001, 1001), "allowed uid"),
        (lambda: policy(uids=[1001]), Creds(1, 1000, 1000), None),
        (lambda: policy(uids=[1001]), Creds(1, 5, DAEMON_GID), None),
        (lambda: policy(uids=[1001]), Creds(1, 0, 0), "root"),
        (lambda: policy(uids=[1001]), Creds(1, DAEMON_UID, DAEMON_GID), "daemon uid"),
        (lambda: policy(gids=[2000]), Creds(1, 1002, 1002), "supplementary group"),
        (lambda: policy(gids=[2000]), Creds(1, 7, 2000), "primary group"),
        (lambda: policy(gids=[2000]), Creds(1, 1000, 1000), None),
        (lambda: policy(uids=[1001], gids=[2000]), Creds(1, 1002, 1002), "supplementary group"),
    ],
)
def test_policy_table(make: Callable[[], AccessPolicy], creds: Creds, reason: str | None) -> None:
    p = make()
    assert p.reason(creds) == reason
    assert p.allows(creds) is (reason is not None)
    if reason is None:
        with pytest.raises(PermissionDenied) as info:
            p.check(creds)
        msg = str(info.value)
        assert f"pid {creds.pid}" in msg
        assert f"uid {creds.uid}" in msg
        assert f"gid {creds.gid}" in msg
        assert info.value.code == "permission_denied"
    else:
        p.check(creds)


def test_group_lookup_only_when_needed() -> None:
    calls: list[tuple[int, int]] = []

    def lookup(uid: int, gid: int) -> Collection[int]:
        calls.append((uid, gid))
        return {gid}

    p = AccessPolicy((), (), DAEMON_UID, DAEMON_GID, group_lookup=lookup)
    p.check(Creds(1, 0, 0))
    p.check(Creds(1, DAEMON_UID, 1))
    p.check(Creds(1, 5, DAEMON_GID))
    assert calls == []
    assert not p.allows(Creds(1, 5, 5))
    assert calls == [(5, 5)]


def test_from_config_and_defaults() -> None:
    p = AccessPolicy.from_config(AccessConfig())
    assert p.daemon_uid == os.geteuid() and p.daemon_gid == os.getegid()
    assert p.default_rule and p.groups == {os.getegid()}
    assert p.allows(Creds(os.getpid(), os.geteuid(), os.getegid()))
    q = AccessPolicy.from_config(
        AccessConfig(allowed_uids=(5,), allowed_gids=(6,)), daemon_uid=1, daemon_gid=2
    )
    assert (q.allowed_uids, q.allowed_gids, q.daemon_uid, q.daemon_gid) == (
        frozenset({5}),
        frozenset({6}),
        1,
        2,
    )
    assert "allowed_uids=[5]" in repr(q)


def test_real_supplementary_groups() -> None:
    root = pwd.getpwuid(0)
    assert root.pw_gid in supplementary_groups(0, root.pw_gid)
    free_uid = next(u for u in range(54321, 60000) if not _has_passwd(u))
    assert supplementary_groups(free_uid, 777) == {777}


def _has_passwd(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


# --- a real process under another uid ------------------------------------------------------

CHILD = """
import socket, sys
addr = sys.argv[1]
if addr.startswith("@"):
    addr = "\\0" + addr[1:]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(addr)
s.sendall(b"hi")
while s.recv(100):
    pass
"""


def _python_for(argv_prefix: list[str], drop: bool) -> str | None:
    """A Python interpreter the unprivileged child can execute (sys.executable may live
    under a directory only root can enter)."""
    for candidate in (sys.executable, "/usr/bin/python3", shutil.which("python3")):
        if candidate is None:
            continue
        try:
            probe = subprocess.run(
                [*argv_prefix, candidate, "-c", "import socket"],
                capture_output=True,
                timeout=30,
                check=False,
                user=NOBODY if drop else None,
                group=NOBODY if drop else None,
                extra_groups=[] if drop else None,
            )
        except OSError:  # exec refused (path not searchable by that uid)
            continue
        if probe.returncode == 0:
            return candidate
    return None


@pytest.fixture(params=["abstract", "path"])
def unix_address(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "abstract":
        yield f"@kvd-test-peercred-{uuid.uuid4().hex}"
    else:
        # The unprivileged child must reach the socket: a private dir it may traverse.
        d = tempfile.mkdtemp(prefix="kvd-peercred-", dir="/tmp")
        os.chmod(d, 0o755)
        try:
            yield os.path.join(d, "kvd.sock")
        finally:
            shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("launcher", ["setpriv", "popen-user"])
async def test_foreign_uid_is_seen_and_rejected(launcher: str, unix_address: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("running a child under another uid needs root (CI runs as root)")
    drop = False  # True: subprocess itself drops to NOBODY (setgroups, setgid, setuid)
    if launcher == "setpriv":
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("setpriv not installed; the popen-user variant covers this")
        prefix = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    else:
        # subprocess drops to the uid/gid (setgroups, setgid, setuid) in the child itself.
        prefix = []
        drop = True
    python = await trio.to_thread.run_sync(_python_for, prefix, drop)
    if python is None:
        pytest.fail(f"no Python interpreter executable by uid {NOBODY}")

    bind_addr: str | bytes = unix_address
    if unix_address.startswith("@"):
        bind_addr = b"\0" + unix_address[1:].encode()
    listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with listener:
        await listener.bind(bind_addr)
        if not unix_address.startswith("@"):
            os.chmod(unix_address, 0o777)
        listener.listen()
        async with trio.open_nursery() as nursery:
            proc = await nursery.start(
                lambda task_status: trio.run_process(
                    [*prefix, python, "-c", CHILD, unix_address],
                    task_status=task_status,
                    user=NOBODY if drop else None,
                    group=NOBODY if drop else None,
                    extra_groups=[] if drop else None,
                )
            )
            with trio.fail_after(20):
                conn, _ = await listener.accept()
            with conn:
                creds = peer_credentials(conn)
                assert await conn.recv(2) == b"hi"
            # conn closed: the child sees EOF and exits 0 (run_process checks).

    assert creds == Creds(pid=proc.pid, uid=NOBODY, gid=NOBODY)
    daemon = AccessPolicy.from_config(AccessConfig())  # we are root, group root
    assert daemon.reason(creds) is None
    with pytest.raises(PermissionDenied, match=rf"pid {proc.pid} \(uid {NOBODY}, gid {NOBODY}\)"):
        daemon.check(creds)
    # The same peer is let in once configured.
    AccessPolicy.from_config(AccessConfig(allowed_uids=(NOBODY,))).check(creds)
    AccessPolicy.from_config(AccessConfig(allowed_gids=(NOBODY,))).check(creds)
