"""What the GPUs' links give without kvd: contiguous device-to-device copies, several at once.

:func:`concurrent_copies` launches one copy per (source GPU, destination GPU, bytes) item, each
on its own stream pair, all before synchronising any: a ctx GPU sending to four gen GPUs at once
shares its outgoing links among them, and that shared egress (not one copy alone) is the ceiling
of a TP1 -> TP4 request. Per copy it reports the GPU time between CUDA events around it; in
aggregate, all bytes over the host-observed wall time of the whole set.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _Copy:
    src: int
    dst: int
    nbytes: int
    a: torch.Tensor
    b: torch.Tensor
    s_src: torch.cuda.Stream
    s_dst: torch.cuda.Stream
    e0: torch.cuda.Event
    e1: torch.cuda.Event

    @classmethod
    def make(cls, src: int, dst: int, nbytes: int) -> _Copy:
        return cls(
            src, dst, nbytes,
            torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src}").fill_(7),
            torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst}"),
            # torch runs a cross-device copy on the source's current stream and fences it with the
            # destination's current stream: both are this copy's own, so no copy waits for another
            torch.cuda.Stream(device=src),  # type: ignore[no-untyped-call]
            torch.cuda.Stream(device=dst),  # type: ignore[no-untyped-call]
            torch.cuda.Event(enable_timing=True),  # type: ignore[no-untyped-call]
            torch.cuda.Event(enable_timing=True),  # type: ignore[no-untyped-call]
        )

    def launch(self) -> None:
        with torch.cuda.stream(self.s_src), torch.cuda.stream(self.s_dst):
            self.e0.record(self.s_src)
            self.b.copy_(self.a, non_blocking=True)
            self.e1.record(self.s_src)


def concurrent_copies(items: list[tuple[int, int, int]], repeat: int) -> dict[str, Any]:
    """Copy ``nbytes`` from GPU ``src`` to GPU ``dst`` for every ``(src, dst, nbytes)`` at once.

    Best of ``repeat`` runs (after one warm-up) by wall time; returns ``wall_s``, ``bytes``,
    ``gbps`` (aggregate), ``egress_gbps`` per source GPU and ``copies`` (per item: ``src``,
    ``dst``, ``bytes``, ``gbps`` from its CUDA events).
    """
    copies = [_Copy.make(src, dst, nbytes) for src, dst, nbytes in items]
    devices = sorted({c.src for c in copies} | {c.dst for c in copies})

    def once() -> float:
        for d in devices:
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        for c in copies:  # all launched ...
            c.launch()
        for d in devices:  # ... then all waited for
            torch.cuda.synchronize(d)
        return time.perf_counter() - t0

    once()
    best, per_copy = float("inf"), [0.0] * len(copies)
    for _ in range(max(1, repeat)):
        wall = once()
        if wall < best:
            best = wall
            per_copy = [c.e0.elapsed_time(c.e1) / 1e3 for c in copies]
    total = sum(c.nbytes for c in copies)
    egress: dict[str, float] = {}
    for c in copies:
        egress[str(c.src)] = egress.get(str(c.src), 0.0) + c.nbytes
    out = {
        "wall_s": best,
        "bytes": total,
        "gbps": total / best / 1e9,
        "egress_gbps": {k: v / best / 1e9 for k, v in egress.items()},
        "copies": [{"src": c.src, "dst": c.dst, "bytes": c.nbytes, "gbps": c.nbytes / s / 1e9 if s else 0.0}
                   for c, s in zip(copies, per_copy, strict=True)],
    }
    copies.clear()  # the buffers go before the daemons allocate their pools
    torch.cuda.empty_cache()
    return out


def measure(ctx_gpus: list[int], gen_bytes: dict[int, int], repeat: int) -> dict[str, Any]:
    """The ceilings of one layout run, for the largest request.

    ``gen_bytes``: bytes each gen GPU receives in that request. ``single``: all the request's
    bytes, first ctx GPU -> first gen GPU, alone. ``fanout``: the first ctx GPU sends every gen
    GPU its share at the same time (its total egress is the ceiling of one request).
    ``all_pairs`` (more than one ctx GPU): every ctx GPU sends every gen GPU its share at once
    (the ceiling of one request per ctx GPU in flight together).
    """
    src = ctx_gpus[0]
    total = sum(gen_bytes.values())
    first = next(iter(gen_bytes))
    out: dict[str, Any] = {
        "single": concurrent_copies([(src, first, total)], repeat),
        "fanout": concurrent_copies([(src, d, n) for d, n in gen_bytes.items()], repeat),
    }
    if len(ctx_gpus) > 1:
        out["all_pairs"] = concurrent_copies([(s, d, n) for s in ctx_gpus for d, n in gen_bytes.items()], repeat)
    return out
