"""No write after failure: once gen's executor hears that a transfer failed and frees its blocks,
no write of that transfer lands in them any more — even when the sender was frozen (SIGSTOP)
in the middle of the transfer and resumes later.

For each kind of failure (gen cancels, the ctx executor is killed, the ctx daemon is frozen
until gen declares it gone) the transfer is frozen mid-flight, the failure strikes, the gen side
must keep reporting nothing (and keep the blocks) while the sender is frozen; then the sender
resumes, gen reports the failure, the blocks are freed, re-allocated by another session and
filled — and must stay intact for 2 s.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from clients import open_client
from clients.client import AsyncClient
from kvd.demo.launch import DaemonProcess
from protocol.errors import BlocksInUse, KvdError, WaitTimeout
from protocol.layout import KVLayout
from tests.transfer_harness import gen_progress, refill_and_watch, start_pair, wait_for_peer

Factory = Callable[..., DaemonProcess]
GEO = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 16, "dtype": "bfloat16"}
LAYOUT = KVLayout(**GEO)  # type: ignore[arg-type]
#: gen with twice the tokens per block: a regroup, so the bytes go through the bounce slots
GEN_BOUNCE = KVLayout(**{**GEO, "tokens_per_block": 32})  # type: ignore[arg-type]
BLOCKS = 384  # 128 KiB each; direct: one NIXL write per block (descs_per_write = 1); bounce:
# one write per 1 MiB chunk with a grant round trip each: either is long enough to freeze
PATTERN = 0x3333
RID = "r-stale"

SENDER = f"""
import sys
import torch
from clients import Client
from protocol.layout import KVLayout
c = Client(sys.argv[1], client="ctx-exec")
pool = c.attach("ctx0")
ids = c.alloc("ctx0", {BLOCKS})
pool.tensor.view(torch.int16)[torch.tensor(ids)] = 0x5A5A  # what a stale write would leave behind
c.publish("{RID}", "ctx0", KVLayout(**{GEO!r}), 0, ids, peer="gen", deadline_s=120)
print("published", flush=True)
try:
    c.wait("{RID}")
    print("done", flush=True)
except Exception as exc:
    print("failed", type(exc).__name__, flush=True)
"""


async def _until(c: AsyncClient, cond: Callable[[str, int], bool], what: str) -> tuple[str, int]:
    with trio.fail_after(30):
        while True:
            state, chunks = await gen_progress(c, RID)
            if cond(state, chunks):
                return state, chunks
            assert state not in ("done", "failed"), f"{what}: the transfer already ended ({state})"
            await trio.sleep(0.005)  # polling the daemon's reply; the condition is the sync point
    raise AssertionError(what)  # pragma: no cover


@pytest.mark.parametrize("path", ["direct", "bounce"])
@pytest.mark.parametrize("fault", ["gen_cancel", "ctx_executor_killed", "ctx_daemon_stopped"])
async def test_no_write_lands_after_failure(daemon_factory: Factory, short_tmp: Path, fault: str, path: str) -> None:
    # a frozen daemon stops answering heartbeats: gen declares it gone (after 5 s in that case)
    beat = 5.0 if fault == "ctx_daemon_stopped" else 60.0
    transfer: dict[str, object] = {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": beat}
    gen_layout, gen_blocks = LAYOUT, BLOCKS
    if path == "direct":
        transfer["descs_per_write"] = 1
    else:
        gen_layout, gen_blocks = GEN_BOUNCE, BLOCKS // 2
        transfer.update(bounce_size_mb=4, chunk_mb=1)
    pair = start_pair(daemon_factory, short_tmp, LAYOUT, gen_layout, num_blocks=2 * BLOCKS, transfer=transfer)
    async with open_client(pair.gen.socket_path, client="gen-exec") as g, \
            open_client(pair.ctx.socket_path, client="probe") as probe:
        await wait_for_peer(probe)
        await wait_for_peer(g)
        ids = await g.alloc("gen0", gen_blocks)
        # reversed: no two blocks form one contiguous run, so every block is its own write
        await g.expect(RID, "gen0", gen_layout, 0, ids[::-1], peer="ctx", deadline_s=120.0)
        sender = subprocess.Popen([sys.executable, "-c", SENDER, pair.ctx.socket_path], stdout=subprocess.PIPE)
        assert sender.stdout is not None
        stopped = False
        try:
            line = await trio.to_thread.run_sync(sender.stdout.readline)
            assert line.strip() == b"published"
            # the first writes landed: freeze the sending daemon in the middle of the transfer
            await _until(g, lambda _s, chunks: chunks >= 1, "no write landed")
            pair.ctx.proc.send_signal(signal.SIGSTOP)
            stopped = True
            state, _chunks = await gen_progress(g, RID)
            assert state != "done", "the transfer ended before the sender was frozen"

            if fault == "gen_cancel":
                await g.cancel(RID)
            elif fault == "ctx_executor_killed":
                sender.kill()
            else:
                await _until(g, lambda s, _c: s == "aborting", "gen never declared the frozen peer gone")

            # gen failed, but a write may still land: it reports nothing and keeps the blocks
            with pytest.raises(WaitTimeout):
                await g.wait(RID, timeout_s=1.0)
            with pytest.raises(BlocksInUse):
                await g.free("gen0", ids)
            # the frozen daemon cannot tell gen about its executor yet; the other faults struck gen
            assert (await gen_progress(g, RID))[0] == ("receiving" if fault == "ctx_executor_killed" else "aborting")

            pair.ctx.proc.send_signal(signal.SIGCONT)
            stopped = False
            with pytest.raises(KvdError):
                await g.wait(RID)
            assert await g.free("gen0", ids) == gen_blocks
        finally:
            if stopped:
                pair.ctx.proc.send_signal(signal.SIGCONT)
            if sender.poll() is None:
                out = await trio.to_thread.run_sync(sender.stdout.readline)
                assert out.split()[:1] == [b"failed"], out
            sender.kill()
            sender.wait()
            sender.stdout.close()

        # another session takes every free block (the failed request's among them) and fills it
        await refill_and_watch(pair.gen.socket_path, "gen0", ids, PATTERN)
        # the thawed ctx daemon learns of the failure from gen or from its lost link, and logs
        # it when it does: wait for that line (it may come after gen's report)
        with trio.fail_after(30):
            while '"transfer.failed"' not in pair.ctx.log():
                await trio.sleep(0.02)
        ctx_log = pair.ctx.log()
        assert ctx_log.count('"transfer.failed"') == 1 and '"transfer.done"' not in ctx_log
        gen_log = pair.gen.log()
        assert gen_log.count('"transfer.failed"') == 1 and '"transfer.done"' not in gen_log
