"""The peer link between kvd daemons: shared-secret auth, handshake, framing, heartbeats.

Wire messages live in :mod:`protocol.peer` (sans-IO); this package does the I/O with trio.
"""

from kvd.peer.auth import (
    MIN_SECRET_BYTES,
    check_nonce,
    handshake_mac,
    load_secret,
    new_nonce,
    verify_mac,
)
from kvd.peer.link import (
    DEFAULT_HANDSHAKE_TIMEOUT,
    HandshakeTimeout,
    NodeNameMismatch,
    OwnNodeName,
    PeerConnection,
    PeerVersionMismatch,
    accept_peer,
    connect_peer,
    connect_with_backoff,
    handshake_client,
    handshake_server,
    open_peer,
    run_heartbeats,
)

__all__ = [
    "DEFAULT_HANDSHAKE_TIMEOUT",
    "MIN_SECRET_BYTES",
    "HandshakeTimeout",
    "NodeNameMismatch",
    "OwnNodeName",
    "PeerConnection",
    "PeerVersionMismatch",
    "accept_peer",
    "check_nonce",
    "connect_peer",
    "connect_with_backoff",
    "handshake_client",
    "handshake_mac",
    "handshake_server",
    "load_secret",
    "new_nonce",
    "open_peer",
    "run_heartbeats",
    "verify_mac",
]
