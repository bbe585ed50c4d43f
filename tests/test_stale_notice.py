"""gen's failure notice about an old request does not fail ctx's new request of the same id.

ctx publishes R first (its offer names its number for R), gen accepts, and ctx's data goes out;
ctx reports R done and forgets it. gen cancels R before it read ctx's path and data-done
messages: its failure notice and ctx's data-done message cross on the link. gen reports R
failed on the data-done message (no ctx write can land any more). ctx's executor then
publishes R again, a new request, before ctx has read gen's old notice.

Before the fix ctx took that notice for the new request and failed it ("gen side failed: ...
cancelled by client"), although nothing was wrong with it. The notice now names ctx's number
for the request it is about (``XferFail.peer_ref``); ctx answers a notice naming another of
its requests as one about a request it no longer knows (gen waits for that word), and leaves
the new request alone. The new request then completes, byte-exact.

The same numbers go in every NIXL notification (a write's to gen, a credit to ctx): a late
one of an earlier request of the id is dropped, not taken for the new request's; the bounce
run here carries them both ways, and a wrong number would leave the transfer waiting.

The link runs through a relay whose two directions the test holds and lets go (no timing window).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import trio

from clients import open_client
from kvd.demo.launch import DaemonProcess
from protocol.errors import TransferCancelled
from tests.gated_link import (
    LAYOUT,
    cancel_across_data_done,
    filled_blocks,
    gated_pair,
    until_active,
    until_idle,
)
from tests.transfer_harness import logged

Factory = Callable[..., DaemonProcess]
RID = "r-notice"
CTX_FILL = 0x3C3C


async def test_an_old_failure_notice_does_not_fail_a_new_ctx_request(daemon_factory: Factory,
                                                                      short_tmp: Path) -> None:
    async with gated_pair(daemon_factory, short_tmp) as (pair, proxy), \
            open_client(pair.gen.socket_path, client="gen-exec") as g, \
            open_client(pair.ctx.socket_path, client="ctx-exec") as c:
        ctx_ids, gen_ids = await filled_blocks(c, g, CTX_FILL)

        # R, ctx first: gen holds ctx's offer (and with it ctx's number for R)
        await c.publish(RID, "ctx0", LAYOUT, 0, ctx_ids, peer="gen")
        await until_active(g)
        # gen accepts; ctx's data goes out, its path and data-done messages are held
        proxy.hold_dir("to_gen")
        await g.expect(RID, "gen0", LAYOUT, 0, gen_ids, peer="ctx")
        assert (await c.wait(RID)).ok
        await until_idle(c)  # ctx ended R and forgot it

        # gen cancels R before it read ctx's path and data-done messages; its notice is held
        await cancel_across_data_done(proxy, g, RID)

        # ctx's executor publishes R again (a new request) while gen's old notice is held;
        # then ctx reads the notice. Before the fix it failed the new request on it
        await c.publish(RID, "ctx0", LAYOUT, 0, ctx_ids, peer="gen")
        await until_active(g)  # gen holds the new offer
        proxy.let_go("to_ctx")
        # gen's next message (the new request's accept) comes after the notice on the link:
        # once ctx has it, the notice was read
        gen_pool = (await g.attach("gen0")).tensor.view(torch.int16)
        gen_pool[torch.tensor(gen_ids)] = 0  # what the new request must overwrite
        await g.expect(RID, "gen0", LAYOUT, 0, gen_ids, peer="ctx")
        with trio.fail_after(30):
            assert (await c.wait(RID)).ok
            assert (await g.wait(RID)).ok
        assert bool((gen_pool[torch.tensor(gen_ids)] == CTX_FILL).all())
        await c.ping()
        await g.ping()

    # ctx: two requests done, none failed; the old notice dropped as stale
    done = await logged(pair.ctx, "transfer.done", 2, request_id=RID)
    assert all(d["role"] == "ctx" for d in done)
    assert '"transfer.failed"' not in pair.ctx.log()
    (failed,) = await logged(pair.gen, "transfer.failed", 1, request_id=RID)
    assert failed["code"] == TransferCancelled.code
    await logged(pair.gen, "transfer.done", 1, request_id=RID)
