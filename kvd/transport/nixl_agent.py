"""A thin, typed, trio-friendly wrapper of one NIXL agent with the UCX backend.

What this module knows about NIXL 1.5.1 (``nixl-cu13``), measured on a 2-core CPU machine with
two processes over loopback (DRAM):

Progress and polling
    With ``progress_thread=False`` (the default, and the faster choice on small hosts) nothing
    inside NIXL drives UCX on its own: UCX only makes progress inside NIXL calls. The *passive*
    side of a write must keep calling :meth:`NixlAgent.notifications` or the sender spins
    forever (over ``tcp``; a slow poll makes a 256 MiB write 10x slower); and the *active* side
    must keep calling into its agent too, or a standalone :meth:`NixlAgent.send_notif` is never
    flushed. The daemon therefore runs ONE :func:`~kvd.transport.poller.poll_notifications` task per agent for the
    agent's whole life; :meth:`NixlAgent.wait` drives progress for the transfer it waits on.
    The *receiver's* poll rate bounds the *sender's* completion latency: a 1 MiB host write
    completes in ≈0.2 ms when the target polls without pause, ≈3 ms when it polls every
    millisecond (and trio cannot sleep less than ≈1.1 ms) — so the poller spins (``hot``)
    while transfers into this daemon are in progress (politely, yielding the CPU every round,
    on hosts with few cores).

Posting is sometimes the copy
    On host memory UCX moves puts with ``cma`` (``process_vm_writev``): ``transfer()`` does the
    whole copy before it returns "DONE" (≈45 ms for 256 MiB here) — the post *is* the transfer.
    Over ``tcp``, RDMA and ``cuda_ipc`` the post returns "PROC" at once. The binding releases
    the GIL while it posts, so :meth:`NixlAgent.write_async` posts from a worker thread (by
    default for DRAM sources) and the event loop keeps running; meanwhile
    :func:`~kvd.transport.poller.poll_notifications` stays out of the agent (see :attr:`NixlAgent.busy`): the agent
    is created with ``NIXL_THREAD_SYNC_STRICT`` (one mutex, no measurable cost), so any other
    call into the same agent would simply wait for the post.

Thread safety
    The agent is created thread-safe (``sync="strict"``) so blocking calls (registration,
    metadata, big posts) can run in ``trio.to_thread.run_sync`` while the event loop polls.

Releasing an in-flight transfer
    ``release`` of a handle whose transfer is still "PROC" *cancels* it: UCX cancels the
    outstanding requests (UCX logs "UCX AM send failed ... Request canceled"), the release
    succeeds, the notification of that write is not delivered (unless the write was already
    finishing: then it may still arrive), and the destination bytes are undefined (partly
    written). Later transfers to the same remote agent work normally. A
    backend that cannot cancel makes the release fail; :meth:`NixlAgent.wait` then keeps
    polling (shielded, bounded) until the transfer ends and releases it then.

Errors NIXL reports
    Every exception from NIXL becomes :class:`protocol.errors.NixlError` naming the operation,
    NIXL's status and a hint. NIXL's own explanation only goes to stderr (glog lines such as
    ``createXferReq: metadata for remote agent 'x' not found``); the status classes seen are
    ``nixlNotFoundError`` (unknown remote agent, or a descriptor outside every registered
    region: "no specified or potential backend had the required registrations"),
    ``nixlInvalidParamError`` (local/remote descriptor lengths differ) and
    ``nixlRemoteDisconnectError`` (the remote process went away; raised by ``transfer`` and
    ``send_notif``). After such a failure UCX must progress once more before the agent is
    destroyed, or the C++ destructor aborts the whole process (``arbiter.c: Assertion
    `ucs_arbiter_group_is_empty(group)' failed``); :meth:`NixlAgent.post` and
    :meth:`NixlAgent.close` do that.

Other traps handled here: ``register_memory`` wants 4-tuples ``(addr, len, dev, "")`` (a
3-tuple fails with a confusing ``TypeError``); ``add_remote_agent`` returns **bytes** while
notification dicts are keyed by **str** (:meth:`NixlAgent.add_remote` returns ``str``); host
memory uses device id 0 inside NIXL (kvd's :class:`Region` says -1); ``make_prepped_xfer``
merges adjacent descriptors (16,384 contiguous 16 KiB descriptors become one: 5.9 GB/s) while
``initialize_xfer`` does not (4.0 GB/s), and a write made from prepared lists skips NIXL's
per-write descriptor validation (:meth:`NixlAgent.slot_descs` keeps such lists for the slots of
a staging region, per write length, until the remote agent is removed);
:meth:`NixlAgent.get_agent_metadata` is a snapshot
— after new registrations the remote side must :meth:`NixlAgent.add_remote` the fresh
metadata again (re-adding a known agent updates it). Metadata is exchanged over kvd's own peer
link; NIXL's listener thread (which binds 0.0.0.0) is never enabled.

Logging: NIXL's Python logger prints INFO lines to *stdout*, where the daemon writes JSON logs;
:func:`load_nixl` lowers it to WARNING on stderr unless ``NIXL_LOG_LEVEL`` is set.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import logging
import os
import sys
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal, TypeAlias, cast

import numpy as np
import numpy.typing as npt
import structlog
import trio

from protocol.errors import BadRequest, NixlError

__all__ = [
    "Descs",
    "MemType",
    "NixlAgent",
    "PreppedDescs",
    "RegHandle",
    "Region",
    "SyncMode",
    "XferHandle",
    "XferState",
    "ensure_loopback_ucx",
    "load_nixl",
]

log = structlog.get_logger("kvd.transport")

MemType = Literal["DRAM", "VRAM"]
XferState = Literal["DONE", "PROC"]
SyncMode = Literal["strict", "rw", "none"]
#: Descriptors: a sequence of ``(addr, nbytes)`` pairs, or a uint64 array of shape (N, 2).
Descs: TypeAlias = "Sequence[tuple[int, int]] | npt.NDArray[np.uint64]"

_nixl_api: ModuleType | None = None
_LIVE_AGENTS: weakref.WeakSet[NixlAgent] = weakref.WeakSet()


@atexit.register
def _close_live_agents() -> None:
    for agent in list(_LIVE_AGENTS):
        with suppress(Exception):
            agent.close()
    gc.collect()  # free C++ agents still held by reference cycles before UCX tears down


def load_nixl() -> ModuleType:
    """Import NIXL's Python API once: ``nixl._api`` when present, else ``nixl_cu13._api``.

    Also quiets NIXL's Python logger (INFO lines on stdout) to WARNING on stderr, unless
    ``NIXL_LOG_LEVEL`` is set.
    """
    global _nixl_api
    if _nixl_api is not None:
        return _nixl_api
    try:
        mod = importlib.import_module("nixl._api")
    except ImportError:
        try:
            mod = importlib.import_module("nixl_cu13._api")
        except ImportError as exc:
            raise NixlError(f"NIXL is not installed (pip install nixl-cu13==1.5.1): {exc}") from None
    nixl_logger = logging.getLogger("nixl")
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_logger.setLevel(logging.WARNING)
    for handler in nixl_logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    _nixl_api = mod
    return mod


def ensure_loopback_ucx() -> None:
    """Keep UCX on loopback: set ``UCX_NET_DEVICES=lo`` unless it is already set.

    Tests and the raw bench call this before creating agents so nothing leaves the host. The
    daemon does not: on a real node UCX must see the RDMA/NVLink devices.
    """
    os.environ.setdefault("UCX_NET_DEVICES", "lo")


@contextmanager
def _scoped_env(env: Mapping[str, str] | None) -> Iterator[None]:
    """Apply ``env`` to os.environ for the duration (UCX reads its config at backend creation)."""
    if not env:
        yield
        return
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass(frozen=True, slots=True)
class Region:
    """A memory range to register: host memory (``device=-1``, ``"DRAM"``) or a GPU's."""

    addr: int
    nbytes: int
    device: int = -1
    mem: MemType = "DRAM"

    def __post_init__(self) -> None:
        if self.addr <= 0 or self.nbytes <= 0:
            raise BadRequest(f"region needs a positive address and size, got {self.addr:#x}+{self.nbytes}")
        if self.mem not in ("DRAM", "VRAM"):
            raise BadRequest(f"region memory type must be 'DRAM' or 'VRAM', not {self.mem!r}")
        if (self.mem == "DRAM") != (self.device < 0):
            raise BadRequest(
                f"region on device {self.device} must say mem={'DRAM' if self.device < 0 else 'VRAM'!r}"
            )


def _nixl_dev(device: int) -> int:
    """kvd says -1 for host memory; NIXL's host descriptors use device id 0."""
    return 0 if device < 0 else device


@dataclass(eq=False, slots=True)
class RegHandle:
    """Registered regions; give it back with :meth:`NixlAgent.deregister`."""

    regions: tuple[Region, ...]
    _dlists: list[Any]
    released: bool = False

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.regions)


@dataclass(eq=False, slots=True)
class PreppedDescs:
    """A descriptor list prepared once (:meth:`NixlAgent.prep_local` / ``prep_remote``).

    Writes then pick descriptors by index (:meth:`NixlAgent.write_prepped`), skipping the
    per-write validation; NIXL merges adjacent picked descriptors.
    """

    agent: str  # remote agent name, or "" for the local side
    lengths: npt.NDArray[np.uint64]
    mem: MemType
    _handle: Any
    released: bool = False

    def __len__(self) -> int:
        return len(self.lengths)


@dataclass(eq=False, slots=True)
class XferHandle:
    """One WRITE transfer; created and posted by :meth:`NixlAgent.write`."""

    remote_agent: str
    nbytes: int
    ndescs: int
    notif: bytes
    _handle: Any
    posted: str = ""  # state returned by the post ("" = not posted yet)
    done: bool = False
    released: bool = False
    started: float = field(default_factory=time.monotonic)

    def describe(self) -> str:
        return f"WRITE of {self.nbytes} bytes in {self.ndescs} descriptors to agent {self.remote_agent!r}"


_HINTS: dict[str, str] = {
    "nixlNotFoundError": "",  # filled per operation
    "nixlInvalidParamError": "invalid parameters (local and remote lists must pair descriptors of equal length)",
    "nixlRemoteDisconnectError": "the remote agent disconnected (its process went away)",
    "nixlBackendError": "the UCX backend reported an error (see the UCX/NIXL lines on stderr)",
    "nixlNotAllowedError": "operation not allowed in this state",
    "nixlMismatchError": "memory type or device mismatch between descriptors and registrations",
    "nixlNotPostedError": "the transfer was not posted",
    "nixlRepostActiveError": "the transfer is still active and cannot be posted again",
    "nixlNotSupportedError": "not supported by the backend",
    "nixlCancelledError": "the transfer was cancelled",
}


def _nixl_error(op: str, exc: BaseException, hint: str = "") -> NixlError:
    # Drop the cause's traceback: its frames hold NIXL's handle objects, which hold the C++
    # agent alive past close() (and a UCX worker alive at exit aborts the process).
    exc.__traceback__ = None
    kind = type(exc).__name__
    text = str(exc) or kind
    hint = hint or _HINTS.get(kind, "")
    msg = f"{op} failed: {kind}: {text}"
    if hint:
        msg += f" ({hint})"
    return NixlError(msg)


_SMALL_LIST = 16
#: Prepared slot descriptor lists :meth:`NixlAgent.slot_descs` keeps per agent (one per write length).
SLOT_DESCS_KEPT = 32
#: Write handles :meth:`NixlAgent.write_slot_async` keeps per remote agent (one per pair of
#: local and remote slot descriptors; 8 send slots x 8 receive slots x a few lengths).
SLOT_WRITES_KEPT = 512


def _desc_array(descs: Descs, device: int) -> npt.NDArray[np.uint64]:
    """(addr, nbytes) pairs → NIXL's (N, 3) uint64 ``(addr, len, dev)`` array."""
    if isinstance(descs, np.ndarray):
        arr = descs
        if arr.ndim != 2 or arr.shape[1] != 2:
            raise BadRequest(f"descriptor array must have shape (N, 2), not {arr.shape}")
        n = arr.shape[0]
        out = np.empty((n, 3), dtype=np.uint64)
        out[:, :2] = arr
    else:
        n = len(descs)
        out = np.empty((n, 3), dtype=np.uint64)
        if n:
            out[:, :2] = np.asarray(descs, dtype=np.uint64).reshape(n, 2)
    if n == 0:
        raise BadRequest("a transfer needs at least one descriptor")
    out[:, 2] = _nixl_dev(device)
    return out


class NixlAgent:
    """One NIXL agent (UCX backend) with typed, error-mapped methods.

    Every method but :meth:`wait`/:meth:`write_async` is synchronous; registration and agent
    creation can take a while (call them through ``trio.to_thread.run_sync``). Not a trio
    object: it may be created and used outside a trio run (bench, helper processes).
    """

    def __init__(
        self,
        name: str,
        *,
        progress_thread: bool = False,
        env: Mapping[str, str] | None = None,
        sync: SyncMode = "strict",
        telemetry: bool = False,
    ) -> None:
        """Create the agent.

        ``env``: UCX/NIXL environment settings (``UCX_TLS``, ``UCX_NET_DEVICES``, ...) applied to
        ``os.environ`` only while the backend is created (UCX reads its configuration then), so
        two agents of one process may differ. ``sync``: NIXL's thread synchronisation;
        ``"strict"`` (default) makes the agent safe to call from worker threads.
        """
        api = load_nixl()
        modes = {
            "strict": api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            "rw": api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
            "none": api.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE,
        }
        if sync not in modes:
            raise BadRequest(f"sync must be one of {sorted(modes)}, not {sync!r}")
        if not name:
            raise BadRequest("a NIXL agent needs a non-empty name")
        self.name = name
        self.progress_thread = progress_thread
        self._busy = 0
        self._remotes: set[str] = set()
        #: remote agents an operation failed with since they were loaded (see :meth:`failed_with`)
        self._failed: set[str] = set()
        #: those of them whose failure was NIXL's "remote disconnect" (see :meth:`disconnected`)
        self._disconnected: set[str] = set()
        self._regs: list[RegHandle] = []
        self._unreleased: list[XferHandle] = []
        # slot descriptor lists prepared by slot_descs(): remote agent ("" = local) -> LRU by key
        self._slot_descs: dict[str, OrderedDict[tuple[int, int, int, int, str, int], PreppedDescs]] = {}
        # idle write handles kept by write_slot_async(): remote agent -> LRU by descriptor pair
        self._slot_writes: dict[str, OrderedDict[tuple[PreppedDescs, int, PreppedDescs, int], XferHandle]] = {}
        self._closed = False
        config = api.nixl_agent_config(
            enable_prog_thread=progress_thread,
            enable_listen_thread=False,
            backends=["UCX"],
            capture_telemetry=telemetry,
            sync_mode=modes[sync],
        )
        with _scoped_env(env):
            try:
                self._agent: Any = api.nixl_agent(name, config)
            except Exception as exc:
                raise _nixl_error(f"create NIXL agent {name!r}", exc) from exc
        _LIVE_AGENTS.add(self)
        if "UCX" not in self._agent.backends:
            raise NixlError(
                f"create NIXL agent {name!r} failed: the UCX backend could not be created "
                f"(available plugins: {self._agent.get_plugin_list()})"
            )

    # -- state --------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """True while a worker thread is inside the agent (a threaded post)."""
        return self._busy > 0

    @property
    def remotes(self) -> frozenset[str]:
        """Remote agents whose metadata is loaded."""
        return frozenset(self._remotes)

    def __repr__(self) -> str:
        return f"NixlAgent({self.name!r}, remotes={sorted(self._remotes)}, regions={sum(len(r.regions) for r in self._regs)})"

    # -- memory -------------------------------------------------------------------------------
    def register(self, regions: Sequence[Region]) -> RegHandle:
        """Register memory with UCX (blocking: pins/maps memory). One call per memory type."""
        if not regions:
            raise BadRequest("register needs at least one region")
        self._check_open()
        by_mem: dict[str, list[Region]] = {}
        for r in regions:
            by_mem.setdefault(r.mem, []).append(r)
        dlists: list[Any] = []
        try:
            for mem, rs in by_mem.items():
                tuples = [(r.addr, r.nbytes, _nixl_dev(r.device), "") for r in rs]
                try:
                    dlists.append(self._agent.register_memory(tuples, mem))
                except Exception as exc:
                    raise _nixl_error(
                        f"register {len(rs)} {mem} region(s) of {sum(r.nbytes for r in rs)} bytes", exc
                    ) from exc
        except BaseException:
            for d in dlists:
                with suppress(Exception):
                    self._agent.deregister_memory(d)
            raise
        handle = RegHandle(tuple(regions), dlists)
        self._regs.append(handle)
        return handle

    def deregister(self, handle: RegHandle) -> None:
        """Deregister what :meth:`register` returned (idempotent)."""
        if handle.released:
            return
        handle.released = True
        if handle in self._regs:
            self._regs.remove(handle)
        errors: list[str] = []
        for d in handle._dlists:
            try:
                self._agent.deregister_memory(d)
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        if errors:
            raise NixlError(f"deregister {len(handle.regions)} region(s) failed: {'; '.join(errors)}")

    # -- metadata and remotes -----------------------------------------------------------------
    def metadata(self) -> bytes:
        """This agent's metadata (connection info + registrations): a snapshot."""
        self._check_open()
        try:
            return bytes(self._agent.get_agent_metadata())
        except Exception as exc:
            raise _nixl_error("get agent metadata", exc) from exc

    def add_remote(self, metadata: bytes) -> str:
        """Load a remote agent's metadata (again, to update it); returns its name as ``str``."""
        self._check_open()
        try:
            raw = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise _nixl_error("load remote agent metadata", exc) from exc
        name = raw.decode() if isinstance(raw, bytes | bytearray) else str(raw)
        self._remotes.add(name)
        return name

    def release_prepared(self, name: str) -> None:
        """Release the descriptor lists :meth:`slot_descs` prepared for remote agent ``name``
        and the write handles :meth:`write_slot_async` kept for it, keeping its metadata
        loaded (a link that went away while the peer may live on: :mod:`kvd.peer.kept_agents`
        says why). Unknown names are ignored."""
        self._release_slot_writes(name)
        self._release_slot_descs(name)

    def failed_with(self, name: str) -> bool:
        """Whether a write to, a transfer state of, or a notification to remote agent ``name``
        failed since it was loaded: its connection may be broken, and loading its metadata
        again does not mend a UCX endpoint that failed (only :meth:`remove_remote` does)."""
        return name in self._failed

    def disconnected(self, name: str) -> bool:
        """Whether an operation with remote agent ``name`` failed because NIXL found its
        connection broken (``nixlRemoteDisconnectError``) since it was loaded: every later
        one will fail too, until the agent is forgotten and loaded again."""
        return name in self._disconnected

    def _note_failure(self, name: str, exc: BaseException | None = None) -> None:
        if name not in self._remotes:  # never loaded, or forgotten already: nothing to mend
            return
        self._failed.add(name)
        if exc is not None and type(exc).__name__ == "nixlRemoteDisconnectError":
            self._disconnected.add(name)

    def probe_remote(self, name: str) -> bool:
        """Send ``name`` an empty notification (receivers drop it); whether UCX took it. An
        endpoint UCX knows to be broken refuses it at once."""
        try:
            self.send_notif(name, b"")
        except NixlError:
            return False
        return True

    def remove_remote(self, name: str) -> None:
        """Forget a remote agent (disconnects from it) after :meth:`release_prepared`.
        Unknown names are ignored."""
        self.release_prepared(name)
        self._failed.discard(name)
        self._disconnected.discard(name)
        if name not in self._remotes:
            return
        self._remotes.discard(name)
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:
            raise _nixl_error(f"remove remote agent {name!r}", exc) from exc

    # -- transfers ----------------------------------------------------------------------------
    def _create_hint(self, remote_agent: str) -> str:
        if remote_agent not in self._remotes:
            return f"metadata of remote agent {remote_agent!r} was never loaded: add_remote() it first"
        return (
            "no backend has registrations covering every descriptor: a local or remote range lies "
            "outside the registered regions, or its memory type/device differs"
        )

    def prepare_write(
        self,
        local: Descs,
        remote: Descs,
        remote_agent: str,
        notif: bytes = b"",
        *,
        local_mem: MemType = "DRAM",
        remote_mem: MemType = "DRAM",
        local_device: int = -1,
        remote_device: int = -1,
    ) -> XferHandle:
        """Create (not post) a WRITE of ``local[i]`` into ``remote[i]`` on ``remote_agent``."""
        self._check_open()
        ln: Any
        rn: Any
        if (
            not isinstance(local, np.ndarray)
            and not isinstance(remote, np.ndarray)
            and 0 < len(local) <= _SMALL_LIST
        ):
            # few descriptors: NIXL's tuple path is ~4x cheaper than building arrays (7 vs 29 µs)
            ldev, rdev = _nixl_dev(local_device), _nixl_dev(remote_device)
            ln = [(int(a), int(n), ldev) for a, n in local]
            rn = [(int(a), int(n), rdev) for a, n in remote]
            count = len(ln)
            if len(rn) != count:
                raise BadRequest(f"{count} local descriptors but {len(rn)} remote ones")
            if any(x[1] != y[1] for x, y in zip(ln, rn, strict=True)):
                raise BadRequest("local and remote descriptors must have equal lengths, pairwise")
            if any(x[1] <= 0 for x in ln):
                raise BadRequest("descriptor lengths must be positive")
            nbytes = sum(x[1] for x in ln)
        else:
            ln = _desc_array(local, local_device)
            rn = _desc_array(remote, remote_device)
            count = int(ln.shape[0])
            if rn.shape[0] != count:
                raise BadRequest(f"{count} local descriptors but {rn.shape[0]} remote ones")
            if not np.array_equal(ln[:, 1], rn[:, 1]):
                raise BadRequest("local and remote descriptors must have equal lengths, pairwise")
            nbytes = int(ln[:, 1].sum())
        op = f"create WRITE of {nbytes} bytes in {count} descriptors to agent {remote_agent!r}"
        try:
            ld = self._agent.get_xfer_descs(ln, local_mem)
            rd = self._agent.get_xfer_descs(rn, remote_mem)
            if ld is None or rd is None:
                raise NixlError(f"{op} failed: NIXL refused the descriptor lists")
            h = self._agent.initialize_xfer("WRITE", ld, rd, remote_agent, notif)
        except NixlError:
            raise
        except Exception as exc:
            raise _nixl_error(
                op, exc, self._create_hint(remote_agent) if type(exc).__name__ == "nixlNotFoundError" else ""
            ) from exc
        return XferHandle(remote_agent, nbytes, count, bytes(notif), h)

    def post(self, handle: XferHandle, notif: bytes | None = None) -> XferState:
        """Post a created transfer (again, once it is done: a repost). On host memory (UCX
        ``cma``) this does the copy itself. ``notif`` replaces the handle's notification."""
        self._check_open()
        if handle.released:
            raise NixlError(f"post {handle.describe()}: the handle was released")
        try:
            if notif is None:
                state = self._agent.transfer(handle._handle)
            else:
                state = self._agent.transfer(handle._handle, notif)
                handle.notif = notif
        except Exception as exc:
            self._note_failure(handle.remote_agent, exc)
            self._release_quietly(handle)
            self._progress_quietly()
            raise _nixl_error(f"post {handle.describe()}", exc) from exc
        if state == "ERR":
            self._note_failure(handle.remote_agent)
            self._release_quietly(handle)
            raise NixlError(f"post {handle.describe()} failed: NIXL returned ERR")
        handle.posted = state
        handle.done = state == "DONE"
        return cast(XferState, state)

    def write(
        self,
        local: Descs,
        remote: Descs,
        remote_agent: str,
        notif: bytes = b"",
        *,
        local_mem: MemType = "DRAM",
        remote_mem: MemType = "DRAM",
        local_device: int = -1,
        remote_device: int = -1,
    ) -> XferHandle:
        """Create and post a WRITE; ``notif`` reaches ``remote_agent`` once the bytes landed."""
        handle = self.prepare_write(
            local,
            remote,
            remote_agent,
            notif,
            local_mem=local_mem,
            remote_mem=remote_mem,
            local_device=local_device,
            remote_device=remote_device,
        )
        self.post(handle)
        return handle

    async def write_async(
        self,
        local: Descs,
        remote: Descs,
        remote_agent: str,
        notif: bytes = b"",
        *,
        local_mem: MemType = "DRAM",
        remote_mem: MemType = "DRAM",
        local_device: int = -1,
        remote_device: int = -1,
        post_in_thread: bool | None = None,
        poll: float = 0.001,
    ) -> XferHandle:
        """Create, post and :meth:`wait` for a WRITE; returns the (released) handle.

        ``post_in_thread`` (default: when the source is host memory, where the post is the
        copy) posts from a worker thread so the event loop keeps running meanwhile.
        """
        handle = self.prepare_write(
            local,
            remote,
            remote_agent,
            notif,
            local_mem=local_mem,
            remote_mem=remote_mem,
            local_device=local_device,
            remote_device=remote_device,
        )
        if post_in_thread is None:
            post_in_thread = local_mem == "DRAM"
        await self._post_and_wait(handle, post_in_thread, poll)
        return handle

    async def write_prepped_async(
        self,
        local: PreppedDescs,
        local_indices: Sequence[int] | npt.NDArray[np.integer[Any]],
        remote: PreppedDescs,
        remote_indices: Sequence[int] | npt.NDArray[np.integer[Any]],
        notif: bytes = b"",
        *,
        post_in_thread: bool | None = None,
        poll: float = 0.001,
    ) -> XferHandle:
        """:meth:`write_prepped`, posted and waited for as :meth:`write_async` does
        (``post_in_thread`` defaults to whether the local list is host memory)."""
        handle = self.write_prepped(local, local_indices, remote, remote_indices, notif, post=False)
        if post_in_thread is None:
            post_in_thread = local.mem == "DRAM"
        await self._post_and_wait(handle, post_in_thread, poll)
        return handle

    async def _post_and_wait(self, handle: XferHandle, post_in_thread: bool, poll: float,
                             notif: bytes | None = None, release: bool = True) -> None:
        try:
            if post_in_thread:
                self._busy += 1
                try:
                    await trio.to_thread.run_sync(self.post, handle, notif)
                finally:
                    self._busy -= 1
            else:
                self.post(handle, notif)
        except BaseException:
            self._release_quietly(handle)
            raise
        await self.wait(handle, poll=poll, release=release)

    async def write_slot_async(
        self,
        local: PreppedDescs,
        local_index: int,
        remote: PreppedDescs,
        remote_index: int,
        notif: bytes,
        *,
        post_in_thread: bool | None = None,
        poll: float = 0.001,
    ) -> None:
        """WRITE ``local[local_index]`` into ``remote[remote_index]`` with ``notif``, posted and
        waited for as :meth:`write_prepped_async` does, through a transfer handle kept for that
        pair of descriptors: the first write makes it, later ones repost it with their own
        notification (no ``make_prepped_xfer``, no release per write). A bounce path writes
        slot ``i`` into slot ``j`` again and again, so few handles serve every chunk.

        A handle is taken out of the cache while its write is in flight (a concurrent write
        of the same pair makes its own), put back once NIXL confirmed it, and released like
        any handle when the write fails or is cancelled (cancelling it, if still in flight:
        no write runs on after this returns or raises). The last :data:`SLOT_WRITES_KEPT` per
        remote agent are kept; :meth:`remove_remote` releases a remote agent's, :meth:`close`
        all of them; a handle whose list was released is made anew."""
        self._check_open()
        key = (local, local_index, remote, remote_index)
        handles = self._slot_writes.get(remote.agent)
        if handles is None:
            handles = self._slot_writes[remote.agent] = OrderedDict()
        handle = handles.pop(key, None)
        if handle is not None and (local.released or remote.released):
            self._release_quietly(handle)
            handle = None
        if handle is None:
            handle = self.write_prepped(local, [local_index], remote, [remote_index], notif, post=False)
            repost: bytes | None = None
        else:
            repost = notif
        if post_in_thread is None:
            post_in_thread = local.mem == "DRAM"
        await self._post_and_wait(handle, post_in_thread, poll, repost, release=False)
        if self._closed or self._slot_writes.get(remote.agent) is not handles:
            self.release(handle)  # the agent closed, or the remote went away, meanwhile
            return
        displaced = handles.pop(key, None)
        handles[key] = handle
        if displaced is not None:
            self._release_quietly(displaced)
        while len(handles) > SLOT_WRITES_KEPT:
            _, old = handles.popitem(last=False)
            self._release_quietly(old)

    def slot_writes_held(self, remote_agent: str) -> int:
        """How many :meth:`write_slot_async` handles are kept for ``remote_agent``."""
        return len(self._slot_writes.get(remote_agent, {}))

    def _release_slot_writes(self, remote_agent: str) -> None:
        for handle in self._slot_writes.pop(remote_agent, {}).values():
            self._release_quietly(handle)

    def prep_local(self, descs: Descs, *, mem: MemType = "DRAM", device: int = -1) -> PreppedDescs:
        """Prepare local descriptors once for many :meth:`write_prepped` calls."""
        self._check_open()
        arr = _desc_array(descs, device)
        try:
            h = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", arr, mem)
        except Exception as exc:
            raise _nixl_error(
                f"prepare {arr.shape[0]} local descriptors", exc, self._create_hint(self.name)
            ) from exc
        return PreppedDescs("", arr[:, 1].copy(), mem, h)

    def prep_remote(
        self, remote_agent: str, descs: Descs, *, mem: MemType = "DRAM", device: int = -1
    ) -> PreppedDescs:
        """Prepare descriptors of ``remote_agent``'s memory once (e.g. its bounce chunk slots)."""
        self._check_open()
        arr = _desc_array(descs, device)
        try:
            h = self._agent.prep_xfer_dlist(remote_agent, arr, mem)
        except Exception as exc:
            hint = self._create_hint(remote_agent) if type(exc).__name__ == "nixlNotFoundError" else ""
            raise _nixl_error(
                f"prepare {arr.shape[0]} descriptors of agent {remote_agent!r}", exc, hint
            ) from exc
        return PreppedDescs(remote_agent, arr[:, 1].copy(), mem, h)

    def write_prepped(
        self,
        local: PreppedDescs,
        local_indices: Sequence[int] | npt.NDArray[np.integer[Any]],
        remote: PreppedDescs,
        remote_indices: Sequence[int] | npt.NDArray[np.integer[Any]],
        notif: bytes = b"",
        *,
        post: bool = True,
    ) -> XferHandle:
        """WRITE ``local[local_indices[i]]`` into ``remote[remote_indices[i]]`` (posted unless ``post=False``)."""
        self._check_open()
        if local.agent or not remote.agent:
            raise BadRequest("write_prepped takes a prep_local list then a prep_remote list")
        li: Any
        ri: Any
        if (
            not isinstance(local_indices, np.ndarray)
            and not isinstance(remote_indices, np.ndarray)
            and 0 < len(local_indices) == len(remote_indices) <= _SMALL_LIST
        ):
            # a few indices (a bounce chunk: one): Python lists, ~8 µs cheaper than numpy here
            li, ri = [int(i) for i in local_indices], [int(i) for i in remote_indices]
            count = len(li)
            nl, nr = len(local), len(remote)
            if any(not 0 <= i < nl for i in li) or any(not 0 <= i < nr for i in ri):
                raise BadRequest(f"descriptor index out of range ({nl} local, {nr} remote)")
            lens = [int(local.lengths[i]) for i in li]
            if lens != [int(remote.lengths[i]) for i in ri]:
                raise BadRequest("local and remote descriptors must have equal lengths, pairwise")
            nbytes = sum(lens)
        else:
            li = np.asarray(local_indices, dtype=np.int32)
            ri = np.asarray(remote_indices, dtype=np.int32)
            if li.shape != ri.shape or li.ndim != 1 or li.size == 0:
                raise BadRequest(
                    f"index lists must be 1-D, non-empty and of equal length ({li.shape} vs {ri.shape})"
                )
            try:
                lens_np = local.lengths[li]
                if not np.array_equal(lens_np, remote.lengths[ri]):
                    raise BadRequest("local and remote descriptors must have equal lengths, pairwise")
            except IndexError:
                raise BadRequest(
                    f"descriptor index out of range ({len(local)} local, {len(remote)} remote)"
                ) from None
            count, nbytes = int(li.size), int(lens_np.sum())
        try:
            h = self._agent.make_prepped_xfer("WRITE", local._handle, li, remote._handle, ri, notif)
        except Exception as exc:
            op = f"create WRITE of {nbytes} bytes in {count} prepared descriptors to agent {remote.agent!r}"
            raise _nixl_error(op, exc) from exc
        handle = XferHandle(remote.agent, nbytes, count, bytes(notif), h)
        if post:
            self.post(handle)
        return handle

    def release_prepped(self, prepped: PreppedDescs) -> None:
        """Free a prepared descriptor list (idempotent), and the write handles
        :meth:`write_slot_async` kept that were made from it."""
        if prepped.released:
            return
        prepped.released = True
        for handles in self._slot_writes.values():
            for key in [k for k in handles if k[0] is prepped or k[2] is prepped]:
                self._release_quietly(handles.pop(key))
        handle, prepped._handle = prepped._handle, None
        if self._closed:
            return
        try:
            handle.release()
        except Exception as exc:
            raise _nixl_error("release prepared descriptor list", exc) from exc

    def slot_descs(
        self,
        remote_agent: str,
        addr: int,
        slot_bytes: int,
        slots: int,
        nbytes: int,
        *,
        mem: MemType = "DRAM",
        device: int = -1,
    ) -> PreppedDescs:
        """The prepared descriptor list ``[addr + i * slot_bytes, + nbytes)`` for ``i`` in
        ``range(slots)``: the slots of a staging region, of this agent (``remote_agent=""``)
        or of ``remote_agent``, for writes of ``nbytes`` (descriptor ``i`` is slot ``i``).

        Prepared on first use and kept (the last :data:`SLOT_DESCS_KEPT` lengths per agent;
        the oldest is released beyond that), so a write is one ``make_prepped_xfer`` and a
        post. :meth:`remove_remote` releases a remote agent's lists (a link that went away),
        :meth:`close` all of them. A write made from a list may outlive the list: NIXL copies
        the picked descriptors into the transfer."""
        if not 0 < nbytes <= slot_bytes or slots < 1:
            raise BadRequest(f"slot descriptors need 0 < nbytes <= slot_bytes and slots >= 1 "
                             f"(nbytes={nbytes}, slot_bytes={slot_bytes}, slots={slots})")
        key = (addr, slot_bytes, slots, nbytes, mem, device)
        lists = self._slot_descs.setdefault(remote_agent, OrderedDict())
        found = lists.get(key)
        if found is not None and not found.released:
            lists.move_to_end(key)
            return found
        base = np.arange(slots, dtype=np.uint64) * np.uint64(slot_bytes) + np.uint64(addr)
        descs = np.stack([base, np.full(slots, nbytes, dtype=np.uint64)], axis=1)
        if remote_agent:
            prepped = self.prep_remote(remote_agent, descs, mem=mem, device=device)
        else:
            prepped = self.prep_local(descs, mem=mem, device=device)
        lists[key] = prepped
        while len(lists) > SLOT_DESCS_KEPT:
            _, old = lists.popitem(last=False)
            with suppress(NixlError):
                self.release_prepped(old)
        return prepped

    def slot_descs_held(self, remote_agent: str) -> int:
        """How many :meth:`slot_descs` lists are held for ``remote_agent`` ("" = local)."""
        return sum(not p.released for p in self._slot_descs.get(remote_agent, {}).values())

    def _release_slot_descs(self, remote_agent: str) -> None:
        for prepped in self._slot_descs.pop(remote_agent, {}).values():
            with suppress(NixlError):
                self.release_prepped(prepped)

    def state(self, handle: XferHandle) -> XferState:
        """The transfer's state, "DONE" or "PROC"; NIXL's "ERR" (or an exception) raises :class:`NixlError`."""
        self._check_open()
        if handle.done:
            return "DONE"
        if handle.released:
            raise NixlError(f"state of {handle.describe()}: the handle was released")
        try:
            state = self._agent.check_xfer_state(handle._handle)
        except Exception as exc:
            self._note_failure(handle.remote_agent, exc)
            raise _nixl_error(f"{handle.describe()}", exc) from exc
        if state == "DONE":
            handle.done = True
            return "DONE"
        if state == "PROC":
            return "PROC"
        self._note_failure(handle.remote_agent)
        raise NixlError(f"{handle.describe()} failed: NIXL reported {state}")

    def release(self, handle: XferHandle) -> None:
        """Free a handle. Releasing one still in flight cancels it (see the module docstring);
        if the backend cannot cancel, :class:`NixlError` is raised and the handle stays."""
        if handle.released:
            return
        if self._closed:  # freed with the agent
            handle.released, handle._handle = True, None
            return
        try:
            handle._handle.release()
        except Exception as exc:
            if handle not in self._unreleased:
                self._unreleased.append(handle)  # keep it alive: NIXL's __del__ would log an error
            raise _nixl_error(
                f"release {handle.describe()}", exc, "still in flight and not cancellable"
            ) from exc
        handle.released = True
        handle._handle = None  # drop NIXL's handle: it holds a reference to the C++ agent
        if handle in self._unreleased:
            self._unreleased.remove(handle)

    def _progress_quietly(self, rounds: int = 1) -> None:
        """Drive UCX a little, ignoring errors. After a failure against a dead remote, UCX
        must progress once before the agent is destroyed, or its destructor aborts the process
        (``arbiter.c: Assertion `ucs_arbiter_group_is_empty(group)' failed``)."""
        for _ in range(rounds):
            try:
                self._agent.get_new_notifs()
            except Exception:
                return

    def _release_quietly(self, handle: XferHandle) -> None:
        with suppress(NixlError):
            self.release(handle)

    async def wait(
        self, handle: XferHandle, *, poll: float = 0.001, spin: float = 0.002, release: bool = True
    ) -> None:
        """Wait for a posted transfer without blocking the event loop.

        Checks the state, then yields with ``trio.sleep(0)`` (≈4 µs a round) for ``spin``
        seconds, then sleeps with a doubling interval capped at ``poll`` (trio's sleeps are
        ms-granular under epoll: anything between 0 and 1 ms takes ≈1.1 ms). The caller's
        deadline/cancel scope applies.
        On success the handle is released (unless ``release=False``); on failure or cancellation
        it is released too — cancelling a transfer still in flight (see the module docstring).
        """
        t0 = time.monotonic()
        interval = 5e-5
        try:
            while self.state(handle) == "PROC":
                if time.monotonic() - t0 < spin:
                    await trio.sleep(0)
                else:
                    await trio.sleep(interval)
                    interval = min(poll, interval * 2)
        except BaseException:
            await self._abort(handle)
            raise
        if release:
            self.release(handle)

    async def _abort(self, handle: XferHandle, timeout: float = 5.0) -> None:
        """Release a failed or cancelled transfer; wait (shielded, bounded) if NIXL can't cancel."""
        with trio.CancelScope(shield=True):
            try:
                self.release(handle)
                return
            except NixlError:
                pass
            with trio.move_on_after(timeout):
                while True:
                    try:
                        if self.state(handle) == "DONE":
                            break
                    except NixlError:
                        break
                    await trio.sleep(0.001)
            try:
                self.release(handle)
            except NixlError as exc:
                log.warning("nixl.xfer_leaked", agent=self.name, xfer=handle.describe(), error=str(exc))

    # -- notifications ------------------------------------------------------------------------
    def notifications(self) -> dict[str, list[bytes]]:
        """New notifications since the last call, by remote agent name (also drives UCX progress)."""
        self._check_open()
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as exc:
            raise _nixl_error("get notifications", exc) from exc
        return cast(dict[str, list[bytes]], notifs)

    def send_notif(self, remote_agent: str, msg: bytes) -> None:
        """Send a standalone notification (delivered by a later progress call of this agent)."""
        self._check_open()
        try:
            self._agent.send_notif(remote_agent, msg)
        except Exception as exc:
            self._note_failure(remote_agent, exc)
            hint = self._create_hint(remote_agent) if type(exc).__name__ == "nixlNotFoundError" else ""
            raise _nixl_error(f"send notification to agent {remote_agent!r}", exc, hint) from exc

    # -- lifetime -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise NixlError(f"NIXL agent {self.name!r} is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release leftover handles, forget remotes, deregister memory, free the agent.

        Best effort and idempotent; every later call raises :class:`NixlError`. Notifications
        not yet drained are dropped. An ``atexit`` hook closes agents still open.
        """
        if self._closed:
            return
        self._progress_quietly(10)
        for h in list(self._unreleased):
            with suppress(NixlError):
                self.release(h)
        for agent in list(self._slot_writes):
            self._release_slot_writes(agent)
        for agent in list(self._slot_descs):
            self._release_slot_descs(agent)
        for name in list(self._remotes):
            with suppress(NixlError):
                self.remove_remote(name)
        for reg in list(self._regs):
            with suppress(NixlError):
                self.deregister(reg)
        self._closed = True
        self._unreleased.clear()
        _LIVE_AGENTS.discard(self)
        self._agent = None  # the C++ agent (and its UCX worker) is destroyed here

    def __enter__(self) -> NixlAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
