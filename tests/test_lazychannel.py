"""LazyChannel: items sent before anyone reads wait in order; reading opens the channel once."""

from __future__ import annotations

import pytest
import trio

from kvd.transfer.lazychannel import LazyChannel


async def test_items_sent_before_the_first_read_come_out_first_in_order() -> None:
    ch: LazyChannel[int] = LazyChannel()
    ch.send_nowait(1)
    ch.send_nowait(2)
    assert not ch.opened
    rx = ch.rx
    assert ch.opened and ch.rx is rx  # opened once
    ch.send_nowait(3)
    assert [rx.receive_nowait() for _ in range(3)] == [1, 2, 3]
    with pytest.raises(trio.WouldBlock):
        rx.receive_nowait()


async def test_a_reader_waiting_on_it_is_woken_by_a_send() -> None:
    ch: LazyChannel[str] = LazyChannel()
    got: list[str] = []

    async def reader(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        rx = ch.rx
        task_status.started()
        got.append(await rx.receive())

    async with trio.open_nursery() as nursery:
        await nursery.start(reader)
        ch.send_nowait("x")
    assert got == ["x"]
