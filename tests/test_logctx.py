"""kvd.ops.logctx: the request id bound for the lines logged meanwhile, restored after."""

from __future__ import annotations

import structlog
from structlog.testing import capture_logs
from structlog.typing import EventDict

from kvd.ops.logctx import bind_request_id, unbind_request_id

log = structlog.get_logger("test")


def _logged(event: str) -> EventDict:
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as lines:
        log.info(event)
    return lines[0]


def test_bound_for_the_lines_logged_meanwhile_and_unbound_after() -> None:
    assert "request_id" not in _logged("before")
    token = bind_request_id("r1")
    assert _logged("during")["request_id"] == "r1"
    unbind_request_id(token)
    assert "request_id" not in _logged("after")


def test_nested_binds_restore_the_outer_request() -> None:
    outer = bind_request_id("r1")
    same = bind_request_id("r1")
    assert same is None  # already bound: nothing to undo
    inner = bind_request_id("r2")
    assert _logged("inner")["request_id"] == "r2"
    unbind_request_id(inner)
    unbind_request_id(same)
    assert _logged("outer")["request_id"] == "r1"
    unbind_request_id(outer)
    assert "request_id" not in _logged("none")


def test_a_request_bound_by_bound_contextvars_is_the_same_key() -> None:
    with structlog.contextvars.bound_contextvars(request_id="r1"):
        assert bind_request_id("r1") is None
        token = bind_request_id("r2")
        assert _logged("inner")["request_id"] == "r2"
        unbind_request_id(token)
        assert _logged("outer")["request_id"] == "r1"
    assert "request_id" not in _logged("after")
