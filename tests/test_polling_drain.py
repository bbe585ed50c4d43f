"""PollingClient across a drain: the daemon answers every watched request (``daemon_stopping``)
before it closes the session, and ``get_finished()`` returns those answers even when it reads
them together with the close; only a later call raises ``ConnectionClosed``.

Found by the pair soak (tests/test_soak_pair.py, ctx drains): a step-loop ctx executor's
request, failed by the drain with daemon_stopping, came back as ConnectionClosed instead,
because get_finished() read the completion and the end of the stream in one call and raised
before routing what it had read.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from clients.polling import PollingClient
from kvd.demo.launch import DaemonProcess
from protocol.errors import ConnectionClosed
from protocol.layout import KVLayout
from tests.conftest import host_pool
from tests.hostile import IO_TIMEOUT

LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, tokens_per_block=32, dtype="bfloat16")


@pytest.mark.parametrize("page", [False, True], ids=["replies", "completion-page"])
def test_get_finished_returns_what_the_draining_daemon_answered_before_it_closed(
        daemon_factory: Callable[..., DaemonProcess], page: bool) -> None:
    d = daemon_factory({"pools": [host_pool("p0")], "node": "solo", "drain_timeout_s": 60.0}, name="solo")
    with PollingClient(d.socket_path, client="gen", completion_page=page) as kvd:
        ids = kvd.alloc("p0", 2)
        # nobody publishes these: the drain fails them at once (their other side never came)
        kvd.expect_and_watch("lonely", "p0", LAYOUT, 0, ids[:1], deadline_s=300)
        kvd.expect_and_watch("lonely-2", "p0", LAYOUT, 0, ids[1:], deadline_s=300)
        assert kvd.ping(b"x") == b"x"  # both registered (frames are served in order)
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(IO_TIMEOUT) == 0  # answered both, closed the session, exited
        # the completions and the end of the stream are all in the socket now
        done = {c.request_id: c for c in kvd.get_finished()}
        assert set(done) == {"lonely", "lonely-2"}, done
        assert all(not c.ok and c.error_code == "daemon_stopping" for c in done.values()), done
        assert kvd.watching == 0
        with pytest.raises(ConnectionClosed, match="daemon stopped or was killed"):
            kvd.get_finished()
