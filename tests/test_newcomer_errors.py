"""Mistakes a newcomer makes with kvd, and what kvd says about them: each case runs real daemons
(subprocesses, real sockets) and checks that the error names what went wrong and what to do.

- ``[pools]`` for ``[[pools]]`` says to write two brackets;
- a configuration value only the daemon's checks refuse (a negative deadline) is a configuration
  error: exit 78, not 1 (systemd would restart a daemon that can never start);
- a transfer to the daemon's own node that no gen rank expects is not "no link to the peer";
- a transfer over a link the two daemons' secrets refuse says to give both the same secret, not
  to start the peer daemon;
- a request id registered twice on a rank says which session holds it and what to do;
- a second ``wait`` for a request whose outcome was reported, or a wait on another session;
- ``deadline_s`` / ``timeout_s`` / ``request_id`` out of the protocol's bounds are refused by the
  client as the argument they are, not by the daemon as a malformed message; so are a ``peer``
  or a layout of the wrong type, a publish without a peer, and block ids in a set;
- the daemon going away under a session says what to do next.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from clients import Client, PollingClient, open_client
from kvd.demo.launch import DaemonProcess, start_daemon, write_config
from kvd.startup import EX_CONFIG
from protocol.errors import (
    BadRequest,
    ConnectionClosed,
    DuplicateRequest,
    IncompatibleLayout,
    NotFound,
    PeerUnavailable,
    TransferTimeout,
)
from protocol.layout import KVLayout
from tests.conftest import host_pool
from tests.hostile import wait_until
from tests.test_ops_access import CLIENT, NOBODY, _as_nobody
from tests.test_startup_errors import base_config, check_failure, secret, serve
from tests.transfer_harness import write_secret

LOST = "open a new Client once kvd answers again (kvctl ping --wait SECONDS)"


def test_a_negative_deadline_in_the_file_is_a_configuration_error(short_tmp: Path) -> None:
    """``[transfer] deadline_s = -1`` used to pass the configuration check and fail the start with
    exit 1 and no hint (systemd restarts on 1); it is refused with the file's other mistakes."""
    path = write_config(short_tmp, "kvd", base_config(short_tmp, transfer={"deadline_s": -1.0}))
    check_failure(serve(path, env={"KVD_LOG_FORMAT": "json"}), exit_code=EX_CONFIG, setting=None,
                  contains=["[transfer] deadline_s must be finite, > 0 and at most 86400 s, got -1.0",
                            "; fix the configuration (systemd/kvd.toml shows and explains every key)"])


@pytest.mark.parametrize("table", ["pools", "peers"])
def test_a_single_bracket_pools_table_says_to_use_two(short_tmp: Path, table: str) -> None:
    """``[pools]`` instead of ``[[pools]]``: msgspec's "expected `array`, got `object`" alone does
    not tell a newcomer that TOML's double brackets make the array."""
    path = short_tmp / "kvd.toml"
    path.write_text(f'socket_path = "{short_tmp / "kvd.sock"}"\nlog_format = "json"\n[{table}]\nname = "x"\n')
    check_failure(serve(str(path)), exit_code=EX_CONFIG, setting=table,
                  contains=[f"kvd: error: {table}: expected `array`, got `object` (in {path}): write each entry "
                            f"as its own [[{table}]] table (two brackets); fix the configuration"])


def test_a_socket_path_too_long_for_a_unix_socket(short_tmp: Path) -> None:
    """A socket_path over 107 bytes (a deep working directory): bind() says "AF_UNIX path too long"
    with no errno, and the daemon's line used to end in "cannot listen on ...: None"."""
    path = str(short_tmp / ("s" * (108 - len(str(short_tmp))))) + ".sock"
    assert len(path) > 107
    config = write_config(short_tmp, "kvd", base_config(short_tmp, socket_path=path))
    check_failure(serve(config, env={"KVD_LOG_FORMAT": "json"}), exit_code=EX_CONFIG, setting="socket_path",
                  contains=[f"kvd: error: socket_path: {path} is {len(path)} bytes long, and a Unix socket path "
                            "holds at most 107; choose a shorter socket_path (KVD_SOCKET)"])
    said = (f"cannot connect to kvd at {path}: AF_UNIX path too long; the path is {len(path)} bytes long, and a "
            "Unix socket path holds at most 107: no daemon can listen there; give the daemon's real socket_path")
    with pytest.raises(ConnectionClosed) as info:
        Client(path, client="t")
    assert info.value.message.startswith(said), info.value.message


async def test_async_client_names_a_socket_path_too_long(short_tmp: Path) -> None:
    path = "/tmp/" + "s" * 120
    with pytest.raises(ConnectionClosed, match="the path is 125 bytes long, and a Unix socket path holds at most 107"):
        async with open_client(path, client="t"):
            pass


def _local_pools() -> list[dict[str, Any]]:
    """A TP1 ctx pool and the two pools of a TP2 gen instance, all on one daemon."""
    return [host_pool("ctx0", num_blocks=8),
            host_pool("gen0", num_blocks=8, tp_size=2, rank=0),
            host_pool("gen1", num_blocks=8, tp_size=2, rank=1)]


def _layouts(d: DaemonProcess) -> tuple[KVLayout, KVLayout]:
    with Client(d.socket_path, client="layouts") as kvd:
        info = {p.name: p.layout for p in kvd.pools()}
    ctx, gen = info["ctx0"], info["gen0"]
    assert ctx is not None and gen is not None
    return ctx, gen


def test_a_transfer_to_the_own_node_that_no_gen_rank_expects(
        daemon_factory: Callable[..., DaemonProcess], short_tmp: Path) -> None:
    """``publish(..., peer=<this daemon's node>)`` is a transfer between its own pools; when no gen
    rank expects it, the deadline's error of a daemon with peer links said "no link to peer 'local'
    (it never connected); start the peer daemon", sending the newcomer after a daemon that does
    not exist."""
    d = daemon_factory({"pools": _local_pools(), "peer_secret_file": secret(short_tmp)}, name="local")
    ctx, gen = _layouts(d)
    with Client(d.socket_path, client="ctx") as c, Client(d.socket_path, client="gen-rank0") as g0:
        ids = c.alloc("ctx0", 2)
        c.publish("nobody", "ctx0", ctx, 0, ids, peer="local", deadline_s=1)
        with pytest.raises(TransferTimeout) as info:
            c.wait("nobody", timeout_s=60)
        said = info.value.message
        assert "missed its deadline of 1 s: no gen executor expected it on this daemon (peer 'local' is this " \
               "daemon: the local path)" in said, said
        assert "check that the gen executors are running and expect this request id here" in said, said
        assert "no link" not in said and "start the peer daemon" not in said, said

        # one of the two gen ranks expects it: both sides name the rank that did not, whichever
        # side registered first (that side's deadline fires first and words the failure)
        gids = g0.alloc("gen0", 2)
        g0.expect("gen-first", "gen0", gen, 0, gids, deadline_s=1)
        c.publish("gen-first", "ctx0", ctx, 0, ids, peer="local", deadline_s=1)
        with pytest.raises(TransferTimeout, match=r"ranks \[1\] never registered \(1 of 2 did\)"):
            c.wait("gen-first", timeout_s=60)
        with pytest.raises(TransferTimeout, match=r"ranks \[1\] never registered \(1 of 2 did\)"):
            g0.wait("gen-first", timeout_s=60)
        c.publish("ctx-first", "ctx0", ctx, 0, ids, peer="local", deadline_s=1)
        g0.expect("ctx-first", "gen0", gen, 0, gids, deadline_s=1)
        with pytest.raises(TransferTimeout, match=r"gen ranks \[1\] never expected it on this daemon"):
            c.wait("ctx-first", timeout_s=60)
        with pytest.raises(TransferTimeout, match=r"gen ranks \[1\] never expected it on this daemon"):
            g0.wait("ctx-first", timeout_s=60)
        c.free("ctx0", ids)
        g0.free("gen0", gids)


def test_a_transfer_over_a_link_the_secrets_refuse_says_to_give_both_the_same_secret(
        daemon_factory: Callable[..., DaemonProcess], short_tmp: Path) -> None:
    """ctx and gen read different peer secrets: ``kvctl peers`` said so (``[auth_failed] ... the
    two daemons read different secrets``), but the wait of the executor publishing to gen ended
    in "start the peer daemon, or check its [[peers]] host/port": advice for a peer that is down,
    while this one runs at that address and refuses the handshake."""
    gen = daemon_factory({"pools": [host_pool("gen0", num_blocks=8)],
                          "peer_secret_file": write_secret(short_tmp, "gen.secret")}, name="gen")
    ctx_secret = write_secret(short_tmp, "ctx.secret")  # another secret
    ctx = daemon_factory({"pools": [host_pool("ctx0", num_blocks=8)], "peer_secret_file": ctx_secret,
                          "peers": [{"name": "gen", "host": "127.0.0.1", "port": gen.peer_port}]}, name="ctx")
    with Client(ctx.socket_path, client="ctx") as c:
        # the deadline below must come after ctx's first refused handshake, not before it
        wait_until(lambda: c.peers()[0].error.startswith("[auth_failed] "), "ctx's refused handshake with gen")
        [peer] = c.peers()
        assert peer.state == "connecting" and "the two daemons read different secrets" in peer.error, peer
        [pool] = c.pools()
        assert pool.layout is not None
        ids = c.alloc("ctx0", 2)
        c.publish("m6a", "ctx0", pool.layout, 0, ids, peer="gen", deadline_s=1)
        with pytest.raises(PeerUnavailable) as info:
            c.wait("m6a", timeout_s=60)
    said = info.value.message
    assert said.startswith("request 'm6a' (ctx side) missed its deadline of 1 s: no link to peer 'gen' (last "
                           f"attempt: [auth_failed] peer 'gen' at 127.0.0.1:{gen.peer_port} failed the "
                           "shared-secret handshake: "), said
    assert said.endswith(
        "; both daemons must read the same secret: the file each one's peer_secret_file names must hold "
        f"identical bytes on both nodes (this daemon reads {ctx_secret}); copy one node's file to the other "
        "(mode 600, owned by the daemon's user) and restart the daemon whose file changed: a daemon reads its "
        "secret when it starts"), said
    assert "start the peer daemon" not in said and "host/port" not in said, said


def test_a_request_id_registered_twice_says_by_whom_and_what_to_do(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """A registration of a request id whose rank a live request holds already was refused with
    "request 'm6b': rank 0 already registered (gen)": not which session holds it (this one, or
    another executor using the same id), nor what to do about it."""
    d = daemon_factory({"pools": _local_pools()}, name="local")
    ctx, gen = _layouts(d)
    pid = os.getpid()
    with Client(d.socket_path, client="ctx") as c, Client(d.socket_path, client="g0") as g0, \
            Client(d.socket_path, client="g0-too") as too, Client(d.socket_path, client="g1") as g1:
        sid = {s.client: s.session_id for s in c.sessions()}
        gids = g0.alloc("gen0", 2)
        g0.expect("m6b", "gen0", gen, 0, gids)  # gen rank 1 has not registered: the side is incomplete
        live = ("and that request is live: request ids must be unique among the live requests of a pair of "
                "daemons (here: this daemon and the ctx daemon that will offer it (gen named no peer)); ")
        with pytest.raises(DuplicateRequest) as info:
            g0.expect("m6b", "gen0", gen, 0, gids)
        assert info.value.message == (f"request 'm6b': gen rank 0 is already registered by this session (session "
                                      f"{sid['g0']} ('g0', pid {pid})), {live}use a new request id, or wait for "
                                      "the live one (or cancel it)")
        other = too.alloc("gen0", 2)
        with pytest.raises(DuplicateRequest) as info:
            too.expect("m6b", "gen0", gen, 0, other)
        assert info.value.message == (f"request 'm6b': gen rank 0 is already registered by another session, "
                                      f"session {sid['g0']} ('g0', pid {pid}), {live}use a new request id, or "
                                      f"leave the live one to session {sid['g0']}, which waits for it or cancels it")
        too.expect("m6b-2", "gen0", gen, 0, other)  # a new id registers

        # a side past registering (ctx TP1, waiting for its gen ranks on this daemon): the same words
        ids = c.alloc("ctx0", 2)
        c.publish("m6c", "ctx0", ctx, 0, ids, peer="local")
        with pytest.raises(DuplicateRequest) as info:
            c.publish("m6c", "ctx0", ctx, 0, ids, peer="local")
        assert info.value.message == (
            f"request 'm6c': ctx rank 0 is already registered by this session (session {sid['ctx']} ('ctx', pid "
            f"{pid})), and that request is live: request ids must be unique among the live requests of a pair of "
            "daemons (here: this daemon 'local' alone: ctx and gen both on it, the local path); use a new request "
            "id, or wait for the live one (or cancel it)")
        # once it ran, and before every session collected it, the id is still taken: it says so
        more = [g0.alloc("gen0", 2), g1.alloc("gen1", 2)]
        g0.expect("m6c", "gen0", gen, 0, more[0])
        g1.expect("m6c", "gen1", gen, 1, more[1])
        assert c.wait("m6c", timeout_s=60).ok
        with pytest.raises(DuplicateRequest) as info:
            c.publish("m6c", "ctx0", ctx, 0, ids, peer="local")
        assert info.value.message == (f"request 'm6c': ctx rank 0 was registered by this session (session "
                                      f"{sid['ctx']} ('ctx', pid {pid})), and that request ended here (done); use "
                                      "a new request id")
        assert g0.wait("m6c", timeout_s=60).ok and g1.wait("m6c", timeout_s=60).ok


def test_waiting_twice_or_on_another_session_says_why(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory({"pools": _local_pools()}, name="local")
    ctx, gen = _layouts(d)
    with Client(d.socket_path, client="ctx") as c, Client(d.socket_path, client="g0") as g0, \
            Client(d.socket_path, client="g1") as g1:
        ids = c.alloc("ctx0", 2)
        gids = [g0.alloc("gen0", 2), g1.alloc("gen1", 2)]
        g0.expect("r1", "gen0", gen, 0, gids[0])
        g1.expect("r1", "gen1", gen, 1, gids[1])
        # the ctx executor's session waiting on the gen ranks' registration: not its request (yet)
        with pytest.raises(NotFound) as info:
            c.wait("r1", timeout_s=5)
        assert info.value.message == ("no request 'r1' is registered by this session: wait on the session "
                                      "(Client) that registered it with expect or publish")
        c.publish("r1", "ctx0", ctx, 0, ids, peer="local")
        assert c.wait("r1", timeout_s=60).path == "local"
        assert g0.wait("r1", timeout_s=60).ok
        # the outcome is reported once per session: a second wait is told so, and where to look
        with pytest.raises(NotFound) as info:
            c.wait("r1", timeout_s=5)
        assert info.value.message == (
            "request 'r1' is not registered by this session: a request 'r1' ended here (done); each session "
            "that registered it is told the outcome by one wait, and then no more (kvctl transfers shows how "
            "it ended)")
        # g1 has not collected its completion yet: it still gets it
        assert g1.wait("r1", timeout_s=60).ok
        # a session that never registered r1 is not told it waited twice
        with Client(d.socket_path, client="bystander") as other, pytest.raises(NotFound) as info:
            other.wait("r1", timeout_s=5)
        assert info.value.message == (
            "no request 'r1' is registered by this session: wait on the session (Client) that registered it "
            "with expect or publish (a request 'r1' that another session registered ended here (done): kvctl "
            "transfers shows how)")
        c.free("ctx0", ids)
        g0.free("gen0", gids[0])
        g1.free("gen1", gids[1])


def test_a_block_listed_twice_is_a_bad_request_that_registers_nothing(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """``block_ids=[b, b]`` in an expect or publish used to be refused as ``BlockNotLeased``
    (the block is leased; the list is malformed): it is a ``BadRequest`` naming the id, its two
    positions and the rank, and nothing is recorded: the same blocks register again, listed once."""
    d = daemon_factory({"pools": _local_pools()}, name="local")
    ctx, gen = _layouts(d)
    with Client(d.socket_path, client="ctx") as c, Client(d.socket_path, client="g0") as g0, \
            Client(d.socket_path, client="g1") as g1:
        ids = c.alloc("ctx0", 2)
        gids = [g0.alloc("gen0", 2), g1.alloc("gen1", 2)]
        b = gids[1][1]
        with pytest.raises(BadRequest) as info:
            g1.expect("r1", "gen1", gen, 1, [gids[1][0], b, b])
        assert info.value.message == (f"request 'r1' (gen rank 1): pool 'gen1': block {b} is listed twice "
                                      "(positions 1 and 2 of block_ids); name each block once")
        with pytest.raises(BadRequest) as info:
            c.publish("r1", "ctx0", ctx, 0, [ids[0], ids[0]], peer="local")
        assert info.value.message == (f"request 'r1' (ctx rank 0): pool 'ctx0': block {ids[0]} is listed twice "
                                      "(positions 0 and 1 of block_ids); name each block once")
        # nothing recorded: no request, no request counted against the sessions, the blocks still theirs
        assert c.transfers() == []
        assert {s.client: s.requests for s in c.sessions()} == {"ctx": 0, "g0": 0, "g1": 0}
        assert {p.name: p.blocks_used for p in c.pools()} == {"ctx0": 2, "gen0": 2, "gen1": 2}
        # the corrected registrations, with the same blocks, go through and the request runs
        g0.expect("r1", "gen0", gen, 0, gids[0])
        g1.expect("r1", "gen1", gen, 1, gids[1])
        c.publish("r1", "ctx0", ctx, 0, ids, peer="local")
        assert c.wait("r1", timeout_s=60).ok
        assert g0.wait("r1", timeout_s=60).ok
        assert g1.wait("r1", timeout_s=60).ok
        assert c.free("ctx0", ids) == 2
        assert g0.free("gen0", gids[0]) == 2
        assert g1.free("gen1", gids[1]) == 2


def test_a_wait_after_a_refused_registration_says_it_was_refused(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """A wait on a request whose registration was refused used to be told, once another session's
    registration of that id had ended, that "each session that registered it is told the outcome"
    (as if it had waited twice): it is told that no such request is registered by this session,
    and that its registration was refused."""
    d = daemon_factory({"pools": _local_pools()}, name="local")
    ctx, gen = _layouts(d)
    with Client(d.socket_path, client="ctx") as c, Client(d.socket_path, client="g0") as g0:
        ids = c.alloc("ctx0", 2)
        gids = g0.alloc("gen0", 2)
        with pytest.raises(BadRequest):
            c.publish("r1", "ctx0", ctx, 0, [ids[1], ids[1]], peer="local")
        refusal = (f"[bad_request] request 'r1' (ctx rank 0): pool 'ctx0': block {ids[1]} is listed twice "
                   "(positions 0 and 1 of block_ids); name each block once")
        with pytest.raises(NotFound) as info:
            c.wait("r1", timeout_s=5)
        assert info.value.message == (f"no request 'r1' is registered by this session: its registration was "
                                      f"refused ({refusal}), and a refused registration registers nothing; "
                                      "register it again, corrected")
        # gen registers r1 and fails at its deadline (gen rank 1 never registers): once a request
        # 'r1' ended here, the ctx session is still told its registration was refused, not that it
        # waited twice
        g0.expect("r1", "gen0", gen, 0, gids, deadline_s=1)
        with pytest.raises(TransferTimeout):
            g0.wait("r1", timeout_s=60)
        with pytest.raises(NotFound) as info:
            c.wait("r1", timeout_s=5)
        assert info.value.message == (f"no request 'r1' is registered by this session: its registration was "
                                      f"refused ({refusal}), and a refused registration registers nothing; "
                                      "register it again, corrected (a request 'r1' that another session "
                                      "registered ended here (failed): kvctl transfers shows how)")
        # registered again, corrected: the refusal is forgotten, and a second wait is told it waited twice
        with Client(d.socket_path, client="g1") as g1:
            g1ids = g1.alloc("gen1", 2)
            g0.expect("r2", "gen0", gen, 0, gids)
            g1.expect("r2", "gen1", gen, 1, g1ids)
            with pytest.raises(BadRequest):
                c.publish("r2", "ctx0", ctx, 0, [ids[0], ids[0]], peer="local")
            c.publish("r2", "ctx0", ctx, 0, ids, peer="local")
            assert c.wait("r2", timeout_s=60).ok
            assert g0.wait("r2", timeout_s=60).ok and g1.wait("r2", timeout_s=60).ok
            with pytest.raises(NotFound) as info:
                c.wait("r2", timeout_s=5)
            assert info.value.message == (
                "request 'r2' is not registered by this session: a request 'r2' ended here (done); each session "
                "that registered it is told the outcome by one wait, and then no more (kvctl transfers shows how "
                "it ended)")
            g1.free("gen1", g1ids)
        g0.free("gen0", gids)
        c.free("ctx0", ids)


def test_layout_mistakes_say_what_to_leave_out(daemon_factory: Callable[..., DaemonProcess]) -> None:
    """Two arguments a newcomer fills in that are best left alone: the layout's ``num_blocks``
    and ``ranks=`` (attention DP only)."""
    d = daemon_factory({"pools": _local_pools()}, name="local")
    _ctx, gen = _layouts(d)
    with Client(d.socket_path, client="gen-rank0") as g0:
        ids = g0.alloc("gen0", 2)
        with pytest.raises(IncompatibleLayout) as info:
            g0.expect("r", "gen0", msgspec.structs.replace(gen, num_blocks=64), 0, ids)
        assert info.value.message == ("layout says num_blocks=64, pool 'gen0' has 8; leave the layout's "
                                      "num_blocks at 0 (it then takes the pool's)")
        with pytest.raises(BadRequest) as bad:
            g0.expect("r", "gen0", gen, 0, ids, ranks=[0])
        assert bad.value.message == ("request 'r': without attention DP every rank takes part; got ranks [0]: "
                                      "leave ranks out, and have every rank of the layout register")
        assert g0.transfers() == []
        g0.free("gen0", ids)


@pytest.fixture(scope="module")
def args_daemon() -> Iterator[DaemonProcess]:
    """One daemon (the default configuration) for the tests of arguments the client refuses
    before anything is sent: none registers a request, and each session's leases end with it."""
    workdir = tempfile.mkdtemp(prefix="kvdn-", dir="/tmp")
    d = start_daemon({"pools": [host_pool()], "transfer": {"bounce_size_mb": 16, "chunk_mb": 2}},
                     workdir=workdir, name="args")
    try:
        yield d
    finally:
        d.kill()
        shutil.rmtree(workdir, ignore_errors=True)


BAD_ARGUMENTS = [
    ({"deadline_s": 0}, "deadline_s must be a number of seconds > 0 and at most 86400, got 0; "
                        "None takes the daemon's [transfer] deadline_s"),
    ({"deadline_s": -1.0}, "deadline_s must be a number of seconds > 0 and at most 86400, got -1.0"),
    ({"deadline_s": 1e9}, "deadline_s must be a number of seconds > 0 and at most 86400, got 1000000000.0"),
    ({"deadline_s": math.nan}, "deadline_s must be a number of seconds > 0 and at most 86400, got nan"),
    ({"request_id": ""}, "request_id must be a non-empty string of at most 256 characters, got ''"),
    ({"request_id": "x" * 257}, "request_id must be a non-empty string of at most 256 characters, got 'xxx"),
]


@pytest.mark.parametrize(("bad", "said"), BAD_ARGUMENTS)
def test_blocking_client_refuses_out_of_bounds_arguments(
        args_daemon: DaemonProcess, bad: dict[str, Any], said: str) -> None:
    """Such a value used to reach the daemon, whose decoder answered ``[protocol] invalid message:
    Expected `float` > 0.0 - at `$.deadline_s``` (a wire fault, to a newcomer's eye)."""
    d = args_daemon
    with Client(d.socket_path, client="args") as kvd:
        layout = kvd.pools()[0].layout
        assert layout is not None
        ids = kvd.alloc("host0", 1)
        args: dict[str, Any] = {"request_id": "r", "deadline_s": None, **bad}
        rid, deadline = args["request_id"], args["deadline_s"]
        for register in (
            lambda: kvd.expect(rid, "host0", layout, 0, ids, deadline_s=deadline),
            lambda: kvd.publish(rid, "host0", layout, 0, ids, "args", deadline_s=deadline),
            lambda: kvd.publish_and_wait(rid, "host0", layout, 0, ids, "args", deadline_s=deadline, timeout_s=1),
        ):
            with pytest.raises(BadRequest) as info:
                register()
            assert info.value.message.startswith(said), info.value.message
        assert kvd.transfers() == []  # nothing was sent: nothing registered
        assert kvd.ping(b"on") == b"on"  # and the session goes on
        kvd.free("host0", ids)


def test_a_negative_wait_timeout_is_refused_by_the_client(args_daemon: DaemonProcess) -> None:
    d = args_daemon
    with Client(d.socket_path, client="args") as kvd:
        for bad in (-1.0, math.inf):
            with pytest.raises(BadRequest, match=r"^\[bad_request\] timeout_s must be a number of seconds >= 0 and at most 86400, "
                                                 r"got .*; None waits until the request ends$"):
                kvd.wait("r", timeout_s=bad)
        # 0 is a valid timeout: the daemon answers (here: the request is not this session's)
        with pytest.raises(NotFound, match="no request 'r' is registered by this session"):
            kvd.wait("r", timeout_s=0)


async def test_async_client_refuses_out_of_bounds_arguments(args_daemon: DaemonProcess) -> None:
    d = args_daemon
    async with open_client(d.socket_path, client="args") as kvd:
        [pool] = await kvd.pools()
        assert pool.layout is not None
        ids = await kvd.alloc("host0", 1)
        with pytest.raises(BadRequest, match=r"^\[bad_request\] deadline_s must be a number of seconds > 0"):
            await kvd.expect("r", "host0", pool.layout, 0, ids, deadline_s=0)
        with pytest.raises(BadRequest, match=r"^\[bad_request\] request_id must be a non-empty string"):
            await kvd.publish_and_wait("", "host0", pool.layout, 0, ids, "args", timeout_s=1)
        with pytest.raises(BadRequest, match=r"^\[bad_request\] timeout_s must be a number of seconds >= 0"):
            await kvd.wait("r", timeout_s=-1)
        assert await kvd.transfers() == []
        assert await kvd.ping(b"on") == b"on"


def test_registration_arguments_the_client_can_check_are_refused_before_sending(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """A ``peer`` of None or a layout that is not a KVLayout reached the daemon, whose decoder
    answered ``[protocol] invalid message: Expected `str`, got `None` - at `$.peer```; a publish
    with no peer got ``publish needs the gen peer's node name`` back; block ids in a set were
    taken in the set's order, which is not the request's token order."""
    d = daemon_factory(name="args")
    with Client(d.socket_path, client="args") as kvd, PollingClient(d.socket_path, client="poll") as poll:
        layout = kvd.pools()[0].layout
        assert layout is not None
        ids = kvd.alloc("host0", 2)
        cases: list[tuple[Callable[[], object], str]] = [
            (lambda: kvd.publish("r", "host0", layout, 0, ids, ""),
             "publish needs peer=, the gen daemon's node name"),
            (lambda: kvd.publish("r", "host0", layout, 0, ids, None),  # type: ignore[arg-type]
             "peer must be a node name (a str), got NoneType None"),
            (lambda: kvd.expect("r", "host0", layout, 0, ids, peer=None),  # type: ignore[arg-type]
             "peer must be a node name (a str), got NoneType None; leave it out"),
            (lambda: kvd.expect("r", "host0", msgspec.structs.asdict(layout), 0, ids),  # type: ignore[arg-type]
             "layout must be a protocol.layout.KVLayout, got dict"),
            (lambda: kvd.expect("r", "host0", layout, 0, set(ids)),  # type: ignore[arg-type]
             "block_ids must be in the request's token order (a list, an array, a tensor), got a set"),
            (lambda: poll.publish_and_watch("r", "host0", layout, 0, ids, ""),
             "publish needs peer=, the gen daemon's node name"),
        ]
        for register, said in cases:
            with pytest.raises(BadRequest) as info:
                register()
            assert info.value.message.startswith(said), info.value.message
        assert poll.watching == 0 and poll.get_finished() == []
        assert kvd.transfers() == []  # nothing was sent: nothing registered
        assert kvd.free("host0", set(ids)) == 2  # type: ignore[arg-type]  # freeing needs no order


def test_blocking_client_of_a_killed_daemon_says_what_to_do(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory(name="gone")
    with Client(d.socket_path, client="gen-rank0") as kvd:
        assert kvd.alloc("host0", 1)
        d.kill()  # SIGKILL, and reaped: the daemon's end of the socket is closed
        for _ in range(2):  # the first call finds the connection gone, and so does the next one
            with pytest.raises(ConnectionClosed) as info:
                kvd.alloc("host0", 1)
            said = info.value.message
            assert said.startswith(("the daemon closed the connection; ", "connection to the daemon broke: ",
                                    "cannot send to the daemon: ")), said
            assert "the daemon stopped or was killed (its log or `journalctl -u kvd` says why)" in said, said
            assert said.endswith(LOST), said


async def test_async_client_waiting_when_its_daemon_is_killed(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory(name="gone")
    async with open_client(d.socket_path, client="gen-rank0") as kvd:
        [pool] = await kvd.pools()
        assert pool.layout is not None
        ids = await kvd.alloc("host0", 1)
        await kvd.expect("r", "host0", pool.layout, 0, ids)
        failed: list[ConnectionClosed] = []

        async def wait() -> None:
            with pytest.raises(ConnectionClosed) as info:
                await kvd.wait("r", timeout_s=600)
            failed.append(info.value)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            # whether the wait is on the wire yet or not, it fails with the same advice
            await trio.to_thread.run_sync(d.kill)
        [exc] = failed
        assert exc.message.startswith(("the daemon closed the connection; ", "connection to the daemon broke: ",
                                       "cannot send to the daemon: ")), exc.message
        assert exc.message.endswith(LOST), exc.message


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run a client as another uid")
@pytest.mark.parametrize("access", [None, {"allowed_uids": [1234]}])
def test_a_refused_user_is_told_how_to_get_in(daemon_factory: Callable[..., DaemonProcess], short_tmp: Path,
                                              access: dict[str, list[int]] | None) -> None:
    """A user the ``[access]`` policy refuses was told who may connect, not what to change."""
    short_tmp.chmod(0o755)
    cfg: dict[str, Any] = {"pools": [host_pool("host0")], "socket_mode": 0o666}
    if access is not None:
        cfg["access"] = access
    d = daemon_factory(cfg, name="acl")
    run = _as_nobody([sys.executable, "-c", CLIENT, d.socket_path])
    assert run.returncode == 0, run.stderr
    [result] = [json.loads(line) for line in run.stdout.splitlines()]
    assert result["ok"] is False and result["code"] == "permission_denied", result
    said = result["message"]
    assert said.startswith(f"peer pid {result['pid']} (uid {NOBODY}, gid {NOBODY}) is not allowed to use this daemon: ")
    if access is None:
        assert said.endswith("only root, uid 0 and members of group 0 may connect; add this user to group 0 "
                             "(usermod -aG, effective from its next login), or list its uid or gid in [access] "
                             "allowed_uids / allowed_gids of the daemon's configuration"), said
    else:
        assert said.endswith("members of gids []; list this uid or one of its groups in [access] allowed_uids / "
                             "allowed_gids of the daemon's configuration"), said
