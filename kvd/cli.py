"""``kvd`` command line: ``kvd serve``, ``kvd demo``, ``kvd bench {ipc,regroup,transfer}``."""

from __future__ import annotations

import argparse
import os
import sys

from protocol.errors import KvdError


def _serve(args: argparse.Namespace) -> int:
    import trio

    from kvd.config import load_config
    from kvd.ops.logs import configure_logging
    from kvd.server import serve

    config = load_config(args.config)
    configure_logging(config.log_format, config.log_level)
    trio.run(serve, config)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvd`` console script."""
    parser = argparse.ArgumentParser(prog="kvd", description="KV-cache transfer daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="run the daemon")
    p_serve.add_argument("--config", "-c", default=os.environ.get("KVD_CONFIG"), help="TOML configuration file")
    sub.add_parser("demo", help="two daemons, a regrouped TP1 -> TP4 transfer over NIXL, verified", add_help=False)
    p_bench = sub.add_parser("bench", help="benchmarks that print figures", add_help=False)
    p_bench.add_argument("what", choices=["ipc", "regroup", "transfer"])
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "serve":
            if rest:
                parser.error(f"unrecognized arguments: {' '.join(rest)}")
            return _serve(args)
        if args.command == "demo":
            from kvd.demo.pair import main as demo_main

            return demo_main(rest)
        if args.what == "ipc":
            from kvd.bench.ipc import main as bench_main
        elif args.what == "regroup":
            from kvd.bench.regroup import main as bench_main
        else:
            from kvd.bench.transfer import main as bench_main
        return bench_main(rest)
    except KvdError as exc:
        print(f"kvd: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
