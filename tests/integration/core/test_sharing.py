"""Sharing one pool over real HTTP, with a scripted worker: fair share in the claim,
quotas (held with a reason, or refused with 429), queue policy (403 naming the field),
concurrency keys, aging, and the owner's usage report."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.integration.core.test_dispatch import Agent
from tests.support import Core, spec, start_core, wait_for

pytestmark = pytest.mark.core(heartbeat_interval_s=0.2, heartbeat_timeout_s=120.0)


def _batch(client, n: int, **overrides) -> list[int]:
    ids: list[int] = []
    for start in range(0, n, 1000):
        body = {"tasks": [spec(**overrides) for _ in range(min(1000, n - start))]}
        answer = client.post("/v1/tasks/batch", json=body)
        assert answer.status_code == 201, answer.text
        ids += [item["id"] for item in answer.json()["tasks"]]
    return ids


def _owners_of(db, task_ids: list[int]) -> list[str]:
    rows = db.execute(
        "SELECT owner FROM core.tasks WHERE id = ANY(%s) ORDER BY id", (task_ids,)
    ).fetchall()
    return [r[0] for r in rows]


def test_a_flood_by_one_owner_does_not_queue_ahead_of_another(core: Core, db) -> None:
    with core.client("alice") as alice, core.client("bob") as bob:
        _batch(alice, 2000)
        bobs = _batch(bob, 5)
        agent = Agent(core, cpu=64)
        taken = [a["task_id"] for a in agent.claim(most=10)]
    assert set(bobs) <= set(taken), "bob's five interleave with alice's backlog"
    assert _owners_of(db, taken).count("alice") == 5


def test_weights_split_a_contended_queue_in_their_ratio(core: Core, db) -> None:
    with core.client("root", "admin") as admin:
        assert admin.patch("/v1/owners/carol/share", json={"weight": 3}).status_code == 200
    with core.client("carol") as carol, core.client("dave") as dave:
        _batch(carol, 100)
        _batch(dave, 100)
        agent = Agent(core, cpu=64)
        taken = [a["task_id"] for a in agent.claim(most=32)]
    owners = _owners_of(db, taken)
    assert len(owners) == 32
    assert 23 <= owners.count("carol") <= 25, "three to one"


def test_a_running_quota_holds_work_with_its_reason(core: Core, db) -> None:
    with core.client("root", "admin") as admin:
        admin.patch("/v1/owners/alice/share", json={"max_cpu": 2}).raise_for_status()
    with core.client("alice") as alice, core.client("bob") as bob:
        ids = _batch(alice, 4)
        bobs = _batch(bob, 2)
        agent = Agent(core, cpu=64)
        taken = {a["task_id"] for a in agent.claim(most=16)}
        assert taken == {*ids[:2], *bobs}, "alice gets two CPUs' worth, bob is not held"
        held = alice.get(f"/v1/tasks/{ids[3]}").json()
        assert held["state"] == "waiting"
        assert held["pending_reason"] == "owner at quota (cpu 2/2)"
        usage = alice.get("/v1/owners/alice/usage").json()
        assert usage["running"]["cpu"] == 2 and usage["waiting"] == 2
        assert usage["at_quota"] == ["cpu"] and usage["quota"]["max_cpu"] == 2
        assert alice.get("/v1/owners/bob/usage").status_code == 404
        assert agent.claim(most=16) == []


def test_the_waiting_quota_refuses_with_429_and_stores_nothing(core: Core, db) -> None:
    with core.client("root", "admin") as admin:
        admin.patch("/v1/owners/alice/share", json={"max_waiting": 3}).raise_for_status()
    with core.client("alice") as alice:
        _batch(alice, 2)
        refused = alice.post("/v1/tasks/batch", json={"tasks": [spec(), spec()]})
        assert refused.status_code == 429
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.headers["Retry-After"] == "10"
        problem = refused.json()
        assert problem["quota"] == "waiting" and "2/3" in problem["detail"]
        assert alice.post("/v1/tasks", json=spec()).status_code == 201
        assert alice.post("/v1/tasks", json=spec()).status_code == 429
    stored = db.execute("SELECT count(*) FROM core.tasks WHERE owner = 'alice'").fetchone()[0]
    assert stored == 3


def test_the_submission_rate_quota_refuses_with_retry_after(core: Core, db) -> None:
    with core.client("root", "admin") as admin:
        admin.patch("/v1/owners/alice/share", json={"max_submits_per_min": 5}).raise_for_status()
    with core.client("alice") as alice:
        _batch(alice, 4)
        assert alice.post("/v1/tasks", json=spec()).status_code == 201
        refused = alice.post("/v1/tasks", json=spec())
        assert refused.status_code == 429
        assert refused.json()["quota"] == "submits_per_min"
        assert 1 <= int(refused.headers["Retry-After"]) <= 60
        assert alice.get("/v1/owners/alice/usage").json()["submitted_last_minute"] == 5
    stored = db.execute("SELECT count(*) FROM core.tasks WHERE owner = 'alice'").fetchone()[0]
    assert stored == 5


def test_the_queue_policy_refuses_with_403_naming_the_field(core: Core, db) -> None:
    policy = {"priority": {"user": {"min": -100, "max": 50}}, "services": False, "owners": None}
    with core.client("root", "admin") as admin:
        assert admin.put("/v1/queues/default/policy", json=policy).status_code == 200
        assert admin.post("/v1/tasks", json=spec(priority=100)).status_code == 201
    with core.client("alice") as alice:
        refused = alice.post("/v1/tasks", json=spec(priority=100))
        assert refused.status_code == 403
        assert refused.json()["field"] == "body.priority"
        assert "-100..50" in refused.json()["detail"]
        batch = {"tasks": [spec(), spec(kind="service")]}
        refused = alice.post("/v1/tasks/batch", json=batch)
        assert refused.status_code == 403 and refused.json()["field"] == "body.tasks.1.kind"
        assert alice.post("/v1/tasks", json=spec(priority=50)).status_code == 201
        assert alice.get("/v1/queues/default/policy").json()["services"] is False
    with core.client("root", "admin") as admin:
        closed = {"owners": ["bob"]}
        admin.put("/v1/queues/default/policy", json=closed).raise_for_status()
    with core.client("alice") as alice:
        refused = alice.post("/v1/tasks", json=spec())
        assert refused.status_code == 403 and refused.json()["field"] == "body.queue"
    stored = db.execute("SELECT count(*) FROM core.tasks WHERE owner = 'alice'").fetchone()[0]
    assert stored == 1


def _open_with_key(db, key: str) -> int:
    query = "SELECT count(*) FROM core.attempts WHERE concurrency_key = %s AND outcome IS NULL"
    return db.execute(query, (key,)).fetchone()[0]


def test_concurrent_claims_never_run_more_than_a_keys_limit(core: Core, db) -> None:
    with core.client("alice") as alice:
        ids = _batch(alice, 40, concurrency={"key": "db-main", "limit": 3})
    agents = [Agent(core, f"w{i}", cpu=16) for i in range(4)]
    done: list[int] = []
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _open_with_key(db, "db-main"))

    def work(agent: Agent) -> None:
        idle = 0
        while len(done) < len(ids) and idle < 200:
            attempts = agent.claim(most=4)
            idle = 0 if attempts else idle + 1
            for attempt in attempts:
                assert agent.report(attempt["attempt_id"]).status_code == 200
                done.append(attempt["task_id"])

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=work, args=(a,)) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    assert sorted(done) == sorted(ids)
    assert 1 <= peak[0] <= 3


def test_a_key_at_its_limit_is_the_pending_reason_and_admins_set_it(core: Core, db) -> None:
    with core.client("root", "admin") as admin:
        limit = {"max_running": 1, "max_starts": None, "window_s": None}
        assert admin.put("/v1/concurrency/db-main", json=limit).status_code == 200
    with core.client("alice") as alice:
        ids = _batch(alice, 3, concurrency={"key": "db-main", "limit": 5})
        agent = Agent(core, cpu=16)
        assert [a["task_id"] for a in agent.claim(most=8)] == [ids[0]]
        reason = alice.get(f"/v1/tasks/{ids[1]}").json()["pending_reason"]
        assert reason == "waiting for concurrency key db-main (1/1 running)"
        state = alice.get("/v1/concurrency/db-main").json()
        assert state["running"] == 1 and state["max_running"] == 1


def test_a_keys_rate_limit_bounds_starts_per_window(core: Core, db) -> None:
    with core.client("root", "admin") as admin:
        limit = {"max_starts": 2, "window_s": 3600}
        admin.put("/v1/concurrency/api", json=limit).raise_for_status()
    with core.client("alice") as alice:
        ids = _batch(alice, 4, concurrency={"key": "api"})
        agent = Agent(core, cpu=16)
        first = agent.claim(most=8)
        assert len(first) == 2
        for attempt in first:
            agent.report(attempt["attempt_id"]).raise_for_status()
        assert agent.claim(most=8) == []
        reason = alice.get(f"/v1/tasks/{ids[3]}").json()["pending_reason"]
        assert reason == "concurrency key api at its rate limit (2/2 starts in 3600 s)"


def test_aging_lifts_low_priority_work_past_its_fair_turn(db_url: str, tmp_path: Path, db):
    server = start_core(db_url, tmp_path, aging_s=1.0, aging_max=200)
    try:
        with server.client("alice") as alice, server.client("bob") as bob:
            low = alice.post("/v1/tasks", json=spec(priority=-50)).json()["id"]
            _batch(bob, 5, priority=50)
            agent = Agent(server, cpu=64)
            # Its turn came 150 s ago: 150 levels up, above priority 50.
            db.execute("UPDATE core.tasks SET vtime = vtime - 150 WHERE id = %s", (low,))
            assert agent.claim(most=1)[0]["task_id"] == low
    finally:
        server.stop()


def test_a_reservation_stops_small_tasks_passing_a_large_one(db_url: str, tmp_path: Path, db):
    server = start_core(
        db_url, tmp_path, heartbeat_timeout_s=120.0, placement_interval_s=0.05,
        preempt_after_s=0.2,
    )  # fmt: skip
    try:
        with server.client("alice") as alice:
            agent = Agent(server, cpu=4)
            _batch(alice, 4, resources={"cpu": 1, "memory_mb": 512})
            first = agent.claim(most=8)
            assert len(first) == 4
            big = alice.post("/v1/tasks", json=spec(resources={"cpu": 4, "memory_mb": 512}))
            big_id = big.json()["id"]
            _batch(alice, 4, resources={"cpu": 1, "memory_mb": 512})
            reserved = "SELECT reserved_for FROM core.workers WHERE id = %s"
            wait_for(lambda: db.execute(reserved, (agent.id,)).fetchone()[0] == big_id)
            agent.report(first[0]["attempt_id"]).raise_for_status()
            assert agent.claim(most=8) == [], "the freed CPU is kept for the large task"
            for attempt in first[1:]:
                agent.report(attempt["attempt_id"]).raise_for_status()
            assert [a["task_id"] for a in agent.claim(most=8)] == [big_id]
            # Its reservation ends (the small ones, blocked in turn, may take the worker's).
            wait_for(lambda: db.execute(reserved, (agent.id,)).fetchone()[0] != big_id)
    finally:
        server.stop()
