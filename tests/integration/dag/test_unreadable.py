"""A workflow version whose stored definition the DAG service can no longer read (stored
under older bounds, or by hand) fails its own runs, and every other workflow goes on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import psycopg

from tests.fixtures.dag import Runner, Worker, node, start_dag, workflow
from tests.support import Core, wait_for

Conn = psycopg.Connection[tuple[Any, ...]]


def test_a_run_whose_definition_cannot_be_read_fails_alone_and_the_others_run(
    core: Core, tmp_path: Path, worker: Worker, db: Conn
) -> None:
    """Its task's end came to a loop that could not parse the definition: the turn failed,
    was tried again with backoff, failed again, for ever, and no event behind it (every
    other workflow's) was applied any more, while /readyz said 200. Now the runs of that
    version fail, saying why, their open nodes are cancelled, and the loop goes on."""
    first = start_dag(core, tmp_path / "first")
    try:
        with first.client() as http:
            runner = Runner(http)
            runner.define(workflow("bad", [node("hold", args=("hold",)), node("after", "hold")]))
            runner.define(workflow("good", [node("one")]))
            bad = runner.start("bad")["id"]
            wait_for(lambda: worker.held)
    finally:
        first.stop()
    db.execute("UPDATE dag.workflows SET definition = definition || '{\"bogus\": 1}'"
               " WHERE name = 'bad'")  # fmt: skip
    second = start_dag(core, tmp_path / "second")
    try:
        with core.client("root", "admin") as admin:
            answer = admin.post(f"/v1/tasks/{worker.held[0]}/cancel")
            assert answer.status_code == 200, answer.text
        with second.client() as http:
            runner = Runner(http)
            good = runner.wait_end(runner.start("good")["id"], timeout=30)
        assert good["state"] == "succeeded"
        run = db.execute("SELECT state, reason FROM dag.runs WHERE id = %s", (bad,)).fetchone()
        assert run is not None and run[0] == "failed", run
        assert "definition" in run[1] and "bogus" in run[1], run
        nodes = db.execute(
            "SELECT name, state FROM dag.nodes WHERE run_id = %s ORDER BY name", (bad,)
        ).fetchall()
        assert nodes == [("after", "cancelled"), ("hold", "cancelled")]
        assert httpx.get(second.url + "/readyz").status_code == 200
    finally:
        second.stop()
