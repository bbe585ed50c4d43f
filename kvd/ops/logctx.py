"""The request id on log lines, bound cheaply where a transfer handles an event.

``structlog.contextvars.bound_contextvars`` copies the whole context on entry and binds,
unbinds and re-binds on exit: about 2 us, and a request's events bind its id a dozen times on
each daemon. :func:`bind_request_id` sets structlog's own context variable for the key
``request_id`` (lines logged meanwhile carry it, exactly as with ``bound_contextvars``) and
:func:`unbind_request_id` restores what was bound before, through the variable's token.
"""

from __future__ import annotations

import contextvars
from typing import Any

import structlog

__all__ = ["bind_request_id", "unbind_request_id"]


def _structlog_var(key: str) -> contextvars.ContextVar[Any]:
    """structlog's context variable for ``key`` (the one ``merge_contextvars`` reads), found
    through the token that binding it returns; the binding is undone at once."""
    token = structlog.contextvars.bind_contextvars(**{key: None})[key]
    token.var.reset(token)
    return token.var


_REQUEST_ID = _structlog_var("request_id")


def bind_request_id(request_id: str) -> contextvars.Token[Any] | None:
    """Bind ``request_id`` for the lines logged until :func:`unbind_request_id`; None when it
    is bound already (the transfer's own actor, or an event fed while it handles another)."""
    if _REQUEST_ID.get(None) == request_id:
        return None
    return _REQUEST_ID.set(request_id)


def unbind_request_id(token: contextvars.Token[Any] | None) -> None:
    """Restore the request id bound before the matching :func:`bind_request_id` (in the same
    step: a token is only valid in the context that made it)."""
    if token is not None:
        _REQUEST_ID.reset(token)
