"""Peer authentication: the shared secret file and the handshake MACs (pure functions).

Both daemons hold the same secret (``peer_secret_file``: at least 16 bytes, e.g.
``(umask 077 && head -c 32 /dev/urandom > secret)``). The handshake is a mutual
challenge-response: each side sends a fresh random nonce, and each proves it knows the secret
with ``HMAC-SHA256(secret, transcript)`` where the transcript binds the protocol version, both
node names, both nonces and the prover's *role* (so a MAC can be neither replayed on another
connection nor reflected back at its sender). The secret never crosses the wire; MACs are
compared with :func:`hmac.compare_digest`.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import pwd
import secrets
import stat
import struct
from pathlib import Path
from typing import Literal

from protocol.errors import AuthFailed, BadRequest, PermissionDenied
from protocol.peer import MAX_NONCE_BYTES, MIN_NONCE_BYTES

__all__ = [
    "MIN_SECRET_BYTES",
    "NONCE_BYTES",
    "Role",
    "check_nonce",
    "handshake_mac",
    "load_secret",
    "new_nonce",
    "verify_mac",
]

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
NONCE_BYTES = 32
_DOMAIN = b"kvd-peer-auth-v1"

Role = Literal["client", "server"]


def _this_user() -> str:
    """``user kvd (uid 998)``, or the uid alone where it has no name."""
    uid = os.geteuid()
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """Read the shared secret; refuse a file others could read or that is not ours.

    Raises :class:`BadRequest` when the file is missing, not a regular file, empty or too
    short, and :class:`PermissionDenied` when its mode gives the group or others any access
    or when another user owns it. Surrounding whitespace (a trailing newline) is stripped.
    """
    p = Path(path)
    if not str(path):
        raise BadRequest("no peer secret file configured (peer_secret_file)")
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        # A relative peer_secret_file is opened from the daemon's working directory, not from the
        # configuration file's: say which file that was, or "does not exist" reads as a lie.
        where = "" if p.is_absolute() else f" (relative to the working directory: {Path.cwd() / p})"
        raise BadRequest(
            f"peer secret file {p}{where} does not exist; create it, owner-only from the start, with "
            f"`(umask 077 && openssl rand -hex 32 > {p})` and give every node the same file (mode 600), "
            "or remove peer_secret_file and [[peers]] to serve local transfers only"
        ) from None
    except OSError as exc:
        if exc.errno is not None and exc.errno == getattr(os, "ELOOP", -1):
            raise PermissionDenied(
                f"peer secret file {p} is a symbolic link; point the config at the file"
            ) from None
        if exc.errno == errno.EACCES:
            # the usual cause: created as root (the README's step) without the chown to kvd
            raise PermissionDenied(
                f"cannot open peer secret file {p}: {exc.strerror}; kvd runs as {_this_user()}: the file must be "
                f"that user's, mode 600 (for the systemd unit: chown kvd:kvd {p}), and its directories "
                "must let that user through"
            ) from None
        raise PermissionDenied(f"cannot open peer secret file {p}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadRequest(f"peer secret file {p} is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise PermissionDenied(
                f"peer secret file {p} has mode {mode:04o}: group/others may access it; "
                f"make it readable by its owner only (chmod 600 {p})"
            )
        if st.st_uid != os.geteuid():
            raise PermissionDenied(
                f"peer secret file {p} is owned by uid {st.st_uid}, not by this daemon's uid {os.geteuid()}; "
                f"chown it to the user kvd runs as"
            )
        data = os.read(fd, MAX_SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET_BYTES:
        raise BadRequest(f"peer secret file {p} is larger than {MAX_SECRET_BYTES} bytes")
    secret = data.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise BadRequest(
            f"peer secret in {p} is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed "
            f"(e.g. head -c 32 /dev/urandom | base64 > {p})"
        )
    return secret


def new_nonce() -> bytes:
    """A fresh random handshake nonce."""
    return secrets.token_bytes(NONCE_BYTES)


def check_nonce(nonce: bytes, *, other: bytes | None = None) -> None:
    """Refuse nonces of the wrong size, or one equal to ours (a reflected handshake)."""
    if not MIN_NONCE_BYTES <= len(nonce) <= MAX_NONCE_BYTES:
        raise AuthFailed(
            f"handshake nonce of {len(nonce)} bytes (expected {MIN_NONCE_BYTES}..{MAX_NONCE_BYTES})"
        )
    if other is not None and hmac.compare_digest(nonce, other):
        raise AuthFailed("the peer echoed our own nonce")


def _field(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def handshake_mac(
    secret: bytes,
    role: Role,
    *,
    version: int,
    client_node: str,
    server_node: str,
    client_nonce: bytes,
    server_nonce: bytes,
) -> bytes:
    """The MAC with which ``role`` proves it knows ``secret`` on this very handshake."""
    if role not in ("client", "server"):
        raise ValueError(f"role must be 'client' or 'server', not {role!r}")
    transcript = b"".join(
        _field(x)
        for x in (
            _DOMAIN,
            role.encode(),
            str(version).encode(),
            client_node.encode(),
            server_node.encode(),
            client_nonce,
            server_nonce,
        )
    )
    return hmac.new(secret, transcript, hashlib.sha256).digest()


def verify_mac(expected: bytes, received: bytes) -> bool:
    """Constant-time comparison of two MACs."""
    return hmac.compare_digest(expected, received)
