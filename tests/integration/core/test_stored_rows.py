"""Rows stored under older, looser rules (a digest in upper case, a label key or an env
name a submission may no longer use, an egress rule's port out of range) are shown as
stored by every read, the CLI's too: an answer re-validated them with the request
models and was a 500 for each of their readers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cairn.cli import app
from tests.support import TRUE_SHA, Core, TurnWorker, cli_as, spec, wait_for

DB = psycopg.Connection[tuple[Any, ...]]


def _old_task(core: Core, db: DB) -> int:
    """A task as an older core stored it: what today's submission refuses, set in SQL."""
    with core.client() as alice:
        answer = alice.post("/v1/tasks", json=spec(labels={"team": "x"}, env={"A": "1"}))
        assert answer.status_code == 201, answer.text
    task_id = int(answer.json()["id"])
    db.execute(
        "UPDATE core.tasks SET artifact_sha256 = upper(artifact_sha256),"
        ' labels = \'{"Old Key": "x"}\', env = \'{"9LIVES": "1"}\' WHERE id = %s',
        (task_id,),
    )
    return task_id


def test_a_task_stored_under_older_rules_is_read_as_stored(core: Core, db: DB) -> None:
    task_id = _old_task(core, db)
    with core.client() as alice:
        one = alice.get(f"/v1/tasks/{task_id}")
        page = alice.get("/v1/tasks")
        cancelled = alice.post(f"/v1/tasks/{task_id}/cancel")
    assert one.status_code == 200, one.text
    task = one.json()
    assert task["artifact"]["sha256"] == TRUE_SHA.upper()
    assert (task["labels"], task["env"]) == ({"Old Key": "x"}, {"9LIVES": "1"})
    assert page.status_code == 200, page.text
    assert [t["artifact"]["sha256"] for t in page.json()["items"]] == [TRUE_SHA.upper()]
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["state"] == "cancelled"
    row = db.execute(
        "SELECT state, artifact_sha256 FROM core.tasks WHERE id = %s", (task_id,)
    ).fetchone()
    assert row == ("cancelled", TRUE_SHA.upper())


def test_the_cli_shows_a_task_stored_under_older_rules(
    core: Core, db: DB, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    task_id = _old_task(core, db)
    cli = cli_as(core, monkeypatch, tmp_path)
    shown = cli.invoke(app, ["show", str(task_id)])
    assert shown.exit_code == 0, shown.output
    assert "file:///bin/true" in shown.output and "Old Key" in shown.output
    listed = cli.invoke(app, ["--json", "ls"])
    assert listed.exit_code == 0, listed.output
    assert [t["artifact"]["sha256"] for t in json.loads(listed.output)] == [TRUE_SHA.upper()]


OLD_EGRESS = {"mode": "allow", "allow": [{"cidr": "10.0.0.0/8", "port": 70000}]}


def _old_egress(db: DB, queue: str) -> None:
    db.execute(
        "INSERT INTO core.queues (name, egress) VALUES (%s, %s)"
        " ON CONFLICT (name) DO UPDATE SET egress = EXCLUDED.egress",
        (queue, json.dumps(OLD_EGRESS)),
    )


def test_a_queue_whose_egress_was_stored_under_older_rules_is_listed(core: Core, db: DB) -> None:
    _old_egress(db, "old")
    with core.client("root", "admin") as admin:
        answer = admin.get("/v1/queues")
    assert answer.status_code == 200, answer.text
    [old] = [q for q in answer.json()["items"] if q["name"] == "old"]
    assert old["egress"] == OLD_EGRESS


def test_a_lease_under_an_egress_stored_under_older_rules_goes_out_as_stored(
    core: Core, db: DB
) -> None:
    """The worker's turn leases it, its egress as stored (the agent then fails that
    attempt alone, naming the field: docs/architecture.md, Dispatch); the whole turn was a
    500, and every claim of the queue's workers with it."""
    _old_egress(db, "default")
    task_id = _old_task(core, db)
    worker = TurnWorker(core, "w1")
    try:
        leased = worker.turn(claim={"cpu": 8, "memory_mb": 16384, "max": 4})["attempts"]
    finally:
        worker.http.close()
    assert [(a["task_id"], a["egress"]) for a in leased] == [(task_id, OLD_EGRESS)]
    assert leased[0]["artifact"]["sha256"] == TRUE_SHA.upper()
    row = db.execute("SELECT state FROM core.tasks WHERE id = %s", (task_id,)).fetchone()
    assert row == ("running",)


def test_a_queue_policy_stored_under_older_rules_is_shown_and_applied(core: Core, db: DB) -> None:
    """A priority range wider than today's bounds: the policy's read was a 500, and so
    was every submission, whose policy check reads every queue's policy."""
    policy = {"priority": {"user": {"min": -500, "max": 500}}, "owners": ["alice"]}
    db.execute("INSERT INTO core.queues (name, policy) VALUES ('old', %s)", (json.dumps(policy),))
    with core.client() as alice:
        shown = alice.get("/v1/queues/old/policy")
        made = alice.post("/v1/tasks", json=spec(queue="old", priority=100))
    with core.client("bob") as bob:
        refused = bob.post("/v1/tasks", json=spec(queue="old"))
    assert shown.status_code == 200, shown.text
    assert shown.json()["priority"] == {"user": {"min": -500, "max": 500}}
    assert made.status_code == 201, made.text
    assert refused.status_code == 403, refused.text
    count = db.execute("SELECT count(*) FROM core.tasks WHERE queue = 'old'").fetchone()
    assert count == (1,)


@pytest.mark.core(services_interval_s=0.1)
def test_a_service_whose_template_was_stored_under_older_rules_is_shown_and_refused(
    core: Core, db: DB
) -> None:
    """Its read shows the template as stored (a 500 before); the controller's start of a
    replica from it is refused naming the field, recorded as the service's message, and
    the controller goes on (a ValidationError escaped its pass)."""
    template = {"name": "web", "kind": "service", "artifact": spec()["artifact"]}
    with core.client() as alice:
        made = alice.post("/v1/services", json={"name": "web", "replicas": 0, "template": template})
        assert made.status_code == 201, made.text
    db.execute(
        "UPDATE core.services SET replicas = 1, template = jsonb_set(template,"
        " '{artifact,sha256}', to_jsonb(upper(template->'artifact'->>'sha256'))) WHERE name = 'web'"
    )

    def refused() -> str | None:
        row = db.execute("SELECT message FROM core.services WHERE name = 'web'").fetchone()
        return row[0] if row and row[0] and "start refused" in row[0] else None

    assert "template.artifact.sha256" in wait_for(refused, timeout=30)
    with core.client() as alice:
        shown = alice.get("/v1/services/web")
    assert shown.status_code == 200, shown.text
    assert shown.json()["template"]["artifact"]["sha256"] == TRUE_SHA.upper()
    assert db.execute("SELECT count(*) FROM core.tasks").fetchone() == (0,)


def test_a_subscription_whose_filter_was_stored_under_older_rules_is_listed(
    core: Core, db: DB
) -> None:
    body = {"name": "hook", "events": ["task.dead"], "url": "https://example.com/x"}
    with core.client() as alice:
        made = alice.post("/v1/subscriptions", json=body)
        assert made.status_code == 201, made.text
        db.execute(
            "UPDATE core.subscriptions SET queue = 'Old Queue', labels = '{\"Old Key\": \"x\"}'"
        )
        listed = alice.get("/v1/subscriptions")
    assert listed.status_code == 200, listed.text
    [hook] = listed.json()["items"]
    assert hook["filter"] == {"queue": "Old Queue", "labels": {"Old Key": "x"}}
