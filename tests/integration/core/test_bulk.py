"""Bulk retry and cancel by filter over real HTTP: counted first, bounded, paged, fenced by
owner, and each task moved as the one-task endpoints move it (guarded, with its event)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx

from tests.support import Core, cairn_cli, spec


def _submit(client: httpx.Client, count: int, **overrides: object) -> list[int]:
    ids: list[int] = []
    for start in range(0, count, 1000):
        batch = [spec(**overrides) for _ in range(min(1000, count - start))]
        answer = client.post("/v1/tasks/batch", json={"tasks": batch})
        assert answer.status_code == 201, answer.text
        ids += [item["id"] for item in answer.json()["tasks"]]
    return ids


def _bury(db, ids: list[int], finished: str = "now()") -> None:
    """As an outage would leave them: dead, their attempts spent."""
    db.execute(
        f"UPDATE core.tasks SET state = 'dead', finished_at = {finished}, attempts = 5, "
        "crashes = 3, version = version + 1 WHERE id = ANY(%s)",
        (ids,),
    )


def _states(db, ids: list[int]) -> dict[str, int]:
    rows = db.execute(
        "SELECT state, count(*) FROM core.tasks WHERE id = ANY(%s) GROUP BY 1", (ids,)
    ).fetchall()
    return dict(rows)


def test_bulk_retry_of_a_thousand_dead_tasks_in_one_call(core: Core, db) -> None:
    with core.client() as alice:
        ids = _submit(alice, 1000, labels={"batch": "nightly"})
        _bury(db, ids)
        counted = alice.post(
            "/v1/tasks/retry", json={"filter": {"state": "dead"}, "dry_run": True}
        ).json()
        assert counted == {
            "matched": 1000,
            "changed": 0,
            "dry_run": True,
            "more": True,
            "refused": 0,
            "refusal": None,
        }
        assert _states(db, ids) == {"dead": 1000}
        done = alice.post("/v1/tasks/retry", json={"filter": {"state": "dead"}})
    assert done.status_code == 200, done.text
    assert done.json() == {
        "matched": 1000,
        "changed": 1000,
        "dry_run": False,
        "more": False,
        "refused": 0,
        "refusal": None,
    }
    assert _states(db, ids) == {"waiting": 1000}
    fresh = db.execute(
        "SELECT count(*) FROM core.tasks WHERE id = ANY(%s) AND attempts = 0 AND crashes = 0 "
        "AND finished_at IS NULL",
        (ids,),
    ).fetchone()
    assert fresh == (1000,)
    # Each moved as one retry moves it: one event, from dead, numbered by the version.
    events = db.execute(
        "SELECT count(*) FROM core.task_events e JOIN core.tasks t ON t.id = e.task_id "
        "WHERE e.task_id = ANY(%s) AND e.op = 'retry' AND e.from_state = 'dead' "
        "AND e.to_state = 'waiting' AND e.seq = t.version AND e.reason = 'retried in bulk by alice'",
        (ids,),
    ).fetchone()
    assert events == (1000,)


def test_the_filter_takes_only_what_it_names_and_only_the_callers_own(core: Core, db) -> None:
    with core.client() as alice, core.client("bob") as bob:
        nightly = _submit(alice, 20, labels={"batch": "nightly"})
        other = _submit(alice, 10, labels={"batch": "hourly"})
        bobs = _submit(bob, 10, labels={"batch": "nightly"})
        _bury(db, nightly + other + bobs)
        done = alice.post(
            "/v1/tasks/retry", json={"filter": {"labels": {"batch": "nightly"}}}
        ).json()
        assert done["changed"] == 20
        assert _states(db, nightly) == {"waiting": 20}
        assert _states(db, other) == {"dead": 10}
        assert _states(db, bobs) == {"dead": 10}
        # Naming another owner is an admin's: a 403 that names the field.
        refused = alice.post("/v1/tasks/retry", json={"filter": {"owner": "bob"}})
        assert refused.status_code == 403
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.json()["errors"][0]["field"] == "body.filter.owner"
    with core.client("root", "admin") as admin:
        done = admin.post("/v1/tasks/retry", json={"filter": {"owner": "bob"}}).json()
    assert done["changed"] == 10
    assert _states(db, bobs) == {"waiting": 10}
    assert _states(db, other) == {"dead": 10}


def test_a_time_window_and_a_limit_bound_what_one_call_takes(core: Core, db) -> None:
    with core.client() as alice:
        old = _submit(alice, 30)
        recent = _submit(alice, 700)
        _bury(db, old, "now() - interval '3 days'")
        _bury(db, recent, "now() - interval '2 hours'")
        window = {"finished_after": (datetime.now(UTC) - timedelta(days=1)).isoformat()}
        first = alice.post("/v1/tasks/retry", json={"filter": window, "limit": 600}).json()
        assert (first["matched"], first["changed"], first["more"]) == (700, 600, True)
        second = alice.post("/v1/tasks/retry", json={"filter": window, "limit": 600}).json()
        assert (second["matched"], second["changed"], second["more"]) == (100, 100, False)
    assert _states(db, recent) == {"waiting": 700}
    assert _states(db, old) == {"dead": 30}


def test_bulk_cancel_stops_running_attempts_and_skips_finished_tasks(core: Core, db) -> None:
    with core.client() as alice, core.client("w1", "worker") as worker:
        ids = _submit(alice, 6, labels={"run": "r1"})
        registered = worker.post(
            "/v1/workers",
            json={"hostname": "h", "queues": ["default"], "cpu": 8, "memory_mb": 8192},
        ).json()
        me = registered["worker"]["id"]
        worker.headers["X-Cairn-Worker-Lease"] = registered["lease"]
        leased = worker.post(
            f"/v1/workers/{me}/claim", json={"cpu": 8, "memory_mb": 8192, "max": 2, "wait": 0}
        ).json()["attempts"]
        assert len(leased) == 2
        db.execute(
            "UPDATE core.tasks SET state = 'succeeded', finished_at = now() WHERE id = %s",
            (ids[-1],),
        )
        done = alice.post("/v1/tasks/cancel", json={"filter": {"labels": {"run": "r1"}}}).json()
        assert (done["matched"], done["changed"], done["more"]) == (5, 5, False)
        beat = worker.post(
            f"/v1/workers/{me}/heartbeat", json={"attempts": [a["attempt_id"] for a in leased]}
        ).json()
    assert _states(db, ids) == {"cancelled": 5, "succeeded": 1}
    closed = db.execute(
        "SELECT outcome, count(*) FROM core.attempts WHERE task_id = ANY(%s) GROUP BY 1", (ids,)
    ).fetchall()
    assert closed == [("cancelled", 2)]
    assert sorted(beat["stop"]) == sorted(a["attempt_id"] for a in leased)
    events = db.execute(
        "SELECT from_state, count(*) FROM core.task_events WHERE task_id = ANY(%s) "
        "AND op = 'cancel' GROUP BY 1 ORDER BY 1",
        (ids,),
    ).fetchall()
    assert events == [("running", 2), ("waiting", 3)]


def test_a_state_the_action_never_takes_is_a_422_naming_it(core: Core) -> None:
    with core.client() as alice:
        answer = alice.post("/v1/tasks/retry", json={"filter": {"state": "succeeded"}})
        unknown = alice.post("/v1/tasks/cancel", json={"filter": {"colour": "red"}})
        too_many = alice.post("/v1/tasks/cancel", json={"limit": 10_001})
    assert answer.status_code == 422
    assert answer.json()["errors"][0]["field"] == "body.filter.state"
    assert "dead" in answer.json()["errors"][0]["reason"]
    assert unknown.status_code == 422 and too_many.status_code == 422


def test_the_cli_counts_then_retries_by_filter(core: Core, db) -> None:
    with core.client() as alice:
        ids = _submit(alice, 40, labels={"batch": "x"})
    _bury(db, ids)
    env = {"CAIRN_URL": core.url, "CAIRN_TOKEN": core.tokens["alice"]}
    command = ["retry", "--state", "dead", "--label", "batch=x"]
    dry = cairn_cli(*command, "--dry-run", env=env)
    assert dry.exit_code == 0, dry.stderr
    assert "40 tasks match; nothing done" in dry.stdout
    assert _states(db, ids) == {"dead": 40}
    done = cairn_cli(*command, "--yes", env=env)
    assert done.exit_code == 0, done.stderr
    assert "retried 40 of 40 tasks" in done.stdout
    assert _states(db, ids) == {"waiting": 40}
