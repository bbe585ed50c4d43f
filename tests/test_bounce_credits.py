"""Bounce credits between two real daemons: gen returns receive slots as NIXL notifications
when ctx asks for them, as ``XferGrant`` messages over the peer link when it does not (as
older daemons do); ctx takes either. The transfer.done lines count what went which way."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvd.demo.launch import DaemonProcess
from protocol.layout import KVLayout
from tests.transfer_harness import assert_exact, run_transfer, start_pair

GEO = {"num_layers": 24, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 16, "dtype": "bfloat16"}
CTX = KVLayout(**GEO)  # type: ignore[arg-type]
GEN = KVLayout(**{**GEO, "tp_size": 4})  # type: ignore[arg-type]


def _done(d: DaemonProcess, rid: str) -> dict[str, object]:
    # the daemon logs the line after its completion replies: wait for it, never read at once
    (done,) = d.logged("transfer.done", request_id=rid)
    return done


@pytest.mark.parametrize("notifs", [True, False], ids=["credit_notif", "xfer_grant"])
async def test_credits_come_back_by_notification_or_over_the_link(
        notifs: bool, daemon_factory: Callable[..., DaemonProcess], short_tmp: Path) -> None:
    # 12 MiB through 4 receive slots of 1 MiB: 12 chunks, 2 slots granted with the destination,
    # the other 10 credits come back as the slots are scattered
    pair = start_pair(daemon_factory, short_tmp, CTX, GEN, num_blocks=32,
                      ctx_extra={"transfer": {"bounce_size_mb": 4, "chunk_mb": 1, "deadline_s": 30.0,
                                              "mapped": False, "credit_notifs": notifs}})
    rid = f"req-credits-{notifs}"
    out = await run_transfer(pair, CTX, GEN, request_id=rid, blocks=16, gen_peer="ctx")
    assert_exact(out, GEN)
    ctx, gen = _done(pair.ctx, rid), _done(pair.gen, rid)
    assert ctx["path"] == gen["path"] == "bounce" and ctx["chunks"] == 12
    cs, gs = ctx["stages"], gen["stages"]
    assert isinstance(cs, dict) and isinstance(gs, dict)
    assert cs["bounce_chunk_bytes"] == 1 << 20
    kind, other = ("credits_notif", "credits_link") if notifs else ("credits_link", "credits_notif")
    assert cs[kind] == gs[kind] == 10 and other not in cs and other not in gs
