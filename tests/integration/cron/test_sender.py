"""The cron service's use of core's client, against a mocked core (respx): batching per
owner, the idempotency key, what is retried and what is not."""

from __future__ import annotations

import asyncio
import itertools
import json
from datetime import UTC, datetime

import httpx
import respx

from libs.common.client import CoreClient
from services.cron.domain.fires import Result
from services.cron.fire import Outgoing, Sender
from tests.support import spec

CORE = "http://core.test"
SLOT = datetime(2027, 1, 4, 12, 1, tzinfo=UTC)


def outgoing(sid: int, owner: str = "alice") -> Outgoing:
    return Outgoing(sid, SLOT, False, owner, {"kind": "task", "task": spec(labels={"team": "x"})})


def send(items: list[Outgoing], chunk: int = 500) -> list[Result]:
    async def run() -> list[Result]:
        async with CoreClient(CORE, "svc") as core:
            return await Sender(core, chunk).send(items)

    return asyncio.run(run())


_ids = itertools.count(100)


def batch_answer(request: httpx.Request) -> httpx.Response:
    tasks = json.loads(request.content)["tasks"]
    items = [{"id": next(_ids), "state": "waiting", "created": True} for _ in tasks]
    return httpx.Response(201, json={"tasks": items})


@respx.mock
def test_fires_go_in_one_batch_naming_each_owner_with_key_and_labels() -> None:
    route = respx.post(f"{CORE}/v1/tasks/batch").mock(side_effect=batch_answer)
    results = send([outgoing(1), outgoing(2), outgoing(3, owner="bob")])
    assert [r.outcome for r in results] == ["submitted"] * 3
    assert route.call_count == 1
    sent = json.loads(route.calls[0].request.content)
    assert sent["owners"] == ["alice", "alice", "bob"]
    first = sent["tasks"][0]
    assert first["idempotency_key"] == "cron:1:2027-01-04T12:01:00+00:00"
    assert first["labels"] == {
        "team": "x",
        "cairn.cron/schedule": "1",
        "cairn.cron/fire-time": "2027-01-04T12:01:00+00:00",
        "cairn.cron/changed-by": "alice",
    }
    assert route.calls[0].request.headers["Authorization"] == "Bearer svc"


@respx.mock
def test_large_fires_are_chunked() -> None:
    route = respx.post(f"{CORE}/v1/tasks/batch").mock(side_effect=batch_answer)
    results = send([outgoing(i) for i in range(1, 8)], chunk=3)
    assert route.call_count == 3
    assert len({r.task_id for r in results}) == 7


@respx.mock
def test_core_unreachable_or_unavailable_leaves_fires_pending() -> None:
    respx.post(f"{CORE}/v1/tasks/batch").mock(side_effect=httpx.ConnectError("refused"))
    assert {r.outcome for r in send([outgoing(1), outgoing(2)])} == {"pending"}
    respx.post(f"{CORE}/v1/tasks/batch").mock(
        return_value=httpx.Response(
            503, json={"type": "https://cairn.dev/problems/unavailable", "detail": "db down"}
        )
    )
    assert {r.outcome for r in send([outgoing(1)])} == {"pending"}


@respx.mock
def test_a_refused_batch_is_split_to_find_the_bad_fire() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        tasks = json.loads(request.content)["tasks"]
        if any(t["labels"]["cairn.cron/schedule"] == "2" for t in tasks):
            return httpx.Response(
                422,
                json={"type": "https://cairn.dev/problems/invalid-input", "detail": "bad queue"},
            )
        return batch_answer(request)

    respx.post(f"{CORE}/v1/tasks/batch").mock(side_effect=answer)
    results = {r.schedule_id: r for r in send([outgoing(1), outgoing(2), outgoing(3)])}
    assert results[1].outcome == results[3].outcome == "submitted"
    assert results[2].outcome == "failed"
    assert results[2].detail is not None
    assert "bad queue" in results[2].detail


@respx.mock
def test_workflow_targets_fail_clearly_without_the_dag_service() -> None:
    item = Outgoing(1, SLOT, False, "alice", {"kind": "dag", "workflow": "w", "params": {}})
    [result] = send([item])
    assert result.outcome == "failed"
    assert result.detail is not None
    assert "DAG" in result.detail


DAG = "http://dag.test"


def send_runs(items: list[Outgoing]) -> list[Result]:
    from libs.common.dag_client import DagClient

    async def run() -> list[Result]:
        async with CoreClient(CORE, "svc") as core, DagClient(DAG, "svc") as dag:
            return await Sender(core, 500, dag).send(items)

    return asyncio.run(run())


@respx.mock
def test_workflow_fires_start_runs_for_the_owner_with_the_fire_key() -> None:
    route = respx.post(f"{DAG}/v1/workflows/nightly/runs").mock(
        return_value=httpx.Response(
            201,
            json={
                "id": 7,
                "owner": "alice",
                "workflow": "nightly",
                "workflow_version": 1,
                "params": {"day": "mon"},
                "state": "queued",
                "idempotency_key": "k",
                "created_at": "2027-01-04T12:01:00Z",
                "started_at": None,
                "finished_at": None,
            },
        )
    )
    target = {"kind": "dag", "workflow": "nightly", "params": {"day": "mon"}}
    [result] = send_runs([Outgoing(3, SLOT, False, "alice", target)])
    assert (result.outcome, result.run_id) == ("submitted", 7)
    request = route.calls[0].request
    assert request.headers["X-Cairn-On-Behalf-Of"] == "alice"
    assert json.loads(request.content) == {
        "params": {"day": "mon"},
        "idempotency_key": "cron:3:2027-01-04T12:01:00+00:00",
        "fire": {
            "slot": "2027-01-04T12:01:00Z",
            "schedule_id": 3,
            "backfill": False,
            "changed_by": "alice",
        },
    }


@respx.mock
def test_a_dag_service_that_is_down_leaves_workflow_fires_pending() -> None:
    respx.post(f"{DAG}/v1/workflows/nightly/runs").mock(side_effect=httpx.ConnectError("no"))
    target = {"kind": "dag", "workflow": "nightly", "params": {}}
    [result] = send_runs([Outgoing(3, SLOT, False, "alice", target)])
    assert result.outcome == "pending"
    assert result.detail is not None
    assert result.detail.startswith("dag:")


@respx.mock
def test_an_answer_core_took_but_cron_cannot_read_leaves_fires_pending() -> None:
    """A 201 whose body is not core's answer (a gateway's page passed for it, a core of
    another version): core may have made the tasks. Its ValidationError was taken for a
    refusal and the fires recorded failed, the slots lost; they stay pending, and the
    next send, under the same keys, finds the tasks."""
    route = respx.post(f"{CORE}/v1/tasks/batch").mock(
        side_effect=[
            httpx.Response(201, text="<html>gateway</html>"),
            httpx.Response(201, json={"tasks": [{"id": 7}]}),  # not a BatchItem
        ]
    )
    first = send([outgoing(1), outgoing(2)])
    second = send([outgoing(3)])
    assert [r.outcome for r in first + second] == ["pending"] * 3
    assert "could not be read" in (first[0].detail or "")
    assert route.call_count == 2  # not split to find a bad fire: none was refused
