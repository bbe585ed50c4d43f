"""The demo/bench scenario between two real daemons on host pools: its requests are byte-exact
with the blocks as allocated and with the same blocks in shuffled order (what the GPU bench
measures as its general case)."""

from __future__ import annotations

from pathlib import Path

from kvd.demo.pair import Scenario, start_pair


def test_shuffled_and_contiguous_requests_are_byte_exact(short_tmp: Path) -> None:
    ctx_d, gen_d = start_pair(short_tmp, gen_tp=4, blocks=16, bounce_mb=16, chunk_mb=2)
    try:
        for shuffle in (False, True):
            scenario = Scenario(ctx_d, gen_d, 12, shuffle=shuffle)
            try:
                # a fresh pool hands out consecutive ids; shuffled, no rank's ids are in order
                assert scenario.contiguous is not shuffle
                if shuffle:
                    assert all(ids != sorted(ids) for ids in (scenario.ctx_ids, *scenario.gen_ids))
                results, _ = scenario.transfer()
                assert {c.ok for c in results.values()} == {True}
                assert scenario.verify()
            finally:
                scenario.close()
    finally:
        ctx_d.stop()
        gen_d.stop()


def test_a_wrong_order_is_caught_by_verify(short_tmp: Path) -> None:
    """verify() compares rank by rank in request order: blocks moved in one order and checked
    in another fail (so the shuffled figures are checked, not assumed)."""
    ctx_d, gen_d = start_pair(short_tmp, gen_tp=4, blocks=8, bounce_mb=16, chunk_mb=2)
    try:
        scenario = Scenario(ctx_d, gen_d, 6, shuffle=True)
        try:
            scenario.transfer()
            assert scenario.verify()
            scenario.gen_ids[2].reverse()
            assert not scenario.verify()
        finally:
            scenario.close()
    finally:
        ctx_d.stop()
        gen_d.stop()
