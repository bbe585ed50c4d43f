"""A failure notice lost with a dying peer link does not leave the other side waiting for its
deadline.

gen reports a failed request only once ctx said that none of its writes can land any more
(``docs/design.md``, "No write after failure"). Here ctx says so, and the link dies with the
notice in it: the TCP proxy between the two daemons drops what it reads (a network failing
silently), ctx's executor cancels, ctx stops its writes, reports and writes its notice into the
dead link; then the link is cut and comes back from the same ctx instance. gen, which lost the
link while receiving, tells ctx it failed (a notice owed until the link is back); ctx, whose
side ended already, answers it with its word that its writes stopped, and gen reports at once.
Before, ctx ignored gen's notice for a request it had ended, and gen waited for its deadline.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from clients import open_client
from kvd.demo.launch import DaemonProcess
from protocol.errors import KvdError, PeerUnavailable, TransferCancelled
from protocol.layout import KVLayout
from tests.transfer_harness import assert_exact, logged, pools_for, proxied_pair, run_transfer, until_landed

Factory = Callable[..., DaemonProcess]
GEO: dict[str, Any] = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 16,
                       "dtype": "bfloat16"}
LAYOUT = KVLayout(**GEO)
BLOCKS = 384  # 128 KiB each, one NIXL write per block: long enough to stop in the middle
RID = "r-lost-notice"
DEADLINE_S = 120.0  # what gen waited for before the fix
TRANSFER: dict[str, Any] = {
    "bounce_size_mb": 4, "chunk_mb": 1, "deadline_s": 30.0, "mapped": False, "descs_per_write": 1,
    "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 60.0,  # the only fault is the one made here
    "reconnect_initial_s": 0.05, "reconnect_max_s": 0.2,
}


@pytest.mark.parametrize("ctx_end", ["cancelled", "done"])
async def test_gen_reports_without_waiting_for_its_deadline(daemon_factory: Factory, short_tmp: Path,
                                                            ctx_end: str) -> None:
    async with proxied_pair(daemon_factory, short_tmp,
                            {"pools": pools_for("ctx", LAYOUT, 2 * BLOCKS), "transfer": TRANSFER},
                            {"pools": pools_for("gen", LAYOUT, 2 * BLOCKS), "transfer": TRANSFER}) as (pair, proxy):
        ctx, gen = pair.ctx, pair.gen
        async with open_client(gen.socket_path, client="gen-exec") as g, \
                open_client(ctx.socket_path, client="ctx-exec") as c:
            ids = await g.alloc("gen0", BLOCKS)
            await g.expect(RID, "gen0", LAYOUT, 0, ids[::-1], peer="ctx", deadline_s=DEADLINE_S)
            ctx_ids = await c.alloc("ctx0", BLOCKS)
            await c.publish(RID, "ctx0", LAYOUT, 0, ctx_ids, peer="gen", deadline_s=DEADLINE_S)
            await until_landed(g, RID)

            proxy.stall()  # from here, what either daemon sends over the link is lost
            if ctx_end == "cancelled":
                await c.cancel(RID)
            with trio.fail_after(30):
                # ctx stopped its writes (cancelled) or has all its data out (done); its word to
                # gen went into the dead link
                await proxy.wait_dropped(b"xfer_fail" if ctx_end == "cancelled" else b"xfer_done")
            assert proxy.cut() == 1  # the link dies; ctx dials again at once

            with trio.fail_after(30), pytest.raises(KvdError) as failed:  # not at its 120 s deadline
                await g.wait(RID)
            assert failed.value.code == PeerUnavailable.code, failed.value
            assert await g.free("gen0", ids) == BLOCKS  # no write can land: the blocks are free to reuse
            # collected only now: ctx kept the ended request until then
            if ctx_end == "cancelled":
                with trio.fail_after(30), pytest.raises(TransferCancelled):
                    await c.wait(RID)
            else:
                assert (await c.wait(RID)).bytes == BLOCKS * LAYOUT.block_bytes(0)

        again = await logged(gen, "peer.connected", 2, node="ctx", dialled_by="ctx")
        assert again[1].get("nixl_agent_kept") is True  # the same ctx instance: no fencing helped
        out = await run_transfer(pair, LAYOUT, LAYOUT, request_id="after", blocks=4)
        assert_exact(out, LAYOUT)
    (gen_failed,) = await logged(gen, "transfer.failed", 1, request_id=RID)
    assert gen_failed["role"] == "gen"
    (ended,) = await logged(ctx, "transfer.failed" if ctx_end == "cancelled" else "transfer.done", 1,
                             request_id=RID)
    assert ended["role"] == "ctx"
