"""The resync finds what core's feed never delivered: a task purged by core's retention
before the DAG service read its outcome fails its node (the run ends instead of
wedging), and a finished task whose events are gone gives its node its real outcome."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from libs.common.dag_models import RUN_FINAL
from libs.common.states import TaskState
from tests.fixtures.dag import Runner, Worker, node, start_dag, workflow
from tests.support import Core, wait_for

pytestmark = pytest.mark.slow
DB = psycopg.Connection[tuple[Any, ...]]


def _first_task(db: DB, run_id: int) -> int | None:
    row = db.execute(
        "SELECT task_id FROM dag.nodes WHERE run_id = %s AND name = 'a'", (run_id,)
    ).fetchone()
    return row[0] if row else None


def _core_state(db: DB, task_id: int) -> str | None:
    row = db.execute("SELECT state FROM core.tasks WHERE id = %s", (task_id,)).fetchone()
    return row[0] if row else None


def _run_state(db: DB, run_id: int) -> str | None:
    row = db.execute("SELECT state FROM dag.runs WHERE id = %s", (run_id,)).fetchone()
    state = row[0] if row else None
    return state if state in RUN_FINAL else None


def _nodes(db: DB, run_id: int) -> dict[str, tuple[str, str | None]]:
    rows = db.execute("SELECT name, state, error FROM dag.nodes WHERE run_id = %s", (run_id,))
    return {name: (state, error) for name, state, error in rows}


def test_the_resync_ends_nodes_whose_outcome_the_feed_never_delivered(
    core: Core, db: DB, tmp_path: Path
) -> None:
    # Released, then the DAG service stops before any worker has run the tasks.
    dag = start_dag(core, tmp_path / "dag")
    try:
        with dag.client() as http:
            runner = Runner(http)
            runner.define(workflow("purged", [node("a"), node("b", "a")]))
            runner.define(workflow("unseen", [node("a"), node("b", "a")]))
            purged = runner.start("purged")["id"]
            unseen = runner.start("unseen")["id"]
        gone = wait_for(lambda: _first_task(db, purged), timeout=30)
        kept = wait_for(lambda: _first_task(db, unseen), timeout=30)
    finally:
        dag.stop()
    worker = Worker(core)
    try:
        for task_id in (gone, kept):
            wait_for(lambda t=task_id: _core_state(db, t) == TaskState.SUCCEEDED, timeout=30)
        # As core's retention would: one task with its events, the other's events only.
        db.execute("DELETE FROM core.task_events WHERE task_id = ANY(%s)", ([gone, kept],))
        db.execute("DELETE FROM core.tasks WHERE id = %s", (gone,))
        assert _nodes(db, purged)["a"][0] == _nodes(db, unseen)["a"][0] == "released"

        dag = start_dag(core, tmp_path / "dag2", dag_resync_s=0.2)
        try:
            assert wait_for(lambda: _run_state(db, purged), timeout=30) == "failed"
            assert wait_for(lambda: _run_state(db, unseen), timeout=30) == "succeeded"
        finally:
            dag.stop()
    finally:
        worker.stop()
    assert _nodes(db, purged) == {
        "a": ("failed", f"its task {gone} is gone from core (purged before its outcome was read)"),
        "b": ("upstream_failed", None),
    }
    assert _nodes(db, unseen) == {"a": ("succeeded", None), "b": ("succeeded", None)}
