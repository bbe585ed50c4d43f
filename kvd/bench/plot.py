"""Draw ``kvd bench transfer --device cuda``'s report as GB/s against request size.

``python -m kvd.bench.plot REPORT.json OUT.png`` (needs matplotlib; no torch, no GPU: the
figure can be drawn on any machine from the JSON a GPU run wrote with ``--json-out``).
Lines: kvd end to end on the mapped path and on the NIXL bounce path, the regroup kernel
alone, and as horizontal lines the contiguous GPU0 -> GPU1 copy and raw NIXL writes of the
same run.
"""

from __future__ import annotations

import json
import sys
from typing import Any

MiB = 1 << 20
#: GPT-OSS-120B KV at TP1: 36 layers x K/V x 8 heads x 32 tokens x 64 x bf16.
BLOCK_BYTES = 36 * 2 * 8 * 32 * 64 * 2


def plot(report: dict[str, Any], path: str) -> None:
    """Write the figure of ``report`` to ``path`` (PNG)."""
    import matplotlib  # type: ignore[import-not-found, unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    scenario = report.get("scenario", {})
    g = int(scenario.get("gen_gpu", 1))  # reports before --gen-gpu: GPU 1
    gpus = scenario.get("gpus") or ["H200", "H200"]
    machine = f"{gpus[0]} x{len(gpus)}" if len(gpus) > 1 else f"one {gpus[0]}"
    # reports with contiguous-id curves measured their main curves with shuffled ids
    ids = ", shuffled block ids" if report["e2e_mapped"].get("by_blocks_contiguous") else ""
    curves = [
        (f"kvd end to end, mapped (regroup kernel){ids}",
         {n: v["gbps"] for n, v in report["e2e_mapped"]["by_blocks"].items()}),
        (f"kvd end to end, NIXL bounce{ids}", {n: v["gbps"] for n, v in report["e2e_nixl_bounce"]["by_blocks"].items()}),
    ]
    for key, label in (("e2e_mapped", "mapped"), ("e2e_nixl_bounce", "NIXL bounce")):
        contiguous = report[key].get("by_blocks_contiguous")  # reports before shuffled ids have none
        if contiguous:
            curves.append((f"kvd end to end, {label}, contiguous block ids", {n: v["gbps"] for n, v in contiguous.items()}))
    if report.get("kernel_alone_gbps"):
        curves.append((f"regroup kernel alone (GPU0 -> GPU{g})", report["kernel_alone_gbps"]))
    for label, by_blocks in curves:
        pts = sorted((int(n), float(v)) for n, v in by_blocks.items())
        ax.plot([p[0] * BLOCK_BYTES / MiB for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.axhline(report["contiguous_copy_gbps"], color="gray", linestyle="--", label=f"contiguous GPU0 -> GPU{g} copy")
    ax.axhline(report["raw_nixl"]["large"]["gbps"], color="green", linestyle="-.", label="raw NIXL, 64 MiB descriptors")
    ax.axhline(report["raw_nixl"]["per_fragment"]["gbps"], color="red", linestyle=":", label="raw NIXL, per 8 KiB fragment")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("request size (MiB; 2.25 MiB per block)")
    ax.set_ylabel("GB/s (end to end: publish -> completion)")
    ax.set_title(f"kvd on {machine}: GPT-OSS-120B KV, ctx TP1 (GPU 0) -> gen TP4 (GPU {g})", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m kvd.bench.plot REPORT.json OUT.png", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        plot(json.load(f), args[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
