"""Membership and queue policy are checked where the power is used, not only at submit
(issue 28, finding 1): a member removed from a team gets none of its secrets, rotated
values included, whether its old task is retried (one or in bulk) or was waiting to be
leased; a retry is refused as a submission would be now."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx

from tests.fixtures.cron import start_cron
from tests.fixtures.dag import start_dag
from tests.integration.core.test_secrets import Worker
from tests.support import Core, spec, wait_for

SECRET = {"BANK": {"secret": "bank", "team": "payroll"}}


def _payroll(core: Core) -> None:
    with core.client("root", "admin") as root:
        assert root.post("/v1/teams", json={"name": "payroll"}).status_code == 201
        for member in ("alice", "bob"):
            assert root.put(f"/v1/teams/payroll/members/{member}").status_code == 200


def _leave(core: Core, member: str) -> None:
    with core.client("root", "admin") as root:
        assert root.delete(f"/v1/teams/payroll/members/{member}").status_code == 200


def _bury(worker: Worker, task_id: int) -> int:
    """Lease the task and fail it for good, so a person may retry it."""
    [leased] = worker.claim()
    assert leased["task_id"] == task_id
    answer = worker.http.post(
        f"/v1/workers/{worker.id}/attempts/{leased['attempt_id']}/report",
        json={"outcome": "failed", "retryable": False},
    )
    assert answer.status_code == 200, answer.text
    return task_id


def _rotate(bob: httpx.Client) -> str:
    new = f"rotated-{uuid.uuid4().hex}"
    assert bob.put("/v1/secrets/bank?team=payroll", json={"value": new}).status_code == 200
    return new


def test_a_removed_member_cannot_retry_an_old_task_into_the_teams_rotated_secret(
    core: Core, db
) -> None:
    _payroll(core)
    worker = Worker(core)
    try:
        with core.client("alice") as alice, core.client("bob") as bob:
            made = alice.post(
                "/v1/secrets", json={"name": "bank", "value": "old-1", "team": "payroll"}
            )
            assert made.status_code == 201, made.text
            own, shared, plain = (
                _bury(worker, alice.post("/v1/tasks", json=body).json()["id"])
                for body in (spec(env=SECRET), spec(env=SECRET, team="payroll"), spec())
            )
            _leave(core, "alice")
            new = _rotate(bob)
            # Her own task: refused as submitting it would be, naming the field.
            refused = alice.post(f"/v1/tasks/{own}/retry")
            assert refused.status_code == 403, refused.text
            assert "env.BANK" in refused.json()["detail"]
            assert "payroll" in refused.json()["detail"]
            # The team's task (still hers) is refused for its team; bob's retry of it
            # acts as alice, who left: refused too.
            assert alice.post(f"/v1/tasks/{shared}/retry").status_code == 403
            assert bob.post(f"/v1/tasks/{shared}/retry").status_code == 403
            # In bulk: what she may still run moves, the rest is left and counted.
            bulk = alice.post("/v1/tasks/retry", json={"filter": {"state": "dead"}})
            assert bulk.status_code == 200, bulk.text
            assert (bulk.json()["changed"], bulk.json()["refused"]) == (1, 2)
            assert f"task {own}:" in bulk.json()["refusal"]
            assert bulk.json()["more"] is False
            again = alice.post("/v1/tasks/retry", json={"filter": {"state": "dead"}})
            assert again.status_code == 403, again.text
            leased = worker.claim()
    finally:
        worker.close()
    assert [a["task_id"] for a in leased] == [plain]
    assert all(new not in str(a["env"]) for a in leased)
    states = dict(db.execute("SELECT id, state FROM core.tasks").fetchall())
    assert states[own] == states[shared] == "dead"


def test_a_waiting_task_of_a_removed_member_dies_at_lease_without_the_value(core: Core, db) -> None:
    _payroll(core)
    worker = Worker(core)
    try:
        with core.client("alice") as alice, core.client("bob") as bob:
            alice.post(
                "/v1/secrets", json={"name": "bank", "value": "old-value-2", "team": "payroll"}
            )
            waiting = alice.post("/v1/tasks", json=spec(env=SECRET)).json()["id"]
            teammates = bob.post("/v1/tasks", json=spec(env=SECRET)).json()["id"]
            _leave(core, "alice")
            new = _rotate(bob)
            leased = worker.claim()
            task = alice.get(f"/v1/tasks/{waiting}").json()
    finally:
        worker.close()
    # bob, still a member, gets the new value; alice's task is not handed out at all.
    assert [(a["task_id"], a["env"]) for a in leased] == [(teammates, {"BANK": new})]
    assert task["state"] == "dead"
    assert "no longer a member of team 'payroll'" in task["last_error"]
    [(attempts, error)] = db.execute(
        "SELECT count(*), max(error) FROM core.attempts WHERE task_id = %s", (waiting,)
    ).fetchall()
    assert attempts == 1 and "payroll" in error


def test_a_retry_is_held_to_the_queues_policy_of_now(core: Core) -> None:
    worker = Worker(core)
    policy = {"priority": {}, "services": True, "guaranteed": True, "owners": ["alice", "bob"]}
    try:
        with core.client("root", "admin") as root, core.client("alice") as alice:
            assert root.put("/v1/queues/default/policy", json=policy).status_code == 200
            task_id = alice.post("/v1/tasks", json=spec()).json()["id"]
            _bury(worker, task_id)
            narrowed = {**policy, "owners": ["bob"]}
            assert root.put("/v1/queues/default/policy", json=narrowed).status_code == 200
            refused = alice.post(f"/v1/tasks/{task_id}/retry")
            assert refused.status_code == 403, refused.text
            assert refused.json()["field"] == "task.queue"
            assert alice.post("/v1/tasks/retry", json={}).status_code == 403
            assert alice.get(f"/v1/tasks/{task_id}").json()["state"] == "dead"
    finally:
        worker.close()


# --- a schedule's target is its owner's (or an admin's) to change (finding 3) -------------


def _prod_deploy(core: Core, *owners: str) -> None:
    policy = {"priority": {}, "services": True, "guaranteed": True, "owners": list(owners)}
    with core.client("root", "admin") as root:
        assert root.put("/v1/queues/prod-deploy/policy", json=policy).status_code == 200


def test_a_teammate_cannot_rewrite_a_team_schedules_target_and_its_fires_say_who_changed_it(
    core: Core, tmp_path: Path, db
) -> None:
    _payroll(core)
    _prod_deploy(core, "alice")  # bob may not use the queue himself
    deploy = spec(queue="prod-deploy", args=["deploy", "v1"])
    target = {"kind": "task", "task": deploy}
    schedule = {"name": "d", "expression": "@daily", "team": "payroll", "target": target}
    cron = start_cron(core, tmp_path / "cron")
    try:
        with (
            cron.client("alice") as alice,
            cron.client("bob") as bob,
            cron.client("root", "admin") as root,
        ):
            made = alice.post("/v1/schedules", json=schedule)
            assert made.status_code == 201, made.text
            assert made.json()["changed_by"] == "alice"
            path = f"/v1/schedules/{made.json()['id']}"
            evil = {"kind": "task", "task": {**deploy, "args": ["sh", "-c", "bob's own"]}}
            refused = bob.patch(path, json={"target": evil})
            assert refused.status_code == 403, refused.text
            assert refused.json()["errors"][0]["field"] == "body.target"
            # bob may still change when it runs, and is named as its last changer.
            renamed = bob.patch(path, json={"expression": "@hourly"})
            assert renamed.status_code == 200 and renamed.json()["changed_by"] == "bob"
            fired = bob.post(f"{path}/trigger")
            assert fired.status_code == 201, fired.text
            first = fired.json()["task_id"]
            # An admin may change what it runs; the fire says so.
            changed = root.patch(
                path, json={"target": {"kind": "task", "task": {**deploy, "args": ["v2"]}}}
            )
            assert changed.status_code == 200 and changed.json()["changed_by"] == "root"
            second = root.post(f"{path}/trigger").json()["task_id"]
            # The fire is held to the owner's queue policy of now.
            _prod_deploy(core, "carol")
            late = bob.post(f"{path}/trigger")
            assert late.status_code == 201 and late.json()["outcome"] == "failed", late.text
            assert "does not admit owner alice" in late.json()["detail"]
    finally:
        cron.stop()
    rows = db.execute(
        "SELECT id, owner, args, labels->>'cairn.cron/changed-by' FROM core.tasks ORDER BY id"
    ).fetchall()
    assert rows == [(first, "alice", ["deploy", "v1"], "bob"), (second, "alice", ["v2"], "root")]


def test_a_teammate_runs_a_team_workflow_only_with_its_owners_params(
    core: Core, tmp_path: Path, db
) -> None:
    _payroll(core)
    node = {"name": "ship", "task": {**spec(args=["{{ params.version }}"]), "name": "ship"}}
    body = {"name": "deploy", "team": "payroll", "params": {"version": "v1"}, "nodes": [node]}
    dag = start_dag(core, tmp_path / "dag")
    try:
        with (
            dag.client("alice") as alice,
            dag.client("bob") as bob,
            dag.client("root", "admin") as root,
        ):
            assert alice.post("/v1/workflows", json=body).status_code == 201
            runs = "/v1/workflows/deploy/runs"
            theirs = {"owner": "alice"}
            refused = bob.post(runs, params=theirs, json={"params": {"version": "bob's own"}})
            assert refused.status_code == 403, refused.text
            assert refused.json()["errors"][0]["field"] == "body.params"
            forged = {"fire": {"slot": "2027-01-04T00:00:00Z", "schedule_id": 1}}
            refused = bob.post(runs, params=theirs, json=forged)
            assert refused.status_code == 403, refused.text
            assert refused.json()["errors"][0]["field"] == "body.fire"
            started = bob.post(runs, params=theirs, json={})
            assert started.status_code == 201, started.text
            by_admin = root.post(runs, params=theirs, json={"params": {"version": "v2"}})
            assert by_admin.status_code == 201, by_admin.text
            ids = [started.json()["id"], by_admin.json()["id"]]
            assert alice.post(runs, json={"params": {"version": "v3"}}).status_code == 201

            def released() -> list | None:
                rows = db.execute(
                    "SELECT owner, args FROM core.tasks"
                    " WHERE labels->>'cairn.dag/run' = ANY(%s) ORDER BY id",
                    ([str(i) for i in ids],),
                ).fetchall()
                return rows if len(rows) == 2 else None

            found = wait_for(released, timeout=30)
    finally:
        dag.stop()
    assert sorted(found) == [("alice", ["v1"]), ("alice", ["v2"])]
    args = db.execute("SELECT args FROM core.tasks").fetchall()
    assert ["bob's own"] not in [a for (a,) in args]
