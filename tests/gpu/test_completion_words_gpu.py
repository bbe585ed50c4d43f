"""Completion tokens stored by ctx's GPU (mapped path): gen's spinning executors finish while
their own daemon is stopped, byte-exact, and that daemon reports the request done, once, when
it runs again."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from clients.blocking import Client
from kvd.demo.launch import DaemonProcess
from protocol import messages as m
from protocol.layout import KVLayout
from tests.transfer_harness import start_pair

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GEO = {"num_layers": 6, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 32, "dtype": "bfloat16"}
LAYOUT = KVLayout(**GEO)  # type: ignore[arg-type]


def _blocks(pool: torch.Tensor, info: m.PoolInfo, ids: list[int]) -> torch.Tensor:
    ax = info.axis_order.index("block")
    return pool.index_select(ax, torch.tensor(ids, device=pool.device)).cpu()


def _until(what: Callable[[], bool], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not what():
        if time.monotonic() > end:
            raise TimeoutError("condition not reached")
        time.sleep(0.005)


@pytest.mark.parametrize("mode", ["1", "memop"])  # the token-store kernel (1), stream memory operations
def test_gen_executors_complete_from_ctx_gpu_tokens_while_their_daemon_is_stopped(
        daemon_factory: Callable[..., DaemonProcess], short_tmp: Path, monkeypatch: pytest.MonkeyPatch,
        mode: str) -> None:
    monkeypatch.setenv("KVD_GPU_TOKENS", mode)  # (the daemons inherit it)
    gen_dev = 1 if torch.cuda.device_count() > 1 else 0
    pair = start_pair(daemon_factory, short_tmp, LAYOUT, LAYOUT, num_blocks=32, mapped=True, memory="auto",
                      ctx_device=0, gen_device=gen_dev)
    pair.ctx.logged("peer.pools_mapped")
    pair.gen.logged("peer.connected", node="ctx")  # gen's executors name peer "ctx": gen must know it
    assert '"peer.completion_page_not_mapped"' not in pair.ctx.log()
    with Client(pair.ctx.socket_path, client="ctx", spin_s=1.0, completion_page=True) as ctx, \
            Client(pair.gen.socket_path, client="gen", spin_s=1.0, completion_page=True) as gen, \
            Client(pair.ctx.socket_path, client="probe") as probe:
        c_info, g_info = ctx.pools()[0], gen.pools()[0]
        c_pool, g_pool = ctx.attach(c_info.name), gen.attach(g_info.name)
        ax = c_info.axis_order.index("block")
        for i in range(6):  # the first loads the kernel (not inline); later ones store tokens
            rid, stop = f"w-{i}", i >= 3
            c_ids, g_ids = ctx.alloc(c_info.name, 4), gen.alloc(g_info.name, 4)
            with torch.no_grad():
                src = c_pool.tensor.index_select(ax, torch.tensor(c_ids, device=c_pool.tensor.device))
                src.copy_(torch.randint(-2000, 2000, src.shape, dtype=torch.int16).view(src.dtype).to(src.device))
                c_pool.tensor.index_copy_(ax, torch.tensor(c_ids, device=c_pool.tensor.device), src)
            torch.cuda.synchronize()
            gen.expect(rid, g_info.name, LAYOUT, 0, g_ids, peer="ctx", deadline_s=60)
            # the announce reached ctx (a transfer there, no executor yet)
            _until(lambda: probe.stats().transfers_active == 1)
            if stop:
                os.kill(pair.gen.pid, signal.SIGSTOP)
            outcome: list[m.Completion | BaseException] = []

            def wait_gen(rid: str = rid, outcome: list[m.Completion | BaseException] = outcome) -> None:
                try:
                    outcome.append(gen.wait(rid))
                except BaseException as exc:
                    outcome.append(exc)

            waiter = threading.Thread(target=wait_gen)
            try:
                waiter.start()
                sent = ctx.publish_and_wait(rid, c_info.name, LAYOUT, 0, c_ids, peer="gen", deadline_s=60)
                waiter.join(timeout=0.9 if stop else 30)
                finished_stopped = not waiter.is_alive()
            finally:
                if stop:
                    os.kill(pair.gen.pid, signal.SIGCONT)
                waiter.join(timeout=30)
            (got,) = outcome
            assert isinstance(got, m.Completion) and got.ok and got.path == "mapped", got
            assert got.bytes == sent.bytes
            if stop:  # only ctx's GPU could have said so: gen's daemon was stopped
                assert finished_stopped
            torch.cuda.synchronize()
            assert torch.equal(_blocks(g_pool.tensor, g_info, g_ids).view(torch.int16),
                               _blocks(c_pool.tensor, c_info, c_ids).view(torch.int16)), rid
            (done,) = pair.gen.logged("transfer.done", request_id=rid)
            assert done["role"] == "gen"
            assert gen.ping(b"x") == b"x"  # the owed wait went out; its reply is dropped
            assert gen.free(g_info.name, g_ids) == 4 and ctx.free(c_info.name, c_ids) == 4
            _until(lambda: probe.stats().transfers_active == 0)
        assert gen.page_completions >= 3
        assert '"transfer.failed"' not in pair.gen.log() and '"transfer.failed"' not in pair.ctx.log()
        assert '"transfer.tokens_not_stored"' not in pair.ctx.log()
        assert '"transfer.completion_page_not_registered"' not in pair.ctx.log()


def test_token_store_kernel_stores_only_after_the_work_before_it() -> None:
    """``kvd_store_tokens`` behind work the host holds back (a stream wait on a host word):
    nothing is stored until that work may finish; then every token, full 64-bit values
    included; bad store lists are refused with nothing enqueued."""
    import mmap

    import numpy as np
    from cuda.bindings import driver as cu

    from kvd.regroup import kernel as kernel_mod
    from kvd.regroup import signal as signal_mod

    k = kernel_mod.kernel_for(0)
    if k is None:
        pytest.skip("the regroup kernel cannot be loaded here (see regroup.kernel_unavailable)")
    page = mmap.mmap(-1, 4096)
    words = np.frombuffer(page, dtype=np.uint64)
    address = words.__array_interface__["data"][0]
    dptr = signal_mod.register_host(address, 4096, 0)
    try:
        stream = torch.cuda.Stream(device=0)  # type: ignore[no-untyped-call]
        gate, tokens = dptr, [(dptr + 8 * (1 + i), v) for i, v in enumerate((7, (1 << 64) - 3, 1 << 63))]
        assert kernel_mod._check(cu.cuCtxPushCurrent(k.ctx), "cuCtxPushCurrent") is None
        try:  # the stream waits for the host to open the gate
            kernel_mod._check(cu.cuStreamWaitValue32(cu.CUstream(stream.cuda_stream), cu.CUdeviceptr(gate), 1,
                                                     cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
                              "cuStreamWaitValue32")
        finally:
            cu.cuCtxPopCurrent()
        signal_mod.store_by_kernel(0, stream.cuda_stream, tokens)
        assert stream.query() is False
        assert words[1:4].tolist() == [0, 0, 0]  # the gate is shut: no store can have run
        words[0] = 1
        stream.synchronize()
        assert words[1:4].tolist() == [7, (1 << 64) - 3, 1 << 63]
        for bad in ([], [(gate, 1)] * (kernel_mod.MAX_TOKEN_STORES + 1), [(gate, -1)], [(gate, 1 << 64)]):
            with pytest.raises(kernel_mod.KernelError):
                k.store_tokens(stream.cuda_stream, bad)
        stream.synchronize()
        assert words[0] == 1  # nothing was enqueued for the refused lists
    finally:
        torch.cuda.synchronize()
        signal_mod.unregister_host(address)
        del words
        page.close()


def test_offer_accept_blocks_are_reusable_as_soon_as_the_page_says_done(
        daemon_factory: Callable[..., DaemonProcess], short_tmp: Path) -> None:
    """ctx published first (offer/accept): gen's executor may see its token, stored by ctx's
    GPU, before gen's daemon read ctx's path message. Registering the same gen blocks to the
    next request at once must then succeed: the daemon settles the request done (the ctx side
    it knows of is still 'offered') instead of refusing the blocks as in use.

    Deterministic up to the order the resumed gen daemon reads its two sockets in: ctx is
    stopped while gen accepts (the accept waits in ctx's socket), gen is stopped before ctx
    resumes (the path message waits in gen's), and the executor's page completion comes while
    gen is stopped; the next registration is written before gen resumes."""
    gen_dev = 1 if torch.cuda.device_count() > 1 else 0
    pair = start_pair(daemon_factory, short_tmp, LAYOUT, LAYOUT, num_blocks=32, mapped=True, memory="auto",
                      ctx_device=0, gen_device=gen_dev)
    pair.ctx.logged("peer.pools_mapped")
    pair.gen.logged("peer.connected", node="ctx")  # gen's executors name peer "ctx": gen must know it
    with Client(pair.ctx.socket_path, client="ctx") as ctx, \
            Client(pair.gen.socket_path, client="gen", spin_s=1.0, completion_page=True) as gen, \
            Client(pair.gen.socket_path, client="probe") as probe:
        c_info, g_info = ctx.pools()[0], gen.pools()[0]
        c_ids, g_ids = ctx.alloc(c_info.name, 4), gen.alloc(g_info.name, 4)
        for i in range(2):  # the first loads the kernel; then its launches are inline and store tokens
            ctx.publish(f"warm-{i}", c_info.name, LAYOUT, 0, c_ids, peer="gen", deadline_s=60)
            assert gen.expect_and_wait(f"warm-{i}", g_info.name, LAYOUT, 0, g_ids, peer="ctx", deadline_s=60).ok
            assert ctx.wait(f"warm-{i}").ok
        before = gen.page_completions
        rounds = 4
        for i in range(rounds):
            rid = f"oa-{i}"
            ctx.publish(rid, c_info.name, LAYOUT, 0, c_ids, peer="gen", deadline_s=60)
            _until(lambda: probe.stats().transfers_active == 1)  # the offer reached gen
            os.kill(pair.ctx.pid, signal.SIGSTOP)
            try:
                gen.expect(rid, g_info.name, LAYOUT, 0, g_ids, peer="ctx", deadline_s=60)  # gen accepts
                os.kill(pair.gen.pid, signal.SIGSTOP)
            finally:
                os.kill(pair.ctx.pid, signal.SIGCONT)
            outcome: list[object] = []
            try:
                got = gen.wait(rid, timeout_s=30)  # from the page: gen's daemon is stopped
                assert got.ok and got.path == "mapped", got

                def register_next(rid: str = f"next-{i}", outcome: list[object] = outcome) -> None:
                    try:
                        # (no peer: nothing is announced; the request ends with its cancel, below)
                        gen.expect(rid, g_info.name, LAYOUT, 0, g_ids, deadline_s=60)
                        outcome.append(rid)
                    except BaseException as exc:
                        outcome.append(exc)

                nxt = threading.Thread(target=register_next)
                nxt.start()
            finally:
                os.kill(pair.gen.pid, signal.SIGCONT)
            nxt.join(timeout=30)
            assert len(outcome) == 1 and not isinstance(outcome[0], BaseException), outcome
            assert ctx.wait(rid).ok
            gen.cancel(f"next-{i}")  # (never published: it ends here, its blocks go back)
            _until(lambda: probe.stats().transfers_active == 0)
        assert gen.page_completions - before == rounds
        assert '"transfer.failed"' not in pair.ctx.log()
        assert [d["role"] for d in pair.gen.logged("transfer.done", request_id="oa-0")] == ["gen"]
