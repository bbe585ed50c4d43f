"""ctx's answer to an old request's failure notice does not fail a new request of the same id.

gen cancels request R just as ctx's data is out: gen's failure notice (``XferFail``) and ctx's
data-done message (``XferDone``) cross on the link. gen reports R failed on the data-done
message (no ctx write can land any more); its executor, told so, registers R again: the id
was forgotten with the outcome, so it names a new request. ctx, which had ended and forgotten
R, answers the old notice that none of its writes can land (``XferFail`` from ctx,
``not_found``, ``writes_stopped``): an answer to gen's notice about the old request.

Before the fix gen took that answer for the new request: it failed R at once, told its
executor so (with the old request's "no request here") and told ctx nothing, since ctx's
side read as failed. ctx then published R against the new request's announced destination
and wrote every block into gen's pool: into blocks gen had handed back as failed, which
another session had taken meanwhile, and ctx reported the request done.

The link runs through a relay in this process whose two directions the test holds and lets go,
so the crossing happens in this order every time (no timing window).
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
RID = "r-echo"
CTX_FILL = 0x5A5A


async def test_an_answer_to_an_old_failure_notice_does_not_fail_a_new_request(daemon_factory: Factory,
                                                                            short_tmp: Path) -> None:
    async with gated_pair(daemon_factory, short_tmp) as (pair, proxy), \
            open_client(pair.gen.socket_path, client="gen-exec") as g, \
            open_client(pair.ctx.socket_path, client="ctx-exec") as c:
        ctx_ids, gen_ids = await filled_blocks(c, g, CTX_FILL)

        # R: ctx's data goes out (NIXL), its path and data-done messages are held
        proxy.hold_dir("to_gen")
        await g.expect(RID, "gen0", LAYOUT, 0, gen_ids, peer="ctx")
        await c.publish(RID, "ctx0", LAYOUT, 0, ctx_ids, peer="gen")
        assert (await c.wait(RID)).ok
        await until_idle(c)  # ctx ended R and forgot it

        # gen cancels R before ctx's data-done message reached it; its notice is held
        await cancel_across_data_done(proxy, g, RID)

        # the executor registers R again (a new request: the old one is forgotten); then ctx
        # reads gen's notice about the old R, answers it, and reads the new announce
        await g.expect(RID, "gen0", LAYOUT, 0, gen_ids, peer="ctx")
        gen_pool = (await g.attach("gen0")).tensor.view(torch.int16)
        gen_pool[torch.tensor(gen_ids)] = 0  # what the new request must overwrite
        proxy.let_go("to_ctx")
        # ctx read the old notice (and answered it) before the new announce, which starts a
        # transfer there; its answer reaches gen before anything ctx sends about the new
        # request (one link, in order). Before the fix gen failed the new request on it, told
        # its executor so ("no request 'r-echo' here"), and ctx went on to write every block
        await until_active(c)
        await c.publish(RID, "ctx0", LAYOUT, 0, ctx_ids, peer="gen")
        with trio.fail_after(30):
            assert (await c.wait(RID)).ok
            assert (await g.wait(RID)).ok
        assert bool((gen_pool[torch.tensor(gen_ids)] == CTX_FILL).all())
        await g.ping()  # the step that replied has ended: its transfer.done line is out

    # one line per request and side: the old request failed, the new one done
    (failed,) = await logged(pair.gen, "transfer.failed", 1, request_id=RID)
    assert failed["code"] == TransferCancelled.code
    (done,) = await logged(pair.gen, "transfer.done", 1, request_id=RID)
    assert done["role"] == "gen"
