"""Structured logging for the daemon: structlog, JSON lines for journald, console on a tty.

:func:`configure_logging` is called once by the CLI before ``serve()``; it is idempotent (the
same arguments again change nothing; new arguments reconfigure, last call wins — nothing is
stacked). Every line carries ``timestamp`` (ISO 8601, UTC), ``level``, ``event`` and, for
loggers from :func:`get_logger`, ``logger``; values bound with
``structlog.contextvars.bind_contextvars`` (request ids, session ids) are merged into every line
logged in that context. Records from the standard :mod:`logging` module (libraries) are
rendered the same way to the same stream.

Loggers are not cached on first use, so module-level loggers follow a later
:func:`configure_logging` and ``structlog.testing.capture_logs`` works in tests.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Literal, TextIO, cast

import msgspec
import structlog
from structlog.typing import EventDict, FilteringBoundLogger, Processor

__all__ = ["LogFormat", "configure_logging", "get_logger", "reset_logging"]

LogFormat = Literal["auto", "json", "console"]

_LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

# What the current configuration was made from (None = not configured by us).
_configured: tuple[str, int, int] | None = None
# The handler we put on the root stdlib logger (so a reconfigure replaces it, never stacks).
_stdlib_handler: logging.Handler | None = None
_stdlib_root_level: int | None = None


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):  # closed or exotic streams
        return False


def _resolve(fmt: str, level: str, stream: TextIO) -> tuple[Literal["json", "console"], int]:
    if fmt not in ("auto", "json", "console"):
        raise ValueError(f"log format must be 'auto', 'json' or 'console', not {fmt!r}")
    try:
        level_no = _LEVELS[level.lower()]
    except KeyError:
        raise ValueError(f"log level must be one of {sorted(_LEVELS)}, not {level!r}") from None
    if fmt == "auto":
        return ("console" if _is_tty(stream) else "json"), level_no
    return cast(Literal["json", "console"], fmt), level_no


def _json_fallback(obj: object) -> object:
    """What JSON cannot hold: its ``__structlog__()`` if it has one, else its ``repr`` (as
    structlog's own renderer does)."""
    structlog_form = getattr(obj, "__structlog__", None)
    return structlog_form() if callable(structlog_form) else repr(obj)


#: One encoder for every line. msgspec's, not the standard library's: a ``transfer.done``
#: line took 7.4 us to encode with ``json.JSONEncoder`` and 1.1 us with this one (timeit,
#: warm; several times that in a daemon's step, where caches are cold), and a daemon writes
#: one per request and side. Its lines are compact (``{"a":1}``), enums are their values,
#: sets lists, and a NaN is ``null`` (the standard encoder wrote ``NaN``, which is not JSON).
_JSON = msgspec.json.Encoder(enc_hook=_json_fallback)
#: For the rare line with text outside ASCII: msgspec writes it as it is, and a line holding
#: U+2028 or U+0085 is two lines to Python's ``str.splitlines`` (and to some log shippers);
#: escaped, as the standard encoder does, every line is one line to every reader.
_ASCII_JSON = json.JSONEncoder(default=_json_fallback, separators=(",", ":"), allow_nan=True)


def _dumps(event_dict: EventDict, **_kw: object) -> str:
    data = _JSON.encode(event_dict)
    if data.isascii():
        return data.decode()
    return _ASCII_JSON.encode(msgspec.json.decode(data))  # (NaN is null already: valid JSON)


class _UtcStamper:
    """``timestamp``: ISO 8601 UTC with microseconds (``2026-01-02T03:04:05.678901Z``), as
    ``TimeStamper(fmt="iso", utc=True)`` writes it (which leaves the fraction out in the rare
    whole second), with the date and time of day formatted once per second: a datetime and its
    ``isoformat`` were ~9 us of every line on a busy daemon, and a reply waits for its line."""

    def __init__(self) -> None:
        self._cache = (-1, "")  # (second, its formatted date and time): one tuple, swapped whole

    def __call__(self, logger: object, method_name: str, event_dict: EventDict) -> EventDict:
        now = time.time()
        second = int(now)
        cached, prefix = self._cache
        if cached != second:
            prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._cache = (second, prefix)
        event_dict["timestamp"] = f"{prefix}.{int((now - second) * 1e6):06d}Z"
        return event_dict


def _renderer(fmt: Literal["json", "console"], stream: TextIO) -> Processor:
    if fmt == "json":
        return structlog.processors.JSONRenderer(serializer=_dumps)
    tty = _is_tty(stream)
    return structlog.dev.ConsoleRenderer(
        colors=tty,
        # No local variables in tracebacks: they can hold secrets (peer secret) and are huge.
        # Off a tty, plain text (rich would still emit ANSI escapes).
        exception_formatter=(
            structlog.dev.RichTracebackFormatter(show_locals=False) if tty else structlog.dev.plain_traceback
        ),
    )


class _NamedWriteLogger(structlog.WriteLogger):
    """A WriteLogger that knows the name it was asked for (``get_logger(name)``)."""

    def __init__(self, file: TextIO, name: str) -> None:
        super().__init__(file)
        self.name = name


class _NamedWriteLoggerFactory:
    def __init__(self, file: TextIO) -> None:
        self._file = file

    def __call__(self, *args: object) -> _NamedWriteLogger:
        name = args[0] if args and isinstance(args[0], str) else ""
        return _NamedWriteLogger(self._file, name)


def _add_logger_name(logger: object, method_name: str, event_dict: EventDict) -> EventDict:
    name = getattr(logger, "name", "")
    if name and "logger" not in event_dict:
        event_dict["logger"] = name
    return event_dict


def configure_logging(
    fmt: LogFormat | str = "auto", level: str = "info", stream: TextIO | None = None, *, cache: bool = False
) -> None:
    """Configure structlog (and route stdlib :mod:`logging` through it) to write to ``stream``.

    ``fmt``: ``"json"`` (one JSON object per line), ``"console"`` (human-readable) or ``"auto"``
    (console when ``stream`` is a tty, JSON otherwise — journald is not a tty).
    ``level``: ``debug`` | ``info`` | ``warning`` | ``error`` | ``critical``; lower is dropped.
    ``stream`` defaults to ``sys.stdout`` (read at call time).
    ``cache``: each logger keeps the configuration it first logged with (no re-binding per
    line: the daemon, configured once per process, sets it; tests that reconfigure do not).
    Raises :class:`ValueError` for an unknown format or level.
    """
    global _configured, _stdlib_handler, _stdlib_root_level
    out: TextIO = sys.stdout if stream is None else stream
    resolved, level_no = _resolve(str(fmt), level, out)
    key = (resolved, level_no, id(out))
    if _configured == key and _stdlib_handler is not None:
        return

    timestamper = _UtcStamper()
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _add_logger_name,
        timestamper,
        structlog.processors.StackInfoRenderer(),
    ]
    if resolved == "json":
        shared.append(structlog.processors.format_exc_info)
    else:
        shared.append(structlog.dev.set_exc_info)
    renderer = _renderer(resolved, out)

    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        context_class=dict,
        logger_factory=_NamedWriteLoggerFactory(out),
        cache_logger_on_first_use=cache,
    )

    # Standard-library records (libraries, warnings) go through the same renderer.
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[
                structlog.contextvars.merge_contextvars,
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                timestamper,
                *([structlog.processors.format_exc_info] if resolved == "json" else []),
            ],
        )
    )
    handler.setLevel(level_no)
    root = logging.getLogger()
    if _stdlib_handler is not None:
        root.removeHandler(_stdlib_handler)
        _stdlib_handler.close()
    else:
        _stdlib_root_level = root.level
    root.addHandler(handler)
    root.setLevel(level_no)
    _stdlib_handler = handler
    _configured = key


def reset_logging() -> None:
    """Undo :func:`configure_logging`: structlog defaults, our stdlib handler removed (tests)."""
    global _configured, _stdlib_handler, _stdlib_root_level
    structlog.reset_defaults()
    root = logging.getLogger()
    if _stdlib_handler is not None:
        root.removeHandler(_stdlib_handler)
        _stdlib_handler.close()
        _stdlib_handler = None
    if _stdlib_root_level is not None:
        root.setLevel(_stdlib_root_level)
        _stdlib_root_level = None
    _configured = None


def get_logger(name: str, **initial_values: object) -> FilteringBoundLogger:
    """A structlog logger whose lines carry ``logger=name`` (plus any ``initial_values``).

    Safe at module level: it is a lazy proxy that picks up the configuration in force when it
    logs (do not ``.bind()`` at import time — that freezes the configuration of that moment).
    """
    return cast(FilteringBoundLogger, structlog.get_logger(name, **initial_values))
