"""``kvd`` command line: ``kvd serve``, ``kvd demo [--model]``, ``kvd bench {ipc,regroup,transfer}``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from kvd.startup import StartupError, one_line
from protocol.errors import KvdError

if TYPE_CHECKING:
    from kvd.config import Config


def _serve(args: argparse.Namespace) -> int:
    """Run the daemon; a failure is one ``kvd: error:`` line, one log line and an exit status."""
    import trio

    from kvd.config import load_config, table_keys
    from kvd.daemon import check_config
    from kvd.ops.logs import configure_logging
    from kvd.startup import check_host_pools, config_error, explain, host_memory

    try:
        config = load_config(args.config)
        check_config(config)  # every value the file alone decides: exit 78 now, not 1 later
    except KvdError as exc:
        _configure_logging_from_env()
        return _report(config_error(args.config, exc, table_keys), stage="startup")
    configure_logging(config.log_format, config.log_level, cache=True)
    try:
        check_host_pools(_host_pools(config), host_memory())
    except StartupError as exc:
        return _report(exc, stage="startup")
    from kvd.server import serve  # torch with it (~1 s): a configuration refused above is told at once

    ready = False

    async def run() -> None:
        nonlocal ready
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, config)
            ready = True

    try:
        _run_profiled(trio.run, run)
    except (Exception, BaseExceptionGroup) as exc:
        if isinstance(exc, BaseExceptionGroup) and exc.subgroup(KeyboardInterrupt) is not None:
            return 130
        return _report(explain(exc), stage="running" if ready else "startup", cause=exc, no_config=args.config is None)
    return 0


def _host_pools(config: Config) -> list[tuple[str, str, int]]:
    """``(setting, name, bytes)`` of each host-memory pool (``memory = "host"`` or ``device = -1``),
    the setting being the size key the pool gives (``pools[i].num_blocks`` or ``.budget_mb``)."""
    pools = []
    for i, pool in enumerate(config.pools):
        if pool.memory == "host" or pool.device < 0:
            key = "num_blocks" if pool.num_blocks > 0 else "budget_mb"
            pools.append((f"pools[{i}].{key}", pool.name, pool.layout().pool_bytes(pool.rank)))
    return pools


def _run_profiled(fn: object, *args: object) -> None:
    """Call ``fn(*args)``; with ``KVD_PROFILE=PREFIX`` set, under cProfile, the stats written to
    ``PREFIX.<pid>.prof`` at exit (for finding where a daemon's host time goes)."""
    prefix = os.environ.get("KVD_PROFILE", "")
    trace = os.environ.get("KVD_TRACE_STEPS", "")
    if trace:
        from kvd.ops.steptrace import StepTrace

        tracer = StepTrace(f"{trace}.{os.getpid()}.steps")
        try:
            fn(*args, instruments=[tracer])  # type: ignore[operator]
        finally:
            tracer.dump()
        return
    if not prefix:
        fn(*args)  # type: ignore[operator]
        return
    import cProfile

    prof = cProfile.Profile()
    try:
        prof.runcall(fn, *args)  # type: ignore[arg-type]
    finally:
        prof.dump_stats(f"{prefix}.{os.getpid()}.prof")


def _configure_logging_from_env() -> None:
    """Logging for a daemon whose configuration could not be read: ``KVD_LOG_*`` or defaults."""
    from kvd.ops.logs import configure_logging

    try:
        configure_logging(os.environ.get("KVD_LOG_FORMAT") or "auto", os.environ.get("KVD_LOG_LEVEL") or "info")
    except ValueError:
        configure_logging("auto", "info")


def _report(error: StartupError, *, stage: str, cause: BaseException | None = None, no_config: bool = False) -> int:
    """One structured log line and one stderr line; returns the exit status.

    ``no_config``: ``kvd serve`` ran without a configuration file (no ``--config``, no
    ``KVD_CONFIG``), so a setting the error names that no variable set is a built-in default."""
    import structlog

    from kvd.config import env_sources

    message = error.message
    sources = env_sources(error.setting, error.message)
    for key, source in sources:
        if source not in message:
            # e.g. KVD_SOCKET exported for a client gives every daemon started from that shell
            # one socket: "another kvd is already serving on it", with the file saying otherwise
            message += (f"; {key} came from the environment ({source}), which overrides the configuration "
                        "file: unset it to use the file's value")
    if no_config and error.setting and error.setting not in {key for key, _source in sources}:
        # `kvd serve` typed without --config: "/run/kvd does not exist" alone reads as a broken
        # install, not as the default of a file that was never given
        message += (f"; kvd serve was given no configuration file (--config FILE, or KVD_CONFIG), so "
                    f"{error.setting} is the built-in default: give it your configuration file (systemd/kvd.toml "
                    "is an example)")
    log = structlog.get_logger("kvd.server")
    fields = {"reason": message, "setting": error.setting or None, "code": error.code,
              "exc_info": cause if error.internal else None}
    if stage == "startup":
        log.error("daemon.startup_failed", **fields)
    else:
        log.error("daemon.failed", **fields)
    print(f"kvd: error: {message}", file=sys.stderr)
    return error.exit_code


#: The benchmarks of ``kvd bench`` and what each measures.
BENCHES = {
    "ipc": "executor <-> daemon round trips over the Unix socket",
    "regroup": "the regroup copies (gather/scatter, box copies) [--device cuda]",
    "transfer": "two daemons end to end against raw NIXL [--device cuda] [--json]; "
                "[--layout --ctx-gpus --gen-gpus --concurrent]: N-GPU layouts, requests in flight together",
}


def installed_version() -> str:
    """The installed kvd version, as ``kvctl status`` names a daemon's ("dev" from a source tree
    that was never installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvd")
    except PackageNotFoundError:  # pragma: no cover - running from an uninstalled tree
        return "dev"


def _gpu_transfer_help(rest: list[str]) -> bool:
    """``kvd bench transfer --device cuda --help``: the GPU bench's own options. The CPU bench's
    parser (which hands ``--device cuda`` on) would print its own help for ``--help`` first,
    without the GPU options (``--gen-gpu``, ``--plot``) that its ``--device`` help points to."""
    from kvd.bench.layout_spec import wanted

    if not {"-h", "--help"} & set(rest) or wanted(rest):  # --layout ...: the layout bench's own help
        return False
    from itertools import pairwise

    return "--device=cuda" in rest or ("--device", "cuda") in pairwise(rest)


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``kvd`` parser and its ``bench`` subparser. ``kvd demo`` and ``kvd bench NAME`` hand
    the rest of the command line to their own parsers (``build_parser`` of those modules)."""
    parser = argparse.ArgumentParser(prog="kvd", description="KV-cache transfer daemon")
    parser.add_argument("--version", action="version", version=f"kvd {installed_version()}",
                        help="print the installed kvd version and exit (kvctl status shows a daemon's)")
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="run the daemon", description="run the daemon until SIGTERM or a drain")
    p_serve.add_argument("--config", "-c", default=os.environ.get("KVD_CONFIG"),
                         help="TOML configuration file (default $KVD_CONFIG; without one, the built-in defaults)")
    sub.add_parser("demo", add_help=False,
                   help="two daemons, a regrouped TP1 -> TP4 transfer over NIXL, verified; "
                        "--model: a small transformer's prefill -> decode through kvd, token-identical")
    bench_help = "\n".join(f"  {name:<10}{text}" for name, text in BENCHES.items())
    p_bench = sub.add_parser(
        "bench", help="benchmarks that print figures", add_help=False, usage="kvd bench {ipc,regroup,transfer} [options]",
        description=f"benchmarks that print figures:\n{bench_help}\n\nkvd bench NAME --help lists NAME's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # add_help=False: `kvd bench transfer --help` must reach the benchmark's own parser
    p_bench.add_argument("what", nargs="?", choices=list(BENCHES), help="the benchmark to run")
    return parser, p_bench


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvd`` console script."""
    parser, p_bench = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench" and args.what is None:
        if rest in (["-h"], ["--help"]):
            p_bench.print_help()
            return 0
        p_bench.error("which benchmark? one of ipc, regroup, transfer (kvd bench --help)")
    try:
        if args.command == "serve":
            if rest:
                parser.error(f"unrecognized arguments: {' '.join(rest)}")
            return _serve(args)
        if args.command == "demo":
            if "--model" in rest:
                from kvd.demo.model.cli import main as model_main

                return model_main([a for a in rest if a != "--model"])
            from kvd.demo.pair import main as demo_main

            return demo_main(rest)
        if args.what == "ipc":
            from kvd.bench.ipc import main as bench_main
        elif args.what == "regroup":
            from kvd.bench.regroup import main as bench_main
        elif _gpu_transfer_help(rest):
            from kvd.bench.transfer_gpu import main as bench_main
        else:
            from kvd.bench.transfer import main as bench_main
        return bench_main(rest)
    except KvdError as exc:
        print(f"kvd: error: {one_line(exc.message or str(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
