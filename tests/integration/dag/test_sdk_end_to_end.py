"""cairn.sdk end to end: a workflow written in Python, applied by ``cairn dag apply``
through the real DAG service and core, run with params and followed by ``run.wait()``;
what the database holds afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest
from typer.testing import CliRunner

from cairn.cli import app
from cairn.sdk import Client, load_file
from libs.common.dag_models import WorkflowCreate
from tests.fixtures.dag import DagServer, Worker
from tests.support import TRUE_SHA

# The test worker ends a task by its arguments (tests/fixtures/dag.py, outcome_of):
# "out JSON" succeeds with JSON as its outputs, "fail" fails it.
PIPELINE = f"""
from cairn.sdk import MAP_ITEM, Artifact, Node, TriggerRule, Workflow, param

TRUE = Artifact(uri="file:///bin/true", sha256="{TRUE_SHA}")

with Workflow("sdk-files", params={{"day": "2026-12-01"}}) as files:
    extract = Node(
        "extract",
        artifact=TRUE,
        args=["out", '{{"files": ["a.csv", "b.csv", "c.csv"], "day": "' + param("day") + '"}}'],
        outputs=["files", "day"],
    )
    load = Node(
        "load",
        artifact=TRUE,
        args=["out", '{{"rows": "' + MAP_ITEM + '"}}'],
        map=extract.outputs.files,
        outputs=["rows"],
    )
    report = Node("report", artifact=TRUE, args=["ok", load.outputs.rows, extract.outputs.day])
    alert = Node("alert", artifact=TRUE, trigger_rule=TriggerRule.ONE_FAILED)
    extract >> load >> report >> alert
"""


def test_a_python_workflow_applied_by_the_cli_runs_to_its_end_through_the_sdk(
    dag: DagServer, worker: Worker, db: psycopg.Connection, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    dag.client("alice").close()  # makes alice's token
    token = dag.core.tokens["alice"]
    monkeypatch.setenv("CAIRN_DAG_URL", dag.url)
    monkeypatch.setenv("CAIRN_TOKEN", token)
    monkeypatch.setenv("CAIRN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("CAIRN_CONFIG", raising=False)
    pipeline = tmp_path / "pipeline.py"
    pipeline.write_text(PIPELINE)

    applied = CliRunner().invoke(app, ["dag", "apply", str(pipeline)])
    assert applied.exit_code == 0, applied.output
    assert "workflow sdk-files version 1 stored (4 nodes)" in applied.output
    [files] = load_file(pipeline)
    stored = db.execute(
        "SELECT definition FROM dag.workflows WHERE owner = 'alice' AND name = 'sdk-files'"
    ).fetchall()
    # what the service stored is the definition the SDK rendered
    assert [WorkflowCreate.model_validate(row[0]) for row in stored] == [files.render()]

    client = Client(dag.url, token)
    [again] = client.apply(files)
    assert (again.version, again.created) == (1, False)
    files.options["max_active_runs"] = 2  # a changed definition is the next version
    [changed] = client.apply(files)
    assert (changed.version, changed.created) == (2, True)
    result = client.start(files, {"day": "2026-12-04"}).wait(timeout_s=60, poll_s=0.05)

    assert result.check().state == "succeeded"
    assert result.outputs["load"] == {"rows": ["a.csv", "b.csv", "c.csv"]}
    rows = db.execute(
        "SELECT r.state, r.params, n.name, n.state, n.outputs FROM dag.runs r"
        " JOIN dag.nodes n ON n.run_id = r.id WHERE r.id = %s ORDER BY n.name",
        (result.id,),
    ).fetchall()
    assert {(r[0], json.dumps(r[1])) for r in rows} == {("succeeded", '{"day": "2026-12-04"}')}
    assert {r[2]: r[3] for r in rows} == {
        "alert": "skipped",
        "extract": "succeeded",
        "load": "succeeded",
        "load[0]": "succeeded",
        "load[1]": "succeeded",
        "load[2]": "succeeded",
        "report": "succeeded",
    }
    by_name = {r[2]: r[4] for r in rows}
    assert by_name["extract"] == {"files": ["a.csv", "b.csv", "c.csv"], "day": "2026-12-04"}
    assert [by_name[f"load[{i}]"] for i in range(3)] == [
        {"rows": f} for f in ("a.csv", "b.csv", "c.csv")
    ]
    report_args = db.execute(
        "SELECT t.args FROM dag.nodes n JOIN core.tasks t ON t.id = n.task_id"
        " WHERE n.run_id = %s AND n.name = 'report'",
        (result.id,),
    ).fetchone()
    assert report_args == (["ok", '["a.csv","b.csv","c.csv"]', "2026-12-04"],)
