"""``python -m kvd.bench.timeline`` through two real daemons on host pools: both daemons' step
traces come back, every request's marks fall inside its span in the order the transfer makes
them, and the report names them (no timing is asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvd.bench import timeline


def test_each_request_has_both_daemons_marks_in_order(tmp_path: Path) -> None:
    trace = timeline.run(tmp_path, geometry="tiny", blocks=1, requests=3, mapped=True, warmup=1)
    assert [r.rid for r in trace.requests] == ["t0", "t1", "t2"]
    assert set(trace.steps) == {"ctx", "gen"}
    starts = [r.t0 for r in trace.requests[1:]] + [float("inf")]
    for r, until in zip(trace.requests, starts, strict=True):
        assert set(r.done) == {"ctx", "gen0", "gen1", "gen2", "gen3"}
        assert all(t > r.t0 for t in r.done.values())
        # a daemon marks a reply once it is written, so the executor may hold it (and end the
        # request's span) first: a request's marks are those before the next request started,
        # which the bench does only once every executor has its completion
        ctx_marks, gen_marks = ([s.name for s in trace.steps[who] if r.t0 <= s.start < until and s.name.startswith("= ")]
                                for who in ("ctx", "gen"))
        publish = ctx_marks.index("= session.request Publish")
        data_out = next(i for i, m in enumerate(ctx_marks) if m.startswith("= feed DataOut"))
        assert publish < data_out
        assert any(m.startswith("= feed DataDoneReceived") for m in gen_marks)
        assert gen_marks.count("= session.replied Completion") == 4  # one per gen executor
    tasks = {name for name, _, _ in timeline.per_request(trace)["ctx"]}
    assert "kvd.executor.session.handle_connection" in tasks
    text = timeline.report(trace, show=2)
    assert text.startswith("3 requests, end to end p50")
    assert text.count("request t") == 2 and "= feed DataOut" in text


def test_bad_arguments_are_refused_before_any_daemon_starts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        timeline.main(["--requests", "0"])
    assert exc.value.code == 2
    assert "--blocks, --requests and --show must be positive" in capsys.readouterr().err
