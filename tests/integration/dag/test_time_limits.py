"""Time limits of the tasks cron and the DAG service submit (issue 31): both submit over
core's HTTP API, so core's one rule applies to them: a workflow's default ``timeout_s``
fills its nodes' (a run may set its own over it), a schedule's task template carries its own, a queue's default fills what
neither sets, and a timeout over the queue's maximum is refused by core and fails only that
node or fire, with the field named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg

from tests.fixtures.cron import start_cron
from tests.fixtures.dag import DagServer, Runner, Worker, node, states, workflow
from tests.integration.cron.test_api import schedule
from tests.support import Core, spec, wait_for

Conn = psycopg.Connection[tuple[Any, ...]]


def _limit(core: Core, queue: str, **limits: int) -> None:
    with core.client("root", "admin") as admin:
        assert admin.patch(f"/v1/queues/{queue}", json=limits).status_code == 200


def _timeouts(db: Conn, run_id: int | None = None) -> dict[str, int | None]:
    rows = db.execute(
        "SELECT labels->>'cairn.dag/node', timeout_s FROM core.tasks"
        " WHERE %s::text IS NULL OR labels->>'cairn.dag/run' = %s::text",
        (run_id, run_id),
    ).fetchall()
    return dict(rows)


def test_a_workflows_default_timeout_fills_its_nodes_and_core_holds_them_to_the_maximum(
    core: Core, dag: DagServer, runner: Runner, worker: Worker, db: Conn
) -> None:
    _limit(core, "default", default_timeout_s=30, max_timeout_s=600)
    body = workflow(
        "limits",
        [
            node("plain"),
            node("own", task={"timeout_s": 300}),
            node("long", task={"timeout_s": 900}),
        ],
        task_timeout_s=120,
    )
    run = runner.run(body, timeout=30)
    assert states(run) == {"plain": "succeeded", "own": "succeeded", "long": "failed"}
    [long] = [n for n in run["nodes"] if n["name"] == "long"]
    assert "timeout_s" in long["error"] and "maximum of 600 s" in long["error"]
    assert _timeouts(db) == {"plain": 120, "own": 300}
    # Without the workflow's default, the queue's applies.
    plain = runner.run(workflow("plain", [node("p")]), timeout=30)
    assert plain["state"] == "succeeded"
    assert db.execute(
        "SELECT timeout_s FROM core.tasks WHERE labels->>'cairn.dag/node' = 'p'"
    ).fetchone() == (30,)


def test_a_runs_own_default_timeout_fills_its_nodes_over_the_workflows(
    dag: DagServer, runner: Runner, worker: Worker, db: Conn
) -> None:
    body = workflow(
        "own-limit", [node("plain"), node("own", task={"timeout_s": 300})], task_timeout_s=120
    )
    runner.define(body)
    for bad in (0, 10**9, "x"):
        refused = runner.http.post("/v1/workflows/own-limit/runs", json={"task_timeout_s": bad})
        assert refused.status_code == 422, refused.text
        assert "body.task_timeout_s" in refused.text
    started = runner.start("own-limit", task_timeout_s=200)
    assert started["task_timeout_s"] == 200
    run = runner.wait_end(started["id"], timeout=30)
    assert run["state"] == "succeeded" and run["task_timeout_s"] == 200
    assert _timeouts(db, run["id"]) == {"plain": 200, "own": 300}
    stored = db.execute("SELECT task_timeout_s FROM dag.runs WHERE id = %s", (run["id"],))
    assert stored.fetchone() == (200,)
    # Without its own, the run keeps (and shows) the workflow's.
    again = runner.wait_end(runner.start("own-limit")["id"], timeout=30)
    assert again["state"] == "succeeded" and again["task_timeout_s"] == 120
    assert _timeouts(db, again["id"]) == {"plain": 120, "own": 300}


def test_a_schedules_tasks_get_the_queues_default_and_one_over_the_maximum_fails_its_fire(
    core: Core, tmp_path: Path, db: Conn
) -> None:
    _limit(core, "default", default_timeout_s=45, max_timeout_s=600)
    cron = start_cron(core, tmp_path)
    try:
        with cron.client("alice") as alice:
            plain = alice.post(
                "/v1/schedules", json=schedule(name="plain", expression="@yearly")
            ).json()["id"]
            target = {"kind": "task", "task": spec(name="long", timeout_s=900, max_wait_s=60)}
            over = alice.post(
                "/v1/schedules", json=schedule(name="over", target=target, expression="@yearly")
            ).json()["id"]
            absolute = {"kind": "task", "task": spec(start_by="2999-01-01T00:00:00Z")}
            refused = alice.post("/v1/schedules", json=schedule(name="x", target=absolute))
            assert refused.status_code == 422 and "start_by" in refused.text
            for sid in (plain, over):
                assert alice.post(f"/v1/schedules/{sid}/trigger").status_code in (200, 201, 202)

        def outcome(sid: int) -> tuple | None:
            return db.execute(
                "SELECT outcome, task_id, detail FROM cron.fires WHERE schedule_id = %s"
                " AND outcome <> 'pending'",
                (sid,),
            ).fetchone()

        done, task_id, _ = wait_for(lambda: outcome(plain), timeout=20)
        failed, _, detail = wait_for(lambda: outcome(over), timeout=20)
    finally:
        cron.stop()
    assert done == "submitted"
    assert db.execute("SELECT timeout_s FROM core.tasks WHERE id = %s", (task_id,)).fetchone() == (
        45,
    )
    assert failed == "failed" and "timeout_s" in detail
