"""Access control: the Unix socket checks SO_PEERCRED against ``[access]``.

Real daemons (running as root here) and real clients running as another user: the client
subprocess drops to uid/gid 65534 (``setpriv --reuid --regid --clear-groups``), so the
kernel reports those credentials to the daemon. The socket directory is made traversable
and the socket world-connectable (``socket_mode = 0o666``) so that the *policy* is what
refuses, not the file mode.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from clients import Client
from kvd.demo.launch import DaemonProcess
from tests.conftest import host_pool
from tests.hostile import wait_until

NOBODY = 65534

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to run a client as another uid",
)

#: Runs as uid/gid 65534: connect to each socket given, report what happened as JSON lines.
CLIENT = textwrap.dedent(
    """
    import json, os, sys
    from clients.blocking import Client
    from protocol.errors import KvdError
    for path in sys.argv[1:]:
        try:
            with Client(path, client="nobody", timeout=10) as c:
                out = {"ok": True, "pong": c.ping(b"hi").decode(), "blocks": len(c.alloc("host0", 2))}
        except KvdError as exc:
            out = {"ok": False, "cls": type(exc).__name__, "code": exc.code, "message": exc.message}
        out.update(path=path, uid=os.getuid(), gid=os.getgid(), pid=os.getpid(), groups=os.getgroups())
        print(json.dumps(out), flush=True)
    """
)


def _as_nobody(args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd="/", **kw)


def _only_session(c: Client) -> bool:
    return c.stats().sessions == 1


def _events(d: DaemonProcess, event: str) -> list[dict[str, Any]]:
    recs = [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]
    return [r for r in recs if r.get("event") == event]


@pytest.fixture
def open_daemon(daemon_factory: Callable[..., DaemonProcess], short_tmp: Path) -> Callable[..., DaemonProcess]:
    """A daemon whose socket any local user can reach; ``access`` is its ``[access]`` table."""
    short_tmp.chmod(0o755)

    def start(name: str, access: dict[str, list[int]] | None = None) -> DaemonProcess:
        cfg: dict[str, Any] = {"pools": [host_pool("host0")], "socket_mode": 0o666}
        if access is not None:
            cfg["access"] = access
        return daemon_factory(cfg, name=name)

    return start


def test_policy_decides_who_may_connect(open_daemon: Callable[..., DaemonProcess]) -> None:
    policies: dict[str, dict[str, list[int]] | None] = {
        "dflt": None,  # the default: root, the daemon's uid (0) and its group (0)
        "bygid": {"allowed_gids": [NOBODY]},
        "byuid": {"allowed_uids": [NOBODY]},
        "others": {"allowed_uids": [1234], "allowed_gids": [4321]},
    }
    with ThreadPoolExecutor(len(policies)) as pool:
        daemons = list(pool.map(open_daemon, policies, policies.values()))
    default, by_gid, by_uid, others = daemons
    assert all(os.stat(d.socket_path).st_mode & 0o777 == 0o666 for d in daemons)

    # a root client is connected to each daemon the whole time
    roots = [Client(d.socket_path, client="root", timeout=10) for d in daemons]
    try:
        run = _as_nobody([sys.executable, "-c", CLIENT, *(d.socket_path for d in daemons)])
        assert run.returncode == 0, run.stderr
        results = {r["path"]: r for r in map(json.loads, run.stdout.splitlines())}
        assert len(results) == len(daemons)
        assert all(r["uid"] == NOBODY and r["gid"] == NOBODY and r["groups"] == [] for r in results.values())

        for d in (default, others):
            r = results[d.socket_path]
            assert r["ok"] is False, r
            # the same exception class as in the daemon, with a message that says who and why
            assert r["cls"] == "PermissionDenied" and r["code"] == "permission_denied"
            assert f"peer pid {r['pid']} (uid {NOBODY}, gid {NOBODY}) is not allowed to use this daemon" in r["message"]
        assert "only root, uid 0 and members of group 0 may connect" in results[default.socket_path]["message"]
        assert "uids [1234], members of gids [4321]" in results[others.socket_path]["message"]

        for d in (by_gid, by_uid):
            r = results[d.socket_path]
            assert r == {**r, "ok": True, "pong": "hi", "blocks": 2}

        # a log line per rejection, with the client's uid and pid; none for the allowed ones
        for d in (default, others):
            lines = _events(d, "session.rejected")
            assert len(lines) == 1, d.log()
            line = lines[0]
            assert line["level"] == "warning"
            assert line["uid"] == NOBODY and line["gid"] == NOBODY
            assert line["pid"] == results[d.socket_path]["pid"]
            assert "is not allowed" in line["reason"]
        for d in (by_gid, by_uid):
            assert not _events(d, "session.rejected")
            opened = [r for r in _events(d, "session.opened") if r["uid"] == NOBODY]
            assert len(opened) == 1 and opened[0]["pid"] == results[d.socket_path]["pid"]

        # kvctl run by a user the policy refuses: exit code 1 and the daemon's reason
        run = _as_nobody([sys.executable, "-m", "clients.kvctl", "--socket", default.socket_path, "status"])
        assert run.returncode == 1, (run.stdout, run.stderr)
        assert "[permission_denied]" in run.stderr and f"(uid {NOBODY}, gid {NOBODY})" in run.stderr
        assert run.stdout == ""
        assert len(_events(default, "session.rejected")) == 2

        # the root sessions were not disturbed, and nothing leaked
        # (the nobody client has exited; a daemon ends its session when it reads the hang-up)
        for c in roots:
            assert c.ping(b"root") == b"root"
            wait_until(partial(_only_session, c), "the nobody client's session to end")
            st = c.stats()
            assert st.blocks_leased == 0 and st.sessions == 1
    finally:
        for c in roots:
            c.close()
