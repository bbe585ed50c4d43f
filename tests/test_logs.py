"""kvd.ops.logs: JSON lines, console on a tty, contextvars, level filtering, idempotence."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from kvd.ops.logs import configure_logging, get_logger, reset_logging

ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")


class TtyStringIO(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _clean_logging() -> Iterator[None]:
    reset_logging()
    structlog.contextvars.clear_contextvars()
    yield
    reset_logging()
    structlog.contextvars.clear_contextvars()


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    log = get_logger("kvd.test")
    log.info("pool.ready", pool="p0", blocks=128)
    log.warning("pool.fabric_unavailable", reason="CUDA_ERROR_NOT_PERMITTED")
    first, second = lines(out)
    assert first["event"] == "pool.ready"
    assert first["level"] == "info"
    assert first["logger"] == "kvd.test"
    assert first["pool"] == "p0"
    assert first["blocks"] == 128
    assert ISO_UTC.match(first["timestamp"]), first["timestamp"]
    assert second["level"] == "warning"
    assert second["reason"] == "CUDA_ERROR_NOT_PERMITTED"


def test_auto_is_json_when_not_a_tty_and_console_on_a_tty() -> None:
    out = io.StringIO()
    configure_logging("auto", "info", stream=out)
    get_logger("t").info("hello", x=1)
    assert lines(out)[0]["event"] == "hello"

    tty = TtyStringIO()
    configure_logging("auto", "info", stream=tty)
    get_logger("t").info("hello", x=1)
    text = tty.getvalue()
    assert "hello" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_console_format() -> None:
    out = io.StringIO()
    configure_logging("console", "debug", stream=out)
    get_logger("t").debug("transfer.done", request_id="r1")
    text = out.getvalue()
    assert "transfer.done" in text
    assert "request_id" in text and "r1" in text


def test_contextvars_appear() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    log = get_logger("kvd.executor.session")
    structlog.contextvars.bind_contextvars(request_id="req-42", session=7)
    log.info("transfer.start")
    structlog.contextvars.unbind_contextvars("request_id")
    log.info("transfer.other")
    first, second = lines(out)
    assert first["request_id"] == "req-42"
    assert first["session"] == 7
    assert "request_id" not in second
    assert second["session"] == 7


@pytest.mark.parametrize(
    ("level", "expected"),
    [
        ("debug", ["d", "i", "w", "e"]),
        ("info", ["i", "w", "e"]),
        ("warning", ["w", "e"]),
        ("error", ["e"]),
        ("WARNING", ["w", "e"]),
    ],
)
def test_level_filtering(level: str, expected: list[str]) -> None:
    out = io.StringIO()
    configure_logging("json", level, stream=out)
    log = get_logger("t")
    log.debug("d")
    log.info("i")
    log.warning("w")
    log.error("e")
    assert [line["event"] for line in lines(out)] == expected


def test_module_level_logger_follows_reconfiguration() -> None:
    log = get_logger("early")  # created before configure, like module-level loggers
    first = io.StringIO()
    configure_logging("json", "info", stream=first)
    log.info("one")
    second = io.StringIO()
    configure_logging("json", "info", stream=second)
    log.info("two")
    assert [line["event"] for line in lines(first)] == ["one"]
    assert [line["event"] for line in lines(second)] == ["two"]


def test_idempotent() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    configure_logging("json", "info", stream=out)
    configure_logging("json", "info", stream=out)
    get_logger("t").info("once")
    logging.getLogger("lib").warning("stdlib once")
    assert [line["event"] for line in lines(out)] == ["once", "stdlib once"]
    ours = [h for h in logging.getLogger().handlers if getattr(h, "stream", None) is out]
    assert len(ours) == 1


def test_stdlib_logging_is_rendered_too() -> None:
    out = io.StringIO()
    configure_logging("json", "warning", stream=out)
    structlog.contextvars.bind_contextvars(request_id="r9")
    logging.getLogger("some.library").info("dropped")
    logging.getLogger("some.library").warning("careful %s", "now")
    (line,) = lines(out)
    assert line["event"] == "careful now"
    assert line["level"] == "warning"
    assert line["logger"] == "some.library"
    assert line["request_id"] == "r9"
    assert ISO_UTC.match(line["timestamp"])


def test_exceptions_in_json() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        get_logger("t").exception("transfer.failed")
    (line,) = lines(out)
    assert line["level"] == "error"
    assert "RuntimeError: boom" in line["exception"]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="format"):
        configure_logging("xml", "info", stream=io.StringIO())
    with pytest.raises(ValueError, match="level"):
        configure_logging("json", "loud", stream=io.StringIO())


def test_capture_logs_works_with_our_loggers() -> None:
    configure_logging("json", "info", stream=io.StringIO())
    with capture_logs() as captured:
        get_logger("t").warning("transfer.bounce_fallback", peer="b")
    assert captured == [{"event": "transfer.bounce_fallback", "peer": "b", "log_level": "warning"}]


def test_console_off_a_tty_has_no_escape_codes() -> None:
    out = io.StringIO()
    configure_logging("console", "info", stream=out)
    try:
        raise ZeroDivisionError("nope")
    except ZeroDivisionError:
        get_logger("t").exception("boom")
    text = out.getvalue()
    assert "\x1b[" not in text
    assert "ZeroDivisionError: nope" in text


def test_json_lines_are_compact_json_with_structlogs_fallbacks() -> None:
    """The renderer is msgspec's JSON encoder: each line is compact JSON (``"event":"x"``, what
    log readers match on), values JSON cannot hold become their ``__structlog__()`` or
    ``repr``, and a NaN is ``null`` (valid JSON, where ``json.dumps`` wrote ``NaN``)."""

    class Custom:
        def __structlog__(self) -> dict[str, int]:
            return {"n": 1}

    class Opaque:
        def __repr__(self) -> str:
            return "<opaque>"

    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    get_logger("kvd.test").info("transfer.done", stages={"planned": 0.5}, custom=Custom(), opaque=Opaque(),
                                text="é\u2028", nan=float("nan"), pair=(1, 2))
    line = out.getvalue().splitlines()[0]
    record = json.loads(line)
    assert line == json.dumps(record, separators=(",", ":"))  # compact, and ASCII: U+2028 stays escaped
    assert len(out.getvalue().splitlines()) == 1
    assert '"event":"transfer.done"' in line
    assert record["custom"] == {"n": 1} and record["opaque"] == "<opaque>" and record["pair"] == [1, 2]
    assert record["text"] == "é\u2028" and record["nan"] is None


def test_timestamps_always_carry_microseconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Six digits of fraction on every line, a whole second included; the date is formatted
    once per second and a new second gets its own."""
    import time as time_mod

    from kvd.ops.logs import _UtcStamper

    stamper = _UtcStamper()
    now = [1767225599.0]  # 2025-12-31T23:59:59 UTC, a whole second
    monkeypatch.setattr(time_mod, "time", lambda: now[0])
    assert stamper(None, "info", {})["timestamp"] == "2025-12-31T23:59:59.000000Z"
    now[0] = 1767225599.999999
    assert stamper(None, "info", {})["timestamp"].startswith("2025-12-31T23:59:59.99999")
    now[0] = 1767225600.25
    assert stamper(None, "info", {})["timestamp"] == "2026-01-01T00:00:00.250000Z"
    monkeypatch.undo()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", stamper(None, "info", {})["timestamp"])
