"""Raw NIXL write throughput between two processes: large descriptors vs per-fragment.

Why kvd avoids per-fragment writes (docs/performance.md has the figures): the same bytes
written as one descriptor, as 64 MiB descriptors, and as 16 KiB descriptors, host memory to host memory over
UCX on loopback (``UCX_NET_DEVICES=lo``). The writer is a :class:`~kvd.transport.NixlAgent`
in this process; the target is a :class:`~kvd.transport.peerproc.PeerProcess`.

``python -m kvd.bench.rawnixl [--size-mb 256] [--progress-thread] [--repeat 3]``
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvd.transport.nixl_agent import NixlAgent, Region, ensure_loopback_ucx
from kvd.transport.peerproc import PeerProcess

__all__ = ["RawBench", "RawBenchResult", "bench_raw_write", "main"]

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class RawBenchResult:
    label: str
    nbytes: int
    desc_bytes: int
    ndescs: int
    seconds: float  # best of the repeats, create + post + completion

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    def line(self) -> str:
        return (
            f"{self.label:<34} {self.ndescs:>6} x {self.desc_bytes:>10} B: "
            f"{self.gbps:6.2f} GB/s ({self.seconds * 1e3:.1f} ms)"
        )


def _descs(base: int, count: int, size: int, stride: int) -> npt.NDArray[np.uint64]:
    arr = np.empty((count, 2), dtype=np.uint64)
    arr[:, 0] = np.uint64(base) + np.arange(count, dtype=np.uint64) * np.uint64(stride)
    arr[:, 1] = size
    return arr


class RawBench:
    """A writer agent + a target process, both with ``nbytes`` of registered host memory."""

    def __init__(self, nbytes: int = 256 * MiB, *, progress_thread: bool = False) -> None:
        ensure_loopback_ucx()
        self.nbytes = nbytes
        self.peer = PeerProcess("rawbench-target", nbytes, progress_thread=progress_thread)
        try:
            self.agent = NixlAgent("rawbench-writer", progress_thread=progress_thread)
            self.src = np.full(nbytes, 0x5A, dtype=np.uint8)
            self.agent.register([Region(self.src.ctypes.data, nbytes)])
            self.remote = self.agent.add_remote(self.peer.metadata)
            self.peer.add_remote(self.agent.metadata())
        except BaseException:
            self.peer.close()
            raise

    def run(
        self,
        desc_bytes: int,
        *,
        repeat: int = 3,
        stride: int | None = None,
        prepped: bool = False,
        label: str = "",
    ) -> RawBenchResult:
        """Write ``nbytes`` (or as many ``desc_bytes`` descriptors as fit with ``stride``)."""
        stride = stride or desc_bytes
        count = self.nbytes // stride
        local = _descs(self.src.ctypes.data, count, desc_bytes, stride)
        remote = _descs(self.peer.addr, count, desc_bytes, stride)
        best = float("inf")
        lp = rp = None
        if prepped:
            lp = self.agent.prep_local(local)
            rp = self.agent.prep_remote(self.remote, remote)
        idx = np.arange(count, dtype=np.int32)
        try:
            for i in range(repeat + 1):  # round 0 warms up (connection, first touch)
                t0 = time.perf_counter()
                if lp is not None and rp is not None:
                    h = self.agent.write_prepped(lp, idx, rp, idx, b"rawbench")
                else:
                    h = self.agent.write(local, remote, self.remote, b"rawbench")
                while self.agent.state(h) == "PROC":
                    pass
                elapsed = time.perf_counter() - t0
                self.agent.release(h)
                if i > 0:
                    best = min(best, elapsed)
        finally:
            if lp is not None:
                self.agent.release_prepped(lp)
            if rp is not None:
                self.agent.release_prepped(rp)
        self.peer.wait_notifs(repeat + 1)
        return RawBenchResult(
            label or f"{desc_bytes} B descriptors", count * desc_bytes, desc_bytes, count, best
        )

    def close(self) -> None:
        self.agent.close()
        self.peer.close()

    def __enter__(self) -> RawBench:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bench_raw_write(nbytes: int, desc_bytes: int, *, progress_thread: bool = False, repeat: int = 3) -> float:
    """GB/s of a two-process NIXL DRAM write of ``nbytes`` cut into ``desc_bytes`` descriptors."""
    with RawBench(nbytes, progress_thread=progress_thread) as bench:
        return bench.run(desc_bytes, repeat=repeat).gbps


def run_suite(
    nbytes: int = 256 * MiB, *, progress_thread: bool = False, repeat: int = 3
) -> list[RawBenchResult]:
    """The standard figures: 1 descriptor, 64 MiB descriptors, 16 KiB descriptors (+ variants)."""
    frag = 16 * 1024
    with RawBench(nbytes, progress_thread=progress_thread) as bench:
        return [
            bench.run(nbytes, repeat=repeat, label="1 descriptor"),
            bench.run(min(64 * MiB, nbytes), repeat=repeat, label="64 MiB descriptors"),
            bench.run(frag, repeat=repeat, label="16 KiB descriptors"),
            bench.run(frag, repeat=repeat, stride=2 * frag, label="16 KiB descriptors, strided (1/2)"),
            bench.run(frag, repeat=repeat, prepped=True, label="16 KiB, prepped (NIXL merges them)"),
        ]


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m kvd.bench.rawnixl``."""
    parser = argparse.ArgumentParser(
        prog="python -m kvd.bench.rawnixl",
        description="Raw NIXL write throughput between two processes: the same bytes as one descriptor, as 64 MiB "
                    "descriptors and as 16 KiB descriptors (host to host over UCX on loopback).",
    )
    parser.add_argument("--size-mb", type=int, default=256, help="bytes written per run, in MiB (default 256)")
    parser.add_argument("--progress-thread", action="store_true", help="enable NIXL's progress thread")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs of each write pattern (default 3)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m kvd.bench.rawnixl``."""
    args = build_parser().parse_args(argv)
    results = run_suite(args.size_mb * MiB, progress_thread=args.progress_thread, repeat=args.repeat)
    print(
        f"NIXL/UCX DRAM write, 2 processes, loopback, progress thread {'on' if args.progress_thread else 'off'}"
    )
    for r in results:
        print(r.line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
