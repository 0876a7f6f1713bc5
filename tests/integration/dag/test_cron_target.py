"""A schedule whose target is a workflow: cron starts runs in the real DAG service, for the
schedule's owner, once per slot; the overlap policy looks at the previous run."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg

from tests.fixtures.cron import EPOCH, FakeClock, start_cron
from tests.fixtures.dag import DagServer, Worker, node, workflow
from tests.integration.cron.test_api import schedule
from tests.support import Core, wait_for

Conn = psycopg.Connection[tuple[Any, ...]]


def fires(db: Conn, sid: int) -> list[tuple[str, int | None]]:
    return db.execute(
        "SELECT outcome, run_id FROM cron.fires WHERE schedule_id = %s ORDER BY fire_time",
        (sid,),
    ).fetchall()


def test_a_schedule_starts_workflow_runs_for_its_owner(
    core: Core, dag: DagServer, worker: Worker, tmp_path: Path, db: Conn
) -> None:
    with dag.client("alice") as alice:
        diamond = workflow(
            "diamond",
            [node("a"), node("b", "a"), node("c", "a"), node("d", "b", "c")],
        )
        assert alice.post("/v1/workflows", json=diamond).status_code == 201
        held = workflow("held", [node("h", args=("hold",))])
        assert alice.post("/v1/workflows", json=held).status_code == 201
    clock = FakeClock(EPOCH)
    cron = start_cron(core, tmp_path, clock, dag_url=dag.url)
    try:
        wait_for(lambda: cron.engine.leader)
        minutely = {"expression": "* * * * *", "timezone": "UTC"}
        with cron.client("alice") as client:
            made = client.post(
                "/v1/schedules",
                json=schedule(name="d", target={"kind": "dag", "workflow": "diamond"}, **minutely),
            )
            assert made.status_code == 201, made.text
            sid = made.json()["id"]
            forbid = client.post(
                "/v1/schedules",
                json=schedule(
                    name="h",
                    target={"kind": "dag", "workflow": "held"},
                    overlap_policy="forbid",
                    **minutely,
                ),
            ).json()["id"]
        clock.set(EPOCH.replace(second=0) + timedelta(minutes=1))
        wait_for(lambda: [f[0] for f in fires(db, sid)] == ["submitted"], timeout=20)
        [(_, run_id)] = fires(db, sid)
        assert run_id is not None
        with dag.client("alice") as alice:
            run = wait_for(
                lambda: (r := alice.get(f"/v1/runs/{run_id}").json())["state"] == "succeeded" and r,
                timeout=30,
            )
        assert run["owner"] == "alice"
        assert run["idempotency_key"] == f"cron:{sid}:2027-01-04T12:01:00+00:00"
        # The held run is still going at the next slot: forbid skips it.
        clock.set(EPOCH.replace(second=0) + timedelta(minutes=2))
        wait_for(lambda: len(fires(db, forbid)) == 2 and len(fires(db, sid)) == 2, timeout=20)
        assert [f[0] for f in fires(db, forbid)] == ["submitted", "skipped_overlap"]
        assert [f[0] for f in fires(db, sid)] == ["submitted", "submitted"]
        runs = db.execute("SELECT count(*) FROM dag.runs WHERE owner = 'alice'").fetchone()
        assert runs == (3,)
    finally:
        cron.stop()


def test_a_workflow_run_knows_its_slot_from_fire_slot(
    core: Core, dag: DagServer, worker: Worker, tmp_path: Path, db: Conn
) -> None:
    stamped = workflow(
        "stamped",
        [
            node(
                "a",
                args=("ok", "for {{ fire.slot }}", "{{ fire.schedule_id }}"),
                task={"env": {"S": "{{ fire.slot }}"}},
            )
        ],
    )
    with dag.client("alice") as alice:
        assert alice.post("/v1/workflows", json=stamped).status_code == 201
        # Started by hand, the templates are empty: no fire started the run.
        by_hand = alice.post("/v1/workflows/stamped/runs", json={}).json()
        refused = alice.post("/v1/workflows/stamped/runs", json={"params": {"fire": "x"}})
        assert refused.status_code == 422
    clock = FakeClock(EPOCH)
    cron = start_cron(core, tmp_path, clock, dag_url=dag.url)
    try:
        wait_for(lambda: cron.engine.leader)
        with cron.client("alice") as client:
            sid = client.post(
                "/v1/schedules",
                json=schedule(
                    name="s",
                    target={"kind": "dag", "workflow": "stamped"},
                    expression="* * * * *",
                    timezone="UTC",
                ),
            ).json()["id"]
        clock.set(EPOCH.replace(second=0) + timedelta(minutes=1))
        wait_for(lambda: [f[0] for f in fires(db, sid)] == ["submitted"], timeout=20)
        [(_, run_id)] = fires(db, sid)

        def task_of(run: int) -> Any:
            return db.execute(
                "SELECT args, env FROM core.tasks WHERE labels->>'cairn.dag/run' = %s",
                (str(run),),
            ).fetchone()

        args, env = wait_for(lambda: task_of(run_id), timeout=20)
        slot = "2027-01-04T12:01:00+00:00"
        assert args == ["ok", f"for {slot}", str(sid)]
        assert env == {"S": slot, "CAIRN_CRON_SLOT": slot, "CAIRN_CRON_SCHEDULE_ID": str(sid)}
        with dag.client("alice") as alice:
            run = alice.get(f"/v1/runs/{run_id}").json()
        assert run["params"]["fire"] == {
            "slot": slot,
            "schedule_id": sid,
            "backfill": False,
            "changed_by": "alice",
        }
        assert wait_for(lambda: task_of(by_hand["id"]), timeout=20) == (
            ["ok", "for ", ""],
            {"S": ""},
        )
    finally:
        cron.stop()
