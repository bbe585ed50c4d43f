"""PollingClient: a step loop's non-blocking get_finished over real daemons and real NIXL.

One thread plays three framework workers (ctx TP1, gen TP2 rank 0 and rank 1), each a
PollingClient: registrations and cancels are sent without waiting, and every loop turn asks
each worker's get_finished. Nothing here sleeps; the loop ends when every watched request
came back, and a generous bound turns a lost completion into a failure instead of a hang.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from clients.polling import PollingClient
from kvd.demo.launch import DaemonProcess
from protocol.errors import BadRequest, ConnectionClosed, error_from_code
from protocol.layout import KVLayout
from protocol.messages import Completion
from tests.conftest import host_pool
from tests.layout_fields import Geometry
from tests.transfer_harness import start_pair

GEOMETRY: Geometry = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 32, "tokens_per_block": 16, "dtype": "bfloat16"}
CTX = KVLayout(**GEOMETRY, tp_size=1)
GEN = KVLayout(**GEOMETRY, tp_size=2, axis_order=("layer", "kv", "block", "head", "token", "dim"))
CANONICAL = ("block", "layer", "kv", "head", "token", "dim")
REQUESTS = 24
GEN_CANCELS = {3, 10, 17}  # gen rank 0 cancels these right after registering
CTX_CANCELS = {5, 12, 19}  # the ctx worker cancels these right after publishing
BOUND_S = 120.0  # a lost completion fails the test here instead of hanging it


def blocks_of(layout: KVLayout, pool: torch.Tensor) -> torch.Tensor:
    return pool.permute(*(layout.axis_order.index(a) for a in CANONICAL))


def kv_of(request: int, nblocks: int) -> torch.Tensor:
    """Request ``request``'s KV, [block, layer, kv, head, token, dim], exact in bfloat16."""
    shape = (nblocks, GEOMETRY["num_layers"], 2, GEOMETRY["num_kv_heads"], 16, GEOMETRY["head_dim"])
    return torch.randint(-128, 128, shape, generator=torch.Generator().manual_seed(request)).to(torch.bfloat16)


def collect(clients: dict[str, PollingClient], want: int, *, between: Callable[[], object] = lambda: None,
            ) -> dict[str, dict[str, Completion]]:
    """Poll every client until each returned ``want`` completions (each request once)."""
    got: dict[str, dict[str, Completion]] = {name: {} for name in clients}
    end = time.monotonic() + BOUND_S
    while any(len(g) < want for g in got.values()):
        assert time.monotonic() < end, {n: sorted(set(map(str, range(want))) - set(g)) for n, g in got.items()}
        for name, kvd in clients.items():
            for done in kvd.get_finished():
                assert done.request_id not in got[name], f"{name}: {done.request_id} returned twice"
                got[name][done.request_id] = done
        between()
    return got


def test_step_loop_many_in_flight_cancels_and_refusals(
    daemon_factory: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    pair = start_pair(daemon_factory, short_tmp, CTX, GEN, num_blocks=64)
    with contextlib.ExitStack() as stack:
        ctx = stack.enter_context(PollingClient(pair.ctx.socket_path, client="ctx-rank0"))
        gen = {r: stack.enter_context(PollingClient(pair.gen.socket_path, client=f"gen-rank{r}",
                                                    timeout=5.0 if r else None)) for r in (0, 1)}
        run_workers(ctx, gen)


def run_workers(ctx: PollingClient, gen: dict[int, PollingClient]) -> None:
    """The three workers' requests, from registration to freeing the blocks."""
    ctx_pool = blocks_of(CTX, ctx.attach("ctx0").tensor)
    gen_pool = {r: blocks_of(GEN, gen[r].attach(f"gen{r}").tensor) for r in (0, 1)}
    sizes = [1 + i % 3 for i in range(REQUESTS)]
    ctx_ids: dict[str, list[int]] = {}  # request -> its blocks
    gen_ids: dict[int, dict[str, list[int]]] = {r: {} for r in (0, 1)}
    for i, n in enumerate(sizes):
        rid = str(i)
        for r in (0, 1):
            gen_ids[r][rid] = gen[r].alloc(f"gen{r}", n)
            gen_pool[r][gen_ids[r][rid]] = -1.0
            gen[r].expect_and_watch(rid, f"gen{r}", GEN, r, gen_ids[r][rid])
            if r == 0 and i in GEN_CANCELS:
                gen[0].cancel_nowait(rid)
        if i == 0:  # nothing published or cancelled yet: a poll returns at once with nothing (gen
            # rank 1's client has a socket timeout, which must not turn the poll into a wait)
            assert gen[0].get_finished() == [] and gen[1].get_finished() == []
            assert gen[0].watching == gen[1].watching == 1
    for i, n in enumerate(sizes):
        rid = str(i)
        ctx_ids[rid] = ctx.alloc("ctx0", n)
        ctx_pool[ctx_ids[rid]] = kv_of(i, n)
        ctx.publish_and_watch(rid, "ctx0", CTX, 0, ctx_ids[rid], "gen")
        if i in CTX_CANCELS:
            ctx.cancel_nowait(rid)

    # a blocking call between polls reads the socket too: completions it meets are kept
    got = collect({"ctx": ctx, "gen0": gen[0], "gen1": gen[1]}, REQUESTS, between=gen[1].pools)
    cancelled = GEN_CANCELS | CTX_CANCELS
    for name, outcomes in got.items():
        for rid, done in outcomes.items():
            if int(rid) in cancelled:  # the cancel or the transfer may win; nothing else
                assert done.ok or done.error_code == "transfer_cancelled", (name, done)
            else:
                assert done.ok, (name, error_from_code(done.error_code, done.error_message))
    for rid in got["gen0"]:
        if int(rid) in GEN_CANCELS:  # rank 0's cancel failed the whole gen side, and ctx
            assert {got[n][rid].ok for n in got} == {False}, rid
    for r in (0, 1):
        lo, hi = GEN.head_range(r)
        for rid, done in got[f"gen{r}"].items():
            if done.ok:
                want = kv_of(int(rid), sizes[int(rid)])[:, :, :, lo:hi]
                assert torch.equal(gen_pool[r][gen_ids[r][rid]], want), (r, rid)
    # every completion, ok or not, means kvd is done with the blocks: free refuses none
    assert ctx.free("ctx0", [b for ids in ctx_ids.values() for b in ids]) == sum(sizes)
    for r in (0, 1):
        assert gen[r].free(f"gen{r}", [b for ids in gen_ids[r].values() for b in ids]) == sum(sizes)
        assert gen[r].watching == 0

    # refused registrations come back as the request's failed completion, once each
    ids = gen[0].alloc("gen0", 1)
    unleased = next(b for b in range(64) if b not in ids)
    gen[0].expect_and_watch("bad-blocks", "gen0", GEN, 0, [unleased])
    gen[0].expect_and_watch("bad-layout", "gen0", CTX, 0, ids)
    gen[0].expect_and_watch("given-up", "gen0", GEN, 0, ids)
    gen[0].cancel_nowait("given-up")
    refused = collect({"gen0": gen[0]}, 3)["gen0"]
    assert refused["bad-blocks"].error_code == "block_not_leased"
    assert refused["bad-layout"].error_code == "incompatible_layout"
    assert refused["given-up"].error_code == "transfer_cancelled"
    assert gen[0].watching == 0 and gen[0].get_finished() == []
    assert gen[0].free("gen0", ids) == 1

    # what the client refuses before sending anything
    with pytest.raises(BadRequest, match="not watched"):
        gen[0].cancel_nowait("given-up")
    with pytest.raises(BadRequest, match="request_id"):
        gen[0].expect_and_watch("", "gen0", GEN, 0, ids)
    assert gen[0].watching == 0


def test_get_finished_says_when_the_daemon_is_gone(
    daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = daemon_factory({"pools": [host_pool("p0", tokens_per_block=16)]})
    layout = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, tokens_per_block=16, dtype="bfloat16")
    with PollingClient(d.socket_path, client="gen") as kvd:
        ids = kvd.alloc("p0", 2)
        kvd.expect("orphan", "p0", layout, 0, ids[:1])  # nobody publishes these
        kvd.watch("orphan")
        kvd.expect_and_watch("orphan-2", "p0", layout, 0, ids[1:])
        assert kvd.get_finished() == [] and kvd.watching == 2
        d.kill()
        with pytest.raises(ConnectionClosed, match=r"daemon stopped or was killed.*open a new Client"):
            kvd.get_finished()
