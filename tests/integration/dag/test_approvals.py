"""Approval gates against a real core and PostgreSQL: a gate waits (no task reaches
core), an approval lets its downstream run, a rejection fails it and its downstream
follows the trigger rules, its timeout applies its default, a decision is taken once
(a second is a 409), and only its approvers decide (403; a run one cannot see is a 404).
What the database holds is checked: the node's state, decision, by whom, comment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.fixtures.dag import DagServer, Runner, Worker, node, start_dag, workflow
from tests.integration.dag.test_runs import _tasks
from tests.support import Core, wait_for
from tests.webhooks import Receiver, subscribe


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
        answer = carol.post(path)
        assert answer.status_code == 200
        assert carol.get(f"/v1/runs/{run_id}").status_code == 404  # she does not see it
    # Of the run, carol gets the gate she decided, not its params nor its other nodes.
    assert answer.json()["params"] == {}
    assert [n["name"] for n in answer.json()["nodes"]] == ["sign-off"]
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


def _audited(db: psycopg.Connection, run_id: int) -> list[tuple[Any, ...]]:
    return db.execute(
        "SELECT actor, actor_role, action, target, source, after FROM core.audit"
        " WHERE target LIKE %s ORDER BY id",
        (f"run:{run_id}/%",),
    ).fetchall()


def test_decisions_reach_the_audit_trail_and_a_waiting_gate_the_webhook(
    core: Core, dag: DagServer, runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    hook = Receiver()
    try:
        with core.client() as alice:
            made = subscribe(alice, hook.url, events=["approval.waiting"])
            report = {"action": "dag.approve", "target": "run:1/node:x", "actor": "mallory"}
            forged = alice.post("/v1/audit/reports", json=report)
            assert forged.status_code == 403, forged.text  # services only
        with core.client("dag-reporter", "service") as service:
            bad = service.post("/v1/audit/reports", json={**report, "action": "token.revoke"})
            assert bad.status_code == 422, bad.text
            assert bad.json()["errors"][0]["field"] == "body.action"
        runner.define(
            workflow(
                "audited", [_gate("person"), _gate("clock", timeout_s=1, on_timeout="approve")]
            )
        )
        run_id = runner.start("audited")["id"]
        _waiting(db, run_id, "person")
        path = f"/v1/runs/{run_id}/nodes/person/reject"
        assert runner.http.post(path, json={"comment": "not today"}).status_code == 200
        assert runner.wait_end(run_id, timeout=30)["state"] == "failed"
        rows = wait_for(lambda: len(found := _audited(db, run_id)) == 2 and found, timeout=20)
        wait_for(lambda: len(hook.all()) == 2, timeout=20)
    finally:
        hook.close()
    by_action = {row[2]: row for row in rows}
    actor, role, _, target, source, after = by_action["dag.reject"]
    assert (actor, role, target) == ("alice", "user", f"run:{run_id}/node:person")
    assert source.startswith("dag-service-")  # the reporting service, then its address
    assert after | {"decided_at": None} == {
        "workflow": "audited", "owner": "alice", "try": 1, "decision": "reject",
        "comment": "not today", "by_timeout": False, "decided_at": None,
    }  # fmt: skip
    actor, role, _, target, _, after = by_action["dag.approve"]
    assert actor.startswith("dag-service-") and role == "service"  # its timeout decided
    assert (target, after["by_timeout"]) == (f"run:{run_id}/node:clock", True)
    pending = db.execute(
        "SELECT count(*) FROM dag.nodes WHERE run_id = %s AND audit_pending", (run_id,)
    ).fetchone()
    assert pending == (0,)
    # Reported again (the loop stopped between core's answer and the mark, or the answer
    # timed out): the same key, so core's trail keeps one row per decision.
    db.execute("UPDATE dag.nodes SET audit_pending = true WHERE run_id = %s", (run_id,))
    wait_for(
        lambda: (
            db.execute(
                "SELECT NOT bool_or(audit_pending) FROM dag.nodes WHERE run_id = %s", (run_id,)
            ).fetchone()
            == (True,)
        ),
        timeout=20,
    )
    assert _audited(db, run_id) == rows
    keys = [k for (k,) in db.execute(
        "SELECT idempotency_key FROM core.audit WHERE target LIKE %s ORDER BY id",
        (f"run:{run_id}/%",),
    )]  # fmt: skip
    person = next(k for k in keys if ":person:" in k)
    assert person.split(":", 1)[1].startswith(f"dag:{run_id}:person:1:decided:")
    got = sorted(hook.all(), key=lambda r: r.doc["data"]["subject"]["node"])
    assert all(r.signed_by(made["secret"]) for r in got)
    assert [r.doc["event"] for r in got] == ["approval.waiting"] * 2
    assert got[1].doc["data"]["subject"] == {
        "run_id": str(run_id), "workflow": "audited", "node": "person",
        "approve": f"/v1/runs/{run_id}/nodes/person/approve",
        "reject": f"/v1/runs/{run_id}/nodes/person/reject",
    }  # fmt: skip


def test_a_report_sent_again_with_its_key_is_recorded_once(
    core: Core, db: psycopg.Connection
) -> None:
    report = {
        "action": "dag.approve",
        "target": "run:7/node:gate",
        "actor": "alice",
        "after": {"try": 1},
        "idempotency_key": "dag:7:gate:1:decided:x",
    }
    with core.client("dag-reporter", "service") as service:
        for _ in range(2):  # a retry after a timeout whose first send was recorded
            sent = service.post("/v1/audit/reports", json=report)
            assert sent.status_code == 204, sent.text
        other = service.post("/v1/audit/reports", json={**report, "after": {"try": 2}})
        assert other.status_code == 409, other.text
        assert other.json()["type"].endswith("idempotency-mismatch")
    with core.client("cron-reporter", "service") as another:  # a key is the service's own
        assert another.post("/v1/audit/reports", json=report).status_code == 204
    rows = db.execute(
        "SELECT source, idempotency_key FROM core.audit WHERE target = 'run:7/node:gate' ORDER BY id"
    ).fetchall()
    assert [(s.split()[0], k) for s, k in rows] == [
        ("dag-reporter", "dag-reporter:dag:7:gate:1:decided:x"),
        ("cron-reporter", "cron-reporter:dag:7:gate:1:decided:x"),
    ]


@pytest.mark.parametrize(
    "after",
    [{"comment": "a\u0000b"}, {"try": 2**64}, {"\u0000": 1}],
    ids=["nul-value", "int-past-64-bits", "nul-key"],
)
def test_an_audit_report_whose_after_cannot_be_kept_is_a_422_naming_it(
    core: Core, db: psycopg.Connection, after: dict[str, object]
) -> None:
    """``after`` is kept as given in the chained trail: a NUL (PostgreSQL's jsonb holds
    none) or an integer past 64 bits was a 500, not a 422 naming the field."""
    report = {"action": "dag.approve", "target": "run:8/node:gate", "after": after}
    with core.client("dag-reporter", "service") as service:
        sent = service.post("/v1/audit/reports", json=report)
    assert sent.status_code == 422, sent.text
    assert "after" in sent.json()["detail"], sent.json()
    found = db.execute("SELECT count(*) FROM core.audit WHERE target = 'run:8/node:gate'")
    assert found.fetchone() == (0,)
