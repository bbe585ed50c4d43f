"""Waits answered in the step that reports their request (kvd.executor.waits), over a real
daemon and raw sockets: timeouts in any order, a reply that cannot be written at once, a
session that ends with waits pending."""

from __future__ import annotations

import select
import threading
from collections.abc import Callable

from clients.blocking import Client
from kvd.demo.launch import DaemonProcess
from protocol import messages as m
from protocol.codec import encode
from protocol.layout import KVLayout
from tests.conftest import host_pool
from tests.hostile import IO_TIMEOUT, Raw, events, wait_until

Factory = Callable[..., DaemonProcess]
ONE = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, tokens_per_block=32, dtype="bfloat16")
#: Ping payloads big enough that a few fill the socket between the daemon and a client that reads nothing.
PAYLOAD = b"x" * (64 << 10)
MAX_PINGS = 256
STUCK_S = 1.0


def _local_daemon(daemon_factory: Factory) -> DaemonProcess:
    return daemon_factory({"pools": [host_pool("ctx0"), host_pool("gen0")]})


def _expect(raw: Raw, rid: str, next_id: int) -> None:
    raw.send(encode(m.Alloc(id=next_id, pool="gen0", count=1)))
    ids = raw.receive()
    assert isinstance(ids, m.Allocated), ids
    raw.send(encode(m.Expect(id=next_id + 1, request_id=rid, pool="gen0", layout=ONE, rank=0,
                             block_ids=ids.block_ids, deadline_s=60)))
    assert isinstance(raw.receive(), m.Registered)


def _publish(d: DaemonProcess, rid: str) -> None:
    with Client(d.socket_path, client="ctx") as ctx:
        ctx.publish(rid, "ctx0", ONE, 0, ctx.alloc("ctx0", 1), peer="kvd")
        assert ctx.wait(rid, timeout_s=30).ok


def test_a_timeout_shorter_than_a_pending_one_expires_first(daemon_factory: Factory) -> None:
    """The session's expiry task sleeps until the earliest deadline: a wait with a shorter
    timeout that comes later moves it (else its error would come after the first wait's 60 s,
    and the read below would fail). The first wait is answered once its request ends."""
    d = _local_daemon(daemon_factory)
    raw = Raw(d.socket_path)
    raw.hello()
    _expect(raw, "long", 10)
    _expect(raw, "short", 20)
    raw.send(encode(m.Wait(id=30, request_id="long", timeout_s=60)))
    raw.send(encode(m.Wait(id=31, request_id="short", timeout_s=0.05)))
    timed_out = raw.error()
    assert (timed_out.id, timed_out.code) == (31, "wait_timeout"), timed_out
    assert "goes on" in timed_out.message
    raw.send(encode(m.Wait(id=32, request_id="long")))  # a second wait on it, without a timeout
    _publish(d, "long")
    answers = {raw.receive(), raw.receive()}
    assert {(a.id, a.ok) for a in answers if isinstance(a, m.Completion)} == {(30, True), (32, True)}, answers
    raw.ping(40)  # nothing else came: no late answer, no second error
    raw.close()


def test_a_reply_behind_a_blocked_write_comes_whole_and_once(daemon_factory: Factory) -> None:
    """The client reads nothing until the daemon is stuck writing its pongs (its send lock
    held): the completion reported meanwhile cannot be written at once; it comes after the
    pong being written, whole, exactly once, and every pong comes."""
    d = _local_daemon(daemon_factory)
    raw = Raw(d.socket_path)
    raw.hello()
    _expect(raw, "blocked", 10)
    raw.send(encode(m.Wait(id=20, request_id="blocked", timeout_s=60)))
    sent: list[int] = []
    rest = b""  # what the socket has not taken of the last ping
    raw.sock.setblocking(False)
    while len(sent) < MAX_PINGS:
        if not rest:
            sent.append(100 + len(sent))
            rest = encode(m.Ping(id=sent[-1], payload=PAYLOAD))
        try:
            rest = rest[raw.sock.send(rest):]
        except BlockingIOError:
            # the daemon stopped reading: it is stuck on a pong we do not read (one that was
            # only slow reads again within STUCK_S; then this test runs the direct write path)
            if not select.select([], [raw.sock], [], STUCK_S)[1]:
                break
    raw.sock.settimeout(IO_TIMEOUT)
    assert len(sent) >= 2, "the socket took every ping: nothing blocked"
    _publish(d, "blocked")  # reported while the gen session's write is stuck
    finished = threading.Event()

    def send_rest() -> None:
        raw.sock.sendall(rest)
        finished.set()

    writer = threading.Thread(target=send_rest)
    writer.start()
    pongs: list[int] = []
    completions: list[m.Completion] = []
    while len(pongs) < len(sent) or not completions:
        reply = raw.receive()
        if isinstance(reply, m.Pong):
            assert reply.payload == PAYLOAD
            pongs.append(reply.id)
        else:
            assert isinstance(reply, m.Completion), reply
            completions.append(reply)
    writer.join(15)
    assert finished.is_set()
    assert pongs == sent  # in order, none lost or cut
    assert [(c.id, c.ok) for c in completions] == [(20, True)]
    raw.ping(30)  # the very next frame is the ping's reply: no second completion
    raw.close()


def test_a_session_that_ends_with_waits_pending_leaves_the_daemon_serving(daemon_factory: Factory) -> None:
    """An executor that hangs up while its waits (timed and not) are pending: they end with
    it, unanswered; its side fails once, and nothing is written for it afterwards (no
    waiter failure, no crash); the daemon serves the next session."""
    d = _local_daemon(daemon_factory)
    raw = Raw(d.socket_path)
    raw.hello()
    _expect(raw, "orphan", 10)
    raw.send(encode(m.Wait(id=20, request_id="orphan", timeout_s=0.2)))
    raw.send(encode(m.Wait(id=21, request_id="orphan")))
    raw.ping(22)  # both waits are in
    raw.close()
    with Client(d.socket_path, client="after") as c:
        assert c.ping(b"up") == b"up"
        wait_until(lambda: c.stats().sessions == 1, "the raw session's end (its leases returned)")
        wait_until(lambda: c.stats().transfers_active == 0, "its failed transfer's end")
        assert c.stats().transfers_failed == 1
    failed = events(d, "transfer.failed")
    assert [(e["request_id"], e["role"]) for e in failed] == [("orphan", "gen")], failed
    for bad in ("session.crashed", "transfer.waiter_failed", "transfer.internal_error"):
        assert not events(d, bad), events(d, bad)
