"""A singleton loop that ends while its replica leads (a stray ``CancelledError``, a
``BaseException`` that escaped ``every``) fails the lead: the loops are stopped and started
again after a pause, instead of the replica leading on without one of them, unseen."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.core import loops


class Escaped(BaseException):
    """Not an ``Exception``: ``every`` lets it through."""


class Singletons:
    """A loop factory: each lead gets a long-lived loop and (in the first lead) one that
    ends as ``end`` says."""

    def __init__(self, end: str) -> None:
        self.end = end
        self.leads: list[list[asyncio.Task[None]]] = []

    async def _ends(self) -> None:
        await asyncio.sleep(0.05)
        if self.end == "cancelled":
            raise asyncio.CancelledError
        if self.end == "returned":
            return
        raise Escaped  # a BaseException that ``every`` does not catch

    def __call__(self) -> list[asyncio.Task[None]]:
        tasks = [asyncio.create_task(asyncio.sleep(3600), name="cairn-steady")]
        if not self.leads:
            tasks.append(asyncio.create_task(self._ends(), name="cairn-fragile"))
        self.leads.append(tasks)
        return tasks


@pytest.mark.parametrize("end", ["cancelled", "returned", "raised"])
def test_a_loop_that_ends_while_leading_restarts_the_lead(
    end: str, caplog: pytest.LogCaptureFixture
) -> None:
    singletons = Singletons(end)

    async def scenario() -> None:
        leadership = loops.Leadership(None, singletons, check_s=0.02)
        runner = asyncio.create_task(leadership.run())
        for _ in range(500):
            if len(singletons.leads) >= 2 and leadership.leading:
                break
            await asyncio.sleep(0.01)
        assert len(singletons.leads) == 2, "the lead was not started again"
        first, second = singletons.leads
        assert all(task.done() for task in first)  # the first lead's loops all stopped
        assert not any(task.done() for task in second)
        assert leadership.running == second
        assert not runner.done()
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
        assert all(task.done() for task in second)

    with caplog.at_level(logging.ERROR, logger="cairn.core.loops"):
        asyncio.run(scenario())
    assert "singleton loops ended while leading: cairn-fragile" in caplog.text
