"""Landed events on a GPU: gen completes a mapped request from the CUDA interprocess event ctx
recorded after its kernel (``kvd.regroup.landed``), byte-exact; a reused slot never completes
early in another process; turned off, gen completes on the data-done message as before."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from kvd.demo.launch import DaemonProcess
from protocol.layout import KVLayout
from tests.transfer_harness import assert_exact, run_transfer, start_pair

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GEO = {"num_layers": 6, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 32, "dtype": "bfloat16"}


def _gen_device() -> int:
    return 1 if torch.cuda.device_count() > 1 else 0


def _done_lines(d: DaemonProcess, prefix: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in d.log().splitlines()
            if '"transfer.done"' in line and f'"{prefix}' in line]


async def _run_many(pair: Any, n: int, prefix: str) -> None:
    ctx, gen = KVLayout(**GEO), KVLayout(**{**GEO, "tp_size": 4})  # type: ignore[arg-type]
    for i in range(n):
        out = await run_transfer(pair, ctx, gen, request_id=f"{prefix}{i}", blocks=8, seed=i, gen_peer="ctx")
        assert_exact(out, gen)
        for c in [*out.ctx.values(), *out.gen.values()]:
            assert c.ok and c.path == "mapped", c
        (sent,) = {c.bytes for c in out.ctx.values()}
        assert all(c.bytes == sent for c in out.gen.values()), out.gen  # gen reports what ctx moved


async def test_gpu_gen_completes_on_the_landed_event(
    daemon_factory: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    """Past the ring's first round (each slot's handle is opened once, in a worker thread,
    while that request completes on the data-done message), gen completes requests from the
    landed event: ``landed_event`` in gen's stages, every request byte-exact, gen's bytes
    those ctx moved. ctx names the event in every inline-launched request's path message."""
    from kvd.regroup.landed import RING_SLOTS

    ctx, gen = KVLayout(**GEO), KVLayout(**{**GEO, "tp_size": 4})  # type: ignore[arg-type]
    pair = start_pair(daemon_factory, short_tmp, ctx, gen, num_blocks=32, mapped=True, memory="auto",
                      ctx_device=0, gen_device=_gen_device())
    n = 2 * RING_SLOTS + 4
    await _run_many(pair, n, "landed-")
    ctx_done = _done_lines(pair.ctx, "landed-")
    gen_done = _done_lines(pair.gen, "landed-")
    assert len(ctx_done) == n and len(gen_done) == n  # one line per side and request
    # the first request loads the kernel and makes the ring (worker thread): not inline
    named = sum(1 for d in ctx_done if d["stages"].get("landed_event") == 1)
    assert named >= n - 1, [line for line in pair.ctx.log().splitlines() if "landed" in line][:5]
    late = [d for d in gen_done if int(d["request_id"].rsplit("-", 1)[1]) >= RING_SLOTS + 1]
    seen = sum(1 for d in late if d["stages"].get("landed_event") == 1)
    # the data-done message may still win a race now and then; most requests must not need it
    assert seen >= len(late) // 2, [d["stages"] for d in late]
    assert '"regroup.landed_event_refused"' not in pair.gen.log()
    assert '"regroup.landed_events_unavailable"' not in pair.ctx.log()


async def test_gpu_landed_events_off_complete_on_the_done_message(
    daemon_factory: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    """``KVD_LANDED_EVENTS=0`` on the ctx daemon: no event in its path messages; gen completes
    on the data-done message, byte-exact, as without the feature."""
    ctx, gen = KVLayout(**GEO), KVLayout(**{**GEO, "tp_size": 4})  # type: ignore[arg-type]
    factory = partial(daemon_factory, env={**os.environ, "KVD_LANDED_EVENTS": "0"})
    pair = start_pair(factory, short_tmp, ctx, gen, num_blocks=32, mapped=True, memory="auto",
                      ctx_device=0, gen_device=_gen_device())
    await _run_many(pair, 6, "off-")
    assert not any(d["stages"].get("landed_event") for d in _done_lines(pair.ctx, "off-"))
    assert not any(d["stages"].get("landed_event") for d in _done_lines(pair.gen, "off-"))


def _reader(conn: Connection, handle: bytes, device: int) -> None:
    """Another process: open the handle, then on each word say whether the event is complete
    at the first look, and poll it until it is."""
    from kvd.regroup import landed

    ev = landed.open_event("writer", handle, device)
    conn.send(ev is not None)
    while conn.recv() == "look":
        first = landed.query(ev)
        while landed.query(ev) is False:
            pass
        conn.send(first)


def test_a_reused_slot_never_completes_early_in_another_process() -> None:
    """The reuse rule the mapped path relies on: a slot recorded again after long GPU work reads
    "not yet" in the process that opened it earlier, until that work is done; and an opened
    slot that was recorded after finished work reads done at once."""
    from kvd.regroup.landed import RING_SLOTS, LandedRing

    torch.zeros(1, device="cuda:0")
    ring = LandedRing(0)
    stream = torch.cuda.Stream(device=0)  # type: ignore[no-untyped-call]
    sid = int(stream.cuda_stream)
    first = ring.record(sid)
    assert first is not None and first.slot == 0 and len(first.handle) == 64
    stream.synchronize()
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_reader, args=(there, first.handle, 0), daemon=True)
    proc.start()
    try:
        assert here.recv() is True
        here.send("look")
        assert here.recv() is True  # recorded after nothing pending: done
        for _ in range(RING_SLOTS - 1):
            assert ring.record(sid) is not None
        with torch.cuda.stream(stream):
            # ~0.1 s of GPU time before the slot's next record
            torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]
        again = ring.record(sid)
        assert again is not None and again.slot == 0 and again.handle == first.handle
        here.send("look")
        assert here.recv() is False  # the reader sees the new record, not the old completion
        assert torch.cuda.Stream.query(stream)
        other = torch.cuda.Stream(device=0)  # type: ignore[no-untyped-call]
        assert ring.record(int(other.cuda_stream)) is None  # one stream only
        here.send("stop")
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
