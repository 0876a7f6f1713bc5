"""The notification calls of CoreClient against a mocked core (respx)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
import respx

from libs.common.client import CoreClient
from libs.common.errors import InvalidInput, NotFound
from libs.common.models import NotificationEvent, SubscriptionCreate

CORE = "http://core.test"
SUBSCRIPTION: dict[str, Any] = {
    "id": 3,
    "owner": "alice",
    "name": "hook",
    "events": ["task.dead"],
    "filter": {"queue": None, "labels": {}},
    "url": "https://hooks.example.com/x",
    "enabled": True,
    "disabled_reason": None,
    "failures": 0,
    "created_at": "2026-12-01T00:00:00Z",
    "updated_at": "2026-12-01T00:00:00Z",
}
DELIVERY = {
    "delivery_id": "6f1c2c4e-2d43-4c47-9a53-0d1f7f0e6a11",
    "subscription_id": 3,
    "event": "test",
    "state": "pending",
    "tries": 0,
    "next_at": "2026-12-01T00:00:00Z",
    "created_at": "2026-12-01T00:00:00Z",
    "finished_at": None,
    "last_status": None,
    "last_error": None,
    "last_at": None,
}


def run(coro_fn):  # type: ignore[no-untyped-def]
    async def go():  # type: ignore[no-untyped-def]
        async with CoreClient(CORE, "tok") as client:
            return await coro_fn(client)

    return asyncio.run(go())


@respx.mock
def test_create_sends_the_spec_and_returns_the_secret_once() -> None:
    route = respx.post(f"{CORE}/v1/subscriptions").mock(
        return_value=httpx.Response(201, json={**SUBSCRIPTION, "secret": "whsec_abc"})
    )
    spec = SubscriptionCreate(name="hook", events=["task.dead"], url="https://hooks.example.com/x")
    made = run(lambda c: c.create_subscription(spec, on_behalf_of="alice"))
    assert made.secret == "whsec_abc"
    request = route.calls[0].request
    assert json.loads(request.content) == {
        "name": "hook",
        "events": ["task.dead"],
        "filter": {"queue": None, "labels": {}},
        "url": "https://hooks.example.com/x",
    }
    assert request.headers["X-Cairn-On-Behalf-Of"] == "alice"
    assert request.headers["Authorization"] == "Bearer tok"


@respx.mock
def test_list_test_log_and_delete() -> None:
    respx.get(f"{CORE}/v1/subscriptions").mock(
        return_value=httpx.Response(200, json={"items": [SUBSCRIPTION]})
    )
    respx.post(f"{CORE}/v1/subscriptions/3/test").mock(
        return_value=httpx.Response(202, json=DELIVERY)
    )
    answers = respx.get(f"{CORE}/v1/subscriptions/3/answers").mock(
        return_value=httpx.Response(
            200,
            json={
                "items": [
                    {
                        "delivery_id": DELIVERY["delivery_id"],
                        "event": "test",
                        "try": 1,
                        "at": "2026-12-01T00:00:01Z",
                        "status": 500,
                        "error": "down",
                        "duration_ms": 3.5,
                    }
                ]
            },
        )
    )
    gone = respx.delete(f"{CORE}/v1/subscriptions/3").mock(return_value=httpx.Response(204))
    assert [s.id for s in run(lambda c: c.subscriptions())] == [3]
    assert run(lambda c: c.test_subscription(3)).event == "test"
    [answer] = run(lambda c: c.answers(3, limit=5))
    assert (answer.try_, answer.status, answer.error) == (1, 500, "down")
    assert answers.calls[0].request.url.params["limit"] == "5"
    run(lambda c: c.delete_subscription(3))
    assert gone.called


@respx.mock
def test_problems_are_raised_as_their_errors() -> None:
    respx.get(f"{CORE}/v1/subscriptions/9").mock(
        return_value=httpx.Response(
            404,
            json={
                "type": "https://cairn.dev/problems/not-found",
                "title": "t",
                "status": 404,
                "detail": "no subscription 9",
            },
        )
    )
    respx.post(f"{CORE}/v1/notifications/events").mock(
        return_value=httpx.Response(
            422,
            json={
                "type": "https://cairn.dev/problems/invalid-input",
                "title": "t",
                "status": 422,
                "detail": "body.key: too long",
                "errors": [{"field": "body.key", "reason": "x"}],
            },
        )
    )
    with pytest.raises(NotFound, match="no subscription 9"):
        run(lambda c: c.subscription(9))
    event = NotificationEvent(event="run.failed", owner="alice", key="run 4")
    with pytest.raises(InvalidInput) as caught:
        run(lambda c: c.notify(event))
    assert caught.value.extra["errors"][0]["field"] == "body.key"


@respx.mock
def test_notify_posts_the_event_and_returns_the_count() -> None:
    route = respx.post(f"{CORE}/v1/notifications/events").mock(
        return_value=httpx.Response(202, json={"queued": 2})
    )
    event = NotificationEvent(event="fire.missed", owner="alice", key="schedule 1 at t")
    assert run(lambda c: c.notify(event)) == 2
    assert json.loads(route.calls[0].request.content) == {
        "event": "fire.missed",
        "owner": "alice",
        "key": "schedule 1 at t",
        "summary": "",
        "labels": {},
        "subject": {},
    }
