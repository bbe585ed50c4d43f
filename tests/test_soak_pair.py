"""Soak across the peer link: executors on two real daemons (ctx and gen) run requests at
random for ``KVD_PAIR_SOAK_SECONDS`` (30 by default) — either side first, gen naming its peer
or not, equal layouts (the direct path) or a regroup (the bounce path: gen with twice the
tokens per block, or gen TP2 with two gen executors), or both daemons on the same-node mapped
path — and strike faults at random points: gen or ctx cancels, a side's executor (or one gen
rank's) hangs up, a side (or one gen rank) never registers and the deadline expires; in the third
case the peer link is also cut now and then (ctx dials gen through a relay in the test
process), in the fourth the gen daemon is killed (SIGKILL) now and then and another started in
its place, as systemd would; in the fifth an operator drains the ctx daemon (``drain`` as root,
or SIGTERM) now and then and another is started in its place once it exited. A request id is
reused once both sides of its request ended ok.

Two of the workers are step-loop executors (a serving framework's connector): they register
with ``PollingClient.publish_and_watch`` / ``expect_and_watch`` and collect outcomes with
``get_finished()`` (one of them with ``completion_page=True``), under the same faults and rules.

Every request must end on both sides with an outcome a caller can act on (ok, or one of the
expected errors; ok on both sides when no fault struck it and no cut, restart or drain came
while it ran), a completed one byte for byte, and gen's blocks must be free to free as soon
as its wait (or ``get_finished()``) returned. A drained ctx daemon refuses new registrations
(``Draining``), ends the requests it had with ok or ``DaemonStopping``, exits 0 and logged one
end line per side it accepted, no error and nothing left running. Afterwards nothing may be
left on either daemon: no lease, no running transfer, no bounce slot; each daemon logged
exactly one ``transfer.done`` or ``transfer.failed`` per request side it accepted, no
error-level line, and a last transfer on every path still goes through byte for byte (from an
AsyncClient executor and from a step-loop one).

The random pauses below only vary the interleaving; no assertion depends on them.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from clients import open_client
from clients.client import AsyncClient
from clients.polling import PollingClient
from kvd.demo.launch import DaemonProcess
from protocol import messages as m
from protocol.errors import (
    ConnectionClosed,
    Draining,
    KvdError,
    NotFound,
    PeerUnavailable,
    TransferCancelled,
    TransferError,
    TransferTimeout,
    error_from_code,
)
from protocol.layout import KVLayout
from tests.tcp_proxy import Proxy
from tests.transfer_harness import logged, pools_for, proxied_pair, wait_for_peer

Factory = Callable[..., DaemonProcess]
SECONDS = float(os.environ.get("KVD_PAIR_SOAK_SECONDS", "30"))
WORKERS = 6
GEO: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 32, "tokens_per_block": 8,
                       "dtype": "bfloat16"}  # 4 KiB blocks
SAME = KVLayout(**GEO)
#: gen with twice the tokens per block: gen block j holds ctx blocks 2j and 2j+1 (a regroup)
DOUBLE = KVLayout(**{**GEO, "tokens_per_block": 16})
NUM_BLOCKS = 512
#: gen TP2: each gen rank holds half of the heads (a regroup, two gen executors)
TP2 = KVLayout(**GEO, tp_size=2)
#: ctx pool, gen pools' prefix (then the rank) and gen layout of each kind of request
KINDS = {"same": ("ctx0", "gsame", SAME), "double": ("ctx0", "gdouble", DOUBLE), "tp2": ("ctx0", "gtp", TP2)}
#: a one-rank fault (hangs up, cancels, never comes) strikes one gen rank of the request
FAULTS = ("none", "none", "none", "none", "gen_cancel", "ctx_cancel", "ctx_hangs_up", "gen_hangs_up",
          "ctx_never", "gen_never", "gen_rank_never")
#: what a side's wait may end with when the other side (or its own executor) struck a fault
FAILED = (TransferCancelled, TransferTimeout, PeerUnavailable, TransferError)


def _name(d: DaemonProcess) -> str:
    """The daemon's name (its config file's: ``ctx``, ``gen``, ``gen2``, ``ctx1``, ...)."""
    return Path(d.config_path).stem


def _events(d: DaemonProcess) -> collections.Counter[str]:
    """Every logged event name, counted, and the error-level lines under ``"!error"``."""
    counts: collections.Counter[str] = collections.Counter()
    for line in d.log().splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            counts[rec["event"]] += 1
            if rec.get("level") in ("error", "critical"):
                counts["!error"] += 1
                counts[f"!error {rec['event']}"] += 1
    return counts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _expected_gen(src: torch.Tensor, layout: KVLayout, rank: int) -> torch.Tensor:
    """What gen rank ``rank``'s blocks must hold, from the ctx blocks ``src`` ([n, layer, kv,
    head, token, dim], TP1): its share of the heads, two ctx blocks a gen block where gen's
    blocks hold twice the tokens."""
    heads = src.shape[3] // layout.tp_size
    src = src[:, :, :, rank * heads:(rank + 1) * heads]
    if layout.tokens_per_block == SAME.tokens_per_block:
        return src
    n, layers, kv, heads, tokens, dim = src.shape
    pairs = src.reshape(n // 2, 2, layers, kv, heads, tokens, dim).permute(0, 2, 3, 4, 1, 5, 6)
    return pairs.reshape(n // 2, layers, kv, heads, 2 * tokens, dim)


@dataclass
class Live:
    """The daemons now running: gen is replaced when the soak restarts it, ctx when it drains it."""

    ctx: DaemonProcess
    gen: DaemonProcess
    #: set while a ctx daemon serves (not during a drain and the start of the next one)
    ctx_up: trio.Event = field(default_factory=trio.Event)
    #: the deadline of a request whose side (or one gen rank) never comes: in the drains case
    #: longer than the drain's 1 s of silence (DRAIN_QUIET_S), so that a drain fails a ctx side
    #: waiting for gen with daemon_stopping rather than its deadline doing it first
    never_deadline_s: float = 1.0


#: what an executor of a gen daemon that was killed under it runs into
GONE = (KvdError, OSError, trio.BrokenResourceError, trio.ClosedResourceError)
#: what a ctx executor may run into while its daemon drains or after it exited
CTX_GONE = (Draining, ConnectionClosed, OSError, trio.BrokenResourceError, trio.ClosedResourceError)
#: which workers are step-loop executors (PollingClient), and which of them read the completion page
POLLING = {4: False, 5: True}


class _Polling(PollingClient):
    """A PollingClient that notes the registrations the daemon accepted (their ``Registered``
    replies, read by ``get_finished``): the soak counts accepted sides against the daemon's
    end lines, and a refused registration comes back as a failed completion like any other."""

    def __init__(self, path: str, *, client: str, completion_page: bool) -> None:
        self.accepted: set[str] = set()
        super().__init__(path, client=client, completion_page=completion_page)

    def _route(self, reply: m.Message) -> bool:
        if isinstance(reply, m.Registered):
            self.accepted.add(reply.request_id)
        return super()._route(reply)


def _outcome(done: m.Completion) -> str:
    """A completion as the worker tallies it: ok, or the name of the error a wait would raise."""
    return "ok" if done.ok else type(error_from_code(done.error_code, done.error_message)).__name__


class Worker:
    """One pair of executors (a ctx one and a gen one) running requests back to back."""

    def __init__(self, index: int, live: Live, until: float, tally: collections.Counter[str],
                 polling: bool | None = None) -> None:
        self.index, self.live, self.until = index, live, until
        self.tally = tally
        #: a step-loop executor (PollingClient, in worker threads; ``page``: completion_page=True)
        self.polling = index in POLLING if polling is None else polling
        self.page = POLLING.get(index, True)
        self.rng = random.Random(1000 + index)
        self.serial = 0
        self.generation = [0, 0, 0]  # ids come back after a request that ended ok (see one_request)
        self.history: list[tuple[str, ...]] = []  # (request id, kind, fault, order, outcome): for failure messages

    async def run(self) -> None:
        while trio.current_time() < self.until:
            with trio.fail_after(60):  # a request that hangs fails the test here
                await self.one_request()

    @asynccontextmanager
    async def _session(self, path: str, who: str) -> AsyncIterator[AsyncClient]:
        async with open_client(path, client=f"{who}{self.index}") as c:
            yield c

    def explain(self, rid: str) -> str:
        """This worker's last requests, and what both daemons logged about ``rid``."""
        lines = [f"{Path(d.config_path).stem}: {line}" for d in (self.live.ctx, self.live.gen)
                 for line in d.log().splitlines() if f'"{rid}"' in line]
        return "\n".join(["last requests (id, kind, fault, order, outcome):", *map(str, self.history[-6:]),
                          f"logged about {rid}:", *lines])

    async def _pause(self) -> None:
        await trio.sleep(self.rng.random() * 0.003)

    async def _open_polling(self, path: str, who: str) -> _Polling:
        return await trio.to_thread.run_sync(partial(_Polling, path, client=f"{who}{self.index}p",
                                                     completion_page=self.page))

    async def _finished(self, kvd: _Polling, rid: str, *, accepted: bool = False,
                        abort: trio.Event | None = None) -> m.Completion | None:
        """The step loop: ``get_finished()`` until ``rid`` came back (this session watches
        nothing else), or with ``accepted`` until its registration was accepted (None then).
        ``abort`` set: the request is cancelled (``cancel_nowait``) and its outcome collected."""
        cancelled = False
        while True:
            got = kvd.get_finished()  # never blocks: called from the event loop's thread
            assert [d.request_id for d in got] in ([], [rid]), (rid, got)
            if got:
                # exactly once (a second get_finished() here could raise instead: the daemon,
                # once it answered every watch, may close a draining daemon's sessions)
                assert kvd.watching == 0, rid
                return got[0]
            if accepted and rid in kvd.accepted:
                return None
            if abort is not None and abort.is_set() and not cancelled:
                kvd.cancel_nowait(rid)
                cancelled = True
            await trio.sleep(0.0005 + self.rng.random() * 0.002)  # a step; the polled reply is the sync point

    async def _wait(self, g: AsyncClient, rid: str, abort: trio.Event) -> m.Completion:
        """``g.wait(rid)``; once ``abort`` is set (ctx's executor could not register: its daemon
        drained, so the router aborts the request) the request is cancelled, its outcome waited for."""
        got: list[m.Completion | Exception] = []

        async def waiter(scope: trio.CancelScope) -> None:
            try:
                got.append(await g.wait(rid))
            except Exception as exc:  # raised below, outside the nursery
                got.append(exc)
            scope.cancel()

        async def aborter() -> None:
            await abort.wait()
            with suppress(*GONE):  # NotFound: it ended already; the wait says how
                await g.cancel(rid)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter, nursery.cancel_scope)
            nursery.start_soon(aborter)
        if isinstance(got[0], Exception):
            raise got[0]
        return got[0]

    async def one_request(self, kind: str = "", fault: str = "") -> None:
        """One request; ``kind`` and ``fault`` at random unless given."""
        self.serial += 1
        slot = self.serial % 3
        rid = f"w{self.index}-{slot}.{self.generation[slot]}"
        kind = kind or self.rng.choice(sorted(KINDS))
        ctx_pool, gen_prefix, gen_layout = KINDS[kind]
        fault = fault or self.rng.choice(FAULTS)
        cuts_before = self.tally["link cuts"]
        restarts_before, drains_before = self.tally["gen restarts"], self.tally["ctx drains"]
        # a gen restart or ctx drain under way (the new daemon not linked yet) strikes this request too
        mid_restart = restarts_before != self.tally["gen restarts done"]
        mid_drain = drains_before != self.tally["ctx drains done"]

        def struck_by_restart() -> bool:
            return mid_restart or self.tally["gen restarts"] != restarts_before

        def struck_by_drain() -> bool:
            return mid_drain or self.tally["ctx drains"] != drains_before
        ctx_d = self.live.ctx  # the ctx daemon this request's ctx executor talks to
        order = self.rng.choice(("gen_peer", "gen", "ctx"))
        n = 2 * self.rng.randint(1, 8)  # ctx blocks: even, so a doubled gen block is whole
        deadline = self.live.never_deadline_s if fault in ("ctx_never", "gen_never", "gen_rank_never") else 30.0
        outcome: dict[str, str] = {}
        registered: dict[str, trio.Event] = {"ctx": trio.Event(), "gen": trio.Event()}
        gen_abort = trio.Event()  # ctx's executor could not register, its daemon draining or gone
        gen_data: dict[int, torch.Tensor] = {}  # gen rank -> its blocks, once ok
        gen_accepted: list[DaemonProcess] = []  # the gen daemon, once it accepted a rank's registration
        ctx_view: dict[str, Any] = {}
        ctx_phase = ["connect"]  # how far the ctx executor got, latest first ("wait": its side was accepted)

        world = gen_layout.world_size
        one_rank = self.rng.randrange(world)  # the rank a one-rank fault strikes
        gen_count = n if gen_layout.tokens_per_block == SAME.tokens_per_block else n // 2
        gen_said: dict[int, str] = {}
        attempted = [0]

        def failure_ok(done: m.Completion) -> str:
            """A polled outcome, checked as a wait's exception would be (FAILED or nothing)."""
            if not done.ok:
                exc = error_from_code(done.error_code, done.error_message)
                assert isinstance(exc, FAILED) or (isinstance(exc, CTX_GONE) and struck_by_drain()), \
                    (rid, done, self.explain(rid))
            return _outcome(done)

        def gen_attempted() -> None:
            attempted[0] += 1
            if attempted[0] == world:
                registered["gen"].set()

        async def gen_rank(r: int) -> None:
            if fault == "gen_never" or (fault == "gen_rank_never" and r == one_rank):
                gen_attempted()  # the other side (and the other ranks) go ahead without it
                return
            tried = [False]
            try:
                if self.polling:
                    await gen_rank_polling(r, tried)
                else:
                    await gen_rank_session(r, tried)
            except GONE:
                if not struck_by_restart():
                    raise
                gen_said[r] = "gone"  # its daemon was killed under it
            finally:
                if not tried[0]:
                    gen_attempted()

        async def gen_rank_session(r: int, tried: list[bool]) -> None:
            name = f"{gen_prefix}{r}"
            gen_d = self.live.gen
            async with self._session(gen_d.socket_path, "gen") as g:
                pool = await g.attach(name)
                ids = await g.alloc(name, gen_count)
                index = torch.tensor(ids, device=pool.tensor.device)
                pool.tensor.view(torch.int16)[index] = 0x0EEE
                _sync(pool.tensor.device)
                if order == "ctx":
                    await registered["ctx"].wait()
                try:
                    await g.expect(rid, name, gen_layout, r, ids, deadline_s=deadline,
                                   peer="ctx" if order == "gen_peer" else "")
                except FAILED as exc:  # the other side (or this one) failed already, and said so
                    gen_said[r] = f"refused {type(exc).__name__}"
                    assert await g.free(name, ids) == len(ids)
                    return
                finally:
                    tried[0] = True
                    gen_attempted()
                gen_accepted.append(gen_d)
                if fault == "gen_hangs_up" and r == one_rank:
                    await self._pause()
                    gen_said[r] = "hung_up"
                    return  # the session ends with the request registered and its blocks leased
                if fault == "gen_cancel" and r == one_rank:
                    await self._pause()
                    with suppress(NotFound):  # it had ended already
                        await g.cancel(rid)
                try:
                    await self._wait(g, rid, gen_abort)
                    gen_said[r] = "ok"
                    gen_data[r] = pool.tensor[index].cpu()
                except FAILED as exc:
                    gen_said[r] = type(exc).__name__
                # the wait returned: no write of this request can land any more, the blocks are free to go
                assert await g.free(name, ids) == len(ids)

        async def gen_rank_polling(r: int, tried: list[bool]) -> None:
            """A step-loop gen rank: expect_and_watch, then get_finished() until it came back."""
            name = f"{gen_prefix}{r}"
            gen_d = self.live.gen
            kvd = await self._open_polling(gen_d.socket_path, "gen")
            try:
                pool = await trio.to_thread.run_sync(kvd.attach, name)
                ids = await trio.to_thread.run_sync(kvd.alloc, name, gen_count)
                index = torch.tensor(ids, device=pool.tensor.device)
                pool.tensor.view(torch.int16)[index] = 0x0EEE
                _sync(pool.tensor.device)
                if order == "ctx":
                    await registered["ctx"].wait()
                kvd.expect_and_watch(rid, name, gen_layout, r, ids, deadline_s=deadline,
                                     peer="ctx" if order == "gen_peer" else "")
                try:  # the registration's reply (accepted, or refused: a failed completion)
                    done = await self._finished(kvd, rid, accepted=True)
                finally:
                    tried[0] = True
                    gen_attempted()
                if rid in kvd.accepted:
                    gen_accepted.append(gen_d)
                if done is None:
                    if fault == "gen_hangs_up" and r == one_rank:
                        await self._pause()
                        gen_said[r] = "hung_up"
                        return  # closed below, the request registered and its blocks leased
                    if fault == "gen_cancel" and r == one_rank:
                        await self._pause()
                        kvd.cancel_nowait(rid)
                    done = await self._finished(kvd, rid, abort=gen_abort)
                assert done is not None
                gen_said[r] = ("" if rid in kvd.accepted else "refused ") + failure_ok(done)
                if done.ok:
                    gen_data[r] = pool.tensor[index].cpu()
                # get_finished returned it, ok or not: the blocks are free to go
                assert await trio.to_thread.run_sync(kvd.free, name, ids) == len(ids)
            finally:
                await trio.to_thread.run_sync(kvd.close)

        async def gen_side() -> None:
            async with trio.open_nursery() as ranks:
                for r in range(world):
                    ranks.start_soon(gen_rank, r)
            if gen_accepted:
                self.tally[f"gen sides accepted {_name(gen_accepted[0])}"] += 1
            if gen_said:
                outcome["gen"] = "/".join(sorted(set(gen_said.values())))

        def fill(pool: Any, ids: list[int]) -> None:
            data = torch.randint(-(2**15), 2**15, (n, *pool.tensor.shape[1:]), dtype=torch.int16,
                                 generator=torch.Generator().manual_seed(self.rng.randrange(2**31)))
            pool.tensor.view(torch.int16)[torch.tensor(ids, device=pool.tensor.device)] = data.to(pool.tensor.device)
            _sync(pool.tensor.device)  # the executor's writes are in memory before it publishes
            ctx_view["data"] = data

        async def ctx_side() -> None:
            if fault == "ctx_never":
                registered["ctx"].set()  # the other side goes ahead alone
                return
            try:
                if self.polling:
                    await ctx_polling()
                else:
                    await ctx_session()
            except CTX_GONE as exc:
                if not struck_by_drain():
                    raise
                # a step-loop executor sent its watch with the registration: the draining daemon
                # answers it before it closes the session, and get_finished() returns the answer
                # first (tests/test_polling_drain.py). An AsyncClient's wait goes after the
                # publish's reply, and a daemon that finished its drain meanwhile closes the
                # session without waiting for it: that executor learns nothing more (a window
                # the daemon does not close)
                assert not (self.polling and ctx_phase[0] == "wait"), (exc, self.explain(rid))
                # its daemon drained (alloc or publish refused) or exited under it
                outcome.setdefault("ctx", f"gone {type(exc).__name__} at {ctx_phase[0]}")
            finally:
                registered["ctx"].set()
                if "wait" not in ctx_phase and outcome.get("ctx", "").startswith(("gone", "refused Draining")):
                    gen_abort.set()  # gen would wait for its deadline: the router aborts it

        async def ctx_session() -> None:
            async with self._session(ctx_d.socket_path, "ctx") as c:
                pool = await c.attach(ctx_pool)
                ids = await c.alloc(ctx_pool, n)
                fill(pool, ids)
                if order != "ctx":
                    await registered["gen"].wait()
                ctx_phase.insert(0, "publish")
                try:
                    await c.publish(rid, ctx_pool, SAME, 0, ids, peer="gen", deadline_s=deadline)
                except (*FAILED, Draining) as exc:  # the other side failed already, or the daemon drains
                    outcome["ctx"] = f"refused {type(exc).__name__}"
                    assert await c.free(ctx_pool, ids) == len(ids)
                    return
                finally:
                    registered["ctx"].set()
                self.tally[f"ctx sides accepted {_name(ctx_d)}"] += 1
                ctx_phase.insert(0, "wait")
                if fault == "ctx_hangs_up":
                    await self._pause()
                    outcome["ctx"] = "hung_up"
                    return
                if fault == "ctx_cancel":
                    await self._pause()
                    with suppress(NotFound):
                        await c.cancel(rid)
                try:
                    await c.wait(rid)
                    outcome["ctx"] = "ok"
                except FAILED as exc:
                    outcome["ctx"] = type(exc).__name__
                ctx_phase.insert(0, "free")
                assert await c.free(ctx_pool, ids) == n

        async def ctx_polling() -> None:
            """A step-loop ctx executor: publish_and_watch, then get_finished() until it came back."""
            kvd = await self._open_polling(ctx_d.socket_path, "ctx")
            try:
                pool = await trio.to_thread.run_sync(kvd.attach, ctx_pool)
                ids = await trio.to_thread.run_sync(kvd.alloc, ctx_pool, n)
                fill(pool, ids)
                if order != "ctx":
                    await registered["gen"].wait()
                ctx_phase.insert(0, "publish")
                kvd.publish_and_watch(rid, ctx_pool, SAME, 0, ids, "gen", deadline_s=deadline)
                try:
                    done = await self._finished(kvd, rid, accepted=True)
                finally:
                    registered["ctx"].set()
                if rid in kvd.accepted:
                    self.tally[f"ctx sides accepted {_name(ctx_d)}"] += 1
                    ctx_phase.insert(0, "wait")
                if done is None:
                    if fault == "ctx_hangs_up":
                        await self._pause()
                        outcome["ctx"] = "hung_up"
                        return
                    if fault == "ctx_cancel":
                        await self._pause()
                        with suppress(ConnectionClosed):  # its daemon closed: get_finished says how it ended
                            kvd.cancel_nowait(rid)
                    done = await self._finished(kvd, rid)
                assert done is not None
                outcome["ctx"] = ("" if rid in kvd.accepted else "refused ") + failure_ok(done)
                ctx_phase.insert(0, "free")
                assert await trio.to_thread.run_sync(kvd.free, ctx_pool, ids) == n
            finally:
                await trio.to_thread.run_sync(kvd.close)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(gen_side)
            nursery.start_soon(ctx_side)

        if outcome != {"ctx": "ok", "gen": "ok"}:
            # a failed request is remembered until its deadline (and remember_ended_s) where a
            # side of it may still have ranks to come, which registering its id are refused
            # with how it ended (docs/design.md, "A transfer"): the next request takes a new id.
            # A retry under the same id is tests/test_id_retry.py's
            self.generation[slot] += 1
        said = f"ctx {outcome.get('ctx', '-')}, gen {outcome.get('gen', '-')}"
        how = "polling page" if self.polling and self.page else "polling" if self.polling else "async"
        self.tally[f"{kind} {fault}: {said}"] += 1
        self.tally[f"{how} requests"] += 1
        self.history.append((rid, kind, fault, order, said))
        struck = self.tally["link cuts"] != cuts_before or struck_by_restart() or struck_by_drain()
        if fault == "none" and not struck:
            assert outcome == {"ctx": "ok", "gen": "ok"}, self.explain(rid)
        if struck_by_drain():
            self.tally[f"drain-struck {fault}: {said}"] += 1
        if fault == "none" and struck_by_drain():
            # what a drain may end a request with (docs/security.md, "Stopping"): a side whose
            # data moved finishes ok, one whose other side never came fails with daemon_stopping
            # (gen hears it from ctx), a registration on the draining daemon is refused
            # (Draining) or finds it gone; then the router aborts gen (TransferCancelled).
            # Never gen's deadline: nobody may leave it waiting for a ctx that is gone
            ctx_allowed = {"ok", "DaemonStopping", "refused Draining"}
            assert outcome["ctx"] in ctx_allowed or (outcome["ctx"].startswith("gone") and (
                not outcome["ctx"].endswith(" at wait"))), self.explain(rid)
            gen_allowed = {"ok", "DaemonStopping"} | ({"TransferCancelled"} if gen_abort.is_set() else set())
            assert {o.removeprefix("refused ") for o in outcome["gen"].split("/")} <= gen_allowed, self.explain(rid)
        for r in range(world):
            if gen_said.get(r) == "ok":
                want = _expected_gen(ctx_view["data"], gen_layout, r)
                assert torch.equal(gen_data[r].view(torch.int16), want), (rid, kind, order, fault, r, how)
                self.tally["checked byte for byte"] += 1
        if outcome.get("ctx", "").startswith(("gone", "refused Draining")):
            await self.live.ctx_up.wait()  # the next request goes to the next ctx daemon


async def _settled(path: str) -> None:
    """Until the daemon has nothing left: no lease, no running transfer, no bounce slot."""
    async with open_client(path, client="check") as c:
        st = await c.stats()
        try:
            with trio.fail_after(45):  # beyond the requests' 30 s deadline: a stuck one has ended
                while not (st.blocks_leased == 0 and st.transfers_active == 0 and st.bounce_chunks_in_use == 0
                           and st.sessions == 1):
                    await trio.sleep(0.05)  # polling the daemon's counters; the condition is the sync point
                    st = await c.stats()
        except trio.TooSlowError:
            raise AssertionError(f"{path}: still held after 45 s: {st.blocks_leased} blocks leased, "
                                 f"{st.transfers_active} transfers active, {st.bounce_chunks_in_use} bounce "
                                 f"chunks in use, {st.sessions} sessions; transfers: {await c.transfers()}") from None
        assert all(p.blocks_used == 0 and p.blocks_free == p.num_blocks for p in st.pools), st.pools
        assert all(t.state in ("done", "failed") for t in await c.transfers())


#: A known, unfixed bug that the link-cut case finds about one run in two to four: after a cut,
#: a gen request can stay waiting past its deadline (seen as 'aborting' for good: gen waits for
#: ctx's word that no write can land, and it never comes). 6da95f4 fixed one such ordering (a
#: notice naming an earlier ctx request was dropped); another remains, not yet found. Run it
#: with ``--runxfail`` (and KVD_PAIR_SOAK_SECONDS=30) to reproduce; it must pass once fixed.
LINK_CUT_STALL = pytest.mark.xfail(reason="known bug: after a link cut a gen request can stay waiting past its "
                                          "deadline (about 1 run in 2-4); see the comment above", strict=False)


@pytest.mark.parametrize(("mapped", "strike"), [
    pytest.param(False, "", id="nixl"),
    pytest.param(True, "", id="mapped"),
    pytest.param(False, "cuts", id="nixl-link-cuts", marks=LINK_CUT_STALL),
    pytest.param(False, "restarts", id="nixl-gen-restarts"),
    pytest.param(False, "drains", id="nixl-ctx-drains"),
])
@pytest.mark.soak
async def test_pair_soak_leaves_nothing_behind(daemon_factory: Factory, short_tmp: Path, mapped: bool,
                                               strike: str) -> None:
    await pair_soak(daemon_factory, short_tmp, mapped=mapped, strike=strike)


async def pair_soak(daemon_factory: Factory, workdir: Path, *, mapped: bool, strike: str = "", memory: str = "host",
                    ctx_device: int = -1, gen_device: int = -1) -> None:
    """The soak on a fresh pair of daemons (host pools, or GPU pools with ``memory="auto"``);
    ``strike``: "cuts" cuts the peer link now and then, "restarts" kills the gen daemon
    (SIGKILL) now and then and starts a new one in its place, "drains" drains the ctx daemon
    (as an operator, or SIGTERM) now and then and starts a new one once it exited."""
    # a short bounce wait would let the fragment fallback take over now and then; this soak is
    # about the bounce path's slots, so the wait is long
    transfer = {"bounce_size_mb": 2, "chunk_mb": 1, "mapped": mapped, "deadline_s": 30.0,
                "bounce_wait_s": 30.0, "heartbeat_interval_s": 0.5}
    gen_pools = [pool for prefix, layout in (("gsame", SAME), ("gdouble", DOUBLE), ("gtp", TP2))
                 for pool in pools_for(prefix, layout, NUM_BLOCKS, memory=memory, device=gen_device)]
    gen_config = {"pools": gen_pools, "transfer": transfer, "log_level": "debug", "node": "gen"}
    ctx_config = {"pools": pools_for("ctx", SAME, NUM_BLOCKS, memory=memory, device=ctx_device),
                  "transfer": transfer, "log_level": "debug", "node": "ctx"}
    # ctx dials gen through a relay in this process, which cuts the link when told
    async with proxied_pair(daemon_factory, workdir, ctx_config, gen_config) as (pair, proxy):
        live = Live(pair.ctx, pair.gen, never_deadline_s=2.5 if strike == "drains" else 1.0)
        live.ctx_up.set()
        secret = str(workdir / "peer.secret")

        def restart() -> None:
            """SIGKILL gen, and start another in its place (new socket, peer port and log)."""
            live.gen.kill()
            live.gen = daemon_factory({**gen_config, "peer_secret_file": secret}, name=f"gen{restarts.count}")
            proxy.target_port = live.gen.peer_port  # ctx dials the relay, which now reaches it

        def next_ctx() -> DaemonProcess:
            """Another ctx daemon (new socket and log), dialling gen through the relay as the first."""
            return daemon_factory({**ctx_config, "peer_secret_file": secret,
                                   "peers": [{"name": "gen", "host": "127.0.0.1", "port": proxy.port}]},
                                  name=f"ctx{len(drained) + 1}")

        restarts = _Restarts(live, restart)
        drained: list[DaemonProcess] = []
        await _soak(live, proxy if strike == "cuts" else None, restarts if strike == "restarts" else None,
                    (next_ctx, drained) if strike == "drains" else None)


@dataclass
class _Restarts:
    live: Live
    restart: Callable[[], None]
    count: int = 0


async def _restart_now_and_then(restarts: _Restarts, until: float, rng: random.Random,
                                tally: collections.Counter[str]) -> None:
    """Kill the gen daemon and start a new one every 1.5-3.5 s until ``until``."""
    while trio.current_time() < until - 3.0:
        await trio.sleep(1.5 + 2 * rng.random())
        restarts.count += 1
        tally["gen restarts"] += 1  # before the kill: a request that sees it knows to expect it
        await trio.to_thread.run_sync(restarts.restart)
        async with open_client(restarts.live.gen.socket_path, client="probe") as probe:
            await wait_for_peer(probe, timeout=30)  # ctx dialled the new gen
        tally["gen restarts done"] += 1


async def _drain_now_and_then(live: Live, next_ctx: Callable[[], DaemonProcess], drained: list[DaemonProcess],
                              until: float, rng: random.Random, tally: collections.Counter[str]) -> None:
    """Every 1.5-3.5 s until ``until``: an operator drains the ctx daemon (``drain`` as root, or
    SIGTERM, by turns), which must refuse new registrations (``Draining``) and exit 0; then
    another ctx daemon is started in its place (as systemd would) and linked to gen."""
    while trio.current_time() < until - 4.0:
        await trio.sleep(1.5 + 2 * rng.random())
        old = live.ctx
        by_signal = len(drained) % 2 == 1
        async with open_client(old.socket_path, client="operator") as op:
            ids = await op.alloc("ctx0", 1)
            tally["ctx drains"] += 1  # before the drain: a request that sees it knows to expect it
            live.ctx_up = trio.Event()
            if by_signal:
                old.proc.send_signal(signal.SIGTERM)
                await logged(old, "daemon.draining")  # the signal was taken: registrations are refused
            else:
                await op.drain()
            drained.append(old)
            # a registration on the draining daemon is refused; it may have exited already
            # when nothing was in flight (its sessions closed then)
            try:
                await op.publish(f"probe-{len(drained)}", "ctx0", SAME, 0, ids, peer="gen", deadline_s=1.0)
                raise AssertionError("a draining daemon accepted a registration")
            except Draining:
                tally["operator's probe refused: Draining"] += 1
            except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
                tally["operator's probe: the daemon had exited"] += 1
        assert await trio.to_thread.run_sync(old.proc.wait, 60) == 0, f"{_name(old)} exited non-zero"
        live.ctx = await trio.to_thread.run_sync(next_ctx)
        async with open_client(live.ctx.socket_path, client="probe") as probe:
            await wait_for_peer(probe, timeout=30)  # the new ctx dialled gen
        tally["ctx drains done"] += 1
        live.ctx_up.set()


async def _cut_now_and_then(proxy: Proxy, until: float, rng: random.Random, tally: collections.Counter[str]) -> None:
    """Cut the peer link at random moments until ``until`` (ctx dials again at once)."""
    while trio.current_time() < until - 1.0:
        await trio.sleep(0.3 + rng.random())
        tally["link cuts"] += proxy.cut() > 0


def _check_ended(d: DaemonProcess, role: str, tally: collections.Counter[str]) -> collections.Counter[str]:
    """No error-level line, and one end line per request side the daemon accepted, never both:
    the sides whose executors waited, hung up, or whose peer never came alike."""
    events = _events(d)
    assert events["!error"] == 0, (_name(d), {k: v for k, v in events.items() if k.startswith("!error")})
    ended = events["transfer.done"] + events["transfer.failed"]
    assert ended == tally[f"{role} sides accepted {_name(d)}"], (_name(d), ended, dict(tally))
    return events


async def _soak(live: Live, proxy: Proxy | None, restarts: _Restarts | None,
                drains: tuple[Callable[[], DaemonProcess], list[DaemonProcess]] | None = None) -> None:
    tally: collections.Counter[str] = collections.Counter()
    # the drains case starts a daemon per drain (each a few seconds of this 2-core box): shorter
    seconds = SECONDS * 2 / 3 if drains is not None else SECONDS
    until = trio.current_time() + seconds
    async with trio.open_nursery() as nursery:
        for i in range(WORKERS):
            nursery.start_soon(Worker(i, live, until, tally).run)
        if proxy is not None:
            nursery.start_soon(_cut_now_and_then, proxy, until, random.Random(7), tally)
        if restarts is not None:
            nursery.start_soon(_restart_now_and_then, restarts, until, random.Random(8), tally)
        if drains is not None:
            nursery.start_soon(_drain_now_and_then, live, *drains, until, random.Random(9), tally)
    ctx, gen = live.ctx, live.gen
    if restarts is not None:  # the last gen is linked before the last requests
        async with open_client(ctx.socket_path, client="probe") as probe:
            await wait_for_peer(probe, timeout=30)
    print(f"\npair soak ({seconds:.0f}s):")
    for key, count in sorted(tally.items()):
        print(f"  {count:5d}  {key}")

    for d in (ctx, gen):
        await _settled(d.socket_path)
    # after all that, one clean request on each kind still goes through byte for byte, from an
    # AsyncClient executor and from a step-loop one (reading the completion page)
    for polling in (False, True):
        last = Worker(WORKERS + polling, live, 0.0, tally, polling=polling)
        for kind in KINDS:
            before = tally["checked byte for byte"]
            with trio.fail_after(60):
                await last.one_request(kind, "none")
            assert tally["checked byte for byte"] == before + KINDS[kind][2].world_size  # one per gen rank
    for d in (ctx, gen):
        await _settled(d.socket_path)

    for d, role in ((ctx, "ctx"), (gen, "gen")):
        assert d.proc.poll() is None, f"the {role} daemon died"
        if role == "gen" and restarts is not None:
            events = _events(d)  # a killed gen logged no end for the sides it had (nor was asked to)
            assert events["!error"] == 0, {k: v for k, v in events.items() if k.startswith("!error")}
            continue
        _check_ended(d, role, tally)
    for old in drains[1] if drains is not None else []:
        # a drained ctx daemon: exited 0 (checked as it went), every side it accepted ended
        # (ok, or failed with daemon_stopping and the like), nothing left running or leaked
        events = _check_ended(old, "ctx", tally)
        assert events["daemon.stopped"] == 1 and events["daemon.drain_timeout"] == 0, (_name(old), events)
        (stopping,) = [json.loads(line) for line in old.log().splitlines() if '"daemon.stopping"' in line]
        assert stopping["transfers_active"] == 0, (_name(old), stopping)
        assert events["nixl.xfer_leaked"] == 0, _name(old)
    if drains is not None:
        assert drains[1], "no drain came"
    assert tally["checked byte for byte"] >= 10, dict(tally)
    assert sum(v for k, v in tally.items() if ": ctx ok, gen ok" in k) > 0
    assert sum(v for k, v in tally.items() if "Cancelled" in k or "Timeout" in k) > 0
    assert tally["polling requests"] > 0 and tally["polling page requests"] > 0, dict(tally)
