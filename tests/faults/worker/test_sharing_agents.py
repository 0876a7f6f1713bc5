"""Sharing one pool through real core and real worker agents: a flood does not hold back
another owner, a concurrency key's limit holds under load (checked in the database), a
running quota holds work with its reason, aging lets low-priority work through a
constant high-priority stream."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import TRUE_SHA, Core, shell_spec, start_core, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def core(db_url: str, tmp_path: Path) -> Iterator[Core]:
    server = start_core(
        db_url, tmp_path / "core", heartbeat_interval_s=0.5, heartbeat_timeout_s=30.0
    )
    yield server
    server.stop()


def true_task(**extra: object) -> dict:
    return {"name": "true", "artifact": {"uri": "file:///bin/true", "sha256": TRUE_SHA}, **extra}


def shell(script: str, **extra: object) -> dict:
    return shell_spec(script, resources={"cpu": 0.5, "memory_mb": 64}, **extra)


def _submit(client, bodies: list[dict]) -> list[int]:
    ids: list[int] = []
    for start in range(0, len(bodies), 1000):
        answer = client.post("/v1/tasks/batch", json={"tasks": bodies[start : start + 1000]})
        assert answer.status_code == 201, answer.text
        ids += [item["id"] for item in answer.json()["tasks"]]
    return ids


def _one(db, query: str, *params: object) -> object:
    return db.execute(query, params).fetchone()[0]


def test_bob_starts_within_seconds_of_alices_flood(core: Core, workers, tmp_path, db) -> None:
    workers.start(core, tmp_path / "w", "w", cpu=4, memory_mb=4096)
    with core.client("alice") as alice, core.client("bob") as bob:
        _submit(alice, [true_task() for _ in range(5000)])
        bobs = _submit(bob, [true_task() for _ in range(20)])
        started = "SELECT count(DISTINCT task_id) FROM core.attempts WHERE task_id = ANY(%s)"
        wait_for(lambda: _one(db, started, bobs) == 20, timeout=60, interval=0.1)
    last_bob = _one(db, "SELECT max(started_at) FROM core.attempts WHERE task_id = ANY(%s)", bobs)
    alices_before = _one(
        db,
        "SELECT count(*) FROM core.attempts a JOIN core.tasks t ON t.id = a.task_id"
        " WHERE t.owner = 'alice' AND a.started_at <= %s",
        last_bob,
    )
    waiting = _one(
        db, "SELECT count(*) FROM core.tasks WHERE owner = 'alice' AND state = 'waiting'"
    )
    # Bob interleaves with the head of alice's backlog instead of queueing behind it.
    assert alices_before < 200, alices_before
    assert waiting > 4000


def test_a_concurrency_key_of_three_never_has_a_fourth_running(core, workers, tmp_path, db):
    for i in range(2):
        workers.start(core, tmp_path / f"w{i}", f"w{i}", cpu=4, memory_mb=2048)
    key = {"key": "db-main", "limit": 3}
    with core.client("alice") as alice, core.client("bob") as bob:
        ids = _submit(alice, [shell("sleep 0.3", concurrency=key) for _ in range(6)])
        ids += _submit(bob, [shell("sleep 0.3", concurrency=key) for _ in range(6)])
        _submit(bob, [shell("sleep 0.2") for _ in range(8)])
    peaks: list[int] = []
    done = threading.Event()
    running = (
        "SELECT (SELECT count(*) FROM core.attempts a JOIN core.tasks t ON t.id = a.task_id"
        "        WHERE a.outcome IS NULL AND t.concurrency_key = 'db-main'),"
        "       (SELECT count(*) FROM core.tasks"
        "        WHERE state = 'running' AND concurrency_key = 'db-main')"
    )

    def watch() -> None:
        with psycopg_connect(core.db_url) as conn:
            while not done.is_set():
                peaks.append(max(conn.execute(running).fetchone()))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        finished = "SELECT count(*) FROM core.tasks WHERE id = ANY(%s) AND state = 'succeeded'"
        wait_for(lambda: _one(db, finished, ids) == len(ids), timeout=120, interval=0.2)
    finally:
        done.set()
        watcher.join()
    assert max(peaks) <= 3
    assert max(peaks) >= 2, "the key's tasks did run side by side"


def psycopg_connect(url: str):
    import psycopg

    from libs.common.settings import libpq_url

    return psycopg.connect(libpq_url(url), autocommit=True)


def test_a_running_quota_holds_work_with_its_reason(core: Core, workers, tmp_path, db) -> None:
    with core.client("root", "admin") as admin:
        admin.patch("/v1/owners/alice/share", json={"max_running": 1}).raise_for_status()
    workers.start(core, tmp_path / "w", "w", cpu=4, memory_mb=2048)
    with core.client("alice") as alice:
        ids = _submit(alice, [shell("sleep 1") for _ in range(3)])
        running = "SELECT count(*) FROM core.tasks WHERE id = ANY(%s) AND state = 'running'"
        wait_for(lambda: _one(db, running, ids) == 1, timeout=30)
        reasons = {t["pending_reason"] for t in alice.get("/v1/tasks").json()["items"]}
        assert "owner at quota (running 1/1)" in reasons
        peak = 0
        finished = "SELECT count(*) FROM core.tasks WHERE id = ANY(%s) AND state = 'succeeded'"

        def all_done() -> bool:
            nonlocal peak
            peak = max(peak, _one(db, running, ids))
            return _one(db, finished, ids) == 3

        wait_for(all_done, timeout=60, interval=0.05)
    assert peak == 1


def test_aging_lets_a_low_priority_task_through_a_high_priority_stream(
    db_url: str, tmp_path: Path, workers, db
) -> None:
    server = start_core(
        db_url, tmp_path / "core", heartbeat_interval_s=0.5, heartbeat_timeout_s=30.0,
        aging_s=0.05,
    )  # fmt: skip
    stop = threading.Event()
    try:
        workers.start(server, tmp_path / "w", "w", cpu=0.5, memory_mb=512)
        with server.client("alice") as alice, server.client("bob") as bob:

            def stream() -> None:
                waiting = (
                    "SELECT count(*) FROM core.tasks WHERE owner = 'bob' AND state = 'waiting'"
                )
                with psycopg_connect(db_url) as conn:
                    while not stop.is_set():
                        if conn.execute(waiting).fetchone()[0] < 4:
                            _submit(bob, [shell("sleep 0.1", priority=50) for _ in range(4)])

            feeder = threading.Thread(target=stream)
            feeder.start()
            wait_for(lambda: _one(db, "SELECT count(*) FROM core.attempts") >= 2, timeout=30)
            low = _submit(alice, [shell("true", priority=-50)])[0]
            state = "SELECT state FROM core.tasks WHERE id = %s"
            wait_for(lambda: _one(db, state, low) in ("running", "succeeded"), timeout=60)
            stop.set()
            feeder.join()
            # The stream never ran dry: bob still had work waiting when alice's task ran.
            started = _one(db, "SELECT started_at FROM core.attempts WHERE task_id = %s", low)
            later = _one(
                db,
                "SELECT count(*) FROM core.tasks WHERE owner = 'bob' AND created_at < %s"
                " AND id NOT IN (SELECT task_id FROM core.attempts WHERE started_at < %s)",
                started,
                started,
            )
            assert later > 0
    finally:
        stop.set()
        server.stop()
