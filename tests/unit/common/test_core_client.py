from __future__ import annotations

import asyncio
import http.cookiejar
import json

import httpx
import pytest
import respx

from libs.common import client as client_module
from libs.common.client import CoreClient
from libs.common.errors import CairnError, IllegalTransition, InvalidInput, NotFound
from libs.common.models import (
    WORKER_LEASE_HEADER,
    AttemptReport,
    AuditReport,
    TaskCreate,
    Turn,
)
from tests.support import spec

BASE = "http://core.test"


def _problem(slug: str, status: int, detail: str, **extra: object) -> httpx.Response:
    body = {"type": f"https://cairn.dev/problems/{slug}", "title": "t", "status": status}
    return httpx.Response(status, json={**body, "detail": detail, **extra})


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


@respx.mock
def test_problem_answers_become_the_matching_errors() -> None:
    respx.get(f"{BASE}/v1/tasks/7").mock(
        return_value=_problem("not-found", 404, "task 7 not found")
    )
    respx.post(f"{BASE}/v1/tasks/7/cancel").mock(
        return_value=_problem("illegal-transition", 409, "cannot cancel a task that is succeeded")
    )
    respx.post(f"{BASE}/v1/tasks").mock(
        return_value=_problem(
            "invalid-input", 422, "body.name: too long", errors=[{"field": "body.name"}]
        )
    )

    async def calls() -> None:
        async with CoreClient(BASE, "tok") as client:
            with pytest.raises(NotFound, match="task 7 not found"):
                await client.get_task(7)
            with pytest.raises(IllegalTransition):
                await client.cancel(7)
            with pytest.raises(InvalidInput) as invalid:
                await client.submit(TaskCreate.model_validate(spec()))
            assert invalid.value.extra["errors"] == [{"field": "body.name"}]

    _run(calls())


@pytest.mark.parametrize(
    # a proxy's or load balancer's own answer; JSON that is not an object was an
    # AttributeError, which cron took for core refusing the fire (failed, not retried)
    "answer",
    [
        {"text": "bad gateway"},
        {"json": ["bad gateway"]},
        {"json": "bad gateway"},
        {"content": b"null"},
    ],
)
@respx.mock
def test_an_answer_without_a_problem_body_keeps_its_status(answer: dict[str, object]) -> None:
    respx.get(f"{BASE}/v1/queues").mock(return_value=httpx.Response(502, **answer))  # type: ignore[arg-type]

    async def call() -> None:
        async with CoreClient(BASE, None) as client:
            await client.queues()

    with pytest.raises(CairnError) as error:
        _run(call())
    assert error.value.status == 502


@respx.mock
def test_the_token_is_sent_and_201_means_created() -> None:
    route = respx.post(f"{BASE}/v1/tasks")
    task = {
        "id": 1, "owner": "a", "name": "n", "queue": "default", "priority": 0, "kind": "task",
        "artifact": spec()["artifact"], "args": [], "env": {}, "input_path": None,
        "output_path": None, "resources": {"cpu": 1, "memory_mb": 512}, "preemptible": False,
        "retry": {"max_attempts": 5}, "timeout_s": None, "run_at": "2026-11-30T00:00:00Z",
        "idempotency_key": None, "labels": {}, "state": "waiting", "attempts": 0,
        "last_error": None, "current_attempt_id": None, "created_at": "2026-11-30T00:00:00Z",
        "updated_at": "2026-11-30T00:00:00Z", "finished_at": None,
    }  # fmt: skip
    route.mock(side_effect=[httpx.Response(201, json=task), httpx.Response(200, json=task)])

    async def calls() -> list[bool]:
        async with CoreClient(BASE, "secret") as client:
            body = TaskCreate.model_validate(spec())
            return [(await client.submit(body))[1], (await client.submit(body))[1]]

    assert _run(calls()) == [True, False]
    assert route.calls[0].request.headers["authorization"] == "Bearer secret"


@respx.mock
def test_a_deprecated_call_is_warned_of_once_with_its_sunset(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sunset = "Wed, 30 Jun 2027 00:00:00 GMT"
    respx.get(f"{BASE}/v1/whoami").mock(
        return_value=httpx.Response(
            200,
            json={"name": "alice", "role": "user"},
            headers={"Deprecation": "@1796083200", "Sunset": sunset},
        )
    )

    async def calls() -> None:
        async with CoreClient(BASE, "tok") as client:
            await client.whoami()
            await client.whoami()

    with caplog.at_level("WARNING", logger="cairn.client"):
        _run(calls())
    warned = [r.getMessage() for r in caplog.records if r.name == "cairn.client"]
    assert warned == [f"GET /v1/whoami is deprecated (sunset: {sunset})"]


@respx.mock
def test_a_turn_goes_to_its_workers_path_under_the_base_with_the_lease() -> None:
    """The turn's URL is joined to the base once per worker: under a base with a path,
    for each worker in turn, with the client's headers as they are at each call."""
    answer = {"state": "live", "reports": [], "attempts": []}
    routes = {
        worker: respx.post(f"{BASE}/cairn/v1/workers/{worker}/turn").mock(
            return_value=httpx.Response(200, json=answer)
        )
        for worker in (5, 6)
    }

    async def calls() -> None:
        async with CoreClient(f"{BASE}/cairn", "tok") as client:
            client.use_lease("first")
            await client.turn(5, Turn())
            client.use_lease("second")
            await client.turn(5, Turn(started=[3]))
            await client.turn(6, Turn())

    _run(calls())
    first, second = routes[5].calls
    assert first.request.headers[WORKER_LEASE_HEADER] == "first"
    assert second.request.headers[WORKER_LEASE_HEADER] == "second"
    assert second.request.headers["content-type"] == "application/json"
    assert json.loads(second.request.content)["started"] == [3]
    assert routes[6].call_count == 1


@respx.mock
def test_a_turn_leaves_out_the_fields_it_does_not_use_as_an_older_core_takes_it() -> None:
    answer = {"state": "live", "reports": [], "attempts": []}
    route = respx.post(f"{BASE}/v1/workers/5/turn").mock(
        return_value=httpx.Response(200, json=answer)
    )

    async def calls() -> None:
        async with CoreClient(BASE, "tok") as client:
            await client.turn(5, Turn())
            await client.turn(5, Turn(draining=True, holding=[]))

    _run(calls())
    plain, drains = (json.loads(call.request.content) for call in route.calls)
    assert not {"progress", "holding", "draining"} & plain.keys()
    assert drains["draining"] is True and drains["holding"] == []


@respx.mock
def test_a_report_field_an_older_core_refuses_is_left_out_from_then_on() -> None:
    """Unset, ``log_bytes`` and ``hand_back_cause`` are not sent; set, and refused by a core
    that predates them (422: unknown field), the turn goes again without them, and so
    does every turn after. A 422 about anything else is raised as it was."""
    answer = {"state": "live", "reports": [], "attempts": []}
    unknown = [
        {"field": "body.reports.0.hand_back_cause", "reason": "Extra inputs are not permitted"}
    ]
    route = respx.post(f"{BASE}/v1/workers/5/turn").mock(
        side_effect=[
            _problem("invalid-input", 422, "body.reports.0.hand_back_cause: ...", errors=unknown),
            httpx.Response(200, json=answer),
            httpx.Response(200, json=answer),
            _problem("invalid-input", 422, "body.claim: bad", errors=[{"field": "body.claim"}]),
        ]
    )
    back = AttemptReport(attempt_id=3, outcome="handed_back", hand_back_cause="source")

    async def calls() -> None:
        async with CoreClient(BASE, "tok") as client:
            await client.turn(5, Turn(reports=[back]))
            await client.turn(
                5, Turn(reports=[back, AttemptReport(attempt_id=4, outcome="succeeded")])
            )
            with pytest.raises(InvalidInput):
                await client.turn(5, Turn(reports=[back]))

    _run(calls())
    bodies = [json.loads(call.request.content)["reports"] for call in route.calls]
    assert [[r.get("hand_back_cause") for r in b] for b in bodies] == [
        ["source"],
        [None],
        [None, None],
        [None],
    ]
    assert not any({"hand_back_cause", "log_bytes"} & r.keys() for b in bodies[1:] for r in b)
    assert route.call_count == 4


@respx.mock
def test_refused_report_fields_are_tried_again_after_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A field left out after a refusal is tried again ``REFUSED_FOR_S`` later (core may
    have been upgraded since): sent and taken, it is sent from then on."""
    answer = {"state": "live", "reports": [], "attempts": []}
    unknown = [{"field": "body.reports.0.log_bytes", "reason": "Extra inputs are not permitted"}]
    route = respx.post(f"{BASE}/v1/workers/5/turn").mock(
        side_effect=[
            _problem("invalid-input", 422, "body.reports.0.log_bytes: ...", errors=unknown),
            httpx.Response(200, json=answer),
            httpx.Response(200, json=answer),
            httpx.Response(200, json=answer),
            httpx.Response(200, json=answer),
        ]
    )
    now = [1000.0]
    monkeypatch.setattr(client_module.time, "monotonic", lambda: now[0])
    late = AttemptReport(attempt_id=3, outcome="succeeded", log_bytes=10)

    async def calls() -> None:
        async with CoreClient(BASE, "tok") as client:
            await client.turn(5, Turn(reports=[late]))  # refused, then sent without
            now[0] += client_module.REFUSED_FOR_S - 1
            await client.turn(5, Turn(reports=[late]))  # still left out
            now[0] += 2
            await client.turn(5, Turn(reports=[late]))  # tried again: taken
            await client.turn(5, Turn(reports=[late]))

    _run(calls())
    sent = [json.loads(call.request.content)["reports"][0].get("log_bytes") for call in route.calls]
    assert sent == [10, None, None, 10, 10]


@respx.mock
def test_a_post_passes_to_the_next_core_only_when_nothing_of_it_was_sent() -> None:
    other = "http://core-2.test"
    respx.post(f"{BASE}/v1/tasks/1/cancel").mock(side_effect=httpx.ConnectError("refused"))
    respx.post(f"{BASE}/v1/tasks/2/cancel").mock(side_effect=httpx.ReadError("reset"))
    respx.post(f"{other}/v1/tasks/1/cancel").mock(return_value=httpx.Response(204))
    second = respx.post(f"{other}/v1/tasks/2/cancel").mock(return_value=httpx.Response(204))

    async def both() -> None:
        async with CoreClient([BASE, other], "t") as core:
            await core._call("POST", "/v1/tasks/1/cancel")
            core._at = 0
            with pytest.raises(httpx.ReadError):
                await core._call("POST", "/v1/tasks/2/cancel")

    _run(both())
    assert second.call_count == 0


@respx.mock
def test_a_turn_that_cannot_reach_its_core_goes_to_the_next_ones_turn_path() -> None:
    """The turn's URL, joined once per worker, is joined to each replica's base: a turn
    whose core refuses its connection goes to the next core's path, and the turns after
    it too."""
    other = "http://core-2.test"
    answer = {"state": "live", "reports": [], "attempts": []}
    first = respx.post(f"{BASE}/v1/workers/5/turn")
    first.side_effect = [httpx.Response(200, json=answer), httpx.ConnectError("refused")]
    second = respx.post(f"{other}/v1/workers/5/turn").mock(
        return_value=httpx.Response(200, json=answer)
    )

    async def turns() -> None:
        async with CoreClient([BASE, other], "t") as core:
            for _ in range(3):
                await core.turn(5, Turn())

    _run(turns())
    assert (first.call_count, second.call_count) == (2, 2)


@respx.mock
def test_cookies_are_read_only_from_answers_that_set_one_and_still_sent_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading an answer's cookies cost a urllib request and response of each answer;
    the client reads them only from an answer with ``Set-Cookie``, and keeps and sends
    them as httpx does."""
    read: list[str] = []
    jar_reads = http.cookiejar.CookieJar.extract_cookies

    def counted(self: http.cookiejar.CookieJar, response: object, request: object) -> None:
        read.append("read")
        jar_reads(self, response, request)

    monkeypatch.setattr(http.cookiejar.CookieJar, "extract_cookies", counted)
    plain = respx.get(f"{BASE}/v1/queues").mock(
        return_value=httpx.Response(200, json={"items": []})
    )
    respx.get(f"{BASE}/v1/whoami").mock(
        return_value=httpx.Response(
            200, json={"name": "alice", "role": "user"}, headers={"Set-Cookie": "lb=7; Path=/"}
        )
    )

    async def calls() -> None:
        async with CoreClient(BASE, "tok") as client:
            await client.queues()
            assert read == []
            await client.whoami()
            assert read == ["read"]
            await client.queues()
            assert read == ["read"]

    _run(calls())
    assert "cookie" not in plain.calls[0].request.headers
    assert plain.calls[-1].request.headers["cookie"] == "lb=7"


@respx.mock
def test_an_audit_report_an_older_core_refuses_for_its_key_goes_again_without_it() -> None:
    """A core that predates audit reports' ``idempotency_key`` refuses it (422, unknown
    field) before recording anything: the DAG service logged the refusal and marked the
    decision audited, so it was never recorded. Sent again without the key, it is; a 422
    about anything else, or with no key to leave out, is raised as it was."""
    unknown = [{"field": "body.idempotency_key", "reason": "Extra inputs are not permitted"}]
    route = respx.post(f"{BASE}/v1/audit/reports").mock(
        side_effect=[
            _problem("invalid-input", 422, "body.idempotency_key: ...", errors=unknown),
            httpx.Response(201, json={}),
            _problem("invalid-input", 422, "body.target: bad", errors=[{"field": "body.target"}]),
            _problem("invalid-input", 422, "body.idempotency_key: ...", errors=unknown),
        ]
    )
    keyed = AuditReport(action="dag.approve", target="run:1/node:gate", idempotency_key="dag:1")

    async def calls() -> None:
        async with CoreClient(BASE, "tok") as client:
            await client.report_audit(keyed)
            with pytest.raises(InvalidInput):
                await client.report_audit(keyed)
            with pytest.raises(InvalidInput):  # nothing to leave out: raised
                await client.report_audit(keyed.model_copy(update={"idempotency_key": None}))

    _run(calls())
    bodies = [json.loads(call.request.content) for call in route.calls]
    assert [b.get("idempotency_key") for b in bodies] == ["dag:1", None, "dag:1", None]
    assert all(b["action"] == "dag.approve" for b in bodies)
    assert route.call_count == 4


@respx.mock
def test_a_heartbeats_seen_an_older_core_refuses_is_left_out_from_then_on() -> None:
    """A core older than ``Heartbeat.seen`` refuses it (422: unknown field): the beat goes
    again at once without it, and so do the beats after; a worker upgraded first kept
    beating (otherwise every beat failed and core buried it)."""
    unknown = [{"field": "body.seen", "reason": "Extra inputs are not permitted"}]
    route = respx.post(f"{BASE}/v1/workers/5/heartbeat").mock(
        side_effect=[
            _problem("invalid-input", 422, "body.seen: ...", errors=unknown),
            httpx.Response(200, json={"state": "live", "stop": []}),
            httpx.Response(200, json={"state": "live", "stop": []}),
        ]
    )

    async def calls() -> None:
        async with CoreClient(BASE, "tok") as client:
            assert (await client.heartbeat(5, [3], seen=3)).state == "live"
            assert (await client.heartbeat(5, [3, 4], seen=4)).state == "live"

    _run(calls())
    bodies = [json.loads(call.request.content) for call in route.calls]
    assert [b.get("seen") for b in bodies] == [3, None, None]
    assert [b["attempts"] for b in bodies] == [[3], [3], [3, 4]]
