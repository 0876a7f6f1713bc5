"""DagClient, the DAG service's typed client (cron's contract), against respx."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import respx

from libs.common.dag_client import DagClient
from libs.common.dag_models import RunState
from libs.common.errors import Conflict, Forbidden, NotFound

BASE = "http://dag.test"
RUN = {
    "id": 7, "owner": "bob", "workflow": "nightly", "workflow_version": 2,
    "params": {"day": "2026-11-30"}, "state": "queued", "idempotency_key": "cron:1:t",
    "created_at": "2026-11-30T00:00:00Z", "started_at": None, "finished_at": None,
    "nodes": [],
}  # fmt: skip


def _problem(slug: str, status: int, detail: str) -> httpx.Response:
    body = {"type": f"https://cairn.dev/problems/{slug}", "title": "t", "status": status}
    return httpx.Response(status, json={**body, "detail": detail})


@respx.mock
def test_start_run_sends_the_key_and_the_owner_and_tells_created_from_existing() -> None:
    route = respx.post(f"{BASE}/v1/workflows/nightly/runs").mock(
        side_effect=[httpx.Response(201, json=RUN), httpx.Response(200, json=RUN)]
    )

    async def twice() -> list[tuple[int, bool]]:
        async with DagClient(BASE, "svc-token") as client:
            out = []
            for _ in range(2):
                run, created = await client.start_run(
                    "nightly", {"day": "2026-11-30"}, "cron:1:t", on_behalf_of="bob"
                )
                out.append((run.id, created))
            return out

    assert asyncio.run(twice()) == [(7, True), (7, False)]
    sent = route.calls[0].request
    assert sent.headers["Authorization"] == "Bearer svc-token"
    assert sent.headers["X-Cairn-On-Behalf-Of"] == "bob"
    assert json.loads(sent.content) == {
        "params": {"day": "2026-11-30"},
        "idempotency_key": "cron:1:t",
    }


@respx.mock
def test_without_a_key_or_owner_neither_is_sent() -> None:
    route = respx.post(f"{BASE}/v1/workflows/w/runs").mock(
        return_value=httpx.Response(201, json=RUN)
    )

    async def call() -> None:
        async with DagClient(BASE, "t") as client:
            await client.start_run("w")

    asyncio.run(call())
    assert json.loads(route.calls[0].request.content) == {"params": {}}
    assert "X-Cairn-On-Behalf-Of" not in route.calls[0].request.headers


@respx.mock
def test_get_and_cancel_run_read_the_state() -> None:
    respx.get(f"{BASE}/v1/runs/7").mock(
        return_value=httpx.Response(200, json={**RUN, "state": "running"})
    )
    respx.post(f"{BASE}/v1/runs/7/cancel").mock(
        return_value=httpx.Response(200, json={**RUN, "state": "cancelled"})
    )

    async def calls() -> tuple[RunState, RunState]:
        async with DagClient(BASE, "t") as client:
            return (await client.get_run(7)).state, (await client.cancel_run(7)).state

    assert asyncio.run(calls()) == (RunState.RUNNING, RunState.CANCELLED)


@respx.mock
def test_problems_become_the_matching_errors() -> None:
    respx.get(f"{BASE}/v1/runs/8").mock(return_value=_problem("not-found", 404, "no run 8"))
    respx.post(f"{BASE}/v1/runs/9/cancel").mock(
        return_value=_problem("conflict", 409, "run 9 is succeeded")
    )
    respx.post(f"{BASE}/v1/workflows/w/runs").mock(
        return_value=_problem("forbidden", 403, "only the service role may use it")
    )

    async def calls() -> None:
        async with DagClient(BASE, "t") as client:
            with pytest.raises(NotFound, match="no run 8"):
                await client.get_run(8)
            with pytest.raises(Conflict, match="succeeded"):
                await client.cancel_run(9)
            with pytest.raises(Forbidden):
                await client.start_run("w", on_behalf_of="bob")

    asyncio.run(calls())


@respx.mock
def test_a_dag_service_that_cannot_be_reached_is_a_transport_error() -> None:
    respx.get(f"{BASE}/v1/runs/1").mock(side_effect=httpx.ConnectError("refused"))

    async def call() -> None:
        async with DagClient(BASE, "t") as client:
            await client.get_run(1)

    with pytest.raises(httpx.TransportError):
        asyncio.run(call())
