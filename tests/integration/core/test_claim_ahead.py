"""Claiming ahead: a claim that asks ``ahead_s`` also leases ready work due within that
many seconds, with ``start_at`` set to the task's ``run_at``; the attempt's deadlines count
from then. Work due now always comes first. Every core here polls once a minute, so only
the claim can find delayed work."""

from __future__ import annotations

from datetime import datetime

import pytest

from tests.integration.core.test_dispatch import Agent, _close_agents  # noqa: F401 - closes them
from tests.support import Core, spec

AHEAD_MAX_S = 30.0


pytestmark = pytest.mark.core(
    promote_interval_s=60.0,
    heartbeat_interval_s=1,
    heartbeat_timeout_s=60,
    claim_ahead_max_s=AHEAD_MAX_S,
)


def _due_in(core: Core, db, seconds: float, count: int = 1, **extra: object) -> list[int]:
    at = db.execute("SELECT now() + make_interval(secs => %s)", (seconds,)).fetchone()[0]
    with core.client() as alice:
        body = {"tasks": [spec(run_at=at.isoformat(), **extra) for _ in range(count)]}
        answer = alice.post("/v1/tasks/batch", json=body)
        assert answer.status_code == 201, answer.text
    return [t["id"] for t in answer.json()["tasks"]]


def _claim(agent: Agent, ahead_s: float, most: int = 16) -> list[dict]:
    room = {"cpu": agent.cpu, "memory_mb": 16384, "max": most, "ahead_s": ahead_s}
    answer = agent.http.post(f"/v1/workers/{agent.id}/claim", json=room)
    assert answer.status_code == 200, answer.text
    return answer.json()["attempts"]


def test_delayed_work_is_leased_only_by_a_claim_ahead_covering_it_with_its_start_at(
    core: Core, db
) -> None:
    [task] = _due_in(core, db, 20)
    agent = Agent(core)
    assert _claim(agent, 0) == []
    assert _claim(agent, 10) == []  # due in 20 s: not covered
    [leased] = _claim(agent, 25)
    assert leased["task_id"] == task
    run_at, started_at, claimed_at, state = db.execute(
        "SELECT t.run_at, a.started_at, e.at, t.state FROM core.tasks t"
        "  JOIN core.attempts a ON a.id = t.current_attempt_id"
        "  JOIN core.task_events e ON e.task_id = t.id AND e.op = 'claim' WHERE t.id = %s",
        (task,),
    ).fetchone()
    assert datetime.fromisoformat(leased["start_at"]) == run_at
    assert claimed_at < run_at  # leased ahead, from ready
    assert started_at == run_at  # its start (and the deadlines from it) is its run_at
    assert state == "running"


def test_work_due_now_gets_a_lease_without_start_at(core: Core, db) -> None:
    with core.client() as alice:
        alice.post("/v1/tasks", json=spec())
    [leased] = _claim(Agent(core), 25)
    assert leased["start_at"] is None


def test_work_leased_ahead_only_fills_the_room_work_due_now_leaves(core: Core, db) -> None:
    """Higher-priority work due in a few seconds does not take the room of work due now."""
    ahead = _due_in(core, db, 5, count=2, priority=9)
    with core.client() as alice:
        now = [alice.post("/v1/tasks", json=spec(priority=0)).json()["id"] for _ in range(2)]
    agent = Agent(core)
    assert sorted(a["task_id"] for a in _claim(agent, 25, most=2)) == sorted(now)
    assert sorted(a["task_id"] for a in _claim(agent, 25, most=2)) == sorted(ahead)


def test_ahead_is_capped_by_cores_setting(core: Core, db) -> None:
    [task] = _due_in(core, db, AHEAD_MAX_S + 10)
    agent = Agent(core)
    assert _claim(agent, AHEAD_MAX_S + 20) == []  # asked 50 s, core allows 30
    db.execute(
        "UPDATE core.tasks SET run_at = now() + interval '20 seconds' WHERE id = %s", (task,)
    )
    assert [a["task_id"] for a in _claim(agent, AHEAD_MAX_S + 20)] == [task]


def test_a_held_attempt_is_lost_for_missing_from_heartbeats_only_after_its_start(
    core: Core, db
) -> None:
    """The never-started check (a beat's grace is 3 s here) counts from the attempt's
    start, its run_at, not from its lease."""
    [task] = _due_in(core, db, 20)
    agent = Agent(core)
    [leased] = _claim(agent, 25)

    def leased_ago(seconds: int) -> list[tuple[object, ...]]:
        db.execute(
            "UPDATE core.attempts SET started_at = t.run_at - make_interval(secs => %s)"
            "  FROM core.tasks t WHERE t.id = task_id AND core.attempts.id = %s",
            (seconds, leased["attempt_id"]),
        )  # as if leased ``seconds`` ago, 20 s ahead of its run_at
        agent.beat([])
        return db.execute(
            "SELECT outcome FROM core.attempts WHERE task_id = %s", (task,)
        ).fetchall()

    assert leased_ago(15) == [(None,)]  # its start is 5 s away
    assert leased_ago(25) == [("lost",)]  # its start was 5 s ago: missing since


def test_a_task_handed_back_before_its_run_at_is_not_leased_again_before_it(core: Core, db) -> None:
    [task] = _due_in(core, db, 20)
    agent = Agent(core)
    [leased] = _claim(agent, 25)
    assert agent.report(leased["attempt_id"], "handed_back").status_code == 200
    assert db.execute("SELECT state FROM core.tasks WHERE id = %s", (task,)).fetchone() == (
        "waiting",
    )
    assert _claim(agent, 0) == []
    db.execute("UPDATE core.tasks SET run_at = now() - interval '1 second' WHERE id = %s", (task,))
    assert [a["task_id"] for a in _claim(agent, 0)] == [task]


@pytest.mark.parametrize("ahead_s", [-1, 61, "soon"])
def test_a_bad_ahead_s_is_refused_naming_the_field(core: Core, ahead_s: object) -> None:
    agent = Agent(core)
    for path, body in (
        ("claim", {"cpu": 1, "memory_mb": 100, "ahead_s": ahead_s}),
        ("turn", {"claim": {"cpu": 1, "memory_mb": 100, "ahead_s": ahead_s}}),
    ):
        answer = agent.http.post(f"/v1/workers/{agent.id}/{path}", json=body)
        assert answer.status_code == 422, answer.text
        fields = [e["field"] for e in answer.json()["errors"]]
        assert fields == [("body.ahead_s" if path == "claim" else "body.claim.ahead_s")]


def test_starts_says_which_held_attempts_may_start(core: Core, db) -> None:
    keep, cancel = _due_in(core, db, 20, count=2)
    agent, other = Agent(core), Agent(core, "w2")
    leased = {a["task_id"]: a["attempt_id"] for a in _claim(agent, 25)}
    with core.client() as alice:
        assert alice.post(f"/v1/tasks/{cancel}/cancel").status_code == 200
    asked = sorted(leased.values())
    answer = agent.http.post(f"/v1/workers/{agent.id}/starts", json={"attempts": asked})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"held": [leased[keep]], "gone": [leased[cancel]]}
    # Another worker's attempt is never held for this one.
    theirs = other.http.post(f"/v1/workers/{other.id}/starts", json={"attempts": asked})
    assert theirs.json() == {"held": [], "gone": asked}
    empty = agent.http.post(f"/v1/workers/{agent.id}/starts", json={"attempts": []})
    assert empty.status_code == 422
    assert [e["field"] for e in empty.json()["errors"]] == ["body.attempts"]
