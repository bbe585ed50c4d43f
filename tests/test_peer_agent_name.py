"""A peer whose NIXL metadata is another agent's than the one its welcome names is refused.

The daemon keys a link by the agent its peer names (``PeerWelcome.nixl_agent``: whether a link
that comes back is the same peer instance, whose agent stays loaded, or a new one) and routes
NIXL notifications by the agent the metadata loads. If the two differ, neither is right, so the
link is refused with an error naming both (``peer.rejected``); an honest peer of the same node
links afterwards as usual. The peer is played on the wire by the test, with a real NIXL agent.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvd.demo.launch import DaemonProcess
from kvd.transport import NixlAgent, ensure_loopback_ucx
from protocol.peer import PeerBye, PeerWelcome, RegionDesc, encode_peer
from tests.hostile import RawPeer, events
from tests.test_bounce_older_peer import gen_daemon
from tests.transfer_harness import write_secret

Factory = Callable[..., DaemonProcess]


def _welcome(agent: NixlAgent, node: str, named: str) -> bytes:
    return encode_peer(PeerWelcome(node=node, software="kvd test", nixl_agent=named, nixl_metadata=agent.metadata(),
                                   bounce=[RegionDesc(name="recv", addr=4096, nbytes=1 << 20, slot_bytes=1 << 20,
                                                      slots=1)]))


def test_metadata_of_another_agent_than_the_welcome_names_is_refused(daemon_factory: Factory,
                                                                      short_tmp: Path) -> None:
    secret_path = write_secret(short_tmp)
    secret = Path(secret_path).read_bytes()
    gen = gen_daemon(daemon_factory, secret_path)
    ensure_loopback_ucx()
    with NixlAgent("ctx-real-agent") as agent:
        liar = RawPeer(gen.peer_port)
        liar.authenticate(secret, node="ctx")
        liar.send(_welcome(agent, "ctx", named="ctx-other-agent"))
        answers = liar.rest()
        liar.close()
        (rejected,) = gen.logged("peer.rejected", node="ctx")
        assert "'ctx-other-agent'" in rejected["error"] and "'ctx-real-agent'" in rejected["error"], rejected
        assert any(isinstance(m, PeerBye) and "ctx-other-agent" in m.reason for m in answers), answers
        assert not [r for r in events(gen, "peer.connected") if "nixl_agent" in r]  # no link came up

        honest = RawPeer(gen.peer_port)
        honest.authenticate(secret, node="ctx")
        honest.send(_welcome(agent, "ctx", named=agent.name))
        (up,) = gen.logged("peer.connected", node="ctx", nixl_agent=agent.name)
        assert up["nixl_agent_kept"] is False  # the refused link kept nothing loaded under the node
        honest.close()
        gen.logged("peer.disconnected", node="ctx")
    assert gen.proc.poll() is None  # the daemon serves on
