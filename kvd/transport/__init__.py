"""Data-plane transports: a typed, trio-friendly NIXL (UCX) agent and its raw benchmark.

See :mod:`kvd.transport.nixl_agent` for what NIXL needs (polling, threads, cancellation).
"""

from kvd.transport.nixl_agent import (
    Descs,
    MemType,
    NixlAgent,
    PreppedDescs,
    RegHandle,
    Region,
    SyncMode,
    XferHandle,
    XferState,
    ensure_loopback_ucx,
    load_nixl,
)
from kvd.transport.poller import poll_notifications

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
    "poll_notifications",
]
