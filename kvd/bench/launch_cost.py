"""Host time of one regroup-kernel launch, by what the process did just before it.

``python -m kvd.bench.launch_cost [--device 0] [--launches 200]`` plans a 1-block GPT-OSS-120B
ctx TP1 -> gen TP4 request with all pools on one GPU and times
:func:`kvd.transfer.movers.launch_kernel` (the host side of the mapped path's launch: block
tables, template lookup, the driver calls) after each of these, ``--launches`` times each:

- ``back to back``: the previous launch has just completed (what a warm loop measures);
- ``after a 2 ms sleep`` and ``after a 20 ms sleep``: the process slept, as a daemon does
  between requests;
- ``after 2 ms of spinning``: the process stayed on its core, touching no memory;
- ``after other Python work``: a few MB of Python objects walked (~3 ms), as the daemon's
  control path does between two launches;
- ``after 2 ms of stream queries``: the process kept calling the driver (``cuStreamQuery`` on
  an idle stream) instead: whether driver calls keep the launch path warm where spinning does not;
- ``after a 2 ms sleep and one stream query``: whether one cheap driver call just before the
  launch pays the pause for it.

Then each driver call of the device-memory launch (``cuCtxPushCurrent``,
``cuMemAllocFromPoolAsync``, ``cuMemcpyHtoDAsync``, ``cuMemFreeAsync``, ``cuEventRecord``,
``cuEventQuery``, ...) alone, back to back and after a 2 ms sleep. Medians in microseconds;
``--json`` prints one object. The figures are what :data:`kvd.regroup.kernel.PARAM_TABLES`
and the busy poll weigh (docs/performance.md). Needs a CUDA GPU and the regroup kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

#: KV geometry of the planned request (GPT-OSS-120B, 2.25 MiB a block at TP1).
GEOMETRY = {"num_layers": 36, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 32, "dtype": "bfloat16"}
POOL_BLOCKS = 256


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m kvd.bench.launch_cost``."""
    p = argparse.ArgumentParser(prog="python -m kvd.bench.launch_cost",
                                description="Host time of one regroup-kernel launch (1-block TP1 -> TP4 request, "
                                            "pools on one GPU) after what the process did just before it, and of "
                                            "each driver call of a launch.")
    p.add_argument("--device", type=int, default=0, help="CUDA device of every pool (default 0)")
    p.add_argument("--launches", type=int, default=200, help="timed launches per case (default 200)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def _spin(seconds: float) -> Callable[[], None]:
    def f() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    return f


def _cases(junk: list[dict[str, Any]], query: Callable[[], object]) -> dict[str, Callable[[], None]]:
    def other_work() -> None:
        total = 0
        for d in junk:
            total += d["a"] + len(d["b"])

    def querying() -> None:
        end = time.perf_counter() + 0.002
        while time.perf_counter() < end:
            query()

    def sleep_then_query() -> None:
        time.sleep(0.002)
        query()

    return {
        "back to back": lambda: None,
        "after a 2 ms sleep": lambda: time.sleep(0.002),
        "after a 20 ms sleep": lambda: time.sleep(0.02),
        "after 2 ms of spinning": _spin(0.002),
        "after other Python work": other_work,
        "after 2 ms of stream queries": querying,
        "after a 2 ms sleep and one stream query": sleep_then_query,
    }


def _median_us(values: list[float]) -> float:
    return round(statistics.median(values) * 1e6, 2)


def measure(device: int, launches: int) -> dict[str, Any]:
    """Every figure of the module's docstring, as a dict (microseconds)."""
    import numpy as np
    import torch

    from kvd.regroup import kernel
    from kvd.regroup.plan import plan
    from kvd.transfer import movers
    from protocol.layout import KVLayout

    if kernel.kernel_for(device) is None:
        raise SystemExit(f"the regroup kernel is unavailable on device {device} (see the regroup.kernel_unavailable "
                         "line above)")
    geo = {**GEOMETRY, "num_blocks": POOL_BLOCKS}
    ctx, gen = KVLayout(**geo, tp_size=1), KVLayout(**geo, tp_size=4)  # type: ignore[arg-type]
    dev = f"cuda:{device}"
    src = {0: torch.randint(0, 256, (ctx.pool_bytes(0),), dtype=torch.uint8, device=dev)}
    dst = {r: torch.zeros(gen.pool_bytes(r), dtype=torch.uint8, device=dev) for r in range(4)}
    rng = np.random.default_rng(3)
    plans = [plan(ctx, gen, {0: rng.permutation(POOL_BLOCKS)[:1]}, {r: rng.permutation(POOL_BLOCKS)[:1] for r in range(4)})
             for _ in range(16)]

    def one(i: int) -> float:
        t0 = time.perf_counter()
        k = movers.launch_kernel(plans[i % len(plans)], src, dst, launch_on="src")
        t = time.perf_counter() - t0
        while not movers.kernel_done_now(k):
            pass
        return t

    for i in range(20):  # templates, events, the module: loaded before anything is timed
        one(i)
    junk = [{"a": i, "b": str(i)} for i in range(20000)]
    cu = kernel._driver()
    idle = cu.CUstream(torch.cuda.Stream(device).cuda_stream)  # type: ignore[no-untyped-call]
    launch: dict[str, float] = {}
    for name, before in _cases(junk, lambda: cu.cuStreamQuery(idle)).items():
        times = []
        for i in range(launches):
            before()
            times.append(one(i))
        launch[name] = _median_us(times)

    k = kernel.kernel_for(device)
    assert k is not None
    hs = cu.CUstream(torch.cuda.current_stream(device).cuda_stream)
    table = np.zeros(64, dtype=np.int64)

    def calls(sleep: float) -> dict[str, float]:
        out: dict[str, list[float]] = {}

        def timed(name: str, fn: Callable[..., Any], *a: Any) -> Any:
            t0 = time.perf_counter()
            r = fn(*a)
            out.setdefault(name, []).append(time.perf_counter() - t0)
            return r

        for _ in range(launches):
            if sleep:
                time.sleep(sleep)
            timed("cuCtxPushCurrent", cu.cuCtxPushCurrent, k.ctx)
            _, d = timed("cuMemAllocFromPoolAsync", cu.cuMemAllocFromPoolAsync, table.nbytes, k._pool, hs)
            timed("cuMemcpyHtoDAsync", cu.cuMemcpyHtoDAsync, d, table.ctypes.data, table.nbytes, hs)
            timed("cuMemFreeAsync", cu.cuMemFreeAsync, d, hs)
            _, ev = timed("cuEventCreate", cu.cuEventCreate, cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
            timed("cuEventRecord", cu.cuEventRecord, ev, hs)
            timed("cuEventQuery", cu.cuEventQuery, ev)
            cu.cuEventSynchronize(ev)
            cu.cuEventDestroy(ev)
            timed("cuCtxPopCurrent", cu.cuCtxPopCurrent)
        return {n: _median_us(v) for n, v in out.items()}

    return {"device": torch.cuda.get_device_name(device), "launches": launches, "launch_host_us": launch,
            "driver_calls_back_to_back_us": calls(0.0), "driver_calls_after_2ms_sleep_us": calls(0.002)}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m kvd.bench.launch_cost``."""
    args = build_parser().parse_args(argv)
    if args.launches < 1:
        print("--launches must be at least 1", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() <= args.device:
        print(f"python -m kvd.bench.launch_cost needs CUDA device {args.device}: this machine has "
              f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}", file=sys.stderr)
        return 2
    report = measure(args.device, args.launches)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"regroup kernel launch, host time (median of {args.launches}; 1-block TP1 -> TP4 on {report['device']}):")
    for name, us in report["launch_host_us"].items():
        print(f"  {name:<40} {us:8.1f} us")
    print("driver calls alone:                back to back   after a 2 ms sleep")
    after = report["driver_calls_after_2ms_sleep_us"]
    for name, us in report["driver_calls_back_to_back_us"].items():
        print(f"  {name:<30} {us:8.2f} us   {after[name]:8.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
