"""Landed events where they cannot work (no CUDA driver on this machine, a handle the driver
refuses), and the path message's field: each case falls back to the data-done message."""

from __future__ import annotations

import msgspec
import pytest

from kvd.regroup import landed
from protocol import transfer as x
from protocol.peer import decode_peer, encode_peer_payload, register_peer_messages

register_peer_messages(*x.XFER_MESSAGES)  # as the daemon's peer links do


def test_a_handle_that_cannot_be_opened_is_remembered_as_refused(capfd: pytest.CaptureFixture[str]) -> None:
    """No driver here (or a handle it refuses): ``open_event`` says None, logs why once, and
    ``opened`` answers from memory afterwards (gen completes such requests on XferDone)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a driver is present: the refusal of a bogus handle is the GPU tests' case")
    handle = bytes(range(64))
    assert landed.opened("ctx-a", handle) == (False, None)
    assert landed.open_event("ctx-a", handle, 0) is None
    assert landed.opened("ctx-a", handle) == (True, None)
    assert landed.open_event("ctx-a", handle, 0) is None  # asked again: from memory, no second line
    err = capfd.readouterr()
    assert (err.out + err.err).count("regroup.landed_event_refused") == 1
    # the same bytes from another instance of the peer (a restarted daemon) are another event
    assert landed.opened("ctx-b", handle) == (False, None)


def test_a_device_without_landed_events_records_none(capfd: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a driver is present: the GPU tests make real rings")
    assert landed.prepare(7) is None
    assert landed.prepared(7)
    assert landed.record(7, 0) is None
    assert landed.prepare(7) is None  # remembered: logged once
    err = capfd.readouterr()
    assert (err.out + err.err).count("regroup.landed_events_unavailable") == 1


def test_the_path_message_carries_a_landed_event_of_exactly_one_handle() -> None:
    ev = x.LandedEvent(device=0, slot=3, handle=b"\x01" * 64, nbytes=1 << 20, chunks=1)
    msg = x.XferPath(request_id="r1", path="mapped", landed=ev)
    back = decode_peer(encode_peer_payload(msg))
    assert back == msg
    plain = decode_peer(encode_peer_payload(x.XferPath(request_id="r2", path="mapped")))
    assert isinstance(plain, x.XferPath) and plain.landed is None  # what an older daemon sends
    for bad in (b"\x01" * 63, b"\x01" * 65):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"device": 0, "slot": 0, "handle": bad, "nbytes": 1, "chunks": 1}, x.LandedEvent)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"device": 0, "slot": x.MAX_LANDED_SLOTS, "handle": b"\x01" * 64, "nbytes": 1, "chunks": 1},
                        x.LandedEvent)
