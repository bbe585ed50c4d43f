"""Unit tests of the hardening pieces that need no daemon: who is an operator, the warning
throttle, configuration checks of the new limits, and the planner's size bound."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from kvd.config import config_from_dict
from kvd.daemon import check_config
from kvd.executor.peercred import AccessPolicy, Creds
from kvd.ops.throttle import Throttle
from kvd.regroup.plan import MAX_PLAN_ROWS, plan
from protocol.errors import BadRequest
from protocol.layout import KVLayout
from tests.conftest import host_pool

DAEMON_UID, DAEMON_GID, OPS = 990, 990, 4000
GROUPS = {1000: {1000, OPS}, 1001: {1001}}


def _groups(uid: int, gid: int) -> Collection[int]:
    return GROUPS.get(uid, set()) | {gid}


# --- operators -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("operator_gids", "creds", "reason"),
    [
        ((), Creds(1, 0, 0), "root"),
        ((), Creds(1, DAEMON_UID, 5), "daemon uid"),
        ((), Creds(1, 1000, DAEMON_GID), None),  # the daemon's group may connect, not operate
        ((OPS,), Creds(1, 1001, OPS), "operator group"),  # primary group
        ((OPS,), Creds(1, 1000, 1000), "operator group"),  # supplementary group
        ((OPS,), Creds(1, 1001, 1001), None),
        ((OPS,), Creds(1, -1, -1), None),  # no credentials
    ],
)
def test_operator_reason(operator_gids: tuple[int, ...], creds: Creds, reason: str | None) -> None:
    p = AccessPolicy((), (), DAEMON_UID, DAEMON_GID, operator_gids=operator_gids, group_lookup=_groups)
    assert p.operator_reason(creds) == reason
    assert str(DAEMON_UID) in p.operator_rule()


def test_operator_gids_come_from_access_config() -> None:
    cfg = config_from_dict({"access": {"operator_gids": [OPS]}}, env={})
    p = AccessPolicy.from_config(cfg.access, daemon_uid=DAEMON_UID, daemon_gid=DAEMON_GID)
    assert p.operator_gids == {OPS} and f"gids [{OPS}]" in p.operator_rule()


# --- the throttle ----------------------------------------------------------------------------------


def test_throttle_writes_one_line_per_window_with_a_count() -> None:
    now = [0.0]
    log = structlog.get_logger("test")
    t = Throttle(log, 10.0, clock=lambda: now[0])
    with capture_logs() as logs:
        assert t.warning("x.y", a=1)
        assert not t.warning("x.y", a=2)
        assert not t.warning("x.y", a=3)
        assert t.warning("other.event")  # events are throttled separately
        now[0] = 10.0
        assert t.warning("x.y", a=4)
        assert not t.warning("x.y", a=5)
    lines = [(e["event"], e.get("a"), e.get("suppressed")) for e in logs]
    assert lines == [("x.y", 1, None), ("other.event", None, None), ("x.y", 4, 2)]
    assert t.suppressed("x.y") == 1
    assert all(e["log_level"] == "warning" for e in logs)


def test_throttle_burst() -> None:
    now = [0.0]
    t = Throttle(structlog.get_logger("test"), 5.0, burst=3, clock=lambda: now[0])
    with capture_logs() as logs:
        written = [t.warning("e.v") for _ in range(5)]
    assert written == [True, True, True, False, False] and len(logs) == 3
    with pytest.raises(ValueError):
        Throttle(structlog.get_logger("test"), 0)


# --- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"limits": {"handshake_timeout_s": 0.0}}, r"\[limits\] handshake_timeout_s must be finite, > 0"),
        ({"limits": {"handshake_timeout_s": float("nan")}}, "handshake_timeout_s must be finite"),
        ({"limits": {"max_pending_connections": 0}}, "max_pending_connections must be at least 1"),
        ({"limits": {"max_pending_peers": 0}}, "max_pending_peers must be at least 1"),
        ({"limits": {"max_ranks_per_request": 0}}, "max_ranks_per_request must be at least 1"),
        ({"limits": {"operator_reserve": -1}}, "operator_reserve must be >= 0"),
        ({"drain_timeout_s": float("inf")}, "drain_timeout_s must be finite"),
        ({"drain_timeout_s": -1.0}, "drain_timeout_s must be finite, >= 0"),
        ({"transfer": {"deadline_s": float("nan")}}, r"\[transfer\] deadline_s must be finite"),
        ({"transfer": {"deadline_s": 2e5}}, "at most 86400 s"),
        ({"transfer": {"heartbeat_timeout_s": 0.0}}, "heartbeat_timeout_s must be finite, > 0"),
        ({"transfer": {"reconnect_initial_s": 0.0}}, r"\[transfer\] reconnect_initial_s must be finite, > 0"),
        ({"transfer": {"reconnect_max_s": float("inf")}}, "reconnect_max_s must be finite"),
        ({"transfer": {"reconnect_initial_s": 5.0, "reconnect_max_s": 2.0}},
         r"reconnect_max_s \(2\) is below reconnect_initial_s \(5\)"),
    ],
)
def test_check_config_refuses_unworkable_values(config: dict[str, Any], message: str) -> None:
    cfg = config_from_dict({"pools": [host_pool()], **config}, env={})
    with pytest.raises(BadRequest, match=message):
        check_config(cfg)


def test_check_config_accepts_the_defaults() -> None:
    check_config(config_from_dict({"pools": [host_pool()]}, env={}))


# --- the planner's bound ---------------------------------------------------------------------------


def test_plan_refuses_a_plan_too_large_before_sizing_it() -> None:
    blocks = 1 << 20
    layout = KVLayout(36, 8, 64, 32, "bfloat16", num_blocks=blocks)
    ids = list(range(blocks))  # 1M blocks x 36 layers x 2 x 8 heads: 604M rows
    with pytest.raises(BadRequest, match=f"exceed the limit of {MAX_PLAN_ROWS}"):
        plan(layout, layout, {0: ids}, {0: ids})
    small = plan(layout, layout, {0: ids[:256]}, {0: ids[:256]})  # a real request plans as before
    assert small.num_tokens == 256 * 32
