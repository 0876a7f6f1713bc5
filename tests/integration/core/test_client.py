"""The typed client against a real core over HTTP."""

from __future__ import annotations

import asyncio

import pytest

from libs.common.client import CoreClient
from libs.common.errors import IllegalTransition, NotFound
from libs.common.models import TaskCreate
from libs.common.states import TaskState
from tests.support import Core, spec


def test_client_round_trip(core: Core) -> None:
    token = core.client("svc", "service").headers["authorization"].split()[1]

    async def scenario() -> None:
        async with CoreClient(core.url, token) as client:
            task, created = await client.submit(
                TaskCreate.model_validate(spec(idempotency_key="k"))
            )
            again, created_again = await client.submit(
                TaskCreate.model_validate(spec(idempotency_key="k"))
            )
            assert (created, created_again, again.id) == (True, False, task.id)
            items = await client.submit_batch([TaskCreate.model_validate(spec())] * 3)
            assert [i.created for i in items] == [True] * 3
            page = await client.list_tasks(state=TaskState.WAITING, limit=10)
            assert len(page.items) == 4
            cancelled = await client.cancel(task.id)
            assert cancelled.state is TaskState.CANCELLED
            with pytest.raises(IllegalTransition):
                await client.cancel(task.id)
            with pytest.raises(NotFound):
                await client.get_task(10**9)
            feed = await client.events(after="0.0", limit=100, wait=1)
            assert [e.op for e in feed.items][-1] == "cancel"
            assert [e.op for e in await client.task_events(task.id)] == ["submit", "cancel"]
            assert await client.attempts(task.id) == []
            assert {q.name for q in await client.queues()} == {"default"}

    asyncio.run(scenario())
