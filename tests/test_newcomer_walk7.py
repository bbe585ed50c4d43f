"""What a newcomer wiring an executor to kvd hit (walk 7), each against a real daemon process:

- a serving engine's block table is a numpy array or a torch tensor: ``expect`` / ``publish`` /
  ``free`` given one raised msgspec's bare ``TypeError: Encoding objects of type numpy.int64 is
  unsupported``; the array is now taken as its ``tolist()``, and a value that still cannot be
  sent (a numpy integer as the rank) is a ``BadRequest`` saying what to pass, nothing sent;
- a single block id where a list belongs raised ``TypeError: 'int' object is not iterable``;
- ``alloc("pool", "3")`` and a float tensor of block ids were refused by the daemon as an
  invalid message (``Expected `int`, got `str` - at `$.count```); the client now says what
  it wanted;
- ``KVD_SOCKET=`` (empty) made kvctl and the clients connect to "" while the daemon takes it as
  unset;
- a call on a ``Client`` after its ``with`` block said ``cannot send to the daemon: [Errno 9] Bad
  file descriptor; the daemon stopped or was killed``: it now says this client was closed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from clients import Client, PollingClient, open_client
from kvd.demo.launch import DaemonProcess
from protocol.errors import BadRequest, ConnectionClosed, TransferCancelled

# The clients annotate block ids as ``list[int]`` and counts and ranks as ``int``. At run time
# they also take a numpy array or torch tensor of ids and a numpy integer count (what these tests
# check), and refuse the deliberately wrong values of the error paths: those calls carry a
# targeted ``# type: ignore[arg-type]`` (``[misc]`` for the list of numpy integers).
BlockTable = Callable[[list[int]], "np.ndarray | torch.Tensor"]

DEFAULT = "/run/kvd/kvd.sock"
CLOSED = "this client is closed (its `with` block ended, or close() was called): the daemon is not at fault"


def test_a_block_table_given_as_an_array_or_a_tensor_is_taken(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory(name="arrays")
    with Client(d.socket_path, client="arrays") as kvd:
        [pool] = kvd.pools()
        assert pool.layout is not None
        tables: tuple[BlockTable, ...] = (np.array, torch.tensor)
        for i, table in enumerate(tables):
            ids = kvd.alloc("host0", 2)
            kvd.expect(f"r{i}", "host0", pool.layout, 0, table(ids), deadline_s=30)  # type: ignore[arg-type]
            kvd.cancel(f"r{i}")
            with pytest.raises(TransferCancelled, match="cancelled by client"):
                kvd.wait(f"r{i}", timeout_s=30)
            assert kvd.free("host0", table(ids)) == 2  # type: ignore[arg-type]
        assert {t.request_id for t in kvd.transfers()} == {"r0", "r1"}


def test_values_that_cannot_be_sent_are_a_bad_request_and_the_session_goes_on(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory(name="values")
    with Client(d.socket_path, client="values") as kvd:
        [pool] = kvd.pools()
        assert pool.layout is not None
        ids = kvd.alloc("host0", 2)
        with pytest.raises(BadRequest, match=r"^\[bad_request\] Expect cannot be sent: Encoding objects of type "
                                             r"numpy.int64 is unsupported; block ids, ranks and counts must be "
                                             r"Python ints"):
            kvd.expect("r", "host0", pool.layout, np.int64(0), ids)  # type: ignore[arg-type]
        with pytest.raises(BadRequest, match=r"^\[bad_request\] Publish cannot be sent: .*numpy.int64"):
            kvd.publish_and_wait("r", "host0", pool.layout, 0, [np.int64(i) for i in ids], "values",  # type: ignore[misc]
                                 timeout_s=1)
        with pytest.raises(BadRequest, match=r"^\[bad_request\] block_ids must be a sequence of block ids "
                                             r"\(the list alloc returned, or a slice of it\), got int 5$"):
            kvd.expect("r", "host0", pool.layout, 0, 5)  # type: ignore[arg-type]
        # a count or an id array of the wrong kind says so here, not as "[protocol] invalid
        # message: Expected `int`, got `str` - at `$.count`" from the daemon
        with pytest.raises(BadRequest, match=r"^\[bad_request\] count must be an integer number of blocks, "
                                             r"got str '3'$"):
            kvd.alloc("host0", "3")  # type: ignore[arg-type]
        with pytest.raises(BadRequest, match=r"count must be a number of blocks, got True"):
            kvd.alloc("host0", True)
        with pytest.raises(BadRequest, match=r"^\[bad_request\] block_ids must be integers; this array holds "
                                             r"floats \(dtype torch.float32\)"):
            kvd.expect("r", "host0", pool.layout, 0, torch.tensor(ids, dtype=torch.float32))  # type: ignore[arg-type]
        assert kvd.transfers() == []  # nothing was sent
        assert kvd.ping(b"on") == b"on"
        assert kvd.free("host0", ids) == 2
        assert len(kvd.alloc("host0", np.int64(1))) == 1  # type: ignore[arg-type]  # a numpy integer is a count


async def test_async_client_takes_arrays_and_refuses_what_it_cannot_send(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory(name="async")
    async with open_client(d.socket_path, client="async") as kvd:
        [pool] = await kvd.pools()
        assert pool.layout is not None
        ids = await kvd.alloc("host0", 2)
        with pytest.raises(BadRequest, match=r"^\[bad_request\] Expect cannot be sent: .*numpy.int64"):
            await kvd.expect("r", "host0", pool.layout, np.int64(0), ids)  # type: ignore[arg-type]
        assert not kvd._pending  # the refused call left no reply slot behind
        await kvd.expect("r", "host0", pool.layout, 0, np.array(ids), deadline_s=30)  # type: ignore[arg-type]
        await kvd.cancel("r")
        with pytest.raises(TransferCancelled, match="cancelled by client"):
            await kvd.wait("r", timeout_s=30)
        assert await kvd.free("host0", torch.tensor(ids)) == 2  # type: ignore[arg-type]
    with pytest.raises(ConnectionClosed) as info:
        await kvd.ping()
    assert info.value.message.startswith(CLOSED), info.value.message
    assert not info.value.by_peer


@pytest.mark.parametrize("kind", [Client, PollingClient])
def test_a_call_after_the_with_block_says_the_client_is_closed(
        daemon_factory: Callable[..., DaemonProcess], kind: type[Client]) -> None:
    d = daemon_factory(name="closed")
    with kind(d.socket_path, client="closed") as kvd:
        assert kvd.ping(b"x") == b"x"
    calls: list[Callable[[], object]] = [kvd.pools, lambda: kvd.wait("r", timeout_s=1)]
    if isinstance(kvd, PollingClient):
        calls.append(kvd.get_finished)
    for call in calls:
        with pytest.raises(ConnectionClosed) as info:
            call()
        assert info.value.message.startswith(CLOSED), info.value.message
        assert "the daemon stopped or was killed" not in info.value.message
        assert not info.value.by_peer
    with Client(d.socket_path, client="again") as again:  # the daemon is fine
        assert again.ping(b"y") == b"y"



def test_an_empty_kvd_socket_counts_as_unset_as_the_daemon_counts_it() -> None:
    """``KVD_SOCKET=`` (an emptied variable, a unit's ``Environment=KVD_SOCKET=``): the daemon takes
    its file's socket_path, but kvctl and the clients said ``cannot connect to kvd at : Invalid
    argument``. They now take the default, as for an unset variable."""
    env = {**os.environ, "KVD_SOCKET": ""}
    probe = "from clients._wire import default_socket_path; print(default_socket_path())"
    said = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert said.stdout.strip() == DEFAULT, said
    if os.path.exists(DEFAULT):
        pytest.skip(f"a kvd may serve {DEFAULT} on this machine: kvctl ping would reach it")
    run = subprocess.run([sys.executable, "-m", "clients.kvctl", "ping"], capture_output=True, text=True,
                         env=env, timeout=60, stdin=subprocess.DEVNULL)
    assert run.returncode == 3 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith(f"kvctl: [connection_closed] cannot connect to kvd at {DEFAULT}: "), run.stderr


def test_every_stage_events_md_refers_to_is_one_a_transfer_records() -> None:
    """events.md said the ctx side's wait for the other side is ``stages.accepted``, a key no
    transfer.done line has (it is ``queued``): each ``stages.NAME`` must be a key the code sets."""
    root = Path(__file__).resolve().parent.parent
    named = set(re.findall(r"`stages\.([a-z_]+)`", (root / "docs" / "events.md").read_text()))
    assert named, "events.md no longer names a stage as stages.NAME"
    source = "\n".join(p.read_text() for p in (root / "kvd").rglob("*.py"))
    recorded = set(re.findall(r"""\.mark\("([a-z_]+)"\)|stages\["([a-z_]+)"\]""", source))
    keys = {k for pair in recorded for k in pair if k}
    assert named <= keys, f"events.md names stages no transfer records: {sorted(named - keys)}"
