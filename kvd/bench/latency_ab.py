"""A/B of a request's end-to-end latency between two source trees of kvd, in one run.

``python -m kvd.bench.latency_ab OLD_TREE NEW_TREE`` alternates the trees round by round
(A B, then B A, ...): each round starts a fresh pair of daemons from that tree (ctx TP1 ->
gen TP4, :mod:`kvd.bench.latency`'s executors, each gen rank a process of its own), warms
up, then times ``--repeat`` requests per order (gen registering first with ``peer=``, and ctx
publishing first). It prints every round and, per order, the median over the rounds of each
tree's p50 and p99 (every executor done, and the ctx executor alone) and of each daemon's CPU
time per request (utime + stime from ``/proc``: steadier than wall time on a shared host),
with the ratios new / old. A tree is a directory holding ``kvd/``, ``protocol/`` and
``clients/`` (``git archive COMMIT | tar -x -C DIR`` makes one from any commit).

The rounds run this file as a script under the tree being measured (``PYTHONPATH=TREE``, with
``--pythonpath`` in front: where the machine's wheels are), so the older tree needs nothing
of this module; its geometry is set through the module constants both trees read.
``--geometry tiny`` (9 KiB blocks of the same structure) measures the control path alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

#: Requests of each order before the timed ones, in every round (a fresh pair of daemons).
WARMUP = 10


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child(args: argparse.Namespace) -> None:
    """One round, run under the tree being measured: prints one JSON line."""
    import tempfile

    import kvd
    import kvd.bench.latency as lat
    import kvd.demo.pair as pair

    if args.tree and not Path(kvd.__file__).resolve().is_relative_to(Path(args.tree).resolve()):
        raise SystemExit(f"kvd was imported from {kvd.__file__}, not from the tree {args.tree}")

    geo = dict(pair.GEOMETRY)
    if args.geometry == "tiny":
        geo.update(head_dim=8, tokens_per_block=1)  # as kvd.bench.latency.TINY_GEOMETRY
    # trees older than the geometry parameter read these two module constants
    for module in (pair, lat):
        setattr(module, "GEOMETRY", geo)  # noqa: B010 (kvd.bench.latency re-exports pair's)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    workdir = Path(tempfile.mkdtemp(prefix="kvd-ab-", dir="/tmp"))
    try:
        _child_round(args, pair, lat, workdir)
    finally:  # (the daemons' configs, sockets and logs of this round)
        shutil.rmtree(workdir, ignore_errors=True)


def _child_round(args: argparse.Namespace, pair: Any, lat: Any, workdir: Path) -> None:
    extra: dict[str, Any] = {"mapped": True}
    if args.busy_poll:
        extra["busy_poll"] = args.busy_poll
    ctx_d, gen_d = pair.start_pair(workdir, gen_tp=lat.GEN_TP, blocks=args.blocks, bounce_mb=64, chunk_mb=16,
                                   memory=args.memory, device=args.device, gen_device=args.gen_device,
                                   extra_transfer=extra)
    out: dict[str, Any] = {}
    try:
        lat._wait_for_link(gen_d)
        # (only what the flags ask for is passed: an older tree's _Executors may lack it)
        page = {"completion_page": True} if args.completion_page else {}
        ex = (lat._Executors(ctx_d, gen_d, args.blocks, None, args.client_spin_s, **page) if args.client_spin_s > 0
              else lat._Executors(ctx_d, gen_d, args.blocks))
        pages = getattr(ex, "page_completions", None) if page else None
        try:
            for i in range(WARMUP):
                ex.once(f"warm-g{i}", True)
                ex.once(f"warm-c{i}", False)
            for order in args.orders.split(","):
                walls: list[float] = []
                ctx_walls: list[float] = []
                c0, g0 = _cpu_s(ctx_d.proc.pid), _cpu_s(gen_d.proc.pid)
                p0 = pages() if pages is not None else {}
                for i in range(args.repeat):
                    wall, ctx_wall, _ = ex.once(f"{order}{i}", order == "gen-first")
                    walls.append(wall)
                    ctx_walls.append(ctx_wall)
                c1, g1 = _cpu_s(ctx_d.proc.pid), _cpu_s(gen_d.proc.pid)
                out[order] = {"p50_s": _pct(walls, 0.5), "p99_s": _pct(walls, 0.99),
                              "ctx_p50_s": _pct(ctx_walls, 0.5), "ctx_p99_s": _pct(ctx_walls, 0.99),
                              "ctx_cpu_s": (c1 - c0) / args.repeat, "gen_cpu_s": (g1 - g0) / args.repeat}
                if pages is not None:  # the share of each executor's waits its page answered
                    p1 = pages()
                    out[order]["page_share"] = {k: (p1[k] - p0.get(k, 0)) / args.repeat for k in p1}
        finally:
            ex.close()
    finally:
        ctx_d.stop()
        gen_d.stop()
    print(json.dumps(out))


_FIGURES = (("p50_s", "p50"), ("p99_s", "p99"), ("ctx_p50_s", "ctx p50"), ("ctx_p99_s", "ctx p99"),
            ("ctx_cpu_s", "ctx cpu/req"), ("gen_cpu_s", "gen cpu/req"))


def round_env(args: argparse.Namespace, name: str, tree: str) -> dict[str, str]:
    """The environment of one round of ``name`` ("old" or "new") under ``tree``: this process's,
    the tree on ``PYTHONPATH`` and that side's ``--env-old`` / ``--env-new`` settings (the
    daemons inherit them: an A/B of one tree with and without a variable)."""
    env = dict(os.environ)
    # absolute: the rounds run in /tmp, where a relative tree (``.``) names nothing
    paths = (str(Path(p).resolve()) for p in (args.pythonpath, tree) if p)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    for item in getattr(args, f"env_{name}"):
        key, _, value = item.partition("=")
        env[key] = value
    return env


def _round(tree: str, args: argparse.Namespace, name: str) -> dict[str, Any]:
    env = round_env(args, name, tree)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--tree", str(Path(tree).resolve()), "--geometry", args.geometry,
           "--blocks", str(args.blocks), "--repeat", str(args.repeat), "--orders", args.orders,
           "--memory", args.memory, "--device", str(args.device), "--busy-poll", args.busy_poll,
           "--client-spin-s", str(args.client_spin_s)] + (["--completion-page"] if args.completion_page else [])
    if args.gen_device is not None:
        cmd += ["--gen-device", str(args.gen_device)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/tmp", timeout=args.round_timeout)
    if proc.returncode:
        raise RuntimeError(f"round under {tree} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m kvd.bench.latency_ab``."""
    parser = argparse.ArgumentParser(prog="python -m kvd.bench.latency_ab",
                                     description="A/B of the 1-request latency between two kvd source trees, "
                                                 "rounds alternated (ABBA...), fresh daemons each round")
    parser.add_argument("trees", nargs="*", help="OLD_TREE NEW_TREE (directories holding kvd/, protocol/, clients/)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per tree (default 4)")
    parser.add_argument("--repeat", type=int, default=200, help="timed requests per order and round (default 200)")
    parser.add_argument("--blocks", type=int, default=1, help="request size in blocks (default 1)")
    parser.add_argument("--geometry", choices=["gpt-oss-120b", "tiny"], default="gpt-oss-120b",
                        help="KV geometry: gpt-oss-120b (2.25 MiB a block; the default) or tiny (9 KiB, the same "
                             "structure)")
    parser.add_argument("--orders", default="gen-first,ctx-first", help="gen-first and/or ctx-first (default both)")
    parser.add_argument("--memory", default="host", help="pool memory: host (default) or auto (GPU pools)")
    parser.add_argument("--device", type=int, default=-1, help="ctx pools' GPU (-1: host; default -1)")
    parser.add_argument("--gen-device", type=int, default=None, help="gen pools' GPU (default: --device)")
    parser.add_argument("--busy-poll", default="", help="both daemons' transfer.busy_poll (default: the tree's own)")
    parser.add_argument("--client-spin-s", type=float, default=0.0,
                        help="every executor's Client(spin_s=) (default 0: waits sleep at once)")
    parser.add_argument("--completion-page", action="store_true",
                        help="with --client-spin-s: every executor's Client(completion_page=True) (trees that "
                             "have completion pages); each round then says the share of waits the page answered")
    parser.add_argument("--pythonpath", default="", help="put in front of each tree on PYTHONPATH (installed wheels)")
    parser.add_argument("--env-old", action="append", default=[], metavar="KEY=VALUE",
                        help="set in the old tree's rounds, daemons included (repeatable; default none): with the "
                             "same tree twice, an A/B of a setting, e.g. --env-new KVD_KERNEL_PARAM_TABLES=1")
    parser.add_argument("--env-new", action="append", default=[], metavar="KEY=VALUE",
                        help="set in the new tree's rounds, daemons included (repeatable; default none)")
    parser.add_argument("--round-timeout", type=float, default=300.0, help="seconds a round may take (default 300)")
    parser.add_argument("--json", action="store_true", help="also print every round as one JSON object at the end")
    parser.add_argument("--child", action="store_true",
                        help="run one round here and print it as JSON (what each round runs, under its tree)")
    parser.add_argument("--tree", default="", help="with --child: the tree kvd must come from (default: none given)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if len(args.trees) != 2:
        parser.error("give two trees: OLD_TREE NEW_TREE")
    if args.completion_page and args.client_spin_s <= 0:
        parser.error("--completion-page needs --client-spin-s > 0 (only a spinning client reads the page)")
    for item in (*args.env_old, *args.env_new):
        key, eq, _ = item.partition("=")
        if not eq or not key or not key.replace("_", "").isalnum():
            parser.error(f"--env-old/--env-new take KEY=VALUE, got {item!r}")
    for tree in args.trees:
        if not Path(tree, "kvd", "__init__.py").is_file():
            parser.error(f"{tree} holds no kvd/ package (make a tree with: git archive COMMIT | tar -x -C DIR)")
    trees = {"old": args.trees[0], "new": args.trees[1]}
    results: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
            res = _round(trees[name], args, name)
            results[name].append(res)
            print(f"round {r} {name}: " + "; ".join(
                f"{order} p50 {v['p50_s'] * 1e3:.3f} p99 {v['p99_s'] * 1e3:.3f} ctx p50 {v['ctx_p50_s'] * 1e3:.3f} ms, "
                f"cpu/req ctx {v['ctx_cpu_s'] * 1e3:.3f} gen {v['gen_cpu_s'] * 1e3:.3f} ms"
                + (", waits the page answered " + " ".join(f"{k} {x:.2f}" for k, x in v["page_share"].items())
                   if "page_share" in v else "")
                for order, v in res.items()),
                flush=True)
    for order in args.orders.split(","):
        med = {name: {key: statistics.median(res[order][key] for res in results[name]) for key, _ in _FIGURES}
               for name in results}
        print(f"{order}, medians over {args.rounds} rounds (ms): " + ", ".join(
            f"{label} {med['old'][key] * 1e3:.3f} -> {med['new'][key] * 1e3:.3f} (x{med['new'][key] / med['old'][key]:.2f})"
            if med["old"][key] > 0 else f"{label} {med['old'][key] * 1e3:.3f} -> {med['new'][key] * 1e3:.3f}"
            for key, label in _FIGURES))
    if args.json:
        print(json.dumps({"trees": trees, "rounds": results}))
    return 0


if __name__ == "__main__":
    if "--child" in sys.argv:
        # run by path under the tree being measured: this file's folder must not shadow modules
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.exit(main())
