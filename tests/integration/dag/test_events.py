"""Event nodes against a real core and PostgreSQL: a node waits for a named event (no
task reaches core), the event's data become its outputs and its downstream reads them,
an event delivered before the node waits is kept and counts, a wait past its timeout
takes its default, an event is kept once per run (the same again is a 200, other data a
409), a node ends its wait once whoever tries again, and a bad event node or event is a
422 naming its field. What the database holds is checked."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
from sqlalchemy.ext.asyncio import create_async_engine

from libs.common.dag_models import NodeState
from services.dag import store
from tests.fixtures.dag import DagServer, Runner, Worker, node, workflow
from tests.integration.dag.test_runs import _tasks
from tests.support import wait_for


def _wait(event: str, *depends_on: str, **spec: Any) -> dict:
    spec = {"name": event, "timeout_s": 3600, **spec}
    return {"name": f"wait-{event}", "event": spec, "depends_on": list(depends_on)}


def _row(db: psycopg.Connection, run_id: int, name: str) -> tuple[Any, ...]:
    found = db.execute(
        "SELECT state, error, outputs, event, wait_until IS NOT NULL, started_at IS NOT NULL"
        " FROM dag.nodes WHERE run_id = %s AND name = %s",
        (run_id, name),
    ).fetchone()
    assert found is not None
    return tuple(found)


def test_an_event_ends_the_wait_and_its_data_go_downstream(
    dag: DagServer, runner: Runner, worker: Worker, db: psycopg.Connection, db_url: str
) -> None:
    waiting = {**_wait("paid", "build"), "outputs": {"amount": {}}}
    after = node("ship", "wait-paid", args=("ok", "{{ nodes.wait-paid.outputs.amount }}"))
    runner.define(workflow("order", [node("build"), waiting, after]))
    run_id = runner.start("order")["id"]
    wait_for(lambda: _row(db, run_id, "wait-paid")[0] == "waiting", timeout=20, interval=0.05)
    assert _row(db, run_id, "wait-paid")[3:] == ("paid", True, True)
    assert set(_tasks(db, run_id)) == {"build"}  # the wait never reaches core

    path = f"/v1/runs/{run_id}/events/paid"
    sent = runner.http.post(path, json={"data": {"amount": 42, "extra": "x"}})
    assert sent.status_code == 201, sent.text
    assert sent.json()["node"] == "wait-paid" and sent.json()["sent_by"] == "alice"
    again = runner.http.post(path, json={"data": {"amount": 42, "extra": "x"}})
    assert again.status_code == 200, again.text
    other = runner.http.post(path, json={"data": {"amount": 7}})
    assert other.status_code == 409, other.text
    unknown = runner.http.post(f"/v1/runs/{run_id}/events/nobody-waits")
    assert unknown.status_code == 404, unknown.text
    with dag.client("mallory") as stranger:
        assert stranger.post(path, json={}).status_code == 404

    run = runner.wait_end(run_id)
    assert run["state"] == "succeeded", run
    assert _row(db, run_id, "wait-paid")[:3] == ("succeeded", None, {"amount": 42})
    assert _tasks(db, run_id)["ship"]["args"][-1] == "42"
    kept = db.execute("SELECT name, data FROM dag.run_events WHERE run_id = %s", (run_id,))
    assert kept.fetchall() == [("paid", {"amount": 42, "extra": "x"})]
    late = runner.http.post(path, json={"data": {"amount": 42, "extra": "x"}})
    assert late.status_code == 409, late.text  # the run ended
    assert _end_again(db_url, run_id) == []  # the guard in SQL: a wait ends once
    assert _row(db, run_id, "wait-paid")[:3] == ("succeeded", None, {"amount": 42})
    _refused(runner)


def test_an_early_event_is_kept_and_a_timeout_takes_its_default(
    runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    hold = {"name": "hold", "approval": {"timeout_s": 3600, "on_timeout": "reject"}}
    nodes = [
        hold,
        _wait("early", "hold"),
        _wait("never", "hold", timeout_s=1, on_timeout="fail"),
        _wait("quiet", "hold", timeout_s=1, on_timeout="succeed"),
        node("after", "wait-never", trigger_rule="all_done"),
    ]
    runner.define(workflow("early", nodes))
    run_id = runner.start("early")["id"]
    sent = runner.http.post(f"/v1/runs/{run_id}/events/early", json={"data": {"k": "v"}})
    assert sent.status_code == 201, sent.text
    assert sent.json()["node"] is None  # kept until a node waits for it
    wait_for(lambda: _row(db, run_id, "hold")[0] == "waiting", timeout=20, interval=0.05)
    assert runner.http.post(f"/v1/runs/{run_id}/nodes/hold/approve").status_code == 200

    run = runner.wait_end(run_id, timeout=30)
    assert run["state"] == "succeeded", run  # wait-never failed, but all_done below it ran
    assert _row(db, run_id, "wait-early")[:3] == ("succeeded", None, {})  # declares none
    assert _row(db, run_id, "wait-never")[:2] == ("failed", "no event 'never' within 1 s")
    assert _row(db, run_id, "wait-quiet")[:2] == ("succeeded", None)
    assert _row(db, run_id, "after")[0] == "succeeded"


def _end_again(db_url: str, run_id: int) -> list[str]:
    """What a second leader (or a restarted one) ends of the node: nothing, it ended."""

    async def again() -> list[str]:
        engine = create_async_engine(db_url)
        try:
            async with engine.begin() as conn:
                change = {"wait-paid": (NodeState.FAILED, "late", {"amount": 0})}
                return await store.end_waits(conn, run_id, change)
        finally:
            await engine.dispose()

    return asyncio.run(again())


def _refused(runner: Runner) -> None:
    both = {**node("w"), "event": {"name": "e", "timeout_s": 60}}
    answer = runner.http.post("/v1/workflows", json=workflow("bad", [both]))
    assert answer.status_code == 422 and "event" in answer.text, answer.text
    for bad in ({"name": "e", "timeout_s": 0}, {"name": "e e", "timeout_s": 5}):
        answer = runner.http.post("/v1/workflows", json=workflow("bad", [_wait("x", **bad)]))
        assert answer.status_code == 422 and "event" in answer.text, answer.text
    big = runner.http.post("/v1/runs/1/events/e", json={"data": {"k": "x" * 70_000}})
    assert big.status_code == 422 and "data" in big.text, big.text
