"""A serving framework's worker over kvd: the step loop a KV connector runs.

One process per worker rank (``python -m kvd.demo.connector --role ctx|gen ...``). It leases
its whole pool once and keeps its own free list (a framework's block manager), keeps up to
``--window`` requests in flight, and every step:

1. registers the requests it admits with ``publish_and_watch`` / ``expect_and_watch`` (one
   write each, no reply awaited),
2. cancels the ones its scheduler aborts with ``cancel_nowait`` (no reply awaited),
3. asks ``get_finished()`` (never blocks) and, for each completion, checks the bytes (gen, ok)
   and puts the request's blocks back on its free list: ok or failed, kvd reports a request
   only once no write into its blocks can land.

Every worker computes the same schedule from ``--seed``: request ``i`` has 1-96 tokens, gen
aborts every 11th (from the 4th), ctx every 13th (from the 6th). The ctx worker writes a
known pattern per request; each gen rank checks its heads of it. The last line printed is a
JSON summary with the step loop's client-side costs; the exit status is 1 if a byte differs
or a request ended in a way its schedule does not allow.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from clients.attach import MappedPool
from clients.polling import PollingClient
from protocol.layout import KVLayout

CANONICAL = ("block", "layer", "kv", "head", "token", "dim")


@dataclass
class Request:
    """One request of the schedule, as a worker holds it while it is in flight."""

    index: int
    request_id: str
    tokens: int
    aborted_by: str  # "", "ctx" or "gen"
    block_ids: list[int] = field(default_factory=list)
    steps: int = 0
    cancelled: bool = False


def schedule(count: int, seed: int) -> list[Request]:
    """The requests every worker of a run agrees on (the router's ids and lengths)."""
    rnd = random.Random(seed)
    return [Request(i, f"s{seed}-{i}", rnd.randint(1, 96), "gen" if i % 11 == 3 else "ctx" if i % 13 == 5 else "")
            for i in range(count)]


def request_kv(layout: KVLayout, index: int, blocks: int) -> torch.Tensor:
    """Request ``index``'s KV, all heads, as [block, layer, kv, head, token, dim] (exact in any dtype)."""
    shape = (blocks, layout.num_layers, 2, layout.num_kv_heads, layout.tokens_per_block, layout.head_dim)
    values = torch.randint(-128, 128, shape, generator=torch.Generator().manual_seed(index))
    return values.to(getattr(torch, layout.dtype))


class Worker:
    """One rank's connector state and its step."""

    def __init__(self, kvd: PollingClient, pool: MappedPool, args: argparse.Namespace) -> None:
        assert pool.info.layout is not None, "the pool's configuration gives its model layout"
        self.kvd, self.pool, self.args = kvd, pool, args
        self.layout: KVLayout = pool.info.layout
        self.rank = pool.info.rank
        self.blocks = pool.tensor.permute(*(self.layout.axis_order.index(a) for a in CANONICAL))
        # a framework's block manager: lease the whole pool once, keep the free list here
        self.free = kvd.alloc(pool.name, pool.info.num_blocks)
        self.todo = schedule(args.requests, args.seed)
        self.todo.reverse()
        self.inflight: dict[str, Request] = {}
        self.outcomes: dict[str, int] = {}
        self.unexpected: list[str] = []
        self.mismatch = 0
        self.poll_us: list[float] = []
        self.register_us: list[float] = []

    @property
    def done(self) -> bool:
        return not self.todo and not self.inflight

    def step(self) -> None:
        """What the framework's step does with kvd."""
        self.admit()
        for req in self.inflight.values():  # the scheduler's aborts
            req.steps += 1
            if req.aborted_by == self.args.role and not req.cancelled and req.steps >= 2:
                self.kvd.cancel_nowait(req.request_id)
                req.cancelled = True
        t0 = time.perf_counter()
        finished = self.kvd.get_finished()
        self.poll_us.append((time.perf_counter() - t0) * 1e6)
        for done in finished:
            req = self.inflight.pop(done.request_id)
            key = "ok" if done.ok else done.error_code
            if done.ok and self.args.role == "gen" and not self.check(req):
                key = "mismatch"
                self.mismatch += 1
            elif not done.ok and not (req.aborted_by and done.error_code == "transfer_cancelled"):
                self.unexpected.append(f"{req.request_id}: {done.error_code}: {done.error_message}")
            self.outcomes[key] = self.outcomes.get(key, 0) + 1
            self.free += req.block_ids  # kvd is done with them, whatever the outcome

    def admit(self) -> None:
        tpb = self.layout.tokens_per_block
        while self.todo and len(self.inflight) < self.args.window:
            req = self.todo[-1]
            n = -(-req.tokens // tpb)
            if len(self.free) < n:
                return  # out of blocks: wait for completions to return some
            self.todo.pop()
            req.block_ids, self.free = self.free[:n], self.free[n:]
            index = torch.tensor(req.block_ids, device=self.blocks.device)
            t0 = time.perf_counter()
            if self.args.role == "ctx":
                kv = request_kv(self.layout, req.index, n).to(self.blocks.device)
                self.blocks[index] = kv  # "prefill" wrote the request's KV into its blocks
                if self.blocks.device.type == "cuda":
                    torch.cuda.synchronize(self.blocks.device)  # kvd reads them from other processes
                t0 = time.perf_counter()
                self.kvd.publish_and_watch(req.request_id, self.pool.name, self.layout, self.rank, req.block_ids,
                                           self.args.peer, deadline_s=self.args.deadline)
            else:
                self.blocks[index] = -1  # anything: the transfer overwrites it
                t0 = time.perf_counter()
                self.kvd.expect_and_watch(req.request_id, self.pool.name, self.layout, self.rank, req.block_ids,
                                          peer=self.args.peer, deadline_s=self.args.deadline)
            self.register_us.append((time.perf_counter() - t0) * 1e6)
            self.inflight[req.request_id] = req

    def check(self, req: Request) -> bool:
        """This rank's heads of the request, as the ctx worker wrote them."""
        lo, hi = self.layout.head_range(self.rank % self.layout.tp_size)
        want = request_kv(self.layout, req.index, len(req.block_ids))[:, :, :, lo:hi]
        got = self.blocks[torch.tensor(req.block_ids, device=self.blocks.device)].cpu()
        return torch.equal(got, want)


def wait_for_link(kvd: PollingClient, node: str, timeout_s: float) -> None:
    """A gen rank naming its ctx peer needs the daemons linked once: wait for the link."""
    end = time.monotonic() + timeout_s
    while not any(p.node == node and p.state == "up" for p in kvd.peers()):
        if time.monotonic() > end:
            raise SystemExit(f"no link to peer {node!r} after {timeout_s:g} s: is that daemon running?")
        time.sleep(0.02)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1) if ordered else 0.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvd.demo.connector", description=__doc__.split("\n")[0])
    p.add_argument("--socket", required=True, help="this worker's kvd socket_path")
    p.add_argument("--role", choices=("ctx", "gen"), required=True, help="a ctx (prefill) or gen (decode) worker")
    p.add_argument("--pool", required=True, help="this rank's pool (its configuration gives layout and rank)")
    p.add_argument("--peer", default="", help="ctx: the gen daemon's node (required); gen: the ctx daemon's node, "
                   "when the router knows it (then a ctx-side abort reaches a gen rank that registers late)")
    p.add_argument("--requests", type=int, default=64, help="requests in the run (default 64)")
    p.add_argument("--window", type=int, default=16, help="requests in flight at most (default 16)")
    p.add_argument("--seed", type=int, default=1,
                   help="the run's schedule; every worker of a run uses the same (default 1)")
    p.add_argument("--deadline", type=float, default=60.0, help="deadline_s of each request (default 60)")
    p.add_argument("--step-ms", type=float, default=2.0, help="the rest of a model step, in ms (default 2)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.role == "ctx" and not args.peer:
        raise SystemExit("--peer: a ctx worker names the gen daemon's node")
    with PollingClient(args.socket, client=f"{args.role}-{args.pool}") as kvd, kvd.attach(args.pool) as pool:
        if args.role == "gen" and args.peer:
            wait_for_link(kvd, args.peer, args.deadline)
        worker = Worker(kvd, pool, args)
        start = time.perf_counter()
        steps = 0
        while not worker.done:
            worker.step()
            steps += 1
            time.sleep(args.step_ms / 1000)
        elapsed = time.perf_counter() - start
    summary = {
        "worker": f"{args.role}-{args.pool}", "requests": args.requests, "window": args.window, "steps": steps,
        "elapsed_s": round(elapsed, 3), "outcomes": worker.outcomes, "mismatch": worker.mismatch,
        "unexpected": worker.unexpected[:5], "poll_us_p50": percentile(worker.poll_us, 0.5),
        "poll_us_p99": percentile(worker.poll_us, 0.99),
        "register_us_p50": percentile(worker.register_us, 0.5),
        "register_us_mean": round(statistics.fmean(worker.register_us), 1) if worker.register_us else 0.0,
    }
    sys.stdout.write(json.dumps(summary) + "\n")
    return 1 if worker.mismatch or worker.unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
