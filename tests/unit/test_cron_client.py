"""CronClient against a mocked cron service (respx)."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import httpx
import pytest
import respx

from libs.common.cron_client import CronClient
from libs.common.cron_models import ScheduleCreate, ScheduleUpdate
from libs.common.errors import InvalidInput, NotFound

CRON = "http://cron.test"
SCHEDULE = {
    "id": 5,
    "owner": "alice",
    "name": "n",
    "expression": "@daily",
    "timezone": "UTC",
    "target": {"kind": "dag", "workflow": "w", "params": {}},
    "misfire_policy": "fire_once",
    "catch_up_limit": 10,
    "misfire_grace_s": 60,
    "overlap_policy": "allow",
    "starts_at": None,
    "ends_at": None,
    "paused": False,
    "version": 1,
    "next_fire_at": "2027-01-05T00:00:00Z",
    "created_at": "2027-01-04T00:00:00Z",
    "updated_at": "2027-01-04T00:00:00Z",
}


def run(coro_fn):  # type: ignore[no-untyped-def]
    async def go():  # type: ignore[no-untyped-def]
        async with CronClient(CRON, "tok") as client:
            return await coro_fn(client)

    return asyncio.run(go())


@respx.mock
def test_create_sends_only_what_was_given() -> None:
    route = respx.post(f"{CRON}/v1/schedules").mock(return_value=httpx.Response(201, json=SCHEDULE))
    body = ScheduleCreate.model_validate(
        {"name": "n", "expression": "@daily", "target": {"kind": "dag", "workflow": "w"}}
    )
    made = run(lambda c: c.create(body))
    assert made.id == 5
    sent = json.loads(route.calls[0].request.content)
    assert sent == {
        "name": "n",
        "expression": "@daily",
        "target": {"kind": "dag", "workflow": "w"},
    }
    assert route.calls[0].request.headers["Authorization"] == "Bearer tok"


@respx.mock
def test_update_next_and_errors() -> None:
    patch = respx.patch(f"{CRON}/v1/schedules/5").mock(
        return_value=httpx.Response(200, json=SCHEDULE)
    )
    run(lambda c: c.update(5, ScheduleUpdate(expression="@hourly")))
    assert json.loads(patch.calls[0].request.content) == {"expression": "@hourly"}
    nxt = respx.get(f"{CRON}/v1/schedules/5/next").mock(
        return_value=httpx.Response(
            200,
            json={
                "schedule_id": 5,
                "timezone": "UTC",
                "after": "2027-03-13T00:00:00Z",
                "items": [],
            },
        )
    )
    run(lambda c: c.next(5, n=3, after=datetime(2027, 3, 13, tzinfo=UTC)))
    assert nxt.calls[0].request.url.params["n"] == "3"
    assert nxt.calls[0].request.url.params["after"] == "2027-03-13T00:00:00+00:00"
    respx.get(f"{CRON}/v1/schedules/9").mock(
        return_value=httpx.Response(
            404, json={"type": "https://cairn.dev/problems/not-found", "detail": "no schedule 9"}
        )
    )
    with pytest.raises(NotFound, match="no schedule 9"):
        run(lambda c: c.get(9))
    respx.post(f"{CRON}/v1/schedules").mock(
        return_value=httpx.Response(
            422,
            json={
                "type": "https://cairn.dev/problems/invalid-input",
                "detail": "body.expression: bad",
                "errors": [{"field": "body.expression", "reason": "bad"}],
            },
        )
    )
    body = ScheduleCreate.model_validate(
        {"name": "n", "expression": "x", "target": {"kind": "dag", "workflow": "w"}}
    )
    with pytest.raises(InvalidInput) as caught:
        run(lambda c: c.create(body))
    assert caught.value.extra["errors"][0]["field"] == "body.expression"
