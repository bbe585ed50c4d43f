"""No write after failure when the peer link between two live daemons is cut mid-transfer.

Peer links keep the peer's NIXL agent loaded when they end (:mod:`kvd.peer.kept_agents`), so
the UCX connection between the two daemons outlives the TCP peer link: cutting the link no
longer tears down the endpoints a failed sender's writes go through. Writes must still stop
before gen reports the failure.

The ctx daemon dials gen through a TCP proxy in the test process (``tests/tcp_proxy.py``); a
large transfer is started and, once the first writes landed on gen, the ctx daemon is frozen
(SIGSTOP, so that the transfer surely is still in flight), the link is cut, and ctx resumes once
gen saw the link go: it finds its link gone with writes still to post and its UCX connection to
gen still up. No heartbeat is missed; the only fault is the cut. Both daemons fail the request: ctx stops its writes and
reports, gen reports once ctx said its writes stopped (which only a link can carry). The link
comes back either at once (ctx redials while it may still be aborting) or only once ctx's
executor heard the failure: meanwhile gen must report nothing and keep the blocks, and on the
direct path (where only ctx's writes touch gen's blocks) the blocks must not change from ctx's
report on. Then gen frees its blocks, another session takes and fills them, and they must stay intact for 2 s;
each daemon logs exactly one ``transfer.failed`` for the request (no ``transfer.done``); the
link came back with the kept agent, and a fresh transfer over it is byte-exact.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import trio

from clients import open_client
from kvd.demo.launch import DaemonProcess
from protocol.errors import BlocksInUse, KvdError, PeerUnavailable, WaitTimeout
from protocol.layout import KVLayout
from protocol.messages import Completion
from tests.transfer_harness import (
    assert_exact,
    gen_progress,
    logged,
    pools_for,
    proxied_pair,
    refill_and_watch,
    run_transfer,
    until_landed,
)

Factory = Callable[..., DaemonProcess]
GEO: dict[str, Any] = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 16,
                       "dtype": "bfloat16"}
LAYOUT = KVLayout(**GEO)
#: gen with twice the tokens per block: a regroup, so the bytes go through the bounce slots
GEN_BOUNCE = KVLayout(**{**GEO, "tokens_per_block": 32})
BLOCKS = 384  # 128 KiB each; direct: one NIXL write per block; bounce: one write per 1 MiB chunk
STALE = 0x5A5A  # the sender's bytes: what a stale write would leave behind
PATTERN = 0x3333  # the next tenant's
RID = "r-cut"
TRANSFER: dict[str, Any] = {
    "bounce_size_mb": 4, "chunk_mb": 1, "deadline_s": 30.0, "mapped": False,
    # no heartbeat loss: the only fault is the cut
    "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 60.0,
    # the dialler comes back quickly after the cut
    "reconnect_initial_s": 0.05, "reconnect_max_s": 0.2,
}


def _records(d: DaemonProcess, event: str, **fields: object) -> list[dict[str, Any]]:
    """Every log record of ``event`` so far with the given field values."""
    needle = f'"{event}"'
    out = []
    for line in d.log().splitlines():
        if needle in line and line.startswith("{"):
            r = msgspec.json.decode(line)
            if r.get("event") == event and all(r.get(k) == v for k, v in fields.items()):
                out.append(r)
    return out


@pytest.mark.parametrize("path", ["direct", "bounce"])
@pytest.mark.parametrize("relink", ["at_once", "after_ctx_failed"])
async def test_no_write_lands_after_the_link_is_cut(daemon_factory: Factory, short_tmp: Path, path: str,
                                                    relink: str) -> None:
    transfer = dict(TRANSFER)
    gen_layout, gen_blocks = LAYOUT, BLOCKS
    if path == "direct":
        transfer["descs_per_write"] = 1
    else:
        gen_layout, gen_blocks = GEN_BOUNCE, BLOCKS // 2
    async with proxied_pair(daemon_factory, short_tmp,
                            {"pools": pools_for("ctx", LAYOUT, 2 * BLOCKS), "transfer": transfer},
                            {"pools": pools_for("gen", gen_layout, 2 * gen_blocks), "transfer": transfer},
                            ) as (pair, proxy), trio.open_nursery() as nursery:
        ctx, gen = pair.ctx, pair.gen
        async with open_client(gen.socket_path, client="gen-exec") as g, \
                open_client(ctx.socket_path, client="ctx-exec") as c:
            ids = await g.alloc("gen0", gen_blocks)
            dest, dest_index = (await g.attach("gen0")).tensor.view(torch.int16), torch.tensor(ids)
            # reversed: no two blocks form one contiguous run, so every block is its own write
            await g.expect(RID, "gen0", gen_layout, 0, ids[::-1], peer="ctx", deadline_s=120.0)
            src = await c.attach("ctx0")
            ctx_ids = await c.alloc("ctx0", BLOCKS)
            src.tensor.view(torch.int16)[torch.tensor(ctx_ids)] = STALE
            await c.publish(RID, "ctx0", LAYOUT, 0, ctx_ids, peer="gen", deadline_s=120.0)

            ctx_outcome: list[Completion | KvdError] = []
            ctx_heard = trio.Event()

            async def ctx_wait() -> None:
                try:
                    ctx_outcome.append(await c.wait(RID))
                except KvdError as exc:
                    ctx_outcome.append(exc)
                ctx_heard.set()

            nursery.start_soon(ctx_wait)

            # the first writes landed: freeze the sender so that the cut surely falls in the
            # middle of the transfer (a few writes it posted may still land), cut the link,
            # wait until gen saw it go, and let the sender go on: it finds its link gone with
            # writes still to post and the UCX connection to gen still up (the kept agent)
            await until_landed(g, RID)
            ctx.proc.send_signal(signal.SIGSTOP)
            try:
                state, _chunks = await gen_progress(g, RID)
                assert state not in ("done", "failed"), f"the transfer ended before the cut ({state})"
                if relink == "after_ctx_failed":
                    proxy.hold()
                assert proxy.cut() == 1
                await logged(gen, "peer.disconnected", 1, node="ctx")
            finally:
                ctx.proc.send_signal(signal.SIGCONT)

            if relink == "after_ctx_failed":
                # ctx stops its writes and reports without its peer; gen cannot hear that it
                # did (the link is down), so it reports nothing and keeps the blocks
                with trio.fail_after(30):
                    await ctx_heard.wait()
                stopped = dest[dest_index]  # (a copy) ctx said its writes stopped: none lands from now on
                with pytest.raises(WaitTimeout):
                    await g.wait(RID, timeout_s=1.0)
                with pytest.raises(BlocksInUse):
                    await g.free("gen0", ids)
                assert (await gen_progress(g, RID))[0] == "aborting"
                assert not _records(gen, "transfer.failed", request_id=RID)
                proxy.release()

            with trio.fail_after(30), pytest.raises(KvdError) as gen_failed:
                await g.wait(RID)
            assert gen_failed.value.code == PeerUnavailable.code, gen_failed.value
            if relink == "after_ctx_failed" and path == "direct":
                late = (dest[dest_index] != stopped).flatten(1).any(dim=1)
                assert not bool(late.any()), f"{int(late.sum())} blocks written after ctx's writes stopped"
            assert await g.free("gen0", ids) == gen_blocks

            # another session takes every free block (the failed request's among them) and
            # fills it; the link comes back (and ctx may still be aborting) meanwhile
            await refill_and_watch(gen.socket_path, "gen0", ids, PATTERN)

            with trio.fail_after(30):
                await ctx_heard.wait()
            (outcome,) = ctx_outcome
            assert isinstance(outcome, KvdError), f"ctx's executor was told {outcome!r}"
            assert outcome.code == PeerUnavailable.code, outcome

        # the link came back from the same instance: its agent was kept, and reloaded over itself
        for d, peer in ((ctx, "gen"), (gen, "ctx")):
            before, again = (await logged(d, "peer.connected", 2, node=peer, dialled_by="ctx"))[:2]
            assert again["nixl_agent"] == before["nixl_agent"] and again.get("nixl_agent_kept") is True, again
            assert "peer.agent_forgotten" not in d.log()
        out = await run_transfer(pair, LAYOUT, gen_layout, request_id="after-cut", blocks=4)
        assert_exact(out, gen_layout)
        assert {c.path for c in out.gen.values()} == {path}

    # one outcome per side: the failure, once, and no success
    for d, role in ((ctx, "ctx"), (gen, "gen")):
        await logged(d, "transfer.done", 1, request_id="after-cut", role=role)  # logged after the cut's
        (failed,) = _records(d, "transfer.failed", request_id=RID)
        assert failed["role"] == role and failed["code"] == PeerUnavailable.code, failed
        assert not _records(d, "transfer.done", request_id=RID)
        # a data task stopped after its side ended is intended, not a fault to warn about
        assert not _records(d, "transfer.task_failed_after_end"), _records(d, "transfer.task_failed_after_end")
