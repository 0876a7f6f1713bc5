"""Approval gates against a real core and PostgreSQL: a gate waits (no task reaches
core), an approval lets its downstream run, a rejection fails it and its downstream
follows the trigger rules, its timeout applies its default, a decision is taken once
(a second is a 409), and only its approvers decide (403; a run one cannot see is a 404).
What the database holds is checked: the node's state, decision, by whom, comment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg

from tests.fixtures.dag import DagServer, Runner, Worker, node, start_dag, workflow
from tests.integration.dag.test_runs import _tasks
from tests.support import wait_for


def _gate(name: str, *depends_on: str, **approval: Any) -> dict:
    spec = {"timeout_s": 3600, "on_timeout": "reject", **approval}
    return {"name": name, "approval": spec, "depends_on": list(depends_on)}


def _row(db: psycopg.Connection, run_id: int, name: str) -> dict[str, Any]:
    cur = db.execute(
        "SELECT state, error, decision, decided_by, decided_at, comment, wait_until"
        " FROM dag.nodes WHERE run_id = %s AND name = %s",
        (run_id, name),
    )
    names = [c.name for c in cur.description or ()]
    found = cur.fetchone()
    assert found is not None
    return dict(zip(names, found, strict=True))


def _waiting(db: psycopg.Connection, run_id: int, name: str) -> dict[str, Any]:
    return wait_for(
        lambda: (row := _row(db, run_id, name))["state"] == "waiting" and row,
        timeout=20,
        interval=0.05,
    )


def _release(**approval: Any) -> dict:
    return workflow(
        "release",
        [
            node("build"),
            _gate("sign-off", "build", **approval),
            node("deploy", "sign-off"),
            node("cleanup", "sign-off", trigger_rule="all_done"),
        ],
    )


def test_approve_then_a_second_decision_is_409(
    runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    runner.define(_release())
    run_id = runner.start("release")["id"]
    waiting = _waiting(db, run_id, "sign-off")
    assert waiting["wait_until"] is not None and waiting["decision"] is None
    assert set(_tasks(db, run_id)) == {"build"}  # the gate never reaches core
    drawn = runner.http.get(f"/v1/runs/{run_id}/graph", params={"format": "mermaid"})
    assert "classDef waiting" in drawn.text, drawn.text

    path = f"/v1/runs/{run_id}/nodes/sign-off"
    answer = runner.http.post(f"{path}/approve", json={"comment": "looks good"})
    assert answer.status_code == 200, answer.text
    shown = {n["name"]: n for n in answer.json()["nodes"]}["sign-off"]
    assert (shown["decision"], shown["decided_by"], shown["comment"]) == (
        "approve", "alice", "looks good",
    )  # fmt: skip
    again = runner.http.post(f"{path}/reject")
    assert again.status_code == 409, again.text

    run = runner.wait_end(run_id)
    assert run["state"] == "succeeded"
    row = _row(db, run_id, "sign-off")
    assert (row["state"], row["decision"], row["decided_by"], row["comment"]) == (
        "succeeded", "approve", "alice", "looks good",
    )  # fmt: skip
    assert row["decided_at"] is not None and row["wait_until"] is None
    assert set(_tasks(db, run_id)) == {"build", "deploy", "cleanup"}
    late = runner.http.post(f"{path}/approve")
    assert late.status_code == 409, late.text  # it no longer waits


def test_reject_fails_the_gate_and_downstream_follows_the_rules(
    runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    runner.define(_release())
    run_id = runner.start("release")["id"]
    _waiting(db, run_id, "sign-off")
    answer = runner.http.post(f"/v1/runs/{run_id}/nodes/sign-off/reject", json={"comment": "no"})
    assert answer.status_code == 200, answer.text
    run = runner.wait_end(run_id)
    assert run["state"] == "failed"
    row = _row(db, run_id, "sign-off")
    assert (row["state"], row["error"], row["decision"], row["decided_by"]) == (
        "failed", "rejected by alice", "reject", "alice",
    )  # fmt: skip
    assert _row(db, run_id, "deploy")["state"] == "upstream_failed"
    assert _row(db, run_id, "cleanup")["state"] == "succeeded"  # all_done runs
    assert set(_tasks(db, run_id)) == {"build", "cleanup"}


def test_the_timeout_applies_its_default(
    runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    runner.define(_release(timeout_s=1, on_timeout="approve"))
    run = runner.wait_end(runner.start("release")["id"], timeout=30)
    assert run["state"] == "succeeded"
    row = _row(db, run["id"], "sign-off")
    assert (row["state"], row["decision"], row["decided_by"], row["comment"]) == (
        "succeeded", "approve", None, "no decision within 1 s: on_timeout applied",
    )  # fmt: skip


def test_only_approvers_decide(
    dag: DagServer, runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    runner.define(_release(approvers={"people": ["carol"]}))
    run_id = runner.start("release")["id"]
    _waiting(db, run_id, "sign-off")
    path = f"/v1/runs/{run_id}/nodes/sign-off/approve"
    refused = runner.http.post(path)  # the run's owner, not named
    assert refused.status_code == 403, refused.text
    with dag.client("mallory") as stranger:
        assert stranger.post(path).status_code == 404  # a run one cannot see is missing
    assert runner.http.post(f"/v1/runs/{run_id}/nodes/build/approve").status_code == 404
    assert _row(db, run_id, "sign-off")["decision"] is None
    with dag.client("carol") as carol:
        assert carol.post(path).status_code == 200
    assert runner.wait_end(run_id)["state"] == "succeeded"
    assert _row(db, run_id, "sign-off")["decided_by"] == "carol"


def test_a_gate_is_validated_by_field(runner: Runner) -> None:
    both = node("gate", approval={"timeout_s": 60, "on_timeout": "approve"})
    answer = runner.http.post("/v1/workflows", json=workflow("bad", [both]))
    assert answer.status_code == 422 and "approval" in answer.text, answer.text
    for bad in ({"timeout_s": 0, "on_timeout": "approve"}, {"timeout_s": 60, "on_timeout": "x"}):
        answer = runner.http.post("/v1/workflows", json=workflow("bad", [_gate("g", **bad)]))
        assert answer.status_code == 422, answer.text
        assert "approval" in answer.text, answer.text
    long = runner.http.post("/v1/runs/1/nodes/g/approve", json={"comment": "x" * 2001})
    assert long.status_code == 422 and "comment" in long.text, long.text


def test_a_decision_through_a_follower_survives_a_leader_change(
    dag: DagServer, runner: Runner, worker: Worker, db: psycopg.Connection, tmp_path: Path
) -> None:
    runner.define(_release())
    run_id = runner.start("release")["id"]
    _waiting(db, run_id, "sign-off")
    follower = start_dag(dag.core, tmp_path / "follower")
    try:
        with follower.client() as http:
            answer = http.post(f"/v1/runs/{run_id}/nodes/sign-off/approve", json={"comment": "ok"})
            assert answer.status_code == 200, answer.text
            dag.stop()  # the leader goes, whether or not it moved the gate on
            ended = wait_for(
                lambda: (r := http.get(f"/v1/runs/{run_id}").json())["state"] == "succeeded" and r,
                timeout=30,
                interval=0.05,
            )
    finally:
        follower.stop()
    assert {n["name"]: n["state"] for n in ended["nodes"]}["deploy"] == "succeeded"
    assert set(_tasks(db, run_id)) == {"build", "deploy", "cleanup"}  # each released once
    row = _row(db, run_id, "sign-off")
    assert (row["state"], row["decided_by"], row["comment"]) == ("succeeded", "alice", "ok")
