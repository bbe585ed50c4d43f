"""gen's bounce receive task that starts after its side began aborting scatters nothing.

ctx's path message starts gen's receive task (``StartReceive``), but a task runs only from
the next scheduler pass. A chunk's notification and the executor's cancel can both be
handled before that pass (the link, the poller and the session are woken together, e.g.
after the daemon was descheduled). The cancel aborts gen's scatters: with no receive task
running yet, the notified chunks are counted as ended at once (their scatters "will not
run"). The task, starting right after, must then not scatter them: it wrote the chunk into
gen's blocks although the machine had counted it over, then reported its end a second time
(``WriteEnded`` with nothing in flight: a protocol error), and the bookkeeping went negative,
so the side was left with one scatter "in flight" forever: after ctx said its writes
stopped, gen never reported, and its blocks and receive slots were never given back.

In one process, with real host pools and staging (the race cannot be ordered from outside
two daemons: it lies within one scheduler pass).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import structlog.testing
import trio
import trio.testing

from kvd.config import TransferConfig
from kvd.pool import Pool
from kvd.transfer.requests import RankPart, Side
from kvd.transfer.transfer import Env, Transfer
from kvd.transport.setup import Staging, _staging
from kvd.transport.slots import SlotPool
from protocol import messages as m
from protocol import transfer as x
from protocol import transfer_fsm as f
from protocol.layout import KVLayout
from tests.bounce_harness import make_pools
from tests.fake_link import FakeLink, FakeLinks

RID = "r-early-cancel"
CTX = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, tokens_per_block=16, dtype="bfloat16", num_blocks=16)
#: twice the tokens per block on gen: a regroup, so the bytes go through the bounce slots
GEN = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, tokens_per_block=32, dtype="bfloat16", num_blocks=8)
CHUNK = 1 << 20  # the whole request (8 ctx blocks of 128 KiB): one chunk
SLOTS = 4
SENTINEL, STAGED = 0xEE, 0xAB


@dataclass
class _Rig:
    nursery: trio.Nursery
    links: FakeLinks
    staging: Staging
    reports: list[m.Completion] = field(default_factory=list)
    ended: list[Transfer] = field(default_factory=list)

    def spawn(self, fn: Callable[[], Awaitable[None]], actor: bool) -> None:
        self.nursery.start_soon(fn)

    def env(self) -> Env:
        return Env(node="gen", cfg=TransferConfig(), nixl=lambda: None,
                   links=lambda: self.links,  # type: ignore[arg-type,return-value]
                   staging=lambda: self.staging, on_report=lambda t, side, c: self.reports.append(c),
                   on_finished=self.ended.append, spawn=self.spawn)


@pytest.fixture
def gen_pool() -> Any:
    pools = make_pools("gen", GEN, 8)
    yield pools[0]
    for pool in pools.values():
        pool.close()


async def test_a_receive_task_starting_after_the_cancel_scatters_nothing(gen_pool: Pool) -> None:
    staging = Staging(_staging(CHUNK, SLOTS, -1), _staging(CHUNK, SLOTS, -1), SlotPool(SLOTS), SlotPool(SLOTS))
    link = FakeLink(held=False, agent="ctx-agent")
    gen_ids = [0, 1, 2, 3]
    gen_pool.tensor_u8().fill_(SENTINEL)
    with structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            rig = _Rig(nursery, FakeLinks({"ctx": link}), staging)
            t = Transfer(rig.env(), RID, "ctx", {f.Role.GEN})
            session = SimpleNamespace(id=1, reads_page=False)
            t.sides[f.Role.GEN] = Side(request_id=RID, role="gen", layout=GEN, ranks=(0,), peer="ctx",
                                       deadline=math.inf,
                                       parts={0: RankPart(0, gen_pool, gen_ids, session)})  # type: ignore[arg-type]
            t.feed(f.SideComplete(f.Role.GEN, deadline=trio.current_time() + 60, deadline_s=60, peer_named=True))
            (announce,) = link.sent
            assert isinstance(announce, x.XferAnnounce) and announce.slots, announce
            slot = announce.slots[0]
            staging.recv.slot_tensor(slot).fill_(STAGED)  # chunk 0, as ctx's write left it

            # one scheduler pass: ctx's path message (the receive task is started, not run),
            # chunk 0's notification, the executor's cancel
            t.post(x.XferPath(request_id=RID, path="bounce", layout=CTX, blocks={0: list(range(8))},
                              chunk_bytes=CHUNK))
            assert t._tasks == 1 and f.Role.GEN not in t._scopes  # started, not running yet
            t.post(x.Notif(RID, 0, slot))
            t.feed(f.Cancel(f.Role.GEN, "cancelled by its executor"))
            assert t.machine.state(f.Role.GEN) is f.State.ABORTING
            assert t.machine.gen.in_flight == 0  # the notified chunk's scatter counted as never run

            await trio.testing.wait_all_tasks_blocked()  # the receive task has its turn
            assert isinstance(link.sent[-1], x.XferFail)  # ctx was told (by the actor, awaited)
            written = int((gen_pool.tensor_u8() != SENTINEL).sum())
            assert written == 0, f"{written} bytes scattered into gen's blocks after the scatter was counted over"
            assert t.machine.gen.in_flight == 0
            assert not rig.reports  # ctx may still write into the receive slots

            # ctx says its writes stopped: gen reports, once, and the transfer ends
            t.post(x.XferFail(request_id=RID, code="transfer_cancelled", message="gen side failed",
                              writes_stopped=True, sender="ctx", ref=t.ref))
            with trio.fail_after(5):
                await t.finished.wait()
    assert [(c.ok, c.error_code) for c in rig.reports] == [(False, "transfer_cancelled")]
    bad = [e for e in logs if e["event"] in ("transfer.internal_error", "transfer.local_protocol_error",
                                             "transfer.task_failed_after_end")]
    assert not bad, bad
