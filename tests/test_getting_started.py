"""docs/getting-started.md, run exactly as written: its files are written verbatim (but for the
peer port, which becomes a free one), its shell blocks run in order in one ``bash`` (``set -euo pipefail``) in an empty directory, with this
Python's ``bin`` first on PATH (the venv of the README's quick start).

The doc marks what the test takes: ``<!-- getting-started: file NAME -->`` before a code block
that is the file NAME, ``<!-- getting-started: run -->`` before a shell block to run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvd.config import Config, LimitsConfig, TransferConfig
from kvd.demo.launch import DaemonProcess
from tests.hostile import events, wait_until
from tests.ports import unused_port

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "getting-started.md"
DOC_PEER_PORT = "17601"  # the gen daemon's peer_port on the page
_BLOCK = re.compile(r"<!-- getting-started: (run|file [\w.]+) -->\n```\w*\n(.*?)```", re.S)


def extract(doc: str) -> tuple[dict[str, str], str]:
    """The doc's files (name -> text) and its shell blocks joined in order."""
    files: dict[str, str] = {}
    script: list[str] = []
    for kind, body in _BLOCK.findall(doc):
        if kind == "run":
            script.append(body)
        else:
            name = kind.split()[1]
            assert name not in files, f"{name} appears twice"
            files[name] = body
    return files, "".join(script)


def test_markers_are_found() -> None:
    doc = DOC.read_text()
    files, script = extract(doc)
    assert len(_BLOCK.findall(doc)) == doc.count("<!-- getting-started:")  # every marker opens a block
    assert set(files) == {"gen.toml", "ctx.toml", "common.py", "ctx_executor.py", "gen_rank.py", "cancel.py"}
    assert "kvd serve --config gen.toml" in script and "python ctx_executor.py" in script


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvdgs-", dir="/tmp"))  # short: AF_UNIX paths
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_getting_started_runs_as_written(workdir: Path) -> None:
    files, script = extract(DOC.read_text())
    # The one change to the page: its peer port becomes a free one, so that the test does not fail
    # when someone on the machine is following the guide, or another checkout runs this test.
    assert DOC_PEER_PORT in files["gen.toml"] and DOC_PEER_PORT in files["ctx.toml"]
    port = str(unused_port())
    for name, text in files.items():
        (workdir / name).write_text(text.replace(DOC_PEER_PORT, port))
    (workdir / "run.sh").write_text("set -euo pipefail\n" + script.replace(DOC_PEER_PORT, port))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env = {k: v for k, v in env.items() if not k.startswith("KVD_")}
    proc = subprocess.Popen(["bash", "run.sh"], cwd=workdir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None or _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the script left: daemons, executors
            proc.wait()
    logs = {name: (workdir / f"{name}.log").read_text() for name in ("ctx", "gen") if (workdir / f"{name}.log").exists()}
    assert proc.returncode == 0, out + "".join(f"\n--- {n}.log\n{t[-3000:]}" for n, t in logs.items())
    lines = out.splitlines()
    assert "all gen ranks byte-exact" in lines
    assert any(re.fullmatch(r"ctx: sent 917504 bytes to gen over path bounce in [\d.]+ s", line) for line in lines), out
    for rank, heads in ((0, "0-3"), (1, "4-7")):
        assert f"gen rank {rank}: 917504 bytes over path bounce, heads {heads}: byte-exact" in lines, out
    row = next(line for line in lines if line.startswith("req-1"))
    assert row.split()[:5] == ["req-1", "ctx", "gen", "done", "bounce"]
    # section 6: the cancelled request, as the page says it prints and lists
    assert "gen rank 0: [transfer_cancelled] request 'req-2' cancelled by client" in lines, out
    row = next(line for line in lines if line.startswith("req-2"))
    assert row.split()[:4] == ["req-2", "gen", "-", "failed"] and "cancelled by client" in row, row
    # one transfer.done per side; both daemons drained and exited, sockets gone
    for name, role in (("ctx", "ctx"), ("gen", "gen")):
        events = [json.loads(line) for line in logs[name].splitlines() if line.startswith("{")]
        done = [e for e in events if e["event"] == "transfer.done"]
        assert [(e["request_id"], e["role"], e["bytes"]) for e in done] == [("req-1", role, 917504)]
        failed = [(e["request_id"], e["code"]) for e in events if e["event"] == "transfer.failed"]
        assert failed == ([("req-2", "transfer_cancelled")] if name == "gen" else [])
        assert events[-1]["event"] == "daemon.stopped"
        assert not (workdir / f"{name}.sock").exists()


def test_the_defaults_the_configs_state_are_true() -> None:
    """A ``key = value  # ... (default X)`` comment in the page's configurations names the key's
    real default (a guide that says 256 where kvd allocates 512 misleads whoever sizes memory)."""
    files, _ = extract(DOC.read_text())
    sections: dict[str, Any] = {"": Config, "transfer": TransferConfig, "limits": LimitsConfig}
    stated = []
    for name in ("gen.toml", "ctx.toml"):
        section = ""
        for line in files[name].splitlines():
            if header := re.fullmatch(r"\[(\w+)\]\s*", line):
                section = header.group(1)
            elif said := re.match(r"(\w+)\s*=.*#.*\(default ([^)]+)\)", line):
                key, value = said.groups()
                default = msgspec.structs.fields(sections[section])
                real = next(f.default for f in default if f.name == key)
                stated.append((name, key, value, str(real)))
    assert stated, "the page states no default any more: drop this test"
    assert [s for s in stated if s[2] != s[3]] == []
    # a peer that refuses the handshake: the page names the settings, here are their defaults
    doc = " ".join(DOC.read_text().split())
    assert "is retried after `transfer.reconnect_initial_s`, doubling up to `reconnect_max_s`" in doc


def test_the_retry_schedule_the_page_gives_is_true(daemon_factory: Callable[..., DaemonProcess],
                                                    short_tmp: Path) -> None:
    """A ctx daemon started before gen's peer port listens: the page says when it tries again.
    It said "after 1 s, then 2, 4, ..." (reconnect_initial_s, which paces refused handshakes);
    a refused TCP connect is retried within 0.1 s, the wait doubling up to 2 s, less a random
    part (up to half). Checked on a real daemon's retry lines, attempts 1 to 6 (the cap)."""
    doc = " ".join(DOC.read_text().split())
    assert ("it tries again within 0.1 s, then waits twice as long each time (less a random part), up to 2 s, "
            "so the link comes up by itself at most about 2 s after gen listens") in doc
    secret = short_tmp / "peer.secret"
    secret.write_text("s" * 64)
    secret.chmod(0o600)
    with socket.socket() as refusing:  # bound, never listening: every connect is refused
        refusing.bind(("127.0.0.1", 0))
        port = refusing.getsockname()[1]
        d = daemon_factory({"peer_secret_file": str(secret), "log_level": "debug",
                            "peers": [{"name": "gen", "host": "127.0.0.1", "port": port}]}, name="ctx")
        wait_until(lambda: len(events(d, "peer.connect_retry")) >= 6, "six refused connects")
    waits = [(r["attempt"], r["retry_in_s"]) for r in events(d, "peer.connect_retry")[:6]]
    assert [a for a, _ in waits] == [1, 2, 3, 4, 5, 6]
    for attempt, wait in waits:
        cap = min(2.0, 0.1 * 2 ** (attempt - 1))
        assert cap / 2 <= wait <= cap, (attempt, wait)
    assert all("Connection refused" in r["error"] for r in events(d, "peer.connect_retry"))


def test_what_the_doc_says_about_shapes_is_true(workdir: Path) -> None:
    """The pool shapes the scripts' comments and the semantics section state."""
    files, _ = extract(DOC.read_text())
    (workdir / "common.py").write_text(files["common.py"])
    sys.path.insert(0, str(workdir))
    try:
        import common  # type: ignore[import-not-found]

        ctx = msgspec.structs.replace(common.CTX, num_blocks=64)  # the pools' num_blocks
        gen = msgspec.structs.replace(common.GEN, num_blocks=64)
        assert ctx.pool_shape(0) == (64, 4, 2, 8, 16, 64)
        assert gen.pool_shape(0) == gen.pool_shape(1) == (4, 2, 64, 4, 16, 64)
        assert gen.head_range(0) == (0, 4) and gen.head_range(1) == (4, 8)
        assert common.blocks_needed(common.TOKENS) == 7 and ctx.block_bytes(0) * 7 == 917504
        doc = DOC.read_text()
        assert "`[64, 4, 2, 8, 16, 64]`" in doc and "`[4, 2, 64, 4, 16, 64]`" in doc
    finally:
        sys.path.remove(str(workdir))
        sys.modules.pop("common", None)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_token_count_mismatch_fails_as_the_page_says(daemon_factory: Callable[..., DaemonProcess],
                                                       short_tmp: Path) -> None:
    """The page said a mismatch fails the registration; both registrations are accepted (neither
    side knows the other's count yet) and both waits raise BadRequest with the two counts, in
    either order and whether gen names the ctx node or not."""
    from clients import Client
    from protocol.errors import BadRequest
    from protocol.layout import KVLayout
    from tests.transfer_harness import start_pair

    doc = " ".join(DOC.read_text().split())
    assert ("the request fails on both sides once they meet, `wait` raising `BadRequest` with both counts "
            "(`ctx has 3 blocks x 16 tokens = 48 token slots, gen has 2 blocks x 16 tokens = 32`)") in doc
    layout = KVLayout(num_layers=2, num_kv_heads=8, head_dim=64, tokens_per_block=16, dtype="bfloat16")
    pair = start_pair(daemon_factory, short_tmp, layout, layout)
    said = "ctx has 3 blocks x 16 tokens = 48 token slots, gen has 2 blocks x 16 tokens = 32"
    with Client(pair.ctx.socket_path, client="ctx", timeout=30) as ctx, \
            Client(pair.gen.socket_path, client="gen", timeout=30) as gen:
        for request, gen_first, peer in (("m1", True, ""), ("m2", False, ""), ("m3", True, "ctx")):
            def expect(request: str = request, peer: str = peer) -> None:
                gen.expect(request, "gen0", layout, 0, gen.alloc("gen0", 2), peer=peer)  # 32 token slots

            def publish(request: str = request) -> None:
                ctx.publish(request, "ctx0", layout, 0, ctx.alloc("ctx0", 3), peer="gen")  # 48

            for register in (expect, publish) if gen_first else (publish, expect):
                register()  # accepted: no error here
            for side in (ctx, gen):
                with pytest.raises(BadRequest, match=said):
                    side.wait(request, timeout_s=60)
