"""A peer cannot grow this daemon's memory with requests nobody here registered.

Offers (and announcements) for request ids no local rank has registered start waiting gen
(ctx) sides; the adversarial review sent 50,000 offers and the daemon's RSS grew 281 -> 503 MB
while the link lived. ``[limits] max_unclaimed_per_peer`` bounds them per peer: beyond, the
peer's next one is refused with ``limit_exceeded`` (``transfer.unclaimed_limit``), and a
local registration claims one (it no longer counts)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import trio

from clients import open_client
from kvd.demo.launch import DaemonProcess
from protocol import transfer as x
from tests.hostile import events
from tests.test_bounce_older_peer import CTX, GEN, OlderPeer, gen_daemon
from tests.transfer_harness import wait_for_peer, write_secret

Factory = Callable[..., DaemonProcess]
LIMIT = 3


async def test_offers_nobody_registered_are_bounded_per_peer(daemon_factory: Factory, short_tmp: Path) -> None:
    secret = write_secret(short_tmp)
    d = gen_daemon(daemon_factory, secret, limits={"max_unclaimed_per_peer": LIMIT})
    ctx = OlderPeer(d, Path(secret).read_bytes(), "flooder", CTX)
    try:
        async with open_client(d.socket_path) as g0, open_client(d.socket_path) as g1:
            await wait_for_peer(g0)
            # a local registration first: the peer's offer for it is claimed, never counted
            ids = {}
            for r, g in enumerate((g0, g1)):
                ids[r] = await g.alloc(f"gen{r}", 2)
                await g.expect("mine", f"gen{r}", GEN, r, ids[r], deadline_s=60.0)
            ctx.send(x.XferOffer(request_id="mine", layout=CTX, blocks={0: [0, 1]}, deadline_s=60.0))
            assert isinstance(await ctx.until(x.XferAccept), x.XferAccept)
            for i in range(LIMIT):
                ctx.send(x.XferOffer(request_id=f"flood-{i}", layout=CTX, blocks={0: [0]}, deadline_s=600.0))
            ctx.send(x.XferOffer(request_id="one-too-many", layout=CTX, blocks={0: [0]}, deadline_s=600.0))
            with trio.fail_after(30):
                fail = await ctx.until(x.XferFail)
            assert isinstance(fail, x.XferFail) and fail.request_id == "one-too-many", fail
            assert fail.code == "limit_exceeded" and "max_unclaimed_per_peer" in fail.message
            st = await g0.stats()
            assert st.transfers_active == LIMIT + 1  # the flood's and ours, not the refused one
            # a local rank claims a flooded one: the peer may start another
            for r, g in enumerate((g0, g1)):
                more = await g.alloc(f"gen{r}", 1)
                await g.expect("flood-0", f"gen{r}", GEN, r, more, deadline_s=60.0)
            assert isinstance(await ctx.until(x.XferAccept), x.XferAccept)
            ctx.send(x.XferOffer(request_id="after-claim", layout=CTX, blocks={0: [0]}, deadline_s=600.0))
            with trio.fail_after(30):
                while (await g0.stats()).transfers_active < LIMIT + 2:
                    await trio.sleep(0.01)  # polling the daemon's own count, not a timing window
        (line,) = events(d, "transfer.unclaimed_limit")
        assert line["peer"] == "flooder" and line["limit"] == LIMIT
    finally:
        ctx.close()
