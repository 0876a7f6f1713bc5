"""A task's policy over real HTTP and a real PostgreSQL (issue 31): queues' time limits
(the default and largest ``timeout_s``, the longest wait to start), ``start_by``, retries
decided by the attempt's exit code or signal, and crashes counted within a window."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from libs.common.models import NO_RETRY_EXIT_CODE
from tests.integration.core.test_dispatch import Agent, _close_agents  # noqa: F401 - closes them
from tests.support import Core, spec, start_core, wait_for

pytestmark = pytest.mark.core(heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0)


def _set_queue(core: Core, name: str, **change: object) -> httpx.Response:
    with core.client("root", "admin") as admin:
        return admin.patch(f"/v1/queues/{name}", json=change)


def _row(db, task_id: int, columns: str) -> tuple:
    return db.execute(f"SELECT {columns} FROM core.tasks WHERE id = %s", (task_id,)).fetchone()


def _problem_field(answer: httpx.Response) -> str:
    assert answer.status_code == 422, answer.text
    return answer.json()["errors"][0]["field"]


# --- time limits ---------------------------------------------------------------------


def test_a_queues_limits_are_set_shown_and_a_default_above_the_maximum_is_refused(
    core: Core, db
) -> None:
    answer = _set_queue(core, "batch", default_timeout_s=600, max_timeout_s=3600, max_wait_s=60)
    assert answer.status_code == 200, answer.text
    shown = answer.json()
    assert (shown["default_timeout_s"], shown["max_timeout_s"], shown["max_wait_s"]) == (
        600,
        3600,
        60,
    )
    # A maximum below the stored default names the maximum; a default above the stored
    # maximum names the default; nothing changes either way.
    assert _problem_field(_set_queue(core, "batch", max_timeout_s=300)) == "body.max_timeout_s"
    assert (
        _problem_field(_set_queue(core, "batch", default_timeout_s=7200))
        == "body.default_timeout_s"
    )
    assert _problem_field(_set_queue(core, "other", default_timeout_s=10, max_timeout_s=5)) == (
        "body.max_timeout_s"
    )
    assert _problem_field(_set_queue(core, "batch", max_wait_s=0)) == "body.max_wait_s"
    stored = db.execute(
        "SELECT default_timeout_s, max_timeout_s, max_wait_s FROM core.queues WHERE name = 'batch'"
    ).fetchone()
    assert stored == (600, 3600, 60)
    assert db.execute("SELECT count(*) FROM core.queues WHERE name = 'other'").fetchone() == (0,)
    # null restores "no limit"
    assert _set_queue(core, "batch", max_wait_s=None).json()["max_wait_s"] is None
    with core.client() as alice:
        [queue] = [q for q in alice.get("/v1/queues").json()["items"] if q["name"] == "batch"]
    assert (queue["default_timeout_s"], queue["max_timeout_s"]) == (600, 3600)


def test_a_submission_gets_its_queues_default_and_is_held_to_its_maximum(core: Core, db) -> None:
    assert _set_queue(core, "batch", default_timeout_s=600, max_timeout_s=3600).status_code == 200
    with core.client() as alice:
        plain = alice.post("/v1/tasks", json=spec(queue="batch"))
        own = alice.post("/v1/tasks", json=spec(queue="batch", timeout_s=1200))
        over = alice.post("/v1/tasks", json=spec(queue="batch", timeout_s=3601))
        service = alice.post("/v1/tasks", json=spec(queue="batch", kind="service"))
        elsewhere = alice.post("/v1/tasks", json=spec(queue="default"))
        batch = alice.post(
            "/v1/tasks/batch",
            json={"tasks": [spec(queue="batch"), spec(queue="batch", timeout_s=86400)]},
        )
    assert plain.status_code == 201 and plain.json()["timeout_s"] == 600
    assert _row(db, plain.json()["id"], "timeout_s") == (600,)
    assert _row(db, own.json()["id"], "timeout_s") == (1200,)
    assert _problem_field(over) == "body.timeout_s"
    assert "maximum of 3600 s" in over.json()["detail"]
    # A service runs until cancelled: no default timeout for it.
    assert _row(db, service.json()["id"], "timeout_s") == (None,)
    assert _row(db, elsewhere.json()["id"], "timeout_s") == (None,)
    # A batch is all or nothing, and the refusal names the task.
    assert _problem_field(batch) == "body.tasks.1.timeout_s"
    assert db.execute("SELECT count(*) FROM core.tasks").fetchone() == (4,)


def test_with_only_a_maximum_the_maximum_is_the_default_and_cores_default_fills_in(
    db_url: str, tmp_path: Path, db
) -> None:
    server = start_core(db_url, tmp_path, default_timeout_s=7200)
    try:
        assert _set_queue(server, "short", max_timeout_s=60).status_code == 200
        with server.client() as alice:
            short = alice.post("/v1/tasks", json=spec(queue="short")).json()
            plain = alice.post("/v1/tasks", json=spec()).json()
            # the task as read back says the same as the answer to its submission
            read = alice.get(f"/v1/tasks/{plain['id']}").json()
    finally:
        server.stop()
    assert _row(db, short["id"], "timeout_s") == (60,)
    assert _row(db, plain["id"], "timeout_s") == (7200,) and read["timeout_s"] == 7200


def test_a_disk_quota_is_filled_from_the_queue_held_to_its_maximum_and_leased_with_it(
    core: Core, db
) -> None:
    answer = _set_queue(core, "scratch", default_disk_mb=256, max_disk_mb=1024)
    assert answer.status_code == 200, answer.text
    assert (answer.json()["default_disk_mb"], answer.json()["max_disk_mb"]) == (256, 1024)
    assert _problem_field(_set_queue(core, "scratch", max_disk_mb=100)) == "body.max_disk_mb"
    disk = {"cpu": 1, "memory_mb": 512}
    with core.client() as alice:
        plain = alice.post("/v1/tasks", json=spec(queue="scratch")).json()
        own = alice.post(
            "/v1/tasks", json=spec(queue="scratch", resources={**disk, "disk_mb": 1024})
        )
        over = alice.post(
            "/v1/tasks", json=spec(queue="scratch", resources={**disk, "disk_mb": 1025})
        )
        zero = alice.post("/v1/tasks", json=spec(resources={**disk, "disk_mb": 0}))
        elsewhere = alice.post("/v1/tasks", json=spec()).json()
    assert plain["resources"]["disk_mb"] == 256
    assert _row(db, own.json()["id"], "disk_mb") == (1024,)
    assert _problem_field(over) == "body.resources.disk_mb"
    assert "maximum of 1024 MB" in over.json()["detail"]
    assert _problem_field(zero) == "body.resources.disk_mb"
    assert _row(db, elsewhere["id"], "disk_mb") == (None,)  # the worker's default

    leased = Agent(core, queues=("scratch",)).claim()
    assert sorted(a["resources"]["disk_mb"] for a in leased) == [256, 1024]


def test_disk_exceeded_is_stored_and_retried_as_a_failure(core: Core, db) -> None:
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=spec(retry={"max_attempts": 2, "base_s": 0.01}))
    agent = Agent(core)
    [first] = agent.claim()
    error = "disk quota exceeded: its files filled the attempt's 8 MB (a write failed with ENOSPC)"
    answer = agent.report(first["attempt_id"], "disk_exceeded", exit_code=1, error=error)
    assert answer.status_code == 200, answer.text
    assert db.execute(
        "SELECT outcome, error FROM core.attempts WHERE id = %s", (first["attempt_id"],)
    ).fetchone() == ("disk_exceeded", error)
    # retried after its backoff, as a failure (as oom_killed is); the 10 ms backoff may
    # be over already (the promoter is hinted), so the move is read from the events
    moves = db.execute(
        "SELECT op, to_state, reason FROM core.task_events WHERE task_id = %s ORDER BY seq",
        (task.json()["id"],),
    ).fetchall()
    assert ("fail", "failed", "retry after backoff") in moves
    assert _row(db, task.json()["id"], "attempts") == (1,)


def test_an_idempotent_resend_matches_although_the_default_changed(core: Core, db) -> None:
    assert _set_queue(core, "batch", default_timeout_s=600).status_code == 200
    body = spec(queue="batch", idempotency_key="nightly-1")
    with core.client() as alice:
        first = alice.post("/v1/tasks", json=body)
        assert _set_queue(core, "batch", default_timeout_s=900).status_code == 200
        again = alice.post("/v1/tasks", json=body)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"] and again.json()["timeout_s"] == 600


def test_a_task_not_started_by_its_start_by_ends_dead_with_the_reason(core: Core, db) -> None:
    # No worker serves the queue: the tasks wait, then expire, each by its own bound.
    assert _set_queue(core, "slow", max_wait_s=1).status_code == 200
    with core.client() as alice:
        own = alice.post("/v1/tasks", json=spec(queue="lonely", max_wait_s=1)).json()
        queued = alice.post("/v1/tasks", json=spec(queue="slow", max_wait_s=3600)).json()
        later = alice.post("/v1/tasks", json=spec(queue="lonely", max_wait_s=3600)).json()
        assert own["start_by"] is not None and later["start_by"] > own["start_by"]
        wait_for(lambda: alice.get(f"/v1/tasks/{queued['id']}").json()["state"] == "dead")
        wait_for(lambda: alice.get(f"/v1/tasks/{own['id']}").json()["state"] == "dead")
        events = alice.get(f"/v1/tasks/{own['id']}/events").json()["items"]
    assert (events[-1]["op"], events[-1]["from_state"], events[-1]["to_state"]) == (
        "expire",
        "waiting",
        "dead",
    )
    assert events[-1]["reason"].startswith("not started by its start_by, ")
    state, error, finished = _row(db, own["id"], "state, last_error, finished_at")
    assert state == "dead" and error == events[-1]["reason"] and finished is not None
    assert _row(db, later["id"], "state") == ("waiting",)
    assert db.execute("SELECT count(*) FROM core.attempts").fetchone() == (0,)


def test_a_start_by_counts_from_run_at_and_a_task_that_started_does_not_expire(
    core: Core, db
) -> None:
    with core.client() as alice:
        delayed = alice.post(
            "/v1/tasks", json=spec(run_at="2999-01-01T00:00:00Z", max_wait_s=60)
        ).json()
        started = alice.post("/v1/tasks", json=spec(max_wait_s=3600)).json()
        bad = alice.post(
            "/v1/tasks",
            json=spec(run_at="2999-01-01T00:00:00Z", start_by="2998-01-01T00:00:00Z"),
        )
    assert delayed["start_by"].startswith("2999-01-01T00:01:00")
    assert _problem_field(bad) == "body"
    agent = Agent(core)
    [attempt] = agent.claim(wait=5)
    assert agent.report(attempt["attempt_id"], "handed_back").status_code == 200
    # Its wait bound passes while it waits again: it started once, so it stays.
    db.execute("UPDATE core.tasks SET start_by = now() WHERE id = %s", (started["id"],))
    db.execute("UPDATE core.tasks SET start_by = now() WHERE id = %s", (delayed["id"],))
    wait_for(lambda: _row(db, delayed["id"], "state") == ("dead",))
    assert _row(db, started["id"], "state") == ("waiting",)


def test_a_claim_does_not_lease_a_task_past_its_start_by(db_url: str, tmp_path: Path, db) -> None:
    # The promoter looks again only in a minute: what holds the task back is the claim.
    server = start_core(db_url, tmp_path, promote_interval_s=60)
    try:
        with server.client() as alice:
            task = alice.post("/v1/tasks", json=spec(queue="q", max_wait_s=3600)).json()
            kept = alice.post("/v1/tasks", json=spec(queue="q", max_wait_s=3600)).json()
        db.execute("UPDATE core.tasks SET start_by = now() WHERE id = %s", (task["id"],))
        agent = Agent(server, queues=("q",))
        assert [a["task_id"] for a in agent.claim(most=2)] == [kept["id"]]
        assert _row(db, task["id"], "state") == ("waiting",)
    finally:
        server.stop()


# --- retry by cause ----------------------------------------------------------------------


def _run_once(core: Core, agent: Agent, retry: dict, **report: object) -> dict:
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=spec(retry={"max_attempts": 3, **retry})).json()
    [attempt] = agent.claim(wait=5)
    answer = agent.report(attempt["attempt_id"], **report)
    assert answer.status_code == 200, answer.text
    with core.client() as alice:
        return {
            "task": alice.get(f"/v1/tasks/{task['id']}").json(),
            "events": alice.get(f"/v1/tasks/{task['id']}/events").json()["items"],
            "attempts": alice.get(f"/v1/tasks/{task['id']}/attempts").json()["items"],
        }


def test_an_exit_code_the_policy_never_retries_buries_the_task(core: Core) -> None:
    agent = Agent(core)
    never = {"never": {"exit_codes": [3, 4]}}
    seen = _run_once(core, agent, never, outcome="failed", exit_code=3)
    assert seen["task"]["state"] == "dead" and seen["task"]["attempts"] == 1
    assert seen["events"][-1]["reason"] == "not retryable: exit code 3 is never retried"
    assert seen["task"]["retry"]["never"] == {"exit_codes": [3, 4], "signals": []}
    other = _run_once(core, agent, never, outcome="failed", exit_code=5)
    assert other["task"]["state"] == "failed"


def test_the_do_not_retry_exit_code_buries_unless_listed_as_always(core: Core) -> None:
    agent = Agent(core)
    seen = _run_once(core, agent, {}, outcome="failed", exit_code=NO_RETRY_EXIT_CODE)
    assert seen["task"]["state"] == "dead"
    assert seen["events"][-1]["reason"].startswith(f"not retryable: exited {NO_RETRY_EXIT_CODE}")
    always = {"always": {"exit_codes": [NO_RETRY_EXIT_CODE]}}
    kept = _run_once(core, agent, always, outcome="failed", exit_code=NO_RETRY_EXIT_CODE)
    assert kept["task"]["state"] == "failed"


def test_an_always_retried_cause_spends_no_attempt_and_is_not_a_crash(core: Core, db) -> None:
    agent = Agent(core)
    always = {"always": {"exit_codes": [75], "signals": [15]}, "poison_after": 1}
    seen = _run_once(core, agent, always, outcome="failed", exit_code=75)
    assert seen["task"]["state"] == "failed" and seen["task"]["attempts"] == 0
    assert seen["events"][-1]["reason"] == (
        "exit code 75 is always retried: after backoff, no attempt spent"
    )
    crashed = _run_once(core, agent, always, outcome="crashed", signal=15)
    assert crashed["task"]["state"] == "failed" and crashed["task"]["attempts"] == 0
    assert crashed["attempts"][-1]["signal"] == 15
    assert _row(db, crashed["task"]["id"], "crashes, cardinality(crashed_at)") == (0, 0)


def test_a_signal_the_policy_never_retries_buries_the_task(core: Core, db) -> None:
    agent = Agent(core)
    seen = _run_once(core, agent, {"never": {"signals": [11]}}, outcome="crashed", signal=11)
    assert seen["task"]["state"] == "dead"
    assert seen["events"][-1]["reason"] == "not retryable: signal 11 is never retried"
    assert db.execute("SELECT signal FROM core.attempts").fetchone() == (11,)


@pytest.mark.parametrize(
    ("retry", "field"),
    [
        ({"never": {"exit_codes": [256]}}, "body.retry.never.exit_codes.0"),
        ({"always": {"exit_codes": [-1]}}, "body.retry.always.exit_codes.0"),
        ({"never": {"signals": [65]}}, "body.retry.never.signals.0"),
        ({"always": {"signals": [0]}}, "body.retry.always.signals.0"),
        ({"never": {"exit_codes": list(range(257))}}, "body.retry.never.exit_codes"),
        ({"never": {"exit_codes": [3]}, "always": {"exit_codes": [3]}}, "body.retry"),
        ({"poison_window_s": 0}, "body.retry.poison_window_s"),
    ],
)
def test_causes_out_of_range_are_refused_naming_the_field(
    core: Core, db, retry: dict, field: str
) -> None:
    with core.client() as alice:
        answer = alice.post("/v1/tasks", json=spec(retry=retry))
    assert _problem_field(answer) == field
    assert db.execute("SELECT count(*) FROM core.tasks").fetchone() == (0,)


# --- the poison window -------------------------------------------------------------------


def test_only_crashes_within_the_window_make_a_poison_pill(core: Core, db) -> None:
    agent = Agent(core)
    with core.client() as alice:
        task = alice.post(
            "/v1/tasks", json=spec(retry={"max_attempts": 10, "poison_window_s": 3600})
        ).json()
    assert task["retry"]["poison_window_s"] == 3600

    def crash() -> None:
        db.execute("UPDATE core.tasks SET run_at = now() WHERE id = %s", (task["id"],))
        [attempt] = agent.claim(wait=5)
        assert agent.report(attempt["attempt_id"], "crashed", signal=9).status_code == 200

    crash()
    crash()
    # Two crashes, both older than the window now: they no longer count.
    db.execute(
        "UPDATE core.tasks SET crashed_at = ARRAY(SELECT c - interval '2 hours'"
        " FROM unnest(crashed_at) c) WHERE id = %s",
        (task["id"],),
    )
    crash()
    assert _row(db, task["id"], "state, crashes") == ("failed", 3)
    crash()
    crash()
    [state] = _row(db, task["id"], "state")
    with core.client() as alice:
        events = alice.get(f"/v1/tasks/{task['id']}/events").json()["items"]
    assert state == "dead"
    assert events[-1]["reason"] == "poison pill: lost 3 times within 1 h"
    # a person's retry starts the count afresh
    with core.client() as alice:
        assert alice.post(f"/v1/tasks/{task['id']}/retry").status_code == 200
    assert _row(db, task["id"], "crashes, cardinality(crashed_at)") == (0, 0)


def test_the_window_defaults_to_cores_setting(db_url: str, tmp_path: Path, db) -> None:
    server = start_core(db_url, tmp_path, poison_window_s=600)
    try:
        with server.client() as alice:
            task = alice.post("/v1/tasks", json=spec()).json()
    finally:
        server.stop()
    assert task["retry"]["poison_window_s"] == 600
    assert _row(db, task["id"], "poison_window_s") == (600,)
