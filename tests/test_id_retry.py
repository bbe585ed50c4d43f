"""A request retried under the same id after it failed for want of the other side.

A router that gives up on a request at its deadline often retries it under the same id. When
the first attempt's peer side is still remembered (an ended request is kept until its deadline
and ``remember_ended_s`` after, so that its late ranks learn how it ended), the retry used to
get the first attempt's failure: the peer answered the retry's announcement or offer with it,
and the retry failed at once with the old deadline's message. Each side now names its own
number for a request in its announcement or offer; a new number is a new request, and the
remembered one gives way to it (``transfer.replaced``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from clients import open_client
from kvd.demo.launch import DaemonProcess
from protocol.errors import TransferCancelled, TransferTimeout
from protocol.layout import KVLayout
from tests.transfer_harness import logged, pools_for, proxied_pair, start_pair, wait_for_peer

Factory = Callable[..., DaemonProcess]
LAYOUT_FIELDS: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 32, "tokens_per_block": 8,
                                 "dtype": "bfloat16"}
LAYOUT = KVLayout(**LAYOUT_FIELDS)
RID = "r-retry"
DEBUG = {"log_level": "debug"}


@pytest.mark.parametrize("first", ["gen", "ctx"])
async def test_a_retry_after_the_other_side_never_came_runs(daemon_factory: Factory, short_tmp: Path,
                                                            first: str) -> None:
    """gen first: gen announces (``peer=``), ctx never publishes, gen's wait times out; the
    retry announces again and ctx publishes. ctx first: ctx offers, gen never expects, ctx's
    wait times out; the retry offers again and gen expects. Both attempts of the retry end ok,
    byte for byte."""
    pair = start_pair(daemon_factory, short_tmp, LAYOUT, LAYOUT, num_blocks=16, ctx_extra=DEBUG, gen_extra=DEBUG)
    async with open_client(pair.gen.socket_path, client="gen-exec") as g, \
            open_client(pair.ctx.socket_path, client="ctx-exec") as c:
        await wait_for_peer(g)
        await wait_for_peer(c)
        ctx_pool, gen_pool = await c.attach("ctx0"), await g.attach("gen0")
        ctx_ids, gen_ids = await c.alloc("ctx0", 4), await g.alloc("gen0", 4)
        data = torch.randint(-(2**15), 2**15, (4, *ctx_pool.tensor.shape[1:]), dtype=torch.int16)
        ctx_pool.tensor.view(torch.int16)[torch.tensor(ctx_ids)] = data

        # the first attempt: only one side comes, and its deadline passes
        lone, other = (g, c) if first == "gen" else (c, g)
        if first == "gen":
            await g.expect(RID, "gen0", LAYOUT, 0, gen_ids, peer="ctx", deadline_s=1.0)
        else:
            await c.publish(RID, "ctx0", LAYOUT, 0, ctx_ids, peer="gen", deadline_s=1.0)
        with pytest.raises(TransferTimeout, match="missed its deadline"):
            await lone.wait(RID)
        # the other daemon ended its side of the first attempt too (no rank of it had registered there)
        other_daemon = pair.ctx if first == "gen" else pair.gen
        await logged(other_daemon, "transfer.dropped", request_id=RID)

        # the retry, same id: the first side registers again; the other daemon lets the new
        # request replace the ended one it remembers, and then the other side registers
        if first == "gen":
            await g.expect(RID, "gen0", LAYOUT, 0, gen_ids, peer="ctx", deadline_s=30.0)
        else:
            await c.publish(RID, "ctx0", LAYOUT, 0, ctx_ids, peer="gen", deadline_s=30.0)
        await logged(other_daemon, "transfer.replaced", request_id=RID)
        if first == "gen":
            await c.publish(RID, "ctx0", LAYOUT, 0, ctx_ids, peer="gen", deadline_s=30.0)
        else:
            await g.expect(RID, "gen0", LAYOUT, 0, gen_ids, peer="ctx", deadline_s=30.0)
        assert (await other.wait(RID)).ok
        assert (await lone.wait(RID)).ok
        assert torch.equal(gen_pool.tensor.view(torch.int16)[torch.tensor(gen_ids)], data)


async def test_a_retry_after_the_gen_daemon_restarted_runs(daemon_factory: Factory, short_tmp: Path) -> None:
    """Request numbers start at random in each daemon process: gen's first request after a
    restart does not carry the number of the first attempt's announcement (both were their
    process's first), which ctx would take for that attempt and answer with its failure."""
    config = {"pools": pools_for("gen", LAYOUT, 16), "log_level": "debug", "node": "gen"}
    async with proxied_pair(daemon_factory, short_tmp, {"pools": pools_for("ctx", LAYOUT, 16), **DEBUG},
                            config) as (pair, proxy):
        async with open_client(pair.gen.socket_path, client="gen-exec") as g:
            await g.expect(RID, "gen0", LAYOUT, 0, await g.alloc("gen0", 4), peer="ctx", deadline_s=1.0)
            with pytest.raises(TransferTimeout, match="missed its deadline"):
                await g.wait(RID)
        await logged(pair.ctx, "transfer.dropped", request_id=RID)

        pair.gen.kill()  # SIGKILL: a new gen process in its place, which ctx dials again
        gen = daemon_factory({**config, "peer_secret_file": str(short_tmp / "peer.secret")}, name="gen-again")
        proxy.target_port = gen.peer_port
        await logged(gen, "peer.connected", 1, node="ctx")  # linked, as the new gen sees it
        async with open_client(gen.socket_path, client="gen-exec") as g, \
                open_client(pair.ctx.socket_path, client="ctx-exec") as c:
            ctx_pool, gen_pool = await c.attach("ctx0"), await g.attach("gen0")
            ctx_ids, gen_ids = await c.alloc("ctx0", 4), await g.alloc("gen0", 4)
            data = torch.randint(-(2**15), 2**15, (4, *ctx_pool.tensor.shape[1:]), dtype=torch.int16)
            ctx_pool.tensor.view(torch.int16)[torch.tensor(ctx_ids)] = data
            await g.expect(RID, "gen0", LAYOUT, 0, gen_ids, peer="ctx", deadline_s=30.0)
            await logged(pair.ctx, "transfer.replaced", request_id=RID)
            await c.publish(RID, "ctx0", LAYOUT, 0, ctx_ids, peer="gen", deadline_s=30.0)
            assert (await c.wait(RID)).ok
            assert (await g.wait(RID)).ok
            assert torch.equal(gen_pool.tensor.view(torch.int16)[torch.tensor(gen_ids)], data)


async def test_a_retry_does_not_replace_a_request_whose_late_ranks_may_still_come(
        daemon_factory: Factory, short_tmp: Path) -> None:
    """gen TP2: rank 0 expects and cancels before rank 1 came, so the gen daemon remembers
    the failure for rank 1. ctx's offer, and its retry of the id, are answered with that
    failure; rank 1, coming late, is refused with it too, rather than joining ctx's retry (a
    request of ranks from two attempts, which would wait for a rank 0 that already left)."""
    tp2 = KVLayout(**{**LAYOUT_FIELDS, "tp_size": 2})
    pair = start_pair(daemon_factory, short_tmp, LAYOUT, tp2, num_blocks=16, ctx_extra=DEBUG, gen_extra=DEBUG)
    async with open_client(pair.gen.socket_path, client="gen-rank0") as g0, \
            open_client(pair.gen.socket_path, client="gen-rank1") as g1, \
            open_client(pair.ctx.socket_path, client="ctx-exec") as c:
        await wait_for_peer(g0)
        await wait_for_peer(c)
        await g0.expect(RID, "gen0", tp2, 0, await g0.alloc("gen0", 2), deadline_s=30.0)
        await g0.cancel(RID)
        with pytest.raises(TransferCancelled):
            await g0.wait(RID)
        ctx_ids = await c.alloc("ctx0", 2)
        for _attempt in range(2):  # the first publish, then its retry under the same id
            await c.publish(RID, "ctx0", LAYOUT, 0, ctx_ids, peer="gen", deadline_s=30.0)
            with trio.fail_after(20), pytest.raises(TransferCancelled, match="cancelled by client"):
                await c.wait(RID)
            with trio.fail_after(20):  # ctx's side has ended and gone (its wait may answer a little before)
                while (await c.stats()).transfers_active:
                    await trio.sleep(0.01)  # polling the daemon's counter; the condition is the sync point
        with pytest.raises(TransferCancelled, match=f"'{RID}' already failed"):
            await g1.expect(RID, "gen1", tp2, 1, await g1.alloc("gen1", 2), deadline_s=30.0)
        assert '"transfer.replaced"' not in pair.gen.log()
