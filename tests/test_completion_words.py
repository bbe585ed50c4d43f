"""The completion page: a spinning executor sees its request done in the daemon's shared page
(``kvd.mapping.words``) instead of waiting for the reply; failures still come as replies; the
page executors get is read-only; slots and tokens are handed out as the daemon promises."""

from __future__ import annotations

import array
import mmap
import os
import socket
from collections.abc import Callable

import numpy as np
import pytest

from clients.blocking import Client
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
