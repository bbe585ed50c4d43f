"""Faults during transfers: each ends in a clear error on both sides within the deadline, and
nothing stays leased (blocks) or in use (bounce chunks) afterwards, as the daemons' stats say."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import trio

from clients import open_client
from kvd.demo.launch import DaemonProcess
from protocol.errors import KvdError, PeerUnavailable, PermissionDenied, TransferCancelled, TransferTimeout
from protocol.layout import KVLayout
from tests.ports import unused_port
from tests.transfer_harness import assert_exact, run_transfer, start_pair, wait_for_peer, write_secret

Factory = Callable[..., DaemonProcess]
GEO = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 16, "dtype": "bfloat16"}
CTX = KVLayout(**GEO)  # type: ignore[arg-type]
GEN = KVLayout(**GEO, tp_size=2)  # type: ignore[arg-type]


async def assert_clean(*daemons: DaemonProcess) -> None:
    """No lease, no bounce chunk in use, no transfer running (executors have disconnected)."""
    for d in daemons:
        async with open_client(d.socket_path, client="checker") as c:
            with trio.fail_after(10):
                while True:
                    st = await c.stats()
                    if st.blocks_leased == 0 and st.bounce_chunks_in_use == 0 and st.transfers_active == 0:
                        break
                    await trio.sleep(0.05)


async def register_gen(d: DaemonProcess, rid: str, *, deadline_s: float, nursery: trio.Nursery,
                       results: dict[int, BaseException | object], blocks: int = 4) -> None:
    """Both gen ranks expect ``rid``; their wait outcomes land in ``results`` (at ``r``), and
    when each wait returned (``time.monotonic()``, at ``r + 100``)."""

    async def rank(r: int, task_status: trio.TaskStatus[None]) -> None:
        async with open_client(d.socket_path, client=f"gen{r}") as c:
            ids = await c.alloc(f"gen{r}", blocks)
            await c.expect(rid, f"gen{r}", GEN, r, ids, deadline_s=deadline_s)
            task_status.started()
            try:
                results[r] = await c.wait(rid)
            except KvdError as exc:
                results[r] = exc
            results[r + 100] = time.monotonic()

    for r in range(2):
        await nursery.start(rank, r)


async def publish_ctx(d: DaemonProcess, rid: str, *, deadline_s: float, blocks: int = 4) -> BaseException | object:
    async with open_client(d.socket_path, client="ctx0") as c:
        ids = await c.alloc("ctx0", blocks)
        await c.publish(rid, "ctx0", CTX, 0, ids, peer="gen", deadline_s=deadline_s)
        try:
            return await c.wait(rid)
        except KvdError as exc:
            return exc


async def test_deadline_expiry_when_ctx_never_publishes(daemon_factory: Factory, short_tmp: Path) -> None:
    pair = start_pair(daemon_factory, short_tmp, CTX, GEN)
    results: dict[int, object] = {}
    t0 = time.monotonic()
    async with trio.open_nursery() as n:
        await register_gen(pair.gen, "r-deadline", deadline_s=1.0, nursery=n, results=results)
    for r in range(2):
        res = results[r]
        assert isinstance(res, TransferTimeout), res
        # which request, which side, the deadline, what it waited for, what to check
        assert res.message.startswith("request 'r-deadline' (gen side) missed its deadline of 1 s while waiting for "
                                      "the ctx side to publish; check that the ctx executors publish this request "
                                      "id with this daemon as their peer"), res.message
        assert "deadline_s" in res.message and "(state " not in res.message
        # at the deadline, not never: a bound with room for a loaded machine (the message says
        # it was the deadline, not another timer)
        assert results[r + 100] - t0 < 10.0  # type: ignore[operator]
    await assert_clean(pair.ctx, pair.gen)


async def test_deadline_expiry_when_gen_never_expects(daemon_factory: Factory, short_tmp: Path) -> None:
    pair = start_pair(daemon_factory, short_tmp, CTX, GEN)
    t0 = time.monotonic()
    res = await publish_ctx(pair.ctx, "r-noexpect", deadline_s=1.0)
    assert isinstance(res, TransferTimeout), res
    # Two timers expire at the same instant: ctx's own, and gen's for the offer it holds (the
    # offer carries ctx's deadline; the machine tells ctx when gen's fires, on purpose:
    # test_transfer_fsm's test_unasked_offer_expires_and_tells_ctx). Whichever the ctx daemon
    # handles first words the one failure; each says the gen ranks never expected it.
    if res.message.startswith("gen side failed: "):
        assert res.message.startswith("gen side failed: request 'r-noexpect' (gen side) missed its deadline of "), \
            res.message
        assert "while waiting for the first gen ranks to expect it; check that every gen executor of the request " \
               "expects it" in res.message, res.message
    else:
        assert "peer 'gen' never accepted the offer" in str(res) and "gen rank" in str(res)  # says where to look
        assert res.message.startswith("request 'r-noexpect' (ctx side) missed its deadline of 1 s: "), res.message
    assert time.monotonic() - t0 < 10.0  # at the deadline (room for a loaded machine), not never
    await assert_clean(pair.ctx, pair.gen)


async def test_local_publish_whose_gen_side_never_expects_says_so(daemon_factory: Factory) -> None:
    """ctx names its own daemon as the peer (the local path) and no gen executor ever expects
    the request: a timeout that says the gen side never registered here, not a peer link down."""
    from tests.transfer_harness import pools_for

    solo = daemon_factory({"pools": pools_for("ctx", CTX, 16) + pools_for("gen", GEN, 16)}, name="solo")
    async with open_client(solo.socket_path, client="ctx0") as c:
        ids = await c.alloc("ctx0", 4)
        await c.publish("r-local", "ctx0", CTX, 0, ids, peer="solo", deadline_s=1.0)
        with pytest.raises(TransferTimeout) as info:
            await c.wait("r-local")
    msg = info.value.message
    assert msg.startswith("request 'r-local' (ctx side) missed its deadline of 1 s: no gen executor expected it on "
                          "this daemon (peer 'solo' is this daemon: the local path)"), msg
    assert "no link to peer" not in msg
    await assert_clean(solo)


async def test_a_gen_rank_naming_no_peer_learns_of_a_ctx_abort_that_came_first(
        daemon_factory: Factory, short_tmp: Path) -> None:
    """ctx publishes and cancels before any gen rank expects the request; a gen rank that then
    expects it without naming its ctx peer is refused with ctx's failure at once (it used to
    register a new request and wait for its whole deadline: only a rank naming the peer
    learnt of the abort)."""
    import json

    pair = start_pair(daemon_factory, short_tmp, CTX, GEN)
    async with open_client(pair.ctx.socket_path, client="ctx0") as c:
        await wait_for_peer(c)
        ids = await c.alloc("ctx0", 4)
        await c.publish("r-early-abort", "ctx0", CTX, 0, ids, peer="gen", deadline_s=60)
        # the offer must reach gen before the cancel: gen counts a transfer once it has it
        async with open_client(pair.gen.socket_path, client="probe") as probe:
            with trio.fail_after(20):
                while (await probe.stats()).transfers_active < 1:
                    await trio.sleep(0.02)
        await c.cancel("r-early-abort")
        with pytest.raises(TransferCancelled):
            await c.wait("r-early-abort")

    def dropped() -> bool:  # gen heard ctx's failure and ended its (never registered) side
        return any(json.loads(line).get("event") == "transfer.dropped"
                   and json.loads(line).get("request_id") == "r-early-abort"
                   for line in pair.gen.log().splitlines() if line.startswith("{"))

    with trio.fail_after(20):
        while not dropped():
            await trio.sleep(0.02)
    async with open_client(pair.gen.socket_path, client="gen0") as g:
        gids = await g.alloc("gen0", 4)
        t0 = time.monotonic()
        with pytest.raises(TransferCancelled, match="already failed: ctx side failed"):
            await g.expect("r-early-abort", "gen0", GEN, 0, gids, deadline_s=60)
        assert time.monotonic() - t0 < 10  # refused at once, not at the 60 s deadline
    await assert_clean(pair.ctx, pair.gen)


def _dead_port() -> socket.socket:
    """A socket bound to a 127.0.0.1 port that never listens: a connect there is refused (kept
    open by the caller so that no one else takes the port meanwhile)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


async def test_publish_to_a_configured_peer_that_is_down_says_what_to_do(
        daemon_factory: Factory, short_tmp: Path) -> None:
    from tests.transfer_harness import pools_for

    with _dead_port() as dead:
        port = dead.getsockname()[1]
        ctx = daemon_factory({"pools": pools_for("ctx", CTX, 16), "peer_secret_file": write_secret(short_tmp),
                              "peers": [{"name": "gen", "host": "127.0.0.1", "port": port}]}, name="ctx")
        res = await publish_ctx(ctx, "r-down", deadline_s=1.0)
    assert isinstance(res, PeerUnavailable), res
    assert res.message.startswith("request 'r-down' (ctx side) missed its deadline of 1 s: no link to peer 'gen'"), \
        res.message
    assert res.message.endswith(f"; start the peer daemon, or check its [[peers]] host/port (127.0.0.1:{port}) "
                                "in this daemon's configuration"), res.message
    await assert_clean(ctx)


async def _publish_after_refusal(ctx: DaemonProcess, rid: str, peer: str) -> BaseException | object:
    """ctx's dialler was refused once (its log says so), then ctx publishes to ``peer``: its
    failure at the deadline names that refusal and the advice for it."""
    with trio.fail_after(20):
        while '"peer.connect_failed"' not in ctx.log():
            await trio.sleep(0.02)
    async with open_client(ctx.socket_path, client="ctx0") as c:
        ids = await c.alloc("ctx0", 4)
        await c.publish(rid, "ctx0", CTX, 0, ids, peer=peer, deadline_s=1.0)
        try:
            return await c.wait(rid)
        except KvdError as exc:
            return exc


async def test_publish_to_a_peer_entry_naming_another_node_says_which_names(
        daemon_factory: Factory, short_tmp: Path) -> None:
    """ctx's [[peers]] entry names 'gne' but the daemon at that address is 'gen': the advice
    names both (it used to say "start the peer daemon", which runs)."""
    from tests.transfer_harness import pools_for

    secret = write_secret(short_tmp)
    gen = daemon_factory({"pools": pools_for("gen", GEN, 16), "peer_secret_file": secret}, name="gen")
    ctx = daemon_factory({"pools": pools_for("ctx", CTX, 16), "peer_secret_file": secret,
                          "peers": [{"name": "gne", "host": "127.0.0.1", "port": gen.peer_port}]}, name="ctx")
    res = await _publish_after_refusal(ctx, "r-name", "gne")
    assert isinstance(res, PeerUnavailable), res
    assert res.message.startswith("request 'r-name' (ctx side) missed its deadline of 1 s: no link to peer 'gne' "
                                  "(last attempt: "), res.message
    assert res.message.endswith("; the daemon at that address announced the node name 'gen', but this daemon's "
                                "[[peers]] entry expects 'gne': if it is the peer meant, rename the entry to 'gen' "
                                "(and name that peer in requests) or set that daemon's node to 'gne'; otherwise "
                                "fix the entry's host/port"), res.message
    assert "start the peer daemon" not in res.message
    await assert_clean(ctx, gen)


async def test_publish_to_a_peer_with_our_own_node_name_says_to_rename_one(
        daemon_factory: Factory, short_tmp: Path) -> None:
    """The daemon at ctx's [[peers]] address was configured with ctx's own node name (two
    configurations copied from one): the advice says so and what to set, not "start the peer
    daemon" (it runs)."""
    from tests.transfer_harness import pools_for

    secret = write_secret(short_tmp)
    gen = daemon_factory({"pools": pools_for("gen", GEN, 16), "peer_secret_file": secret, "node": "ctx"}, name="gen")
    ctx = daemon_factory({"pools": pools_for("ctx", CTX, 16), "peer_secret_file": secret,
                          "peers": [{"name": "gen", "host": "127.0.0.1", "port": gen.peer_port}]}, name="ctx")
    res = await _publish_after_refusal(ctx, "r-own-name", "gen")
    assert isinstance(res, PeerUnavailable), res
    assert "has our own node name 'ctx'" in res.message, res.message
    assert res.message.endswith(f"; the daemon at 127.0.0.1:{gen.peer_port} announced this daemon's own node name "
                                "'ctx': every daemon needs a node name of its own (two configurations copied from "
                                "one?): set node (KVD_NODE) in one of them and restart that daemon"), res.message
    assert "start the peer daemon" not in res.message
    await assert_clean(ctx, gen)


async def test_publish_to_an_address_that_never_completes_the_handshake_says_what_to_check(
        daemon_factory: Factory, short_tmp: Path) -> None:
    """Something at ctx's [[peers]] address accepts the connection and says nothing (another
    service, or a stalled daemon): after ``[limits] handshake_timeout_s`` (which the dialler
    now honours as the listener does) the advice names the address and what to check."""
    from tests.transfer_harness import pools_for

    async def silent(stream: trio.SocketStream) -> None:  # reads until closed, answers nothing
        with trio.move_on_after(30):
            while await stream.receive_some():
                pass
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, silent, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        ctx = daemon_factory({"pools": pools_for("ctx", CTX, 16), "peer_secret_file": write_secret(short_tmp),
                              "limits": {"handshake_timeout_s": 0.5},
                              "peers": [{"name": "gen", "host": "127.0.0.1", "port": port}]}, name="ctx")
        res = await _publish_after_refusal(ctx, "r-silent", "gen")
        nursery.cancel_scope.cancel()
    assert isinstance(res, PeerUnavailable), res
    assert "did not complete the handshake within 0.5 s" in res.message, res.message
    assert res.message.endswith(f"; something at 127.0.0.1:{port} accepted the connection but did not complete the "
                                "peer handshake within 0.5 s: check that this is the peer daemon's peer_port (not "
                                "another service's) and that the daemon there is not stalled (kvctl status on that "
                                "node)"), res.message
    assert "start the peer daemon" not in res.message
    await assert_clean(ctx)


@pytest.mark.parametrize("reply", ["challenge", "refusal"])
async def test_publish_to_a_peer_of_another_protocol_version_says_to_align_versions(
        daemon_factory: Factory, short_tmp: Path, reply: str) -> None:
    """The daemon at ctx's [[peers]] address speaks another peer protocol: it challenges with
    its version (both versions known), or refuses ours as a newer kvd does (ours known). The
    advice says both daemons must run compatible kvd versions, naming what is known."""
    from importlib.metadata import version as installed

    from kvd.peer.auth import new_nonce
    from protocol.peer import PEER_PROTOCOL_VERSION, PeerChallenge, PeerError, encode_peer
    from tests.transfer_harness import pools_for

    theirs = PEER_PROTOCOL_VERSION + 1
    answer = encode_peer(
        PeerChallenge(version=theirs, node="gen", nonce=new_nonce(), mac=b"") if reply == "challenge" else
        PeerError(code="version_mismatch", message=f"peer 'ctx' speaks peer protocol {PEER_PROTOCOL_VERSION}, "
                  f"we speak {theirs}"))

    async def other_kvd(stream: trio.SocketStream) -> None:  # answers the hello, reads until closed
        with trio.move_on_after(10):
            await stream.send_all(answer)
            while await stream.receive_some():
                pass
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, other_kvd, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        ctx = daemon_factory({"pools": pools_for("ctx", CTX, 16), "peer_secret_file": write_secret(short_tmp),
                              "peers": [{"name": "gen", "host": "127.0.0.1", "port": port}]}, name="ctx")
        res = await _publish_after_refusal(ctx, "r-version", "gen")
        nursery.cancel_scope.cancel()
    assert isinstance(res, PeerUnavailable), res
    assert res.message.startswith("request 'r-version' (ctx side) missed its deadline of 1 s: no link to peer "
                                  "'gen' (last attempt: "), res.message
    ours = f"this daemon runs kvd {installed('kvd')} (peer protocol {PEER_PROTOCOL_VERSION})"
    peer = (f"the peer speaks peer protocol {theirs}" if reply == "challenge" else
            "the peer refused that protocol (its refusal above, or its log, says which one it speaks)")
    assert res.message.endswith(f"; both daemons must run compatible kvd versions: {ours}, {peer}; install the "
                                "same kvd release on both nodes and restart the daemon that changed"), res.message
    assert "start the peer daemon" not in res.message
    await assert_clean(ctx)


async def test_expect_naming_a_configured_peer_that_is_down_fails_at_its_deadline(
        daemon_factory: Factory, short_tmp: Path) -> None:
    """gen names its ctx daemon (``expect(peer=)``) but the link never comes up: the announce
    never leaves, so no ctx write can land. Both ranks' waits fail at the deadline (they used
    to hang: the side counted its destination as handed out and waited for ctx's word), and
    nothing stays leased or running."""
    from tests.transfer_harness import pools_for

    results: dict[int, object] = {}

    async def rank(d: DaemonProcess, r: int, task_status: trio.TaskStatus[None]) -> None:
        async with open_client(d.socket_path, client=f"gen{r}") as c:
            ids = await c.alloc(f"gen{r}", 4)
            await c.expect("r-unsent", f"gen{r}", GEN, r, ids, peer="ctx", deadline_s=1.0)
            task_status.started()
            try:
                results[r] = await c.wait("r-unsent")
            except KvdError as exc:
                results[r] = exc

    with _dead_port() as dead:
        port = dead.getsockname()[1]
        gen = daemon_factory({"pools": pools_for("gen", GEN, 16), "peer_secret_file": write_secret(short_tmp),
                              "peers": [{"name": "ctx", "host": "127.0.0.1", "port": port}]}, name="gen")
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for r in range(2):
                    await nursery.start(rank, gen, r)
    for r in range(2):
        res = results[r]
        # the announce never left: never "announced to it", whichever deadline handler ran first
        assert isinstance(res, PeerUnavailable), results
        assert res.message.startswith("request 'r-unsent' (gen side): its destination never reached the peer: "
                                      "no link to peer 'ctx' (last attempt: "), res.message
        assert res.message.endswith(f"; start the peer daemon, or check its [[peers]] host/port (127.0.0.1:{port}) "
                                    "in this daemon's configuration"), res.message
        assert "announced" not in res.message, res.message
    await assert_clean(gen)


async def test_expect_naming_a_peer_with_another_secret_says_the_destination_never_left(
        daemon_factory: Factory, short_tmp: Path) -> None:
    """gen names its ctx daemon (``expect(peer=)``) but the two read different secrets: the
    link never comes up, so no announce ever leaves. Every gen wait ends in ``PeerUnavailable``
    naming the refused handshake and the secret advice, never a timeout saying the destination
    was announced. At each request's deadline two handlers wake (the transfer's deadline and
    the sender waiting for the link), in an order the scheduler picks anew for each: eight
    requests make both orders happen in a run all but once in 128."""
    from tests.transfer_harness import pools_for

    rids = [f"r-secret-{i}" for i in range(8)]
    results: dict[tuple[str, int], object] = {}

    async def rank(rid: str, r: int, task_status: trio.TaskStatus[None]) -> None:
        async with open_client(gen.socket_path, client=f"gen{r}-{rid}") as c:
            ids = await c.alloc(f"gen{r}", 1)
            await c.expect(rid, f"gen{r}", GEN, r, ids, peer="ctx", deadline_s=1.5)
            task_status.started()
            try:
                results[rid, r] = await c.wait(rid)
            except KvdError as exc:
                results[rid, r] = exc

    ctx = daemon_factory({"pools": pools_for("ctx", CTX, 16),
                          "peer_secret_file": write_secret(short_tmp, "ctx.secret")}, name="ctx")
    gen_secret = write_secret(short_tmp, "gen.secret")
    gen = daemon_factory({"pools": pools_for("gen", GEN, 16), "peer_secret_file": gen_secret,
                          "peers": [{"name": "ctx", "host": "127.0.0.1", "port": ctx.peer_port}]}, name="gen")
    # the refusal is known before any request waits: each one's failure can name it
    with trio.fail_after(20):
        while '"peer.auth_failed"' not in gen.log():
            await trio.sleep(0.02)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for rid in rids:
                for r in range(2):
                    await nursery.start(rank, rid, r)
    assert len(results) == 2 * len(rids), results
    for (rid, _r), res in sorted(results.items()):
        assert isinstance(res, PeerUnavailable), (rid, res)
        assert res.message.startswith(f"request {rid!r} (gen side): its destination never reached the peer: "
                                      "no link to peer 'ctx' (last attempt: "), res.message
        assert "failed the shared-secret handshake" in res.message, res.message
        assert "both daemons must read the same secret" in res.message and gen_secret in res.message, res.message
        assert "announced" not in res.message and "start the peer daemon" not in res.message, res.message
    await assert_clean(gen, ctx)


async def test_peer_without_the_secret_is_refused(daemon_factory: Factory, short_tmp: Path) -> None:
    gen_secret = write_secret(short_tmp, "gen.secret")
    ctx_secret = write_secret(short_tmp, "ctx.secret")
    from tests.transfer_harness import pools_for

    gen = daemon_factory({"pools": pools_for("gen", GEN, 16), "peer_secret_file": gen_secret}, name="gen")
    ctx = daemon_factory({"pools": pools_for("ctx", CTX, 16), "peer_secret_file": ctx_secret,
                          "peers": [{"name": "gen", "host": "127.0.0.1", "port": gen.peer_port}]}, name="ctx")
    results: dict[int, object] = {}
    async with trio.open_nursery() as n:
        await register_gen(gen, "r-auth", deadline_s=2.0, nursery=n, results=results)
        res = await publish_ctx(ctx, "r-auth", deadline_s=2.0)
    assert isinstance(res, PeerUnavailable), res
    assert "auth" in str(res).lower()
    for r in range(2):
        assert isinstance(results[r], TransferTimeout), results[r]
    # ctx logs its refusal before its publish fails; gen logs its own when it reads ctx's,
    # which may come a moment later
    assert '"peer.auth_failed"' in ctx.log()
    with trio.fail_after(20):
        while '"peer.auth_failed"' not in gen.log():
            await trio.sleep(0.02)
    await assert_clean(ctx, gen)


async def test_peer_that_never_grants_credit_times_out_both_sides(daemon_factory: Factory, short_tmp: Path) -> None:
    pair = start_pair(daemon_factory, short_tmp, CTX, GEN, transfer={"bounce_wait_s": 30.0},
                      gen_extra={"transfer": {"bounce_size_mb": 4, "chunk_mb": 1, "grant_credits": False}})
    results: dict[int, object] = {}
    async with trio.open_nursery() as n:
        await register_gen(pair.gen, "r-nocredit", deadline_s=2.0, nursery=n, results=results)
        async with open_client(pair.ctx.socket_path) as c:
            await wait_for_peer(c)
        res = await publish_ctx(pair.ctx, "r-nocredit", deadline_s=1.5)
    assert isinstance(res, TransferTimeout), res
    assert "streaming" in str(res) or "deadline" in str(res)
    for r in range(2):
        assert isinstance(results[r], KvdError), results[r]
    await assert_clean(pair.ctx, pair.gen)


async def test_no_credit_within_bound_falls_back_per_fragment(daemon_factory: Factory, short_tmp: Path) -> None:
    pair = start_pair(daemon_factory, short_tmp, CTX, GEN, transfer={"bounce_wait_s": 0.3},
                      gen_extra={"transfer": {"bounce_size_mb": 4, "chunk_mb": 1, "grant_credits": False}})
    out = await run_transfer(pair, CTX, GEN, request_id="r-fallback", blocks=4)
    assert_exact(out, GEN)
    for c in [*out.ctx.values(), *out.gen.values()]:
        assert c.path == "fragment" and c.fallback == "fragment", c
    assert '"transfer.bounce_fallback"' in pair.ctx.log()
    await assert_clean(pair.ctx, pair.gen)


async def test_peer_killed_mid_transfer(daemon_factory: Factory, short_tmp: Path) -> None:
    geo = {**GEO, "num_layers": 32}
    ctx_l, gen_l = KVLayout(**geo), KVLayout(**{**geo, "tp_size": 2})  # type: ignore[arg-type]
    pair = start_pair(daemon_factory, short_tmp, ctx_l, gen_l, num_blocks=64,
                      transfer={"bounce_size_mb": 2, "chunk_mb": 1})
    results: dict[int, object] = {}

    async def gen_rank(r: int, task_status: trio.TaskStatus[None]) -> None:
        async with open_client(pair.gen.socket_path) as c:
            ids = await c.alloc(f"gen{r}", 64)
            await c.expect("r-kill", f"gen{r}", gen_l, r, ids, deadline_s=60)
            task_status.started()
            try:
                results[r] = await c.wait("r-kill")
            except KvdError as exc:
                results[r] = exc

    async def killer() -> None:
        async with open_client(pair.gen.socket_path) as c:
            with trio.fail_after(15):  # the transfer must get under way: no unbounded poll
                while not any(t.state == "receiving" and t.chunks_done > 0 for t in await c.transfers()):
                    await trio.sleep(0.002)
        os.kill(pair.gen.pid, signal.SIGKILL)

    t0 = time.monotonic()
    async with trio.open_nursery() as n:
        for r in range(2):
            await n.start(gen_rank, r)
        n.start_soon(killer)
        async with open_client(pair.ctx.socket_path) as c:
            ids = await c.alloc("ctx0", 64)
            await c.publish("r-kill", "ctx0", ctx_l, 0, ids, peer="gen", deadline_s=60)
            with pytest.raises((PeerUnavailable, KvdError)) as info:
                await c.wait("r-kill")
    # long before the 60 s deadline (room for a loaded machine): the kill ended it, not the clock
    assert time.monotonic() - t0 < 45
    assert isinstance(info.value, PeerUnavailable) or "disconnect" in str(info.value), info.value
    for r in range(2):  # the gen executors lost their daemon: a clean connection error
        assert isinstance(results[r], KvdError), results[r]
    await assert_clean(pair.ctx)


EXECUTOR = """
import sys, time, os
from clients import Client
from protocol.layout import KVLayout
c = Client(sys.argv[1])
ids = c.alloc("ctx0", 4)
c.publish("r-exec", "ctx0", KVLayout(4, 8, 64, 16, "bfloat16"), 0, ids, peer="gen", deadline_s=30)
print("published", flush=True)
time.sleep(60)
"""


async def test_executor_killed_after_publish(daemon_factory: Factory, short_tmp: Path) -> None:
    # no credit, long bounce wait: the transfer is still in flight when the executor dies
    pair = start_pair(daemon_factory, short_tmp, CTX, GEN, transfer={"bounce_wait_s": 30.0},
                      gen_extra={"transfer": {"bounce_size_mb": 4, "chunk_mb": 1, "grant_credits": False}})
    results: dict[int, object] = {}
    async with trio.open_nursery() as n:
        await register_gen(pair.gen, "r-exec", deadline_s=30.0, nursery=n, results=results)
        async with open_client(pair.ctx.socket_path) as c:
            await wait_for_peer(c)
        proc = subprocess.Popen([sys.executable, "-c", EXECUTOR, pair.ctx.socket_path], stdout=subprocess.PIPE)
        assert proc.stdout is not None
        line = await trio.to_thread.run_sync(proc.stdout.readline)
        assert line.strip() == b"published"
        # in flight: ctx's data path runs (and waits for the credit gen never grants)
        async with open_client(pair.ctx.socket_path, client="watcher") as c:
            with trio.fail_after(15):
                while not any(t.request_id == "r-exec" and t.role == "ctx" and t.state == "sending"
                              for t in await c.transfers()):
                    await trio.sleep(0.02)
        killed = time.monotonic()
        proc.kill()
        proc.wait()
        proc.stdout.close()
    for r in range(2):
        assert isinstance(results[r], TransferCancelled), results[r]
        assert "session" in str(results[r])
        # told when the executor died, far from the 30 s deadline (timed from the kill: the
        # executor's start-up before it is no part of it)
        assert results[r + 100] - killed < 20  # type: ignore[operator]
    await assert_clean(pair.ctx, pair.gen)


async def test_cancel_by_request_id(daemon_factory: Factory, short_tmp: Path) -> None:
    """Another session may not cancel the request; an operator (the daemon's uid) may, with force."""
    pair = start_pair(daemon_factory, short_tmp, CTX, GEN)
    results: dict[int, object] = {}
    async with trio.open_nursery() as n:
        await register_gen(pair.gen, "r-cancel", deadline_s=30.0, nursery=n, results=results)
        async with open_client(pair.gen.socket_path) as c:
            with pytest.raises(PermissionDenied, match="another session"):
                await c.cancel("r-cancel")
            await c.cancel("r-cancel", force=True)
    for r in range(2):
        assert isinstance(results[r], TransferCancelled), results[r]
    await assert_clean(pair.gen)


async def test_restarted_peer_is_reconnected(daemon_factory: Factory, short_tmp: Path) -> None:
    port = unused_port()  # gen is restarted on it: a port nothing else takes meanwhile
    pair = start_pair(daemon_factory, short_tmp, CTX, GEN, gen_extra={"peer_port": port})
    out = await run_transfer(pair, CTX, GEN, request_id="r-before", blocks=4)
    assert_exact(out, GEN)
    pair.gen.kill()
    from tests.transfer_harness import pools_for

    secret = str(short_tmp / "peer.secret")
    gen2 = daemon_factory({"pools": pools_for("gen", GEN, 16), "peer_secret_file": secret, "peer_port": port,
                           "transfer": {"bounce_size_mb": 4, "chunk_mb": 1}}, name="gen")
    pair.gen = gen2
    out = await run_transfer(pair, CTX, GEN, request_id="r-after", blocks=4)
    assert_exact(out, GEN)


GEN_EXECUTOR = """
import sys, time
from clients import Client
from protocol.layout import KVLayout
c = Client(sys.argv[1])
ids = c.alloc("gen1", 4)
c.expect(sys.argv[2], "gen1", KVLayout(4, 8, 64, 16, "bfloat16", tp_size=2), 1, ids, ranks=[0, 1],
         deadline_s=60, peer=sys.argv[3])
print("expected", flush=True)
time.sleep(120)
"""


def _failed(d: DaemonProcess, rid: str) -> list[str]:
    return [line for line in d.log().splitlines() if '"event":"transfer.failed"' in line and f'"{rid}"' in line]


@pytest.mark.parametrize("gen_peer", ["", "ctx"])
async def test_gen_executor_killed_before_ctx_publishes_fails_ctx(
        daemon_factory: Factory, short_tmp: Path, gen_peer: str) -> None:
    """Every gen rank registered, one is killed, then ctx publishes: ctx learns gen's failure
    from the gen daemon (the offer is answered with it), instead of waiting for its deadline."""
    pair = start_pair(daemon_factory, short_tmp, CTX, GEN)
    rid = "r-genfail"
    async with open_client(pair.gen.socket_path, client="gen0") as g0:
        await wait_for_peer(g0)
        await g0.expect(rid, "gen0", GEN, 0, await g0.alloc("gen0", 4), ranks=[0, 1], deadline_s=60, peer=gen_peer)
        proc = subprocess.Popen([sys.executable, "-c", GEN_EXECUTOR, pair.gen.socket_path, rid, gen_peer],
                                stdout=subprocess.PIPE)
        assert proc.stdout is not None
        line = await trio.to_thread.run_sync(proc.stdout.readline)
        assert line.strip() == b"expected"  # the gen side is complete: both ranks registered
        proc.kill()
        proc.wait()
        proc.stdout.close()
        with pytest.raises(TransferCancelled, match="session"):
            await g0.wait(rid)
    async with open_client(pair.ctx.socket_path, client="ctx0") as c:
        ids = await c.alloc("ctx0", 4)
        registered = False
        # the deadline is far off: the failure comes from the gen daemon's answer, not from it
        with trio.fail_after(30), pytest.raises(TransferCancelled, match="gen side failed") as info:
            await c.publish(rid, "ctx0", CTX, 0, ids, peer="gen", deadline_s=120)
            registered = True
            await c.wait(rid)
        assert info.value.code == TransferCancelled.code
    if not gen_peer:  # gen never spoke to ctx: the publish is accepted, its offer answered with the failure
        assert registered
    # (with a named peer gen told ctx proactively: a publish after that news is refused at once)
    assert len(_failed(pair.gen, rid)) == 1
    assert len(_failed(pair.ctx, rid)) == (1 if registered else 0)
    # both daemons serve a new request, and nothing stays leased
    out = await run_transfer(pair, CTX, GEN, request_id="r-after-genfail", blocks=4, gen_peer=gen_peer)
    assert_exact(out, GEN)
    await assert_clean(pair.ctx, pair.gen)
