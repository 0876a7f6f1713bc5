"""Membership and queue policy are checked where the power is used, not only at submit
(issue 28, finding 1): a member removed from a team gets none of its secrets, rotated
values included, whether its old task is retried (one or in bulk) or was waiting to be
leased; a retry is refused as a submission would be now."""

from __future__ import annotations

import uuid

import httpx

from tests.identity.test_secrets import Worker
from tests.support import Core, spec

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
