"""An ended request is remembered until its deadline: a late rank or message learns how it ended.

Real daemons in subprocesses. Each case synchronises on the daemons' replies and log lines,
never on sleeps: expiry is made to happen by short deadlines with ``[transfer]
remember_ended_s = 0`` (remembered until the deadline only), and the bound by a small ``[limits]
max_ended_requests``.

- a rank of a side that ended before it registered is refused at once with how the side ended,
  however long after the end (up to the request's deadline), not started as a new request that
  waits for its own deadline;
- once the memory of it expired, the same request id is a new request, and it runs;
- at most ``max_ended_requests`` ended requests are remembered: the one due first is forgotten
  early, and logged so;
- a ctx side that fails before it heard from gen (a rank left before the others published, or
  its offer never reached gen) tells gen: gen ranks waiting fail at once with ctx's reason, and
  gen ranks that expect the request later are refused at once with it, also when the notice
  waited for the link to come up; the notices waiting for a link are bounded too.
"""

from __future__ import annotations

import json
import math
import re
import socket
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from clients import open_client
from clients.client import AsyncClient
from kvd.demo.launch import DaemonProcess
from protocol.errors import KvdError, TransferCancelled
from protocol.layout import KVLayout
from tests.ports import unused_port
from tests.transfer_harness import assert_exact, pools_for, run_transfer, start_pair, wait_for_peer

Factory = Callable[..., DaemonProcess]
GEO = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 16, "dtype": "bfloat16"}
CTX = KVLayout(**GEO)  # type: ignore[arg-type]
CTX2 = KVLayout(**GEO, tp_size=2)  # type: ignore[arg-type]
GEN = KVLayout(**GEO, tp_size=2)  # type: ignore[arg-type]


def _solo(factory: Factory, **transfer: Any) -> DaemonProcess:
    """One daemon with a ctx TP1 pool and two gen TP2 pools (the local path), debug log."""
    limits = transfer.pop("limits", {})
    return factory({"pools": pools_for("ctx", CTX, 16) + pools_for("gen", GEN, 16), "log_level": "debug",
                    "transfer": {"bounce_size_mb": 4, "chunk_mb": 1, **transfer}, "limits": limits}, name="solo")


async def logged(d: DaemonProcess, event: str, count: int = 1, **fields: object) -> list[dict[str, Any]]:
    """``d``'s log records of ``event`` once there are ``count`` (read in a thread: the test's
    other tasks go on)."""
    return await trio.to_thread.run_sync(partial(d.logged, event, count, 30.0, **fields))


async def register_rank(c: AsyncClient, rid: str, rank: int, *, deadline_s: float, role: str, peer: str) -> None:
    """Rank ``rank`` of 2 registers ``rid`` on its own two blocks: ``expect`` (gen) or ``publish`` (ctx)."""
    ids = await c.alloc(f"{role}{rank}", 2)
    if role == "gen":
        await c.expect(rid, f"gen{rank}", GEN, rank, ids, ranks=[0, 1], deadline_s=deadline_s, peer=peer)
    else:
        await c.publish(rid, f"ctx{rank}", CTX2, rank, ids, ranks=[0, 1], peer=peer, deadline_s=deadline_s)


async def end_with_rank0_only(d: DaemonProcess, rid: str, *, deadline_s: float = 60.0, how: str = "cancel",
                              role: str = "gen", peer: str = "") -> None:
    """Rank 0 of 2 registers ``rid`` and leaves (cancel, then its wait; or its executor
    disconnects): the side ends before rank 1 registered, and no executor holds it any more."""
    async with open_client(d.socket_path, client=f"{role}0") as c:
        await register_rank(c, rid, 0, deadline_s=deadline_s, role=role, peer=peer)
        if how == "cancel":
            await c.cancel(rid)
            with pytest.raises(KvdError):  # cancelled (or, with a short deadline, timed out first)
                await c.wait(rid)
    # (disconnect: the session ends here; the side fails with "executor session N ended")


async def late_rank1(d: DaemonProcess, rid: str, *, deadline_s: float = 60.0, role: str = "gen",
                     peer: str = "") -> None:
    """Rank 1 of 2 registers ``rid`` (raises what the registration raises)."""
    async with open_client(d.socket_path, client=f"{role}1") as c:
        await register_rank(c, rid, 1, deadline_s=deadline_s, role=role, peer=peer)
        await c.cancel(rid)  # registered as a new request: end it (the caller only checks that)


@pytest.mark.parametrize("how", ["cancel", "disconnect"])
async def test_a_late_rank_is_told_how_its_side_ended_until_the_deadline(daemon_factory: Factory, how: str) -> None:
    """``remember_ended_s = 0``: the side's end is still remembered (its deadline is 60 s off),
    so rank 1 is refused at once with rank 0's reason. It used to be forgotten a fixed 10 s
    after the end (here: at once), and rank 1 started a new request that waited 60 s."""
    solo = _solo(daemon_factory, remember_ended_s=0.0)
    await end_with_rank0_only(solo, "r-late", how=how)
    await logged(solo, "transfer.failed", request_id="r-late")
    with trio.fail_after(20), pytest.raises(TransferCancelled, match="'r-late' already failed") as info:
        await late_rank1(solo, "r-late")
    assert ("cancelled by client" if how == "cancel" else "session") in info.value.message
    assert len(solo.logged("transfer.failed", request_id="r-late")) == 1  # one outcome for the side


def test_remembered_until_the_deadline_and_at_least_remember_ended_s() -> None:
    from kvd.transfer.engine import remember_until

    assert remember_until(100.0, now=10.0, at_least_s=10.0) == 100.0  # the deadline, further off
    assert remember_until(15.0, now=10.0, at_least_s=10.0) == 20.0  # at least 10 s after the end
    assert remember_until(math.inf, now=10.0, at_least_s=10.0) == 20.0  # no deadline known
    assert remember_until(5.0, now=10.0, at_least_s=0.0) == 10.0  # past its deadline: now


async def test_a_late_rank_after_the_deadline_is_still_told_for_remember_ended_s(daemon_factory: Factory) -> None:
    """The request's deadline passed, but it ended less than ``remember_ended_s`` ago: a late
    rank is still refused with how it ended. (Synchronised without a clock: a second request
    registered afterwards with the same deadline_s times out after the first one's deadline.)"""
    solo = _solo(daemon_factory, remember_ended_s=600.0)
    await end_with_rank0_only(solo, "r-floor", deadline_s=0.5)
    async with open_client(solo.socket_path, client="clock") as c:
        await c.expect("r-clock", "gen0", GEN, 0, await c.alloc("gen0", 1), ranks=[0, 1], deadline_s=0.5)
        with pytest.raises(KvdError, match="missed its deadline"):
            await c.wait("r-clock")
    with trio.fail_after(20), pytest.raises(KvdError, match="'r-floor' already failed"):
        await late_rank1(solo, "r-floor")


async def test_once_forgotten_the_request_id_is_a_new_request(daemon_factory: Factory) -> None:
    """A short deadline: the ended request is forgotten at it (``transfer.forgotten``), and then
    the same id registers as a new request, which runs (the local path) and is verified."""
    solo = _solo(daemon_factory, remember_ended_s=0.0)
    await end_with_rank0_only(solo, "r-again", deadline_s=0.5)
    await logged(solo, "transfer.forgotten", request_id="r-again")
    gen_done: dict[int, object] = {}

    async def gen_rank(r: int, task_status: trio.TaskStatus[None]) -> None:
        async with open_client(solo.socket_path, client=f"gen{r}") as c:
            ids = await c.alloc(f"gen{r}", 2)
            await c.expect("r-again", f"gen{r}", GEN, r, ids, ranks=[0, 1], deadline_s=60)
            task_status.started()
            gen_done[r] = await c.wait("r-again")

    async with trio.open_nursery() as n:
        for r in range(2):
            await n.start(gen_rank, r)
        async with open_client(solo.socket_path, client="ctx0") as c:
            ids = await c.alloc("ctx0", 2)
            await c.publish("r-again", "ctx0", CTX, 0, ids, peer="solo", deadline_s=60)
            done = await c.wait("r-again")
    assert done.ok and done.path == "local", done
    assert all(getattr(gen_done[r], "ok", False) for r in range(2)), gen_done
    assert len(solo.logged("transfer.failed", request_id="r-again")) == 1  # only the first one's


async def test_ended_requests_remembered_are_bounded(daemon_factory: Factory) -> None:
    """``max_ended_requests = 2``: a third ended request makes the daemon forget the one due
    first (logged as ``transfer.forgotten_early``), whose id then registers as a new request;
    the others are still remembered and refuse their late ranks at once."""
    solo = _solo(daemon_factory, remember_ended_s=0.0, limits={"max_ended_requests": 2})
    for i in range(3):
        await end_with_rank0_only(solo, f"r-many{i}")
        await logged(solo, "transfer.failed", request_id=f"r-many{i}")
    early = await logged(solo, "transfer.forgotten_early")
    assert [r["request_id"] for r in early] == ["r-many0"], early
    assert early[0]["limit"] == 2
    for i in (1, 2):
        with trio.fail_after(20), pytest.raises(TransferCancelled, match="already failed"):
            await late_rank1(solo, f"r-many{i}")
    with trio.fail_after(20):
        await late_rank1(solo, "r-many0")  # forgotten: a new request (cancelled by the helper)
    # r-many0's new request ended too: it is the one remembered now, r-many1 was due first
    early = await logged(solo, "transfer.forgotten_early", 2)
    assert [r["request_id"] for r in early] == ["r-many0", "r-many1"], early


def _dropped(d: DaemonProcess, rid: str) -> bool:
    """gen heard of ctx's failure and ended the gen side no executor registered yet."""
    return any(json.loads(line).get("event") == "transfer.dropped" and json.loads(line).get("request_id") == rid
               for line in d.log().splitlines() if line.startswith("{"))


@pytest.mark.parametrize("how", ["cancel", "disconnect"])
async def test_gen_ranks_that_expect_later_learn_of_a_ctx_abort_before_any_offer(
        daemon_factory: Factory, short_tmp: Path, how: str) -> None:
    """ctx rank 0 of 2 publishes and leaves before rank 1 does: ctx never offered, yet it tells
    gen (``XferFail``); gen ranks that expect the request afterwards (naming no peer) are
    refused at once with ctx's reason, and so is the late ctx rank on its daemon. They used to
    start a new request and wait for their whole deadline."""
    pair = start_pair(daemon_factory, short_tmp, CTX2, GEN)
    async with open_client(pair.ctx.socket_path, client="probe") as c:
        await wait_for_peer(c)
    await end_with_rank0_only(pair.ctx, "r-ctx-early", how=how, role="ctx", peer="gen")
    await logged(pair.ctx, "transfer.failed", request_id="r-ctx-early")
    await logged(pair.gen, "transfer.dropped", request_id="r-ctx-early")
    with trio.fail_after(20), pytest.raises(TransferCancelled, match="already failed: ctx side failed") as info:
        await late_rank1(pair.gen, "r-ctx-early")
    assert ("cancelled by client" if how == "cancel" else "session") in info.value.message
    with trio.fail_after(20), pytest.raises(TransferCancelled, match="'r-ctx-early' already failed"):
        await late_rank1(pair.ctx, "r-ctx-early", role="ctx", peer="gen")
    assert not pair.gen.logged("transfer.dropped", request_id="r-ctx-early")[1:]  # one end for gen's side
    # both daemons serve a new request, and nothing stays leased
    out = await run_transfer(pair, CTX2, GEN, request_id="r-after-ctx-early", blocks=2)
    assert_exact(out, GEN)


async def test_waiting_gen_ranks_fail_at_once_when_ctx_aborts_before_its_offer(
        daemon_factory: Factory, short_tmp: Path) -> None:
    """Both gen ranks expect (naming no peer) and wait; ctx rank 0 of 2 publishes and cancels
    before rank 1 publishes (no offer ever went out). gen's waits fail at once with ctx's
    reason, once each side (they used to wait for their 60 s deadline)."""
    pair = start_pair(daemon_factory, short_tmp, CTX2, GEN)
    results: dict[int, object] = {}

    async def gen_rank(r: int, task_status: trio.TaskStatus[None]) -> None:
        async with open_client(pair.gen.socket_path, client=f"gen{r}") as c:
            ids = await c.alloc(f"gen{r}", 2)
            await c.expect("r-wait", f"gen{r}", GEN, r, ids, ranks=[0, 1], deadline_s=60)
            task_status.started()
            try:
                results[r] = await c.wait("r-wait")
            except KvdError as exc:
                results[r] = exc

    async with open_client(pair.ctx.socket_path, client="probe") as c:
        await wait_for_peer(c)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            for r in range(2):
                await n.start(gen_rank, r)
            await end_with_rank0_only(pair.ctx, "r-wait", role="ctx", peer="gen")
    for r in range(2):
        res = results[r]
        assert isinstance(res, TransferCancelled), res
        assert "ctx side failed" in res.message and "cancelled by client" in res.message, res.message
    assert len(await logged(pair.gen, "transfer.failed", request_id="r-wait")) == 1
    assert len(pair.ctx.logged("transfer.failed", request_id="r-wait")) == 1
    out = await run_transfer(pair, CTX2, GEN, request_id="r-after-wait", blocks=2)
    assert_exact(out, GEN)


async def test_a_ctx_abort_while_the_link_was_down_reaches_gen_when_it_comes_up(
        daemon_factory: Factory, short_tmp: Path) -> None:
    """ctx publishes while its gen peer is not up (the offer waits for the link), and its
    executor leaves: ctx's failure notice is owed to the link, and once the gen daemon is up it
    learns of it; a gen rank that then expects the request is refused at once with ctx's reason
    (it used to be dropped as a notice for an unknown request: the rank waited 60 s)."""
    from tests.transfer_harness import write_secret

    secret = write_secret(short_tmp)
    fast = {"bounce_size_mb": 4, "chunk_mb": 1, "mapped": False, "reconnect_initial_s": 0.05,
            "reconnect_max_s": 0.2}
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as dead:
        # held, never listening: ctx's dials are refused; gen listens on it once it is let go
        dead.bind(("127.0.0.1", unused_port()))
        port = dead.getsockname()[1]
        ctx = daemon_factory({"pools": pools_for("ctx", CTX, 16), "peer_secret_file": secret, "transfer": fast,
                              "peers": [{"name": "gen", "host": "127.0.0.1", "port": port}]}, name="ctx")
        async with open_client(ctx.socket_path, client="ctx0") as c:
            await c.publish("r-down", "ctx0", CTX, 0, await c.alloc("ctx0", 2), peer="gen", deadline_s=60)
        # (the executor left: its side fails with "executor session N ended")
        await logged(ctx, "transfer.failed", request_id="r-down")
    gen = daemon_factory({"pools": pools_for("gen", GEN, 16), "peer_secret_file": secret, "peer_port": port,
                          "transfer": fast, "log_level": "debug"}, name="gen")
    await logged(gen, "transfer.dropped", request_id="r-down")
    with trio.fail_after(20), pytest.raises(TransferCancelled, match="already failed: ctx side failed") as info:
        await late_rank1(gen, "r-down")
    # who left, in the words the other side hears: the session's client name, pid and ranks
    assert re.search(r"executor session \d+ \('ctx0', pid \d+, rank 0\) ended before the request did",
                     info.value.message), info.value.message


def test_failure_notices_owed_to_a_peer_that_is_down_are_bounded() -> None:
    """A peer down for long: the notices waiting for its link are at most max_ended_requests;
    the oldest is dropped, and logged (``peer.owed_dropped``)."""
    import structlog.testing

    from kvd.config import Config, LimitsConfig
    from kvd.peer.links import PeerLinks
    from protocol import transfer as x

    async def deliver(link: object, msg: object) -> None:
        raise AssertionError("nothing is delivered here")

    links = PeerLinks(Config(limits=LimitsConfig(max_ended_requests=2)), None, {}, "test",  # type: ignore[arg-type]
                      deliver=deliver, link_up=lambda link: None, link_lost=lambda node, why: None)
    with structlog.testing.capture_logs() as logs:
        for i in range(3):
            links.owe("gen", x.XferFail(request_id=f"r{i}", code="transfer_cancelled", message="m", sender="ctx"))
    assert [msg.request_id for msg in links.owed["gen"]] == ["r1", "r2"]
    assert [(e["event"], e["request_id"], e["limit"]) for e in logs] == [("peer.owed_dropped", "r0", 2)]
