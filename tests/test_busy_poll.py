"""``transfer.busy_poll``: while a request is unfinished the daemon's event loop spins instead of
sleeping in the kernel (a wake-up per hop costs ~0.3 ms on some hosts), and an idle daemon does
not spin. Real daemons, real sockets; the spin is observed through ``Stats``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from clients import open_client
from clients.client import AsyncClient
from kvd.config import BUSY_POLL_AUTO_CPUS, TransferConfig
from kvd.demo.launch import DaemonProcess
from protocol.layout import KVLayout
from tests.transfer_harness import assert_exact, run_transfer, start_pair

Factory = Callable[..., DaemonProcess]
GEO = {"num_layers": 2, "num_kv_heads": 8, "head_dim": 64, "tokens_per_block": 16, "dtype": "bfloat16"}
ONE = KVLayout(**GEO)  # type: ignore[arg-type]
TP2 = KVLayout(**GEO, tp_size=2)  # type: ignore[arg-type]


async def _settled(client: AsyncClient) -> int:
    """The busy-poll pass count once no transfer is active (the spin has parked)."""
    with trio.fail_after(20):
        while (st := await client.stats()).transfers_active:
            await trio.sleep(0.01)
    return st.busy_poll_passes


def _logged(d: DaemonProcess, event: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in d.log().splitlines() if f'"event":"{event}"' in line]


@pytest.mark.parametrize("gen_first", [True, False])
async def test_busy_poll_spins_while_a_request_is_pending_and_parks_when_idle(
        daemon_factory: Factory, short_tmp: Path, gen_first: bool) -> None:
    pair = start_pair(daemon_factory, short_tmp, ONE, TP2, mapped=True, transfer={"busy_poll": "on"})
    async with open_client(pair.ctx.socket_path) as c, open_client(pair.gen.socket_path) as g:
        before = {"ctx": await _settled(c), "gen": await _settled(g)}
        out = await run_transfer(pair, ONE, TP2, request_id="r-busy", blocks=4, gen_peer="ctx" if gen_first else "")
        assert_exact(out, TP2)
        after = {"ctx": await _settled(c), "gen": await _settled(g)}
        for name, client in (("ctx", c), ("gen", g)):
            st = await client.stats()
            assert st.busy_poll
            # it spun while the request was pending ...
            assert after[name] > before[name], (name, before, after)
            # ... and is parked now: other requests (these stats calls) do not make it spin
            assert st.busy_poll_passes == after[name]
            assert (await client.stats()).busy_poll_passes == after[name]
    for d in (pair.ctx, pair.gen):
        (line,) = _logged(d, "transfer.busy_poll")
        assert isinstance(line["cpus"], int) and line["cpus"] >= 1


async def test_busy_poll_off_never_spins(daemon_factory: Factory, short_tmp: Path) -> None:
    pair = start_pair(daemon_factory, short_tmp, ONE, TP2, mapped=True, transfer={"busy_poll": "off"})
    out = await run_transfer(pair, ONE, TP2, request_id="r-quiet", blocks=4, gen_peer="ctx")
    assert_exact(out, TP2)
    for d in (pair.ctx, pair.gen):
        async with open_client(d.socket_path) as client:
            st = await client.stats()
        assert not st.busy_poll and st.busy_poll_passes == 0
        assert _logged(d, "transfer.busy_poll") == []


@pytest.mark.parametrize(("cpus", "on"), [(2, False), (BUSY_POLL_AUTO_CPUS - 1, False), (BUSY_POLL_AUTO_CPUS, True),
                                          (128, True)])
def test_auto_spins_only_on_hosts_with_cores_to_spare(monkeypatch: pytest.MonkeyPatch, cpus: int, on: bool) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cpus)))
    assert TransferConfig().busy_poll == "auto"
    assert TransferConfig().busy_poll_on() is on
    assert TransferConfig(busy_poll="on").busy_poll_on() and not TransferConfig(busy_poll="off").busy_poll_on()
