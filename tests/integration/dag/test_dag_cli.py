"""``cairn dag run``, ``outputs``, ``clear`` and the rest against the real DAG service and core."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest
from typer.testing import CliRunner

from cairn.cli import app
from tests.fixtures.dag import DagServer, Runner, Worker, node, workflow
from tests.integration.dag.test_approvals import _gate, _row, _waiting
from tests.integration.dag.test_branches import _branching
from tests.support import wait_for


@pytest.fixture
def cli(dag: DagServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    dag.client("alice").close()  # makes alice's token
    monkeypatch.setenv("CAIRN_DAG_URL", dag.url)
    monkeypatch.setenv("CAIRN_URL", dag.core.url)
    monkeypatch.setenv("CAIRN_TOKEN", dag.core.tokens["alice"])
    monkeypatch.setenv("CAIRN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("CAIRN_CONFIG", raising=False)
    return CliRunner()


def test_outputs_are_listed_and_a_clear_reruns_from_a_node(
    cli: CliRunner, runner: Runner, worker: Worker
) -> None:
    body = workflow(
        "cli-data",
        [
            node("extract", args=("out", json.dumps({"rows": 7})), outputs={"rows": {}}),
            node("load", "extract", args=("ok", "{{ nodes.extract.outputs.rows }}")),
        ],
    )
    run = runner.run(body)
    rid = str(run["id"])
    listed = cli.invoke(app, ["dag", "outputs", rid])
    assert listed.exit_code == 0, listed.output
    assert "extract" in listed.output and "rows" in listed.output and "7" in listed.output
    as_json = cli.invoke(app, ["dag", "outputs", rid, "--json"])
    assert json.loads(as_json.output) == {"extract": {"rows": 7}}
    missing = cli.invoke(app, ["dag", "outputs", rid, "--node", "nope"])
    assert missing.exit_code == 1
    cleared = cli.invoke(app, ["dag", "clear", rid, "load"])
    assert cleared.exit_code == 0, cleared.output
    assert "again load" in cleared.output
    done = runner.wait_end(run["id"])
    assert {n["name"]: n["try_number"] for n in done["nodes"]} == {"extract": 1, "load": 2}
    assert done["state"] == "succeeded"


def test_a_retry_of_failed_instances_from_the_cli(
    cli: CliRunner, runner: Runner, worker: Worker
) -> None:
    body = workflow(
        "cli-map",
        [
            node(
                "each",
                args=("{{ map.item }}", "2", "{{ node.try }}"),
                map={"over": "{{ params.items }}"},
            )
        ],
    )
    run = runner.run(body, params={"items": ["ok", "fail-below"]})
    assert run["state"] == "failed"
    retried = cli.invoke(app, ["dag", "retry", str(run["id"]), "--failed-instances"])
    assert retried.exit_code == 0, retried.output
    assert "again each[1]" in retried.output and "each[0]" not in retried.output
    done = runner.wait_end(run["id"])
    assert done["state"] == "succeeded"
    tries = {n["name"]: n["try_number"] for n in done["nodes"]}
    assert tries == {"each": 2, "each[0]": 1, "each[1]": 2}


def test_a_skipped_branch_shows_why_in_the_run_tree(
    cli: CliRunner, runner: Runner, worker: Worker
) -> None:
    run = runner.run(_branching("cli-branch"))
    shown = cli.invoke(app, ["dag", "status", str(run["id"])], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    line = next(text for text in shown.output.splitlines() if "publish" in text)
    assert "skipped" in line and 'when is false: params.env == "prod"' in line


def test_an_approval_gate_is_approved_from_the_cli(
    cli: CliRunner, runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    runner.define(workflow("cli-gate", [node("build"), _gate("sign-off", "build")]))
    rid = runner.start("cli-gate")["id"]
    _waiting(db, rid, "sign-off")
    shown = cli.invoke(app, ["dag", "status", str(rid)])
    assert "waits for approval" in shown.output, shown.output
    approved = cli.invoke(app, ["dag", "approve", str(rid), "sign-off", "--comment", "ship it"])
    assert approved.exit_code == 0, approved.output
    assert "sign-off approved" in approved.output
    again = cli.invoke(app, ["dag", "reject", str(rid), "sign-off"])
    assert again.exit_code != 0 and "not waiting" in again.output, again.output
    assert runner.wait_end(rid)["state"] == "succeeded"
    row = _row(db, rid, "sign-off")
    assert (row["decision"], row["decided_by"], row["comment"]) == ("approve", "alice", "ship it")


def test_a_run_started_from_the_cli_takes_its_own_task_timeout(
    cli: CliRunner, runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    runner.define(workflow("cli-limit", [node("a"), node("b", task={"timeout_s": 300})]))
    started = cli.invoke(app, ["dag", "run", "cli-limit", "--task-timeout", "90", "--json"])
    assert started.exit_code == 0, started.output
    run = json.loads(started.output)
    assert run["task_timeout_s"] == 90
    assert runner.wait_end(run["id"])["state"] == "succeeded"
    rows = db.execute(
        "SELECT labels->>'cairn.dag/node', timeout_s FROM core.tasks"
        " WHERE labels->>'cairn.dag/run' = %s",
        (str(run["id"]),),
    ).fetchall()
    assert dict(rows) == {"a": 90, "b": 300}


def test_an_event_is_signalled_and_a_trigger_made_listed_and_deleted_from_the_cli(
    cli: CliRunner, runner: Runner, db: psycopg.Connection
) -> None:
    wait = {"name": "wait", "event": {"name": "paid", "timeout_s": 600}, "outputs": {"n": {}}}
    runner.define(workflow("cli-event", [wait], params={"who": "x"}))
    rid = str(runner.start("cli-event")["id"])

    def waiting() -> bool:
        row = db.execute("SELECT state FROM dag.nodes WHERE run_id = %s", (int(rid),))
        return row.fetchone() == ("waiting",)

    wait_for(waiting, timeout=20, interval=0.05)
    shown = cli.invoke(app, ["dag", "status", rid])
    assert "waits for event paid" in shown.output, shown.output
    bad = cli.invoke(app, ["dag", "signal", rid, "paid", "--data", "[1]"])
    assert bad.exit_code == 2, bad.output
    sent = cli.invoke(app, ["dag", "signal", rid, "paid", "--data", '{"n": 3}'])
    assert sent.exit_code == 0 and "node wait" in sent.output, sent.output
    assert runner.wait_end(int(rid))["state"] == "succeeded"
    assert db.execute(
        "SELECT outputs FROM dag.nodes WHERE run_id = %s", (int(rid),)
    ).fetchone() == ({"n": 3},)

    made = cli.invoke(
        app, ["dag", "trigger", "create", "cli-event", "--param", "who=user.name", "--json"]
    )
    assert made.exit_code == 0, made.output
    trigger = json.loads(made.output)
    assert trigger["secret"] and trigger["params"] == {"who": "user.name"}
    listed = cli.invoke(app, ["dag", "trigger", "list", "cli-event"], env={"COLUMNS": "200"})
    assert (
        f"/v1/triggers/{trigger['id']}" in listed.output and trigger["secret"] not in listed.output
    )
    gone = cli.invoke(app, ["dag", "trigger", "delete", "cli-event", str(trigger["id"])])
    assert gone.exit_code == 0, gone.output
    assert db.execute("SELECT count(*) FROM dag.triggers").fetchone() == (0,)
