"""The completion page: a spinning executor sees its request done in the daemon's shared page
(``kvd.mapping.words``) instead of waiting for the reply, and so does a PollingClient's
get_finished; failures still come as replies; the page executors get is read-only; slots and
tokens are handed out as the daemon promises."""

from __future__ import annotations

import array
import mmap
import os
import select
import socket
import time
from collections.abc import Callable

import numpy as np
import pytest

from clients.blocking import Client
from clients.polling import PollingClient
from kvd.demo.launch import DaemonProcess
from kvd.mapping.words import SLOT_WORDS, WordsView, pack_meta
from kvd.transfer.words import CompletionPage
from protocol import messages as m
from protocol.codec import decode_reply, encode
from protocol.errors import NotFound, PoolError, TransferCancelled
from protocol.framing import FrameBuffer
from protocol.layout import KVLayout
from tests.conftest import host_pool

Factory = Callable[..., DaemonProcess]
GEO = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 32, "dtype": "bfloat16"}
ONE = KVLayout(**GEO)  # type: ignore[arg-type]


def _local(d_factory: Factory) -> DaemonProcess:
    """ctx and gen pools on one daemon (node "kvd"): the local path."""
    return d_factory({"pools": [host_pool("ctx0"), host_pool("gen0")]})


def test_a_spinning_executor_completes_from_the_page_and_still_collects(daemon_factory: Factory) -> None:
    d = _local(daemon_factory)
    with Client(d.socket_path, client="gen", spin_s=0.05, completion_page=True) as gen, Client(d.socket_path, client="ctx") as ctx:
        g_ids, c_ids = gen.alloc("gen0", 3), ctx.alloc("ctx0", 3)
        gen.expect("r-page", "gen0", ONE, 0, g_ids, deadline_s=60)
        sent = ctx.publish_and_wait("r-page", "ctx0", ONE, 0, c_ids, peer="kvd", deadline_s=60)
        d.logged("transfer.done", 2, request_id="r-page")  # both sides reported: gen's token is in
        assert gen.page_completions == 0
        done = gen.wait("r-page")  # answered by the page: no reply read
        assert gen.page_completions == 1
        assert done.ok and done.request_id == "r-page" and done.path == "local"
        assert done.bytes == sent.bytes > 0 and done.chunks == sent.chunks and done.duration_s > 0
        # the wait it owed goes with the next call (its reply dropped): the request is collected
        assert gen.ping(b"after") == b"after"
        with pytest.raises(NotFound):
            gen.wait("r-page")
        assert gen.free("gen0", g_ids) == 3  # nothing holds the blocks


def test_failures_come_as_replies_and_leave_the_page_alone(daemon_factory: Factory) -> None:
    d = _local(daemon_factory)
    with Client(d.socket_path, client="gen", spin_s=0.05, completion_page=True) as gen:
        ids = gen.alloc("gen0", 2)
        gen.expect("r-cancel", "gen0", ONE, 0, ids, deadline_s=60)
        gen.cancel("r-cancel")
        with pytest.raises(TransferCancelled):
            gen.wait("r-cancel")
        assert gen.page_completions == 0


def test_spinning_waits_and_registrations_sent_with_their_waits_use_the_page_or_the_reply(
        daemon_factory: Factory) -> None:
    """Whatever comes first, page or reply, each request has exactly one outcome and the
    session stays in step (the later reply is dropped)."""
    d = _local(daemon_factory)
    with Client(d.socket_path, client="gen", spin_s=0.2, completion_page=True) as gen, \
            Client(d.socket_path, client="ctx", spin_s=0.2, completion_page=True) as ctx:
        for i in range(40):
            rid = f"r-{i}"
            g_ids, c_ids = gen.alloc("gen0", 1), ctx.alloc("ctx0", 1)
            gen.expect(rid, "gen0", ONE, 0, g_ids, deadline_s=60)
            assert ctx.publish_and_wait(rid, "ctx0", ONE, 0, c_ids, peer="kvd", deadline_s=60).ok
            assert gen.wait(rid).ok
            assert gen.free("gen0", g_ids) == 1 and ctx.free("ctx0", c_ids) == 1
        assert gen.ping(b"x") == b"x" and ctx.ping(b"y") == b"y"
        assert gen.page_completions + ctx.page_completions > 0


def _finished(clients: dict[str, PollingClient], want: int) -> dict[str, dict[str, m.Completion]]:
    """Each client's completions, polled until it returned ``want`` (each request once); between
    polls, until one of their sockets has something to read (a lost completion fails here
    after a generous bound instead of hanging)."""
    got: dict[str, dict[str, m.Completion]] = {name: {} for name in clients}
    end = time.monotonic() + 60
    while True:
        for name, kvd in clients.items():
            for done in kvd.get_finished():
                assert done.request_id not in got[name], f"{name}: {done.request_id} returned twice"
                got[name][done.request_id] = done
        if all(len(g) >= want for g in got.values()):
            return got
        left = end - time.monotonic()
        assert left > 0, {name: len(g) for name, g in got.items()}
        select.select([kvd._sock for kvd in clients.values()], [], [], left)


@pytest.mark.parametrize("page", [True, False], ids=["page", "no-page"])
def test_a_polling_client_returns_each_request_once_from_the_page_and_drops_its_reply(
        daemon_factory: Factory, page: bool) -> None:
    """Rounds of requests up to the session's limit: every one is returned once, from the page
    when the client maps it (before its reply is read), and the daemon answered every watch
    and collected every request: the next round's watches and registrations are not refused.
    (A few watched slots are read one by one, more with one gather: rounds of both.)"""
    rounds = (4, 12, 12)
    d = daemon_factory({"pools": [host_pool("ctx0"), host_pool("gen0")],
                        "limits": {"max_inflight_per_session": max(rounds)}})
    with PollingClient(d.socket_path, client="gen", completion_page=page) as gen, \
            Client(d.socket_path, client="ctx") as ctx:
        returned: set[str] = set()
        for r, per_round in enumerate(rounds):
            rids = [f"r{r}-{i}" for i in range(per_round)]
            g_ids = {rid: gen.alloc("gen0", 1 + i % 2) for i, rid in enumerate(rids)}
            for i, rid in enumerate(rids):
                if i % 2:  # registered by an earlier call, then watched
                    gen.expect(rid, "gen0", ONE, 0, g_ids[rid], deadline_s=60)
                    gen.watch(rid)
                else:
                    gen.expect_and_watch(rid, "gen0", ONE, 0, g_ids[rid], deadline_s=60)
            # the daemon answers in order: once the pong is here, every Registered reply was
            # read, and the client knows each request's slot and token
            assert gen.ping(b"registered") == b"registered"
            assert gen.get_finished() == [] and gen.watching == per_round
            sent = {}
            for rid, ids in g_ids.items():
                c_ids = ctx.alloc("ctx0", len(ids))
                sent[rid] = ctx.publish_and_wait(rid, "ctx0", ONE, 0, c_ids, peer="kvd", deadline_s=60)
                assert sent[rid].ok and ctx.free("ctx0", c_ids) == len(ids)
            # every gen side reported: its token is in the page (stored before its reply was written)
            d.logged("transfer.done", sum(rounds[:r + 1]), role="gen")
            if page:
                got = gen.get_finished()  # all of them, from the page, in one poll
                assert gen.page_completions == sum(rounds[:r + 1])
                assert sorted(c.request_id for c in got) == sorted(rids)
            else:
                got = list(_finished({"gen": gen}, per_round)["gen"].values())
                assert gen.page_completions == 0
            for c in got:
                assert c.ok and c.path == "local" and c.bytes == sent[c.request_id].bytes > 0, c
                assert c.chunks == sent[c.request_id].chunks and c.duration_s > 0
            assert returned.isdisjoint(c.request_id for c in got)
            returned.update(c.request_id for c in got)
            assert gen.watching == 0
            # the replies came too (the daemon answers in order: before the pong) and were
            # dropped: nothing is returned twice
            assert gen.ping(b"after") == b"after"
            assert gen.get_finished() == []
            # the daemon collected each one: a wait finds nothing (an uncollected request would
            # answer with its completion), the session holds no request, its blocks free
            for rid in rids:
                with pytest.raises(NotFound, match="ended here"):
                    gen.wait(rid)
            assert [s.requests for s in gen.sessions() if s.client == "gen"] == [0]
            assert gen.free("gen0", [b for ids in g_ids.values() for b in ids]) == len(
                [b for ids in g_ids.values() for b in ids])
        assert len(returned) == sum(rounds)
        assert gen.get_finished() == [] and gen.ping(b"x") == b"x"


def test_a_polling_client_gets_failures_from_the_replies(daemon_factory: Factory) -> None:
    """Cancelled and expired requests are never in the page: they come from their replies."""
    d = _local(daemon_factory)
    with PollingClient(d.socket_path, client="gen", completion_page=True) as gen:
        ids = gen.alloc("gen0", 3)
        gen.expect_and_watch("f-cancel", "gen0", ONE, 0, ids[:1], deadline_s=60)
        gen.expect_and_watch("f-late", "gen0", ONE, 0, ids[1:2], deadline_s=0.3)  # nobody publishes
        gen.expect("f-cancel-2", "gen0", ONE, 0, ids[2:], deadline_s=60)
        gen.watch("f-cancel-2")
        gen.cancel_nowait("f-cancel")
        gen.cancel("f-cancel-2")
        got = _finished({"gen": gen}, 3)["gen"]
        assert got["f-cancel"].error_code == got["f-cancel-2"].error_code == "transfer_cancelled"
        assert got["f-late"].error_code == "transfer_timeout"
        assert not any(c.ok for c in got.values()) and gen.page_completions == 0
        assert gen.watching == 0 and gen.get_finished() == []
        assert gen.free("gen0", ids) == 3


def test_polling_clients_in_a_step_loop_take_page_or_reply_once_each(daemon_factory: Factory) -> None:
    """ctx and gen both poll, with cancels from either side: whichever comes first, page or
    reply, each request is returned once and the sessions stay in step."""
    d = _local(daemon_factory)
    n = 32
    cancels = {"gen": {3, 11, 20}, "ctx": {7, 15, 28}}
    with PollingClient(d.socket_path, client="gen", completion_page=True) as gen, \
            PollingClient(d.socket_path, client="ctx", completion_page=True) as ctx:
        kvds = {"gen": gen, "ctx": ctx}
        g_ids = gen.alloc("gen0", n)
        c_ids = ctx.alloc("ctx0", n)
        for i in range(n):
            gen.expect_and_watch(f"s-{i}", "gen0", ONE, 0, g_ids[i:i + 1], peer="kvd", deadline_s=60)
            if i in cancels["gen"]:
                gen.cancel_nowait(f"s-{i}")
        for i in range(n):
            ctx.publish_and_watch(f"s-{i}", "ctx0", ONE, 0, c_ids[i:i + 1], "kvd", deadline_s=60)
            if i in cancels["ctx"]:
                ctx.cancel_nowait(f"s-{i}")
        got = _finished(kvds, n)
        cancelled = {f"s-{i}" for i in cancels["gen"] | cancels["ctx"]}
        for name, outcomes in got.items():
            assert set(outcomes) == {f"s-{i}" for i in range(n)}
            for rid, done in outcomes.items():
                assert done.ok or (rid in cancelled and done.error_code == "transfer_cancelled"), (name, done)
        for name, kvd in kvds.items():
            assert kvd.ping(name.encode()) == name.encode()
            assert kvd.get_finished() == [] and kvd.watching == 0
        assert gen.free("gen0", g_ids) == n and ctx.free("ctx0", c_ids) == n


def _attach_words(path: str, writable: bool = False) -> tuple[m.Message, list[int]]:
    """Hello, then AttachWords, on a raw socket: the second reply and the fds that came (a
    Welcome carries none: every fd received is the page's)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    frames = FrameBuffer(1 << 20)
    replies: list[m.Message] = []
    fds: list[int] = []
    try:
        sock.sendall(encode(m.Hello(id=1, version=m.PROTOCOL_VERSION, client="raw"))
                     + encode(m.AttachWords(id=2, writable=writable)))
        while len(replies) < 2:
            data, anc, _f, _a = sock.recvmsg(65536, socket.CMSG_SPACE(16))
            for level, kind, raw in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", raw[: len(raw) - len(raw) % 4]))
            assert data
            replies.extend(decode_reply(payload) for payload in frames.feed(data))
    finally:
        sock.close()
    return replies[1], fds


def test_executors_get_the_page_read_only(daemon_factory: Factory) -> None:
    d = _local(daemon_factory)
    reply, fds = _attach_words(d.socket_path)
    assert isinstance(reply, m.WordsAttached) and reply.slot_words == SLOT_WORDS and len(fds) == 1
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fds[0], reply.slots * SLOT_WORDS * 8, flags=mmap.MAP_SHARED,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
        view = WordsView(fds[0], reply.slots)
        with pytest.raises(ValueError, match="read-only"):
            view.words[0] = 1
        view.close()
    finally:
        for fd in fds:
            os.close(fd)


def test_the_page_allocator_hands_out_slots_in_turn_and_tokens_once() -> None:
    page = CompletionPage(slots=3)
    try:
        got = [page.take() for _ in range(3)]
        assert [s for s, _ in got] == [0, 1, 2]
        assert len({t for _, t in got}) == 3 and all(t for _, t in got)
        assert page.take() == (-1, 0)  # all held: no slot, the socket answers
        page.give_back(1)
        slot, token = page.take()
        assert slot == 1 and token not in {t for _, t in got}
        page.give_back(0)
        page.give_back(2)
        assert page.take()[0] == 0  # first freed, first reused
        # a done slot reads its token and outcome; another token reads nothing
        page.done(slot, token, 4096, "mapped", 3, 0.25)
        assert page.holds(slot, token) and not page.holds(slot, token + 1)
        out = page.view.outcome(slot, token)
        assert out is not None and (out.nbytes, out.path, out.chunks, out.duration_s) == (4096, "mapped", 3, 0.25)
        assert page.view.outcome(slot, token + 1) is None
        # priming writes the outcome but not the token (a GPU stores that)
        s2, t2 = page.take()
        page.prime(s2, 100, "mapped")
        assert page.view.outcome(s2, t2) is None and int(page.view.words[s2 * SLOT_WORDS + 2]) == pack_meta("mapped", 0)
        page.view.words[s2 * SLOT_WORDS] = np.uint64(t2)
        out2 = page.view.outcome(s2, t2)
        assert out2 is not None and out2.nbytes == 100 and out2.path == "mapped"
    finally:
        page.close()


def test_a_short_page_is_refused() -> None:
    fd = os.memfd_create("short")
    try:
        os.ftruncate(fd, 8)
        with pytest.raises(PoolError, match="expected at least"):
            WordsView(fd, 4)
    finally:
        os.close(fd)
