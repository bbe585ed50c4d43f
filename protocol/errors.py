"""The one error hierarchy of kvd.

Every error that can cross the wire is a subclass of :class:`KvdError` with a stable
``code`` string. The daemon sends ``Error(code=..., message=...)``; the client looks the
code up with :func:`error_from_code` and raises the *same* class, so executor code can
``except OutOfBlocks`` whether the failure happened locally or in the daemon.

Codes never change meaning once released; new errors get new codes.
"""

from __future__ import annotations

from typing import ClassVar


class KvdError(Exception):
    """Base of every kvd error. ``code`` is stable and travels over the wire."""

    code: ClassVar[str] = "internal"

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}" if self.message else f"[{self.code}]"


class InternalError(KvdError):
    """A bug or an unexpected condition in the daemon; the message says what."""

    code = "internal"


# --- protocol and connection -------------------------------------------------------------


class ProtocolError(KvdError):
    """The other side sent bytes that are not a valid kvd message."""

    code = "protocol"


class FrameTooLarge(ProtocolError):
    """A length prefix announced a frame larger than the configured maximum."""

    code = "frame_too_large"


class VersionMismatch(KvdError):
    """Client and daemon speak incompatible protocol versions."""

    code = "version_mismatch"


class HandshakeRequired(ProtocolError):
    """A request arrived before the Hello/Welcome handshake."""

    code = "handshake_required"


class BadRequest(KvdError):
    """A well-formed message whose content is invalid (unknown pool, negative count, ...)."""

    code = "bad_request"


class ConnectionClosed(KvdError):
    """The connection was closed (by us, or broken by the other side; see ``by_peer``)."""

    code = "connection_closed"

    def __init__(self, message: str = "", *, by_peer: bool = True) -> None:
        super().__init__(message)
        self.by_peer = by_peer


class PermissionDenied(KvdError):
    """The caller's credentials (SO_PEERCRED uid/gid, peer secret) are not allowed."""

    code = "permission_denied"


class AuthFailed(PermissionDenied):
    """A peer daemon failed the shared-secret challenge."""

    code = "auth_failed"


class LimitExceeded(KvdError):
    """A configured limit (sessions, in-flight requests, blocks per session) was hit."""

    code = "limit_exceeded"


class ReplyTooLarge(LimitExceeded):
    """The reply to this request would not fit in one frame; page it (``offset``/``limit``)."""

    code = "reply_too_large"


class Draining(KvdError):
    """The daemon is shutting down and takes no new work."""

    code = "draining"


class NotFound(KvdError):
    """The named object (pool, request, peer) does not exist."""

    code = "not_found"


# --- pool and blocks ---------------------------------------------------------------------


class PoolError(KvdError):
    """Pool memory could not be created, exported or mapped."""

    code = "pool_error"


class FabricUnavailable(PoolError):
    """Fabric memory was required but the probe failed (``require_fabric``)."""

    code = "fabric_unavailable"


class OutOfBlocks(KvdError):
    """The pool has fewer free blocks than asked for; nothing was allocated."""

    code = "out_of_blocks"


class BlockNotLeased(KvdError):
    """A block id is not leased to this session (double free, foreign or unknown id)."""

    code = "block_not_leased"


class BlocksInUse(KvdError):
    """The blocks belong to a registered request that has not finished; nothing was freed."""

    code = "blocks_in_use"


# --- layouts and transfers ---------------------------------------------------------------


class IncompatibleLayout(KvdError):
    """The ctx and gen layouts cannot be regrouped into each other."""

    code = "incompatible_layout"


class TransferError(KvdError):
    """A transfer failed; the message names the stage and cause."""

    code = "transfer_failed"


class TransferTimeout(TransferError):
    """A transfer did not finish before its deadline."""

    code = "transfer_timeout"


class TransferCancelled(TransferError):
    """A transfer was cancelled by request id."""

    code = "transfer_cancelled"


class PeerUnavailable(TransferError):
    """The peer daemon is unknown, unreachable, or went away, or the link to it cannot
    authenticate (the two daemons read different secrets: the message says so)."""

    code = "peer_unavailable"


class UnknownPeer(PeerUnavailable):
    """A request names a peer daemon that is neither configured nor connected."""

    code = "unknown_peer"


class DaemonStopping(TransferError):
    """The daemon is stopping (SIGTERM, drain) and the request could not finish: its other side
    never came, or ``drain_timeout_s`` passed first. Register it again with a running daemon."""

    code = "daemon_stopping"


class WaitTimeout(KvdError):
    """``wait(timeout_s)`` expired; the transfer itself goes on (wait again, or cancel it)."""

    code = "wait_timeout"


class RemoteProtocolError(ProtocolError):
    """The peer daemon broke the transfer protocol (a message it may not send in its state)."""

    code = "remote_protocol_error"


class LocalProtocolError(InternalError):
    """This daemon fed its own transfer state machine an event its state does not allow (a bug)."""

    code = "local_protocol_error"


class NixlError(TransferError):
    """NIXL/UCX reported an error; the message carries its text."""

    code = "nixl_error"


class DuplicateRequest(KvdError):
    """A request id is already registered on this side."""

    code = "duplicate_request"


def _all_subclasses(cls: type[KvdError]) -> list[type[KvdError]]:
    out: list[type[KvdError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


ERRORS_BY_CODE: dict[str, type[KvdError]] = {KvdError.code: InternalError}
for _cls in _all_subclasses(KvdError):
    if _cls.code in ERRORS_BY_CODE and ERRORS_BY_CODE[_cls.code] is not _cls:
        raise RuntimeError(f"duplicate kvd error code {_cls.code!r}")  # pragma: no cover
    ERRORS_BY_CODE[_cls.code] = _cls


def error_from_code(code: str, message: str) -> KvdError:
    """Build the exception for a wire ``Error`` reply; unknown codes become :class:`KvdError`."""
    cls = ERRORS_BY_CODE.get(code)
    if cls is None:
        err = KvdError(f"{message} (unknown error code {code!r})")
        return err
    if cls is ConnectionClosed:
        return ConnectionClosed(message, by_peer=True)
    return cls(message)
