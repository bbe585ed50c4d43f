"""Before its Hello, an executor connection may announce a frame of at most 64 KiB.

A Hello is a few hundred bytes. Without a bound of its own, the first frame of a connection
could be as large as ``max_frame_size`` (16 MiB by default), and the daemon buffered what
came of it until ``handshake_timeout_s``: every one of the ``max_pending_connections`` (256)
connections that had not said Hello could hold 16 MiB of the daemon's memory, 4 GiB in all,
before any of them became a session. Now a first frame announced above
:data:`~protocol.limits.MAX_HELLO_FRAME` is refused as soon as its length arrives, as the
peer port does before a peer authenticated; frames after the Hello keep the usual limit, even
when they arrive in the same read as the Hello.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from kvd.demo.launch import DaemonProcess
from protocol import messages as m
from protocol.codec import encode
from protocol.framing import HEADER
from protocol.limits import MAX_HELLO_FRAME
from tests.hostile import Baseline, Raw

Factory = Callable[..., DaemonProcess]


def test_a_first_frame_above_the_hello_limit_is_refused_at_once(daemon_factory: Factory) -> None:
    # a handshake timeout far above the reads' timeout: an answer can only be the refusal
    d = daemon_factory({"limits": {"handshake_timeout_s": 300}})
    base = Baseline.take(d)
    raw = Raw(d.socket_path)
    raw.send(HEADER.pack(MAX_HELLO_FRAME + 1))  # the length alone, nothing of the frame
    err = raw.error()
    assert (err.id, err.code) == (0, "frame_too_large"), err
    assert str(MAX_HELLO_FRAME) in err.message
    assert raw.receive() is None  # then the daemon hangs up
    raw.close()
    assert [r["event"] for r in base.new_warnings()] == ["session.frame_too_large"]
    base.check()


def test_a_hello_at_the_limit_and_large_frames_after_it_are_served(daemon_factory: Factory) -> None:
    d = daemon_factory()
    base = Baseline.take(d)
    raw = Raw(d.socket_path)
    hello = msgspec.msgpack.encode(m.Hello(id=1, version=m.PROTOCOL_VERSION, client="big"))
    # pad the Hello with an unknown field (ignored) to exactly the limit
    pad = MAX_HELLO_FRAME - len(hello) - len(msgspec.msgpack.encode("pad")) - 3  # 3: a bin16 header
    body = bytes([hello[0] + 1]) + hello[1:] + msgspec.msgpack.encode("pad") + msgspec.msgpack.encode(b"p" * pad)
    assert len(body) == MAX_HELLO_FRAME
    ping = m.Ping(id=2, payload=b"x" * (4 * MAX_HELLO_FRAME))  # far above the Hello's limit
    raw.send(HEADER.pack(len(body)) + body + encode(ping))  # one write: both in one read
    assert isinstance(raw.receive(), m.Welcome)
    assert raw.receive() == m.Pong(id=2, payload=ping.payload)
    raw.close()
    assert base.new_warnings() == []
    base.check()
