"""The liveness path's own pool: heartbeats (and the reaper) are answered while the data
path's load holds every connection of its pool; and the lease check's cache keeps its
fence."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from libs.common.client import DEFAULT_TIMEOUT
from libs.common.settings import libpq_url
from services.core.settings import CoreSettings
from tests.support import Core, spec, start_core, wait_for

DB = psycopg.Connection[tuple[Any, ...]]
DATA_POOL = 2


def _register(core: Core, name: str) -> tuple[httpx.Client, int]:
    http = core.client(name, "worker")
    offer = {"hostname": f"{name}.test", "queues": ["default"], "cpu": 1, "memory_mb": 512}
    answer = http.post("/v1/workers", json=offer)
    assert answer.status_code == 201, answer.text
    http.headers["X-Cairn-Worker-Lease"] = answer.json()["lease"]
    return http, answer.json()["worker"]["id"]


def _lock_waiters(db: DB, statement: str | None = None) -> int:
    """Sessions waiting for a table's lock: with the group commit off (below), only the data
    pool's (the submissions' inserts, the promoter's moves), each holding its connection.
    ``statement``: only those whose statement matches this regular expression."""
    row = db.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock' AND wait_event = 'relation'"
        " AND (%(statement)s::text IS NULL OR query ~ %(statement)s)",
        {"statement": statement},
    ).fetchone()
    assert row is not None
    return int(row[0])


#: ``db.tasks``' submit statements, one task's and many's, by how they begin
SUBMITS = r"^\s*WITH (stamped|input) AS"


def test_a_heartbeat_is_answered_while_submits_hold_every_data_connection(
    db_url: str, tmp_path: Path, db: DB
) -> None:
    # Without the group commit each submission's insert holds a data connection while it
    # waits (with it, they wait on the group's own connection and the pool stays free).
    core = start_core(
        db_url,
        tmp_path,
        db_pool_size=DATA_POOL,
        db_pool_timeout_s=60.0,
        heartbeat_timeout_s=3600.0,
        submit_group_commit=False,
    )
    worker, worker_id = _register(core, "w1")
    answers: list[int] = []
    try:
        with psycopg.connect(libpq_url(db_url)) as locker:
            # Every insert into core.tasks now waits on this lock, holding its connection.
            locker.execute("LOCK TABLE core.tasks IN SHARE MODE")

            def submit() -> None:
                with core.client("alice") as alice:
                    answers.append(alice.post("/v1/tasks", json=spec()).status_code)

            submitters = [threading.Thread(target=submit) for _ in range(DATA_POOL + 1)]
            for thread in submitters:
                thread.start()
            # The whole data pool waits on the lock (the extra submit waits for the pool).
            wait_for(lambda: _lock_waiters(db) >= DATA_POOL)
            before = db.execute(
                "SELECT last_heartbeat_at FROM core.workers WHERE id = %s", (worker_id,)
            ).fetchone()
            beat = worker.post(
                f"/v1/workers/{worker_id}/heartbeat", json={"attempts": []}, timeout=5.0
            )
            assert beat.status_code == 200, beat.text
            assert beat.json()["state"] == "live"
            after = db.execute(
                "SELECT last_heartbeat_at FROM core.workers WHERE id = %s", (worker_id,)
            ).fetchone()
            assert before is not None and after is not None and after[0] > before[0]
            assert answers == []  # the submits were still waiting when the beat came back
            locker.rollback()
        for thread in submitters:
            thread.join(timeout=30)
        assert answers == [201] * (DATA_POOL + 1)
    finally:
        worker.close()
        core.stop()


def test_a_cached_lease_still_fences_out_another_principal_and_a_wrong_lease(
    db_url: str, tmp_path: Path
) -> None:
    core = start_core(db_url, tmp_path, heartbeat_timeout_s=3600.0)
    owner, worker_id = _register(core, "w1")
    lease = owner.headers["X-Cairn-Worker-Lease"]
    path = f"/v1/workers/{worker_id}/heartbeat"
    try:
        assert owner.post(path, json={"attempts": []}).status_code == 200  # cached now
        with core.client("mallory", "worker") as mallory:
            stolen = mallory.post(
                path, json={"attempts": []}, headers={"X-Cairn-Worker-Lease": lease}
            )
            assert stolen.status_code == 404
            assert stolen.json()["detail"] == f"worker {worker_id} not found"
        wrong = owner.post(path, json={"attempts": []}, headers={"X-Cairn-Worker-Lease": "x"})
        assert wrong.status_code == 404
        with core.client("root", "admin") as admin:
            answer = admin.post(
                path, json={"attempts": []}, headers={"X-Cairn-Worker-Lease": lease}
            )
            assert answer.status_code == 200
        assert owner.post(path, json={"attempts": []}).status_code == 200
    finally:
        owner.close()
        core.stop()


@pytest.mark.parametrize("group_commit", [False, True], ids=["pooled", "group-commit"])
def test_an_overloaded_core_refuses_a_request_before_its_client_gives_up(
    db_url: str, tmp_path: Path, db: DB, group_commit: bool
) -> None:
    """Every data connection held (each submission's insert waiting on a lock), or, with
    the group commit, its write held: a submission that finds no connection free, or waits
    in the group's line, is answered 503 (retryable, nothing done) within the pool's wait,
    before the client's own read timeout, rather than done later for a client that
    stopped listening."""
    assert CoreSettings().db_pool_timeout_s < DEFAULT_TIMEOUT.read  # type: ignore[operator]
    # With the group commit, a pool with room: the requests' other reads (the token) and
    # core's loops (their moves wait on the lock too) leave connections free.
    core = start_core(
        db_url,
        tmp_path,
        db_pool_size=8 if group_commit else DATA_POOL,
        db_pool_timeout_s=1.0,
        submit_group_commit=group_commit,
    )
    held: list[int] = []
    try:
        with psycopg.connect(libpq_url(db_url)) as locker:
            locker.execute("LOCK TABLE core.tasks IN SHARE MODE")

            def submit() -> None:
                with core.client("alice") as alice:
                    held.append(alice.post("/v1/tasks", json=spec(), timeout=30).status_code)

            holders = [threading.Thread(target=submit) for _ in range(DATA_POOL)]
            for thread in holders:
                thread.start()
            if group_commit:  # the group's write waits on the lock
                wait_for(lambda: _lock_waiters(db, SUBMITS) >= 1)
            else:
                wait_for(lambda: _lock_waiters(db) >= DATA_POOL)
            with core.client("bob") as bob:
                started = time.monotonic()
                refused = bob.post("/v1/tasks", json=spec(name="extra"), timeout=30)
                took = time.monotonic() - started
            assert refused.status_code == 503, refused.text
            assert refused.headers["content-type"].startswith("application/problem+json")
            assert took < 5.0
            locker.rollback()
        for thread in holders:
            thread.join(timeout=30)
        # (the connections the lock held may have been core's own loops', whose writes
        # wait on it too: a holder may have been refused as well)
        names = [r[0] for r in db.execute("SELECT name FROM core.tasks").fetchall()]
        assert "extra" not in names
    finally:
        core.stop()
