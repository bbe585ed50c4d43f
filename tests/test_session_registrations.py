"""What a session remembers of its registrations (``Session.registrations``), and what a wait on
a request the engine does not hold for the session is told from it: waited twice, refused, or
never registered here (the daemon-level cases run real daemons in test_newcomer_errors.py)."""

from __future__ import annotations

import pytest

from kvd.config import Config
from kvd.daemon import Daemon
from kvd.executor.peercred import AccessPolicy
from kvd.executor.session import RECENT_REGISTRATIONS, REFUSAL_TEXT_LEN, Session
from kvd.ops.metrics import Metrics
from protocol import messages as m
from protocol.errors import BadRequest, DuplicateRequest, NotFound


def _session() -> Session:
    return Session(id=1, pid=1, uid=0, gid=0)


def test_a_refusal_is_kept_until_the_request_id_registers() -> None:
    s = _session()
    s.note_registration("r", BadRequest("block 3 is listed twice"))
    assert s.registrations == {"r": "[bad_request] block 3 is listed twice"}
    s.note_registration("r", DuplicateRequest("again"))  # the latest refusal says why
    assert s.registrations == {"r": "[duplicate_request] again"}
    s.note_registration("r")  # registered, corrected
    assert s.registrations == {"r": ""}
    # a refused second registration of a request the session registered does not undo that
    s.note_registration("r", DuplicateRequest("already registered"))
    assert s.registrations == {"r": ""}


def test_the_record_is_bounded_oldest_first_and_refusals_clipped() -> None:
    s = _session()
    for i in range(RECENT_REGISTRATIONS + 5):
        s.note_registration(f"r{i}")
    assert len(s.registrations) == RECENT_REGISTRATIONS
    assert "r4" not in s.registrations and "r5" in s.registrations
    s.note_registration("r5")  # registered again: the newest now, the last to go
    s.note_registration("x", BadRequest("y" * 10_000))
    assert list(s.registrations)[-2:] == ["r5", "x"]
    assert "r6" not in s.registrations and len(s.registrations) == RECENT_REGISTRATIONS
    assert len(s.registrations["x"]) <= REFUSAL_TEXT_LEN


class _NoRequests:
    """An engine that holds no request for any session (what it says is the engine's own)."""

    def completion_now(self, session: Session, msg: m.Wait) -> m.Completion | None:
        raise NotFound(f"request {msg.request_id!r} is not registered by this session")


def _daemon() -> Daemon:
    daemon = Daemon(Config(), {}, AccessPolicy(), Metrics(process_metrics=False))
    daemon.engine = _NoRequests()  # type: ignore[assignment]
    return daemon


def _told(daemon: Daemon, session: Session, rid: str) -> str:
    with pytest.raises(NotFound) as info:
        daemon.completion_now(session, m.Wait(id=1, request_id=rid))
    return info.value.message


def test_a_wait_on_a_request_the_engine_forgot_says_which_it_was() -> None:
    daemon, s = _daemon(), _session()
    assert _told(daemon, s, "never") == ("no request 'never' is registered by this session: wait on the "
                                         "session (Client) that registered it with expect or publish")
    s.note_registration("refused", BadRequest("block 3 is listed twice"))
    assert _told(daemon, s, "refused") == (
        "no request 'refused' is registered by this session: its registration was refused ([bad_request] "
        "block 3 is listed twice), and a refused registration registers nothing; register it again, corrected")
    # registered here, collected, and no longer in the daemon's history of ended requests
    s.note_registration("done")
    assert _told(daemon, s, "done") == (
        "request 'done' is not registered by this session any more: this session registered it, and its "
        "outcome was reported already; each session that registered a request is told the outcome by one "
        "wait, and then no more")
