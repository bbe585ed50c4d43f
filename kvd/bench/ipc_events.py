"""What CUDA interprocess events cost and how a second process sees them (the landed events of
:mod:`kvd.regroup.landed` rest on this).

``python -m kvd.bench.ipc_events [--device N]``: this process creates an interprocess event
(the driver API through cuda-python, as kvd does), a second process opens its handle; then,
round by round, this process records the event after GPU work of some length and tells the
other, which reports its first query ("not ready" while the work runs: a re-recorded event is
seen as such), how long it polled, and when it saw completion relative to this process's own
synchronize. Prints the costs of create, get-handle, open, record and query.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

from kvd.regroup.kernel import _check, _driver, _primary_context


def _status(res: Any) -> Any:
    return res[0] if isinstance(res, tuple) else res


def _reader(conn: Connection, device: int) -> None:
    cu = _driver()
    ctx = _primary_context(device)
    _check(cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    handle = cu.CUipcEventHandle()
    handle.reserved = conn.recv()
    t = time.perf_counter()
    ev = _check(cu.cuIpcOpenEventHandle(handle), "cuIpcOpenEventHandle")
    conn.send(time.perf_counter() - t)
    while conn.recv() == "recorded":
        t0 = time.perf_counter()
        first = _status(cu.cuEventQuery(ev))
        polls = 1
        while _status(cu.cuEventQuery(ev)) == cu.CUresult.CUDA_ERROR_NOT_READY:
            polls += 1
        conn.send((getattr(first, "name", str(first)), polls, time.perf_counter() - t0, time.time()))
    t = time.perf_counter()
    for _ in range(1000):
        cu.cuEventQuery(ev)
    conn.send((time.perf_counter() - t) / 1000)


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m kvd.bench.ipc_events``."""
    ap = argparse.ArgumentParser(
        prog="python -m kvd.bench.ipc_events",
        description="What CUDA interprocess events cost, and how a second process sees one recorded "
                    "again after GPU work (what kvd's landed events rest on). Needs a CUDA GPU and "
                    "cuda-python.")
    ap.add_argument("--device", type=int, default=0, help="CUDA device (default 0)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("error: python -m kvd.bench.ipc_events needs a CUDA GPU (torch sees none)")
    dev = args.device
    torch.zeros(1, device=f"cuda:{dev}")
    cu = _driver()
    ctx = _primary_context(dev)
    _check(cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    flags = cu.CUevent_flags.CU_EVENT_INTERPROCESS | cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
    t = time.perf_counter()
    ev = _check(cu.cuEventCreate(flags), "cuEventCreate")
    t_create = time.perf_counter() - t
    t = time.perf_counter()
    handle = _check(cu.cuIpcGetEventHandle(ev), "cuIpcGetEventHandle")
    t_get = time.perf_counter() - t
    print(f"create {t_create * 1e6:.1f} us, get handle {t_get * 1e6:.1f} us, handle {len(bytes(handle.reserved))} bytes")
    spawn = mp.get_context("spawn")
    here, there = spawn.Pipe()
    proc = spawn.Process(target=_reader, args=(there, dev), daemon=True)
    proc.start()
    here.send(bytes(handle.reserved))
    print(f"other process: open {here.recv() * 1e6:.1f} us")
    stream = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
    hs = cu.CUstream(stream.cuda_stream)
    for i, cycles in enumerate([2_000_000, 2_000_000, 200_000, 0, 20_000_000]):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
        t = time.perf_counter()
        _check(cu.cuEventRecord(ev, hs), "cuEventRecord")
        t_rec = time.perf_counter() - t
        here.send("recorded")
        stream.synchronize()
        t_done = time.time()
        first, polls, waited, t_seen = here.recv()
        print(f"round {i}: {cycles} GPU cycles of work, record {t_rec * 1e6:.1f} us; other process: first query "
              f"{first}, {polls} polls over {waited * 1e6:.0f} us, saw it {(t_seen - t_done) * 1e6:+.0f} us "
              "after this process's synchronize returned")
    here.send("stop")
    print(f"other process: query {here.recv() * 1e6:.2f} us")
    proc.join()


if __name__ == "__main__":
    main()
