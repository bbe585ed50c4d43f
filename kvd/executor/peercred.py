"""Who is on the other end of a Unix socket (``SO_PEERCRED``), and may they use the daemon.

``SO_PEERCRED`` gives the pid, effective uid and effective gid the peer had when it called
``connect()``, translated into our namespaces by the kernel (a peer in another pid namespace
shows pid 0; an unmapped uid shows the overflow uid 65534). It cannot be forged by the peer.

:class:`AccessPolicy` decides from those credentials. It is built from ``[access]`` in the
configuration (:class:`kvd.config.AccessConfig`):

- root (uid 0) and the daemon's own uid are always allowed;
- both lists empty (the default): members of the daemon's own group are allowed — the peer's
  primary gid is the daemon's gid, or the daemon's gid is among the supplementary groups of
  the peer's uid in the user database (``os.getgrouplist``);
- otherwise exactly the listed uids, and members (primary or supplementary, as above) of the
  listed gids; the daemon's group is then no longer allowed implicitly.

*Operators* — root, the daemon's own uid, and members (primary or supplementary) of
``[access] operator_gids`` — may also use the verbs that change the daemon itself (``drain``)
and the connection slots reserved for them (``[limits] operator_reserve``):
:meth:`AccessPolicy.operator_reason`.

Looking up supplementary groups reads the user database (NSS), which may be slow with LDAP &
co; it only happens when the cheap checks (uid, primary gid) did not already decide. Callers
that must not stall the event loop on NSS can run :meth:`AccessPolicy.check` in
``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import os
import pwd
import socket
import struct
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Protocol

import msgspec

from protocol.errors import PermissionDenied

if TYPE_CHECKING:
    from kvd.config import AccessConfig

__all__ = ["AccessPolicy", "Creds", "peer_credentials", "supplementary_groups"]

_UCRED = struct.Struct("3i")  # struct ucred { pid_t pid; uid_t uid; gid_t gid; }


class _SupportsGetsockopt(Protocol):
    def getsockopt(self, level: int, optname: int, buflen: int, /) -> bytes: ...


class Creds(msgspec.Struct, frozen=True):
    """The peer's credentials at ``connect()`` time."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: _SupportsGetsockopt) -> Creds:
    """``SO_PEERCRED`` of a connected ``AF_UNIX`` socket (stdlib or ``trio.socket``).

    Raises :class:`OSError` when the kernel refuses (not a Unix socket, not connected, ...).
    """
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    # uid_t/gid_t are unsigned; "3i" shows (uid_t)-1, "no credentials", as -1.
    return Creds(pid=pid, uid=uid, gid=gid)


def supplementary_groups(uid: int, gid: int) -> frozenset[int]:
    """Groups of ``uid`` in the user database (``os.getgrouplist``), always including ``gid``.

    A uid with no passwd entry (containers, ``setpriv --reuid``) has only ``gid``.
    """
    try:
        name = pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return frozenset({gid})
    try:
        return frozenset(os.getgrouplist(name, gid)) | {gid}
    except OSError:
        return frozenset({gid})


def _ids(values: Iterable[int]) -> frozenset[int]:
    return frozenset(int(v) for v in values)


class AccessPolicy:
    """Decides whether peer credentials may use the daemon (see the module docstring)."""

    def __init__(
        self,
        allowed_uids: Collection[int] = (),
        allowed_gids: Collection[int] = (),
        daemon_uid: int | None = None,
        daemon_gid: int | None = None,
        *,
        operator_gids: Collection[int] = (),
        group_lookup: Callable[[int, int], Collection[int]] = supplementary_groups,
    ) -> None:
        self.allowed_uids = _ids(allowed_uids)
        self.allowed_gids = _ids(allowed_gids)
        self.operator_gids = _ids(operator_gids)
        self.daemon_uid = os.geteuid() if daemon_uid is None else daemon_uid
        self.daemon_gid = os.getegid() if daemon_gid is None else daemon_gid
        self._group_lookup = group_lookup

    @classmethod
    def from_config(
        cls, access: AccessConfig, *, daemon_uid: int | None = None, daemon_gid: int | None = None
    ) -> AccessPolicy:
        """The policy of ``[access]`` for a daemon running as ``daemon_uid``/``daemon_gid``
        (default: this process's effective ids)."""
        return cls(
            access.allowed_uids, access.allowed_gids, daemon_uid, daemon_gid, operator_gids=access.operator_gids
        )

    @property
    def default_rule(self) -> bool:
        """True when no list is configured: the daemon's own group is allowed."""
        return not self.allowed_uids and not self.allowed_gids

    @property
    def groups(self) -> frozenset[int]:
        """The gids whose members are allowed."""
        return frozenset({self.daemon_gid}) if self.default_rule else self.allowed_gids

    def reason(self, creds: Creds) -> str | None:
        """Why ``creds`` are allowed (a short phrase), or None when they are not."""
        if creds.uid == 0:
            return "root"
        if creds.uid == self.daemon_uid:
            return "daemon uid"
        if creds.uid in self.allowed_uids:
            return "allowed uid"
        groups = self.groups
        if not groups:
            return None
        if creds.gid in groups:
            return "primary group"
        if creds.uid < 0:
            return None
        if groups & frozenset(self._group_lookup(creds.uid, creds.gid)):
            return "supplementary group"
        return None

    def operator_reason(self, creds: Creds) -> str | None:
        """Why ``creds`` are an operator's ("root", "daemon uid", "operator group"), or None."""
        if creds.uid == 0:
            return "root"
        if creds.uid == self.daemon_uid:
            return "daemon uid"
        if not self.operator_gids:
            return None
        if creds.gid in self.operator_gids:
            return "operator group"
        if creds.uid >= 0 and self.operator_gids & frozenset(self._group_lookup(creds.uid, creds.gid)):
            return "operator group"
        return None

    def operator_rule(self) -> str:
        """Who the operators are, in words (for refusals)."""
        groups = f", members of gids {sorted(self.operator_gids)}" if self.operator_gids else ""
        return f"root, uid {self.daemon_uid}{groups} ([access] operator_gids)"

    def allows(self, creds: Creds) -> bool:
        """True when ``creds`` may use the daemon."""
        return self.reason(creds) is not None

    def check(self, creds: Creds) -> None:
        """Return if ``creds`` may use the daemon, else raise :class:`PermissionDenied`."""
        if self.allows(creds):
            return
        if self.default_rule:
            rule = (f"only root, uid {self.daemon_uid} and members of group {self.daemon_gid} may connect; add "
                    f"this user to group {self.daemon_gid} (usermod -aG, effective from its next login), or list "
                    "its uid or gid in [access] allowed_uids / allowed_gids of the daemon's configuration")
        else:
            rule = (
                f"allowed: root, uid {self.daemon_uid}, uids {sorted(self.allowed_uids)}, "
                f"members of gids {sorted(self.allowed_gids)}; list this uid or one of its groups in "
                "[access] allowed_uids / allowed_gids of the daemon's configuration"
            )
        raise PermissionDenied(
            f"peer pid {creds.pid} (uid {creds.uid}, gid {creds.gid}) is not allowed to use this daemon: {rule}"
        )

    def __repr__(self) -> str:
        return (
            f"AccessPolicy(allowed_uids={sorted(self.allowed_uids)}, allowed_gids={sorted(self.allowed_gids)}, "
            f"operator_gids={sorted(self.operator_gids)}, daemon_uid={self.daemon_uid}, daemon_gid={self.daemon_gid})"
        )
