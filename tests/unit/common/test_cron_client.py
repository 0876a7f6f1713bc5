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


BACKFILL = {
    "schedule_id": 5,
    "slots": 48,
    "queued": 40,
    "already": 8,
    "first": "2027-01-02T12:00:00Z",
    "last": "2027-01-04T11:00:00Z",
}


@respx.mock
def test_backfill_sends_from_and_to() -> None:
    route = respx.post(f"{CRON}/v1/schedules/5/backfill").mock(
        return_value=httpx.Response(202, json=BACKFILL)
    )
    start = datetime(2027, 1, 2, 12, tzinfo=UTC)
    end = datetime(2027, 1, 4, 11, tzinfo=UTC)
    done = run(lambda c: c.backfill(5, start, end))
    assert (done.slots, done.queued, done.already) == (48, 40, 8)
    assert json.loads(route.calls[0].request.content) == {
        "from": "2027-01-02T12:00:00Z",
        "to": "2027-01-04T11:00:00Z",
    }


@respx.mock
def test_cairn_cron_backfill_prints_what_it_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from cairn.cli import app

    route = respx.post(f"{CRON}/v1/schedules/5/backfill").mock(
        return_value=httpx.Response(202, json=BACKFILL)
    )
    monkeypatch.setenv("CAIRN_CRON_URL", CRON)
    monkeypatch.setenv("CAIRN_TOKEN", "tok")
    result = CliRunner().invoke(
        app,
        ["cron", "backfill", "5", "--from", "2027-01-02T12:00:00", "--to", "2027-01-04T11:00:00"],
    )
    assert result.exit_code == 0, result.output
    assert "48 slots" in result.output
    assert "40 queued" in result.output
    # A time without an offset is read as UTC.
    assert json.loads(route.calls[0].request.content)["from"] == "2027-01-02T12:00:00Z"
