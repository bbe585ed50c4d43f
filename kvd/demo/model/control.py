"""What the demo's driver and its executor processes say to each other over pipes.

In a serving system a router tells a ctx worker to prefill a request and a gen worker to
decode it, and carries the first token from one to the other; the KV itself goes through kvd.
Here the driver plays the router. Every step that the other side depends on is an event on a
pipe: the gen ranks report ``Expected`` once their ``expect`` calls have returned, the ctx
executor reports ``Published`` once its ``publish`` calls have; the driver starts the next
side only then, so both registration orders are exercised for real, never by a sleep.

Messages are plain frozen dataclasses of Python and numpy values (no torch tensors: pickled
tensors would travel through shared memory or CUDA IPC instead of the pipe).
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

import numpy as np

from protocol.errors import KvdError

M = TypeVar("M")


@dataclass(frozen=True)
class Prompt:
    """One request: its id and its prompt's token ids."""

    request_id: str
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Ready:
    """An executor is attached to its pool and has built its model."""

    worker: str


@dataclass(frozen=True)
class Start:
    """Driver → executor: go ahead (ctx: prefill and publish; gen: allocate and expect)."""


@dataclass(frozen=True)
class Published:
    """ctx → driver: every request is prefilled, written into the pool and published."""

    worker: str
    first_tokens: dict[str, int]
    prefill_s: dict[str, float]
    prefill_logits: dict[str, np.ndarray[Any, Any]]
    blocks: dict[str, int]


@dataclass(frozen=True)
class Expected:
    """gen rank → driver: every request is expected (its ``expect`` calls returned)."""

    worker: str


@dataclass(frozen=True)
class FirstTokens:
    """Driver → gen ranks: the token each request's prefill produced (the router carries it)."""

    tokens: dict[str, int]


@dataclass(frozen=True)
class CompletionInfo:
    """A kvd :class:`~protocol.messages.Completion`, as the driver reports it."""

    path: str
    bytes: int
    duration_s: float
    chunks: int
    fallback: str


@dataclass(frozen=True)
class CtxDone:
    """ctx → driver: every transfer completed on the ctx side (blocks freed)."""

    worker: str
    completions: dict[str, CompletionInfo]


@dataclass(frozen=True)
class GenDone:
    """gen rank → driver: the decoded tokens (and, from rank 0, every step's logits)."""

    worker: str
    tokens: dict[str, list[int]]
    logits: dict[str, np.ndarray[Any, Any]]
    completions: dict[str, CompletionInfo]
    decode_s: float
    device: str = ""
    backend: str = ""


@dataclass(frozen=True)
class Failed:
    """An executor raised: the error and where."""

    worker: str
    error: str
    trace: str = field(default="", repr=False)


class WorkerFailed(KvdError):
    """An executor process failed or exited before saying what the driver waited for."""

    code = "worker_failed"


def run_worker(name: str, conn: Connection, body: Callable[[], None]) -> None:
    """Run an executor's body; any exception is reported on ``conn`` as :class:`Failed`."""
    try:
        body()
    except BaseException as exc:
        # a daemon's refusal (a KvdError) says all there is in its message; its traceback,
        # flattened into the driver's one error line, only buried it. Anything else is a bug
        # in the executor, and there the traceback is what finds it.
        trace = "" if isinstance(exc, KvdError) else traceback.format_exc()
        with contextlib.suppress(OSError):  # the driver may be gone (that is why recv failed)
            conn.send(Failed(name, f"{type(exc).__name__}: {exc}", trace))
        conn.close()
        raise SystemExit(1) from None


def expect_msg(
    conns: Mapping[str, Connection], procs: Mapping[str, BaseProcess], kind: type[M], timeout_s: float
) -> dict[str, M]:
    """One ``kind`` message from every worker in ``conns``, in any order (see :func:`collect`)."""
    got = collect(conns, procs, dict.fromkeys(conns, kind), timeout_s)
    return {n: m for n, m in got.items() if isinstance(m, kind)}


def collect(
    conns: Mapping[str, Connection], procs: Mapping[str, BaseProcess], kinds: Mapping[str, type], timeout_s: float
) -> dict[str, object]:
    """One message of type ``kinds[name]`` from every worker ``name`` in ``conns``, in any order.

    All pipes and process sentinels are watched at once, so whichever worker fails first is
    reported at once: a :class:`Failed` reply, a worker that exits or closes its pipe before
    sending, or ``timeout_s`` (a backstop against a hung executor, not a synchronisation)
    raise :class:`WorkerFailed`.
    """
    got: dict[str, object] = {}
    deadline = time.monotonic() + timeout_s
    by_conn = {id(c): n for n, c in conns.items()}
    while len(got) < len(conns):
        pending = [n for n in conns if n not in got]
        sentinels = {procs[n].sentinel: n for n in pending}
        left = deadline - time.monotonic()
        if left <= 0:
            raise WorkerFailed(f"nothing from {pending} within {timeout_s:.0f}s")
        ready = wait([*(conns[n] for n in pending), *sentinels], left)
        for obj in ready:
            if isinstance(obj, Connection):
                name = by_conn[id(obj)]
                want = kinds[name]
                try:
                    msg = obj.recv()
                except EOFError:
                    raise WorkerFailed(f"{name} closed its pipe before sending {want.__name__}") from None
                if isinstance(msg, Failed):
                    raise WorkerFailed(f"{msg.worker} failed: {msg.error}" + (f"\n{msg.trace}" if msg.trace else ""))
                if not isinstance(msg, want):
                    raise WorkerFailed(f"{name} sent {type(msg).__name__}, expected {want.__name__}")
                got[name] = msg
        for obj in ready:
            if isinstance(obj, int) and (name := sentinels[obj]) not in got and not conns[name].poll():
                raise WorkerFailed(f"{name} exited with code {procs[name].exitcode} before sending "
                                   f"{kinds[name].__name__}")
    return got
