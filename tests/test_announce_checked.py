"""gen's announced destination is validated when it arrives (off the publish's critical path);
a peer that announces block ids its own layout forbids still gets the request refused at
publish, with the planner's clear error, as before. The gen peer is played on the wire by the
test (a raw authenticated peer link with a real NIXL agent, see ``test_bounce_older_peer``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from clients import open_client
from kvd.demo.launch import DaemonProcess
from protocol import transfer as x
from protocol.errors import KvdError
from tests.test_bounce_older_peer import BLOCKS, CTX, GEN, _regions, ctx_with_played_gen
from tests.transfer_harness import wait_for_peer

Factory = Callable[..., DaemonProcess]


@pytest.mark.parametrize(("gen_ids", "error"), [
    ({0: [5, 5, 6, 2], 1: [3, 7, 0, 4]}, "gen rank 0: duplicate block id 5"),
    ({0: [5, 1, 6, 2], 1: [3, 7, 0, BLOCKS]}, f"gen rank 1: block id {BLOCKS} out of range"),
])
async def test_an_announce_with_bad_block_ids_fails_the_publish_clearly(
        daemon_factory: Factory, short_tmp: Path, gen_ids: dict[int, list[int]], error: str) -> None:
    d, gen = ctx_with_played_gen(daemon_factory, short_tmp, "badgen")
    try:
        async with open_client(d.socket_path) as c:
            await wait_for_peer(c)
            gen.send(x.XferAnnounce(request_id="r-bad", layout=GEN, blocks=gen_ids, pools=_regions(gen),
                                    pool_names={0: "g0", 1: "g1"}, slots=[0, 1], deadline_s=60.0,
                                    chunking=x.CHUNKING_RANGES))
            ids = await c.alloc("ctx0", 4)
            await c.publish("r-bad", "ctx0", CTX, 0, ids, peer="badgen", deadline_s=60.0)
            fail = await gen.until(x.XferFail)
            assert isinstance(fail, x.XferFail) and error in fail.message, fail
            with trio.fail_after(30), pytest.raises(KvdError, match=error):
                await c.wait("r-bad")
            # nothing was written and the blocks are back: they can be freed, and the daemon serves on
            await c.free("ctx0", ids)
            st = await c.stats()
            assert st.transfers_failed == 1 and st.blocks_leased == 0
    finally:
        gen.close()
