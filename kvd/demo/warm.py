"""A Python interpreter that imports torch ahead of time, then becomes ``python -m kvd serve``.

Of the ~1.4 s a daemon takes from spawn to READY=1 on a 2-core box, ~1 s is ``import torch``,
which no configuration can change. :class:`kvd.demo.launch.WarmInterpreters` starts this module
ahead of need (``python -m kvd.demo.warm``); it imports torch and waits for one line on its
stdin: a JSON object ``{"argv": [...], "env": {...}, "log": path}``. It then redirects stdout and
stderr to ``log``, stdin to ``/dev/null``, sets the environment keys the launcher says may differ
(:data:`kvd.demo.launch.LATE_ENV`; the launcher checks every other key is the one this process
was started with), and runs the ``kvd`` package as ``__main__`` with ``argv``, as
``python -m kvd`` does. An empty stdin (the launcher went away) ends it with status 0.

It imports nothing of kvd: the daemon's own modules are imported by ``kvd serve``, in the order
and at the time they always are. Besides torch it imports the third-party packages every daemon
imports before it is ready and that read nothing of the environment a request may change
(:data:`PRELOADED`: another ~0.2 s of start-up on that box). Not NIXL: loading it loads UCX,
which reads its ``UCX_*`` configuration then, and those keys are the request's.
"""

from __future__ import annotations

import json
import os
import runpy
import sys


def become_daemon(request: dict[str, object]) -> None:
    """Take the log, the environment and the command line of ``request``; run ``kvd``."""
    log = os.open(str(request["log"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    env = request["env"]
    assert isinstance(env, dict)
    late = tuple(str(k) for k in request["late"]) if isinstance(request["late"], list) else ()
    for key in [k for k in os.environ if k.startswith(late) and k not in env]:
        del os.environ[key]
    for key, value in env.items():
        if str(key).startswith(late):
            os.environ[str(key)] = str(value)
    argv = request["argv"]
    assert isinstance(argv, list)
    sys.argv = ["kvd", *(str(a) for a in argv)]  # argv[0] becomes kvd/__main__.py, as with -m
    runpy.run_module("kvd", run_name="__main__", alter_sys=True)


#: imported ahead with torch (``kvd serve`` imports each of them before READY=1)
PRELOADED = ("msgspec", "prometheus_client", "structlog", "trio")


def main() -> int:
    import importlib

    import torch  # noqa: F401 - the point: the second of start-up spent before the daemon is asked for

    for name in PRELOADED:
        importlib.import_module(name)

    line = sys.stdin.buffer.readline()
    if not line:
        return 0
    request = json.loads(line)
    become_daemon(request)  # kvd's __main__ ends the process with the daemon's exit status
    return 0


if __name__ == "__main__":
    sys.exit(main())
