"""Two peer-port handshakes that were not refused or not logged.

- A peer naming itself ``""`` was authenticated and linked. ``""`` is the daemon's own word
  for "no peer": gen sides that named no ctx peer are keyed by it, so such a link reached
  every unmatched gen side with any message (an ``XferPath`` failed each one) where a named
  peer can only offer. The handshake now refuses an empty node name, on both sides.
- A stranger whose first message is a ``PeerError`` naming ``auth_failed`` or
  ``version_mismatch`` was closed without a log line (the listener took the error for one the
  handshake had logged). It is now one (rate-limited) warning like any other refusal.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from clients import Client
from kvd.demo.launch import DaemonProcess
from kvd.peer.auth import load_secret, new_nonce
from protocol.peer import PEER_PROTOCOL_VERSION, PeerError, PeerHello, encode_peer
from tests.hostile import IO_TIMEOUT, Baseline, RawPeer, wait_until
from tests.transfer_harness import write_secret

Factory = Callable[..., DaemonProcess]


def _peer_daemon(factory: Factory, workdir: Path) -> tuple[DaemonProcess, bytes]:
    secret_path = write_secret(workdir, "refusals.secret")
    d = factory({"peer_secret_file": secret_path}, name="refusing")
    assert d.peer_port
    return d, load_secret(secret_path)


def _only_warning(base: Baseline, event: str) -> dict[str, object]:
    wait_until(lambda: any(r["event"] == event for r in base.new_warnings()), f"the {event} warning")
    got = base.new_warnings()
    assert [r["event"] for r in got] == [event], got
    return got[0]


def test_an_empty_node_name_is_refused(daemon_factory: Factory, short_tmp: Path) -> None:
    d, _secret = _peer_daemon(daemon_factory, short_tmp)
    base = Baseline.take(d)
    attacker = RawPeer(d.peer_port)
    attacker.send(encode_peer(PeerHello(version=PEER_PROTOCOL_VERSION, node="", nonce=new_nonce())))
    said = attacker.rest()  # no challenge: refused before the secret comes into it
    attacker.close()
    assert [type(msg) for msg in said] == [PeerError], said
    assert isinstance(said[0], PeerError) and said[0].code == "bad_request" and "node name" in said[0].message
    line = _only_warning(base, "peer.handshake_failed")
    assert "node name" in str(line["reason"])
    with Client(d.socket_path, client="probe", timeout=IO_TIMEOUT) as c:
        assert c.peers() == []
    base.check()


@pytest.mark.parametrize(("code", "event"), [("auth_failed", "peer.auth_failed"),
                                             ("version_mismatch", "peer.version_mismatch")])
def test_a_strangers_refusal_before_hello_is_logged(daemon_factory: Factory, short_tmp: Path,
                                                     code: str, event: str) -> None:
    d, _secret = _peer_daemon(daemon_factory, short_tmp)
    base = Baseline.take(d)
    stranger = RawPeer(d.peer_port)
    stranger.send(encode_peer(PeerError(code=code, message="go away")))
    assert stranger.rest() == []  # closed, nothing said to a stranger
    stranger.close()
    line = _only_warning(base, event)
    assert line["side"] == "server" and str(line["remote"]).startswith("127.0.0.1:")
    assert "go away" in str(line.get("reason") or line.get("error"))
    base.check()
