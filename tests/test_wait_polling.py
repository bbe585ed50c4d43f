"""``kvd.transfer.movers.wait_polling``: how the event loop waits for GPU work (the ctx side for
its kernel's completion, gen for a landed event), with trio's clock under the test's control."""

from __future__ import annotations

import trio
import trio.testing

from kvd.transfer.movers import KERNEL_LINK_BPS, wait_polling


async def test_asks_at_every_checkpoint_until_an_answer_other_than_false() -> None:
    answers = iter([False, False, True])
    asked = 0

    def ready() -> bool:
        nonlocal asked
        asked += 1
        return next(answers)

    assert await wait_polling(ready, 1 << 20) is True
    assert asked == 3
    assert await wait_polling(lambda: None, 1 << 20) is None  # the caller stopped asking


async def test_a_large_transfer_sleeps_through_half_its_expected_time_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    nbytes = int(KERNEL_LINK_BPS * 0.1)  # ~0.1 s expected
    times: list[float] = []

    def ready() -> bool:
        times.append(trio.current_time())
        return len(times) > 2

    t0 = trio.current_time()
    assert await wait_polling(ready, nbytes) is True
    # asked once at once, then after sleeping half the expected time less 1 ms, then again
    assert times[0] == t0 and abs(times[1] - t0 - 0.049) < 1e-9 and times[2] == times[1]
    done_at_once = [trio.current_time()]
    assert await wait_polling(lambda: True, nbytes) is True  # done before the sleep: no sleep
    assert trio.current_time() == done_at_once[0]
