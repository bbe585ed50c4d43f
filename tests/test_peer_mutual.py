"""Two daemons that list each other under ``[[peers]]`` settle on one link: the one dialled by
the node whose name sorts first ("ctx" < "gen"). Transfers between them complete, and neither
log fills with links replacing each other. A restarted peer still replaces its stale link."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from clients import open_client
from kvd.demo.launch import DaemonProcess
from protocol.layout import KVLayout
from tests.hostile import events
from tests.ports import unused_port
from tests.transfer_harness import Pair, assert_exact, pools_for, run_transfer, write_secret

Factory = Callable[..., DaemonProcess]
GEO: dict[str, Any] = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 16,
                       "dtype": "bfloat16"}
CTX = KVLayout(**GEO)
GEN = KVLayout(**GEO, tp_size=2)
TRANSFER = {"bounce_size_mb": 4, "chunk_mb": 1, "deadline_s": 30.0, "mapped": False}


def _start_gen(factory: Factory, secret: str, ctx_port: int, gen_port: int) -> DaemonProcess:
    cfg: dict[str, Any] = {"pools": pools_for("gen", GEN, 16), "peer_secret_file": secret, "transfer": TRANSFER,
                           "peer_port": gen_port, "peers": [{"name": "ctx", "host": "127.0.0.1", "port": ctx_port}]}
    return factory(cfg, name="gen")


def _start_mutual(factory: Factory, workdir: Path) -> Pair:
    """gen (listing ctx, not up yet), then ctx listing gen: both dial. Both on ports of
    :func:`unused_port`: ctx's is named before ctx listens, gen's is the one a restarted gen takes."""
    secret = write_secret(workdir)
    ctx_port = unused_port()
    gen = _start_gen(factory, secret, ctx_port, unused_port())
    ctx = factory({"pools": pools_for("ctx", CTX, 16), "peer_secret_file": secret, "transfer": TRANSFER,
                   "peer_port": ctx_port, "peers": [{"name": "gen", "host": "127.0.0.1", "port": gen.peer_port}]},
                  name="ctx")
    return Pair(ctx, gen)


def _link_now(d: DaemonProcess, peer: str) -> dict[str, Any] | None:
    """The daemon's current link to ``peer`` from its log: the last ``peer.connected`` of a
    link ready for transfers, unless a ``peer.disconnected`` of that peer came after it."""
    current: dict[str, Any] | None = None
    for rec in events(d):
        if rec.get("node") != peer:
            continue
        if rec["event"] == "peer.connected" and "nixl_agent" in rec:
            current = rec
        elif rec["event"] == "peer.disconnected":
            current = None
    return current


def _settled(pair: Pair, gen_pid: int) -> bool:
    """Both daemons hold the link ctx dialled, to this gen instance: the link the pair keeps
    (nothing replaces it but a new instance of a daemon)."""
    at_ctx, at_gen = _link_now(pair.ctx, "gen"), _link_now(pair.gen, "ctx")
    return (at_ctx is not None and at_gen is not None and at_ctx.get("dialled_by") == "ctx"
            and at_gen.get("dialled_by") == "ctx" and at_ctx["nixl_agent"].startswith(f"gen-{gen_pid}-"))


async def _wait_settled(pair: Pair, timeout: float = 30.0) -> None:
    with trio.move_on_after(timeout):
        while not _settled(pair, pair.gen.pid):
            await trio.sleep(0.02)
        return
    counts = {name: len(events(d, "peer.replaced")) for name, d in (("ctx", pair.ctx), ("gen", pair.gen))}
    raise AssertionError(f"the pair never settled on the link ctx dialled; peer.replaced lines: {counts}; "
                         f"links: ctx {_link_now(pair.ctx, 'gen')}, gen {_link_now(pair.gen, 'ctx')}")


def _assert_quiet_log(d: DaemonProcess, *, replaced: int, duplicates: int) -> None:
    rep, dup = events(d, "peer.replaced"), events(d, "peer.duplicate_link")
    assert len(rep) <= replaced and len(dup) <= duplicates, (d.log_path, rep, dup)
    for rec in dup:  # both sides name the same link as the kept one
        assert rec["kept"] == "dialled by ctx" and rec["closed"] == "dialled by gen", rec
    assert "replaced by a new link" not in d.log()


async def test_peers_listed_on_both_sides_settle_on_one_link(daemon_factory: Factory, short_tmp: Path) -> None:
    pair = _start_mutual(daemon_factory, short_tmp)
    await _wait_settled(pair)
    for i in range(3):
        out = await run_transfer(pair, CTX, GEN, request_id=f"r-mutual-{i}", blocks=4, seed=i)
        assert_exact(out, GEN)
    # one startup race at most: each side closed the link gen dialled once, nothing replaced
    _assert_quiet_log(pair.ctx, replaced=0, duplicates=1)
    _assert_quiet_log(pair.gen, replaced=0, duplicates=1)
    for d in (pair.ctx, pair.gen):  # settling is no fault: a closed duplicate is an info line
        assert [r for r in events(d) if r["event"].startswith("peer.") and r["level"] != "info"] == []
    # the link that carried the transfers is the one from the start: no link came up since
    for d, peer in ((pair.ctx, "gen"), (pair.gen, "ctx")):
        ups = [r for r in events(d, "peer.connected") if "nixl_agent" in r and r["node"] == peer]
        assert len(ups) <= 2 and ups[-1]["dialled_by"] == "ctx", (d.log_path, ups)
    # kvctl peers says who dialled the kept link, though each daemon lists the other
    for d, peer, direction in ((pair.ctx, "gen", "outgoing"), (pair.gen, "ctx", "incoming")):
        async with open_client(d.socket_path) as c:
            assert [(p.node, p.state, p.direction) for p in await c.peers()] == [(peer, "up", direction)]


async def test_restarted_peer_listed_on_both_sides_replaces_its_link(daemon_factory: Factory,
                                                                     short_tmp: Path) -> None:
    pair = _start_mutual(daemon_factory, short_tmp)
    await _wait_settled(pair)
    out = await run_transfer(pair, CTX, GEN, request_id="r-before", blocks=4)
    assert_exact(out, GEN)
    gen_port, ctx_port = pair.gen.peer_port, pair.ctx.peer_port
    pair.gen.kill()
    pair.gen = _start_gen(daemon_factory, str(short_tmp / "peer.secret"), ctx_port, gen_port)
    await _wait_settled(pair)  # ctx's link reaches the new gen instance
    out = await run_transfer(pair, CTX, GEN, request_id="r-after", blocks=4, seed=1)
    assert_exact(out, GEN)
    # ctx: the old link replaced at most once (if the new gen dialled before ctx saw the old
    # one break), one startup race per gen instance at most
    _assert_quiet_log(pair.ctx, replaced=1, duplicates=2)
    _assert_quiet_log(pair.gen, replaced=0, duplicates=1)
    for rec in events(pair.ctx, "peer.replaced"):
        assert rec["reason"] == "a new instance of the peer", rec
