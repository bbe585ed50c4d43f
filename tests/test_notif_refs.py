"""NIXL notifications name the receiver's number for the request (``ref``), and stay readable
by and from daemons that predate it (the field is last, with a default)."""

from __future__ import annotations

import msgspec

from protocol import transfer as x


class _OldNotif(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    seq: int
    slot: int


class _OldCredit(msgspec.Struct, frozen=True, array_like=True, tag="credit"):
    request_id: str
    slots: list[int]


def test_a_write_notification_carries_the_receivers_number() -> None:
    wire = x.encode_notif(x.Notif("r1", 3, 7, 41))
    assert x.decode_notif(wire) == x.Notif("r1", 3, 7, 41)
    # an older daemon reads the new notification (the extra field ignored) ...
    assert msgspec.msgpack.decode(wire, type=_OldNotif) == _OldNotif("r1", 3, 7)
    # ... and its own, without a number, reads as "not known" (0: matched by id alone)
    assert x.decode_notif(msgspec.msgpack.encode(_OldNotif("r1", 3, 7))) == x.Notif("r1", 3, 7, 0)


def test_a_credit_carries_the_senders_number_and_is_never_taken_for_a_write() -> None:
    wire = x.encode_notif(x.Credit("r1", [0, 5], 9))
    assert x.decode_notif(wire) == x.Credit("r1", [0, 5], 9)
    assert msgspec.msgpack.decode(wire, type=_OldCredit) == _OldCredit("r1", [0, 5])
    assert x.decode_notif(msgspec.msgpack.encode(_OldCredit("r1", [0, 5]))) == x.Credit("r1", [0, 5], 0)
    # a write notification whose id is "credit" is still a write's
    assert isinstance(x.decode_notif(x.encode_notif(x.Notif("credit", 1, 2, 3))), x.Notif)


def test_numbers_out_of_range_are_not_notifications() -> None:
    assert x.decode_notif(msgspec.msgpack.encode(["r1", 1, 2, -1])) is None
    assert x.decode_notif(msgspec.msgpack.encode(["credit", "r1", [1], 1 << 63])) is None
