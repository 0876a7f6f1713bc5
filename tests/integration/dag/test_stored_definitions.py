"""A workflow version whose stored definition the service can no longer parse (stored
under older bounds) is still shown, and so are its runs: the answers re-validated the
definition with the request models and were a 500."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cairn.cli import app
from tests.fixtures.dag import Runner, node, start_dag, workflow
from tests.support import TRUE_SHA, Core, cli_as

Conn = psycopg.Connection[tuple[Any, ...]]


def test_a_definition_stored_under_older_bounds_and_its_runs_are_shown(
    core: Core, tmp_path: Path, db: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = start_dag(core, tmp_path / "first")
    try:
        with first.client() as http:
            runner = Runner(http)
            runner.define(workflow("old", [node("a"), node("b", "a")]))
            run_id = runner.start("old")["id"]
    finally:
        first.stop()
    db.execute(
        "UPDATE dag.workflows SET definition = jsonb_set(definition,"
        " '{nodes,0,task,artifact,sha256}', to_jsonb(upper(%s))) WHERE name = 'old'",
        (TRUE_SHA,),
    )
    second = start_dag(core, tmp_path / "second")  # nothing parsed yet
    try:
        with second.client() as http:
            shown = http.get("/v1/workflows/old")
            run = http.get(f"/v1/runs/{run_id}")
            graph = http.get(f"/v1/runs/{run_id}/graph")
            retried = http.post(f"/v1/runs/{run_id}/retry")
        cli = cli_as(core, monkeypatch, tmp_path)
        monkeypatch.setenv("CAIRN_DAG_URL", second.url)
        status = cli.invoke(app, ["--json", "dag", "status", str(run_id)])
    finally:
        second.stop()
    assert shown.status_code == 200, shown.text
    task = shown.json()["definition"]["nodes"][0]["task"]
    assert task["artifact"]["sha256"] == TRUE_SHA.upper()
    assert run.status_code == 200, run.text
    nodes = [(n["name"], n["depends_on"], n["trigger_rule"]) for n in run.json()["nodes"]]
    assert nodes == [("a", [], "all_success"), ("b", ["a"], "all_success")]
    assert graph.status_code == 200, graph.text
    assert graph.json()["edges"] == [{"source": "a", "target": "b"}]
    # A change of such a run is refused saying why, not a 500.
    assert retried.status_code == 409, retried.text
    assert "can no longer be read" in retried.json()["detail"]
    assert status.exit_code == 0, status.output
    shown = json.loads(status.output)["nodes"]
    assert [(n["name"], n["depends_on"]) for n in shown] == [("a", []), ("b", ["a"])]
