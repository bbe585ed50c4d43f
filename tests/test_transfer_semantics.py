"""What a caller can rely on: announced destinations, registration refusals, cancel rights,
wait timeouts, limits, one outcome per side, and no bounce staging on a local-only daemon."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from clients import open_client
from kvd.demo.launch import DaemonProcess
from protocol.errors import (
    BadRequest,
    BlocksInUse,
    IncompatibleLayout,
    PermissionDenied,
    TransferCancelled,
    UnknownPeer,
    WaitTimeout,
)
from protocol.layout import KVLayout
from tests.conftest import host_pool
from tests.transfer_harness import assert_exact, run_transfer, start_pair, wait_for_peer

Factory = Callable[..., DaemonProcess]
GEO = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 32, "dtype": "bfloat16"}
ONE = KVLayout(**GEO)  # type: ignore[arg-type]
TP2 = KVLayout(**GEO, tp_size=2)  # type: ignore[arg-type]


def _lines(d: DaemonProcess, event: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in d.log().splitlines() if f'"event":"{event}"' in line]


def _local(**extra: object) -> dict[str, object]:
    """ctx and gen pools on one daemon (node "kvd")."""
    return {"pools": [host_pool("ctx0"), host_pool("gen0")], **extra}


@pytest.mark.parametrize("announce", [True, False])
async def test_announced_destination_moves_data_without_a_round_trip(
        daemon_factory: Factory, short_tmp: Path, announce: bool) -> None:
    pair = start_pair(daemon_factory, short_tmp, ONE, TP2)
    out = await run_transfer(pair, ONE, TP2, request_id="r-ann", blocks=4, gen_peer="ctx" if announce else "")
    assert_exact(out, TP2)
    (done,) = pair.ctx.logged("transfer.done", request_id="r-ann")  # logged after the replies: waited for
    assert done["round_trips"] == (0 if announce else 1)


async def test_unknown_peer_is_refused_at_registration(daemon_factory: Factory) -> None:
    d = daemon_factory(_local())
    async with open_client(d.socket_path) as c:
        ids = await c.alloc("ctx0", 2)
        with pytest.raises(UnknownPeer, match="'gne'"):
            await c.publish("r1", "ctx0", ONE, 0, ids, peer="gne")
        with pytest.raises(UnknownPeer, match=r"'nowhere' is neither configured nor connected \(known peers: none; "
                           r"this node: 'kvd'\): check the name; a peer that dials this daemon .* retry when "
                           r"'kvctl peers' lists it, or list it in this daemon's \[\[peers\]\] too"):
            await c.expect("r1", "ctx0", ONE, 0, ids, peer="nowhere")
        assert await c.free("ctx0", ids) == 2  # nothing stayed registered


async def test_local_transfer_with_ctx_publishing_first(daemon_factory: Factory) -> None:
    d = daemon_factory(_local())
    async with open_client(d.socket_path) as gen, open_client(d.socket_path) as ctx:
        await ctx.publish("r-cf", "ctx0", ONE, 0, await ctx.alloc("ctx0", 2), peer="kvd", deadline_s=60)
        await gen.expect("r-cf", "gen0", ONE, 0, await gen.alloc("gen0", 2), deadline_s=60)
        assert (await gen.wait("r-cf")).path == "local"
        assert (await ctx.wait("r-cf")).ok


async def test_wait_timeout_is_distinct_and_the_transfer_goes_on(daemon_factory: Factory) -> None:
    d = daemon_factory(_local())
    async with open_client(d.socket_path) as gen, open_client(d.socket_path) as ctx:
        g_ids, c_ids = await gen.alloc("gen0", 2), await ctx.alloc("ctx0", 2)
        await gen.expect("r-wait", "gen0", ONE, 0, g_ids, deadline_s=60)
        with pytest.raises(WaitTimeout, match="goes on"):
            await gen.wait("r-wait", timeout_s=0.2)
        await ctx.publish("r-wait", "ctx0", ONE, 0, c_ids, peer="kvd")
        assert (await gen.wait("r-wait")).path == "local"
        assert (await ctx.wait("r-wait")).ok


async def test_only_the_registering_session_or_an_operator_cancels(daemon_factory: Factory) -> None:
    d = daemon_factory(_local())
    async with open_client(d.socket_path) as owner, open_client(d.socket_path) as other:
        ids = await owner.alloc("gen0", 2)
        await owner.expect("r-own", "gen0", ONE, 0, ids, deadline_s=60)
        with pytest.raises(PermissionDenied, match=r"not registered by this session \(another session registered it"):
            await other.cancel("r-own")
        assert (await owner.transfers())[0].state == "ready"  # untouched
        await other.cancel("r-own", force=True)  # same uid as the daemon: an operator
        with pytest.raises(TransferCancelled, match="operator"):
            await owner.wait("r-own")


async def test_blocks_of_an_unfinished_request_cannot_join_another(daemon_factory: Factory) -> None:
    d = daemon_factory(_local())
    async with open_client(d.socket_path) as c:
        ids = await c.alloc("gen0", 3)
        await c.expect("r-a", "gen0", ONE, 0, ids[:2], deadline_s=60)
        with pytest.raises(BlocksInUse, match="'r-a'"):
            await c.expect("r-b", "gen0", ONE, 0, ids[1:], deadline_s=60)
        await c.cancel("r-a")
        with pytest.raises(TransferCancelled):
            await c.wait("r-a")
        await c.expect("r-b", "gen0", ONE, 0, ids[1:], deadline_s=60)  # free again once r-a ended


async def test_a_pool_configured_as_one_rank_is_not_another(daemon_factory: Factory) -> None:
    d = daemon_factory({"pools": [host_pool("g0", tp_size=2, rank=0), host_pool("g1", tp_size=2, rank=1)]})
    async with open_client(d.socket_path) as c:
        ids = await c.alloc("g0", 2)
        with pytest.raises(BadRequest, match="configured as rank 0"):
            await c.expect("r1", "g0", TP2, 1, ids)


async def test_a_layout_the_pool_cannot_hold_is_refused_naming_the_fields_first(daemon_factory: Factory) -> None:
    d = daemon_factory({"pools": [host_pool("g0", tp_size=2, rank=0)]})
    async with open_client(d.socket_path) as c:
        ids = await c.alloc("g0", 2)
        with pytest.raises(IncompatibleLayout) as info:
            await c.expect("r-tp", "g0", KVLayout(**GEO, tp_size=4), 0, ids)  # type: ignore[arg-type]
        assert info.value.message.startswith(
            "pool 'g0' does not match rank 0 of the given layout: tp_size: pool has 2, request has 4; "
            "the pool holds shape "), info.value.message
        two = KVLayout(**{**GEO, "head_dim": 128, "dtype": "float16"}, tp_size=2)  # type: ignore[arg-type]
        with pytest.raises(IncompatibleLayout, match=r"layout: head_dim: pool has 64, request has 128, "
                                                     r"dtype: pool has bfloat16, request has float16; "):
            await c.publish("r-hd", "g0", two, 0, ids, peer="kvd")
        # refused, nothing registered: the same blocks serve a matching layout at once
        await c.expect("r-ok", "g0", TP2, 0, ids, deadline_s=60)
        await c.cancel("r-ok")


async def test_geometry_mismatch_on_one_daemon_fails_both_sides_at_once(daemon_factory: Factory) -> None:
    other = KVLayout(**{**GEO, "num_layers": 8})  # type: ignore[arg-type]
    d = daemon_factory({"pools": [host_pool("ctx0"), host_pool("gen0", num_layers=8)]})
    async with open_client(d.socket_path) as gen, open_client(d.socket_path) as ctx:
        await gen.expect("r-geo", "gen0", other, 0, await gen.alloc("gen0", 2), deadline_s=120)
        await ctx.publish("r-geo", "ctx0", ONE, 0, await ctx.alloc("ctx0", 2), peer="kvd", deadline_s=120)
        with trio.fail_after(30):  # far below the deadline: nobody waits for it
            with pytest.raises(IncompatibleLayout):
                await ctx.wait("r-geo")
            with pytest.raises(IncompatibleLayout):
                await gen.wait("r-geo")


async def test_finished_requests_do_not_count_against_limits(daemon_factory: Factory) -> None:
    d = daemon_factory(_local(limits={"max_inflight_per_session": 3}))
    async with open_client(d.socket_path) as gen, open_client(d.socket_path) as ctx:
        for i in range(8):  # ctx never waits; every earlier request has finished
            rid = f"r-{i}"
            await gen.expect(rid, "gen0", ONE, 0, await gen.alloc("gen0", 1), deadline_s=60)
            await ctx.publish(rid, "ctx0", ONE, 0, await ctx.alloc("ctx0", 1), peer="kvd", deadline_s=60)
            assert (await gen.wait(rid)).ok
        await gen.ping()  # the step that replied (and then logged transfer.done) has ended
        assert len(_lines(d, "transfer.done")) == 16


async def test_gen_rank_leaving_before_its_side_is_complete_fails_ctx_once(
        daemon_factory: Factory, short_tmp: Path) -> None:
    pair = start_pair(daemon_factory, short_tmp, ONE, TP2)
    async with open_client(pair.ctx.socket_path) as ctx:
        await wait_for_peer(ctx)
        await ctx.publish("r-half", "ctx0", ONE, 0, await ctx.alloc("ctx0", 2), peer="gen", deadline_s=120)
        async with open_client(pair.gen.socket_path) as g0:
            await g0.expect("r-half", "gen0", TP2, 0, await g0.alloc("gen0", 2), deadline_s=120)
        # rank 0's executor left before rank 1 registered: both sides fail now, not at the deadline
        with trio.fail_after(30):
            with pytest.raises(TransferCancelled, match="session"):
                await ctx.wait("r-half")
        async with open_client(pair.gen.socket_path) as g1:
            with pytest.raises(TransferCancelled):  # rank 1 comes late: told what happened
                await g1.expect("r-half", "gen1", TP2, 1, await g1.alloc("gen1", 2), deadline_s=120)
    for d in (pair.ctx, pair.gen):
        assert len([e for e in _lines(d, "transfer.failed") if e["request_id"] == "r-half"]) == 1
        assert not [e for e in _lines(d, "transfer.done") if e["request_id"] == "r-half"]


async def test_a_local_only_daemon_allocates_no_bounce_staging(daemon_factory: Factory) -> None:
    # the default bounce size (512 MiB for receiving and again for sending): never touched here
    d = daemon_factory({"pools": [host_pool("ctx0"), host_pool("gen0")], "transfer": {}})
    async with open_client(d.socket_path) as c:
        st = await c.stats()
        assert st.bounce_chunks_total == 0
        rss_kib = int(next(line.split()[1] for line in Path(f"/proc/{d.pid}/status").read_text().splitlines()
                           if line.startswith("VmRSS:")))
        assert rss_kib < 900 * 1024, f"{rss_kib >> 10} MiB resident with 2 small pools"
    assert "transport.staging_ready" not in d.log()


@pytest.mark.parametrize("gen_peer", ["", "ctx"])
async def test_ctx_publishing_first_still_transfers(daemon_factory: Factory, short_tmp: Path, gen_peer: str) -> None:
    """The offer waits on the gen daemon until the gen executors register (or name the peer)."""
    pair = start_pair(daemon_factory, short_tmp, ONE, TP2)
    async with open_client(pair.ctx.socket_path) as ctx, open_client(pair.gen.socket_path) as g0, \
            open_client(pair.gen.socket_path) as g1:
        await wait_for_peer(ctx)
        await wait_for_peer(g0)
        await ctx.publish("r-first", "ctx0", ONE, 0, await ctx.alloc("ctx0", 2), peer="gen", deadline_s=60)
        with pytest.raises(WaitTimeout):  # nobody expects it yet: it waits, and the offer with it
            await ctx.wait("r-first", timeout_s=0.3)
        for r, g in enumerate((g0, g1)):
            await g.expect("r-first", f"gen{r}", TP2, r, await g.alloc(f"gen{r}", 2), deadline_s=60, peer=gen_peer)
        with trio.fail_after(30):
            assert (await ctx.wait("r-first")).ok
            assert (await g0.wait("r-first")).ok and (await g1.wait("r-first")).ok


async def test_cancel_while_the_peer_link_is_down_is_prompt(daemon_factory: Factory, short_tmp: Path) -> None:
    """ctx published to a configured peer that is not up: its offer waits aside, a cancel does not."""
    from tests.transfer_harness import write_secret

    d = daemon_factory({"pools": [host_pool("ctx0")], "peer_secret_file": write_secret(short_tmp),
                        "peers": [{"name": "gen", "host": "127.0.0.1", "port": 9}]})  # nothing listens
    async with open_client(d.socket_path) as c:
        await c.publish("r-down", "ctx0", ONE, 0, await c.alloc("ctx0", 2), peer="gen", deadline_s=120)
        await c.cancel("r-down")
        with trio.fail_after(30), pytest.raises(TransferCancelled):
            await c.wait("r-down")
