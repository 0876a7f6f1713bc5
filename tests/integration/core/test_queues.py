from __future__ import annotations

from tests.support import Core, spec, wait_for


def test_pause_parks_waiting_work_and_resume_releases_it(core: Core, db) -> None:
    with core.client() as alice, core.client("root", "admin") as admin:
        before = alice.post("/v1/tasks", json=spec(queue="batch")).json()
        paused = admin.post("/v1/queues/batch/pause").json()
        assert paused["paused"] is True
        assert alice.get(f"/v1/tasks/{before['id']}").json()["state"] == "ready"
        during = alice.post("/v1/tasks", json=spec(queue="batch")).json()
        assert during["state"] == "ready"
        other = alice.post("/v1/tasks", json=spec(queue="default")).json()
        assert other["state"] == "waiting"
        resumed = admin.post("/v1/queues/batch/resume").json()
        assert resumed["paused"] is False and resumed["depth"]["waiting"] == 2
        reasons = alice.get(f"/v1/tasks/{before['id']}/events").json()["items"]
    assert [(e["op"], e["to_state"]) for e in reasons] == [
        ("submit", "waiting"),
        ("park", "ready"),
        ("promote", "waiting"),
    ]


def test_a_submit_racing_a_pause_is_parked_by_the_promoter(core: Core, db) -> None:
    with core.client() as alice, core.client("root", "admin") as admin:
        admin.post("/v1/queues/q/pause")
        # As if the submit had read the queue just before the pause committed:
        task = alice.post("/v1/tasks", json=spec(queue="q")).json()
        db.execute("UPDATE core.tasks SET state = 'waiting' WHERE id = %s", (task["id"],))
        wait_for(lambda: alice.get(f"/v1/tasks/{task['id']}").json()["state"] == "ready")


def test_queue_list_reports_depth_and_oldest_waiting_age(core: Core, db) -> None:
    with core.client() as alice:
        for _ in range(3):
            alice.post("/v1/tasks", json=spec(queue="reports"))
        alice.post("/v1/tasks", json=spec(queue="reports", run_at="2999-01-01T00:00:00Z"))
        db.execute(
            "UPDATE core.tasks SET updated_at = now() - interval '90 s' WHERE state = 'waiting'"
        )
        queues = {q["name"]: q for q in alice.get("/v1/queues").json()["items"]}
    reports = queues["reports"]
    assert reports["depth"]["waiting"] == 3 and reports["depth"]["ready"] == 1
    assert 89 < reports["oldest_waiting_age_s"] < 300
