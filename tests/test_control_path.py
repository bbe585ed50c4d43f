"""The per-request control path: a small mapped request run in the publish's own step (after
its reply), registrations pipelined with their wait, waits answered in the reporting step."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from clients import open_client
from clients.blocking import Client
from kvd.demo.launch import DaemonProcess
from protocol import messages as m
from protocol.errors import IncompatibleLayout, KvdError
from protocol.layout import KVLayout
from tests.conftest import host_pool
from tests.hostile import Raw
from tests.transfer_harness import assert_exact, run_transfer, start_pair, wait_for_peer

Factory = Callable[..., DaemonProcess]
GEO = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 32, "dtype": "bfloat16"}
ONE = KVLayout(**GEO)  # type: ignore[arg-type]
TP2 = KVLayout(**GEO, tp_size=2)  # type: ignore[arg-type]
#: gen pools whose head size the ctx side cannot regroup into (found by the planner, at publish)
TP2_WIDE = KVLayout(**{**GEO, "head_dim": 128}, tp_size=2)  # type: ignore[arg-type]


def _lines(d: DaemonProcess, event: str, rid: str) -> list[dict[str, object]]:
    out = []
    for line in d.log().splitlines():
        if f'"event":"{event}"' in line:
            rec = json.loads(line)
            if rec.get("request_id") == rid:
                out.append(rec)
    return out


async def test_an_announced_mapped_request_moves_exact_bytes_from_the_publish_step(
        daemon_factory: Factory, short_tmp: Path) -> None:
    """gen announced its destination: ctx plans, copies and reports inside the publish's step
    (4 blocks of 256 KiB fit the inline limit), byte for byte, with no round trip."""
    pair = start_pair(daemon_factory, short_tmp, ONE, TP2, mapped=True)
    out = await run_transfer(pair, ONE, TP2, request_id="r-inline", blocks=4, gen_peer="ctx")
    assert_exact(out, TP2)
    # logged after the completion replies: waited for, never read at once
    (done,) = pair.ctx.logged("transfer.done", request_id="r-inline")
    assert done["path"] == "mapped" and done["round_trips"] == 0
    assert len(pair.gen.logged("transfer.done", request_id="r-inline")) == 1


async def test_a_publish_whose_inline_data_path_fails_fails_once_and_releases_blocks(
        daemon_factory: Factory, short_tmp: Path) -> None:
    """The planner refuses the pair of layouts inside the publish's step: ctx fails once (its
    executor's pipelined wait gets the error), gen hears it and fails once, and every block
    goes back (each executor frees its blocks, which a request still holding them refuses)."""
    pair = start_pair(daemon_factory, short_tmp, ONE, TP2_WIDE, mapped=True)
    async with open_client(pair.gen.socket_path) as g0, open_client(pair.gen.socket_path) as g1, \
            open_client(pair.ctx.socket_path) as ctx:
        await wait_for_peer(g0)
        gens = [g0, g1]
        gen_ids = [await c.alloc(f"gen{r}", 2) for r, c in enumerate(gens)]
        for r, c in enumerate(gens):
            await c.expect("r-bad", f"gen{r}", TP2_WIDE, r, gen_ids[r], peer="ctx", deadline_s=30)
        ctx_ids = await ctx.alloc("ctx0", 2)
        with trio.fail_after(30):
            with pytest.raises(IncompatibleLayout, match="head_dim differs"):
                await ctx.publish_and_wait("r-bad", "ctx0", ONE, 0, ctx_ids, peer="gen", deadline_s=30)
            for c in gens:
                with pytest.raises(KvdError) as failed:
                    await c.wait("r-bad")
                assert failed.value.code == IncompatibleLayout.code
        assert await ctx.free("ctx0", ctx_ids) == 2
        for r, c in enumerate(gens):
            assert await c.free(f"gen{r}", gen_ids[r]) == 2
    for d, role in ((pair.ctx, "ctx"), (pair.gen, "gen")):
        failed_lines = _lines(d, "transfer.failed", "r-bad")
        assert [rec["role"] for rec in failed_lines] == [role], failed_lines
        assert not _lines(d, "transfer.done", "r-bad")


def test_a_wait_that_timed_out_gets_no_second_reply_when_the_request_ends(daemon_factory: Factory) -> None:
    """Waits are answered in the step that reports the request: one that timed out before
    must not be answered again. On the wire: the timeout's error, then exactly one
    completion (for the second wait), then the ping's reply."""
    d = daemon_factory({"pools": [host_pool("ctx0"), host_pool("gen0")]})
    raw = Raw(d.socket_path)
    raw.hello()
    raw.send(_encode(m.Alloc(id=2, pool="gen0", count=2)))
    ids = raw.receive()
    assert isinstance(ids, m.Allocated)
    raw.send(_encode(m.Expect(id=3, request_id="r-to", pool="gen0", layout=ONE, rank=0, block_ids=ids.block_ids,
                              deadline_s=30)))
    assert isinstance(raw.receive(), m.Registered)
    raw.send(_encode(m.Wait(id=4, request_id="r-to", timeout_s=0.05)))
    timed_out = raw.error()
    assert (timed_out.id, timed_out.code) == (4, "wait_timeout")
    raw.send(_encode(m.Wait(id=5, request_id="r-to", timeout_s=30)))  # waits: ctx has not published
    with Client(d.socket_path, client="ctx") as ctx:
        ctx.publish("r-to", "ctx0", ONE, 0, ctx.alloc("ctx0", 2), peer="kvd")
        assert ctx.wait("r-to", timeout_s=30).ok
    done = raw.receive()
    assert isinstance(done, m.Completion) and done.id == 5 and done.ok and done.path == "local", done
    raw.ping(6)  # the very next frame is the ping's reply: no late answer to wait 4
    raw.close()


def test_pipelined_registrations_refused_or_accepted(daemon_factory: Factory) -> None:
    """publish_and_wait / expect_and_wait: a refused registration raises its own error and the
    session goes on (the wait's reply, sent with it, is dropped); accepted ones return the
    completion."""
    d = daemon_factory({"pools": [host_pool("ctx0"), host_pool("gen0")]})
    with Client(d.socket_path, client="ctx") as ctx, Client(d.socket_path, client="gen") as gen:
        with pytest.raises(KvdError) as refused:
            ctx.publish_and_wait("r-p", "ctx0", ONE, 0, [0, 1], peer="kvd", timeout_s=30)  # not leased
        assert refused.value.code == "block_not_leased"
        assert ctx.ping(b"after") == b"after"
        c_ids, g_ids = ctx.alloc("ctx0", 2), gen.alloc("gen0", 2)
        results: dict[str, m.Completion] = {}
        errors: list[BaseException] = []

        def gen_side() -> None:
            try:
                results["gen"] = gen.expect_and_wait("r-p", "gen0", ONE, 0, g_ids, deadline_s=30, timeout_s=30)
            except BaseException as exc:  # re-raised in the test's thread
                errors.append(exc)

        th = threading.Thread(target=gen_side)
        th.start()
        results["ctx"] = ctx.publish_and_wait("r-p", "ctx0", ONE, 0, c_ids, peer="kvd", deadline_s=30, timeout_s=30)
        th.join(60)
        assert not th.is_alive() and not errors, errors
        assert results["ctx"].ok and results["gen"].ok and results["gen"].path == "local"
        assert ctx.stats().requests_registered == 2


def test_a_registration_sent_with_its_wait_gets_both_replies_in_one_write(
        daemon_factory: Factory, short_tmp: Path) -> None:
    """publish and wait in one write: the announced mapped request completes in the publish's
    step, and the Registered reply and the Completion reach the executor together (one read
    returns both, in order). A wait that cannot be answered yet does not hold the reply back:
    with the gen side not registered, Registered comes alone and the Completion later."""
    from protocol.codec import decode_reply
    from protocol.framing import FrameBuffer

    def read_once(raw: Raw) -> list[m.Message]:
        return [decode_reply(p) for p in FrameBuffer(1 << 20).feed(raw.sock.recv(1 << 20))]

    pair = start_pair(daemon_factory, short_tmp, ONE, TP2, mapped=True)
    gens = [Client(pair.gen.socket_path, client=f"gen{r}") for r in range(2)]
    raw = Raw(pair.ctx.socket_path)
    try:
        from kvd.demo.pair import wait_for_link

        wait_for_link(gens[0], "ctx")
        gen_ids = [c.alloc(f"gen{r}", 2) for r, c in enumerate(gens)]
        raw.hello()
        raw.send(_encode(m.Alloc(id=2, pool="ctx0", count=4)))
        ids = raw.receive()
        assert isinstance(ids, m.Allocated)
        for r, c in enumerate(gens):
            c.expect("r-both", f"gen{r}", TP2, r, gen_ids[r], peer="ctx", deadline_s=30)
        with Client(pair.ctx.socket_path, client="probe") as probe:  # the announce reached ctx
            give_up = time.monotonic() + 30
            while probe.stats().transfers_active < 1:
                assert time.monotonic() < give_up, "gen's announce never reached ctx"
                time.sleep(0.005)
        raw.send(_encode(m.Publish(id=3, request_id="r-both", pool="ctx0", layout=ONE, rank=0,
                                   block_ids=ids.block_ids[:2], peer="gen", deadline_s=30))
                 + _encode(m.Wait(id=4, request_id="r-both", timeout_s=30)))
        registered, done = read_once(raw)
        assert isinstance(registered, m.Registered) and registered.id == 3, registered
        assert isinstance(done, m.Completion) and done.id == 4 and done.ok and done.path == "mapped", done
        for c in gens:
            assert c.wait("r-both", timeout_s=30).ok
        # the gen side registers only after the publish: its wait is answered later
        raw.send(_encode(m.Publish(id=5, request_id="r-later", pool="ctx0", layout=ONE, rank=0,
                                   block_ids=ids.block_ids[2:], peer="gen", deadline_s=30))
                 + _encode(m.Wait(id=6, request_id="r-later", timeout_s=30)))
        assert [(type(r), r.id) for r in read_once(raw)] == [(m.Registered, 5)]
        for r, c in enumerate(gens):
            c.expect("r-later", f"gen{r}", TP2, r, gen_ids[r], deadline_s=30)
        later = raw.receive()
        assert isinstance(later, m.Completion) and later.id == 6 and later.ok, later
        raw.ping(7)
    finally:
        raw.close()
        for c in gens:
            c.close()


def _encode(msg: m.Message) -> bytes:
    from protocol.codec import encode

    return encode(msg)
