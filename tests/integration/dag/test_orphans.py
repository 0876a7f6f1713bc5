"""A release whose task core accepted but whose recording failed, and the run cancelled
before the next turn: the cancel still reaches that task, found by its idempotency key."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from tests.fixtures.dag import DagServer, Runner, Worker, node, workflow
from tests.support import wait_for

pytestmark = pytest.mark.slow
DB = psycopg.Connection[tuple[Any, ...]]

# Fault injection: recording the release of node "victim" fails, as if the DAG service's
# database went away between core's answer and the record.
FAIL_RECORD = """
CREATE FUNCTION dag.fail_victim() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.name = 'victim' AND NEW.state = 'released' THEN
        RAISE EXCEPTION 'injected: recording the release failed';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER fail_victim BEFORE UPDATE ON dag.nodes FOR EACH ROW
EXECUTE FUNCTION dag.fail_victim();
"""


def _core_task(db: DB, run_id: int, name: str) -> tuple[Any, ...] | None:
    return db.execute(
        "SELECT id, state FROM core.tasks WHERE labels->>'cairn.dag/run' = %s"
        " AND labels->>'cairn.dag/node' = %s",
        (str(run_id), name),
    ).fetchone()


def test_cancelling_a_run_cancels_a_task_whose_release_was_never_recorded(
    dag: DagServer, runner: Runner, worker: Worker, db: DB
) -> None:
    db.execute(FAIL_RECORD)
    runner.define(workflow("orphan", [node("victim", args=("hold",))]))
    run_id = runner.start("orphan")["id"]
    wait_for(lambda: _core_task(db, run_id, "victim"), timeout=30)
    answer = runner.http.post(f"/v1/runs/{run_id}/cancel")
    assert answer.status_code == 200, answer.text
    db.execute("DROP TRIGGER fail_victim ON dag.nodes")
    wait_for(lambda: (_core_task(db, run_id, "victim") or (0, ""))[1] == "cancelled", timeout=30)
    wait_for(lambda: runner.get(run_id)["nodes"][0]["state"] == "cancelled", timeout=30)
    assert runner.get(run_id)["state"] == "cancelled"
