"""The services' loops stop when they are stopped: a sleep that a wake-up and a cancel
reach in the same pass of the loop ends with the cancel, and ``stop`` ends a task that
lost one cancel, without swallowing its caller's own."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from libs.common import waits


async def _sleeper(event: asyncio.Event, turns: list[int]) -> None:
    """A service loop's shape: a turn, then a sleep until woken or a tick passes."""
    while True:
        turns.append(1)
        event.clear()
        await waits.woken(event, 30.0)


def test_a_sleep_woken_as_it_is_cancelled_ends_with_the_cancel() -> None:
    async def run() -> None:
        for passes in range(4):  # the cancel 0 to 3 passes of the loop after the wake
            event, turns = asyncio.Event(), []
            task = asyncio.create_task(_sleeper(event, turns))
            await asyncio.sleep(0.01)
            event.set()
            for _ in range(passes):
                await asyncio.sleep(0)
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=2)
            # asyncio.wait_for(event.wait(), 30) lost this cancel for 0 to 2 passes
            assert done, f"the cancel {passes} passes after the wake was lost"
            assert task.cancelled()

    asyncio.run(run())


def test_woken_says_whether_the_event_was_set() -> None:
    async def run() -> tuple[bool, bool]:
        event = asyncio.Event()
        asyncio.get_running_loop().call_later(0.01, event.set)
        return await waits.woken(event, 5.0), await waits.woken(asyncio.Event(), 0.01)

    assert asyncio.run(run()) == (True, False)


async def _deaf_once(ended: list[str]) -> None:
    """A task that loses the first cancel it gets (a library that caught it), then ends
    on the next."""
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(30)
    try:
        await asyncio.sleep(30)
    finally:
        ended.append("ended")


def test_stop_cancels_again_a_task_that_lost_a_cancel() -> None:
    async def run() -> list[str]:
        ended: list[str] = []
        task = asyncio.create_task(_deaf_once(ended))
        await asyncio.sleep(0)
        await asyncio.wait_for(waits.stop(task), 5)
        assert task.cancelled()
        return ended

    assert asyncio.run(run()) == ["ended"]


def test_a_cancel_of_the_caller_waits_for_the_stop_then_is_raised() -> None:
    """A stop of the stopper (the lifespan's, as a leader steps down) was swallowed by
    ``await task`` under suppress(CancelledError): it campaigned again, for good."""

    async def run() -> list[str]:
        ended: list[str] = []
        inner = asyncio.create_task(_deaf_once(ended))
        await asyncio.sleep(0)
        outer = asyncio.create_task(waits.stop(inner))
        await asyncio.sleep(0.01)
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        assert inner.done()
        return ended

    assert asyncio.run(run()) == ["ended"]


def test_awaiting_names_each_coroutine_down_to_where_the_task_waits() -> None:
    async def run() -> str:
        task = asyncio.create_task(_sleeper(asyncio.Event(), []), name="sleeper")
        await asyncio.sleep(0.01)
        where = waits.awaiting(task)
        await waits.stop(task)
        return where

    where = asyncio.run(run())
    assert where.startswith("task sleeper:\n")
    assert [line.rsplit(" in ", 1)[1] for line in where.splitlines()[1:4]] == [
        "_sleeper",
        "woken",
        "wait",  # asyncio.Event.wait, under asyncio.timeout
    ]
