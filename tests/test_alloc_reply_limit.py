"""An ``Alloc`` whose reply cannot fit one frame changes nothing: no block stays leased.

Alloc is all or nothing. When the ``Allocated`` reply (every block id) is larger than the
session's reply limit (``max_frame_size``, at least 1 MiB), the request fails with
``reply_too_large``; the blocks it took must go back at once: the executor was never told
their ids, so it could neither use nor free them, and they would stay out of everyone's reach
until its session ended (a whole pool, here).
"""

from __future__ import annotations

from collections.abc import Callable

from clients import Client
from kvd.demo.launch import DaemonProcess
from protocol import messages as m
from protocol.codec import encode
from tests.conftest import host_pool
from tests.hostile import IO_TIMEOUT, Baseline, Raw

Factory = Callable[..., DaemonProcess]
#: ids above 65535 take 5 bytes each in msgpack: 300,000 of them are ~1.4 MB, above 1 MiB
BLOCKS = 300_000
TINY = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "tokens_per_block": 1}


def test_alloc_too_large_for_its_reply_leases_nothing(daemon_factory: Factory) -> None:
    d = daemon_factory({"pools": [host_pool("host0", **TINY, num_blocks=BLOCKS)],
                        "limits": {"max_frame_size": 65536}})  # replies: at most 1 MiB
    base = Baseline.take(d)
    raw = Raw(d.socket_path)
    raw.hello()
    raw.send(encode(m.Alloc(id=3, pool="host0", count=BLOCKS)))
    err = raw.error()
    assert (err.id, err.code) == (3, "reply_too_large"), err
    with Client(d.socket_path, client="other", timeout=IO_TIMEOUT) as other:
        assert other.stats().blocks_leased == 0  # the refused alloc left nothing leased
        assert other.pools()[0].blocks_free == BLOCKS  # the pool is there for everyone
    # the message says what to do about an alloc: ask for fewer blocks at a time
    assert "alloc" in err.message and "fewer" in err.message, err.message
    # what does fit is allocated as before, on the same session
    raw.send(encode(m.Alloc(id=4, pool="host0", count=1000)))
    reply = raw.receive()
    assert isinstance(reply, m.Allocated) and len(reply.block_ids) == 1000, reply
    raw.send(encode(m.Free(id=5, pool="host0", block_ids=reply.block_ids)))
    assert raw.receive() == m.Freed(id=5, pool="host0", count=1000)
    raw.close()
    assert [r["event"] for r in base.new_warnings()] == ["session.reply_too_large"]
    base.check()
