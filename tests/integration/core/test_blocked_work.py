"""The placement pass's look for blocked guaranteed work (``db.placement.make_room``)
reads the head of each served queue's line, in the claim's order, however long the
backlog: it read and sorted every waiting task once a second (13 % of PostgreSQL's time
beside batch submits at 500,000 waiting). A guaranteed task at the head that fits no
worker gets a reservation; the same task deeper in line than ``BLOCKED_LINE`` waits for
the line; with no live worker nothing is read."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import psycopg
import pytest
from sqlalchemy.dialects.postgresql import psycopg as dialects
from sqlalchemy.ext.asyncio import create_async_engine

from libs.common import pipeline
from services.core.db import placement
from tests.support.plans import analyzed, insert_tasks, nodes, rows_read

DB = psycopg.Connection[tuple[Any, ...]]
LINE = placement.BLOCKED_LINE


def _waiting(
    db: DB, count: int, *, queue: str = "default", cpu: float = 0.5, every: int = 3
) -> None:
    """``count`` waiting tasks, every ``every``-th preemptible, in line after those
    before (their stamps rise with their ids), last touched a minute ago."""
    db.execute(
        """INSERT INTO core.tasks (owner, name, queue, kind, artifact_uri, artifact_sha256,
               cpu, memory_mb, max_attempts, backoff_cap_s, backoff_jitter, poison_after,
               preemptible, state, vtime, updated_at)
           SELECT 'alice', 'x', %s, 'task', 'file:///bin/true', repeat('0', 64), %s, 1, 1,
                  60, false, 3, g %% %s = 0, 'waiting',
                  (SELECT COALESCE(max(vtime), 0) FROM core.tasks) + g,
                  now() - interval '1 minute'
           FROM generate_series(1, %s) g""",
        (queue, cpu, every, count),
    )


def _big(db: DB) -> int:
    """A guaranteed task of 3 CPU, last in line."""
    _waiting(db, 1, cpu=3.0)
    row = db.execute("SELECT max(id) FROM core.tasks").fetchone()
    assert row is not None
    db.execute("UPDATE core.tasks SET preemptible = false WHERE id = %s", (row[0],))
    return int(row[0])


def _worker(db: DB) -> int:
    """A live worker of 4 CPU, 2 of them held by a running guaranteed task: the big task
    fits it, but not now."""
    [[worker]] = db.execute(
        "INSERT INTO core.workers (principal, hostname, queues, cpu, memory_mb)"
        " VALUES ('w', 'w', '{default}', 4, 4096) RETURNING id"
    ).fetchall()
    [[task]] = db.execute(
        """INSERT INTO core.tasks (owner, name, queue, kind, artifact_uri, artifact_sha256,
               cpu, memory_mb, max_attempts, backoff_cap_s, backoff_jitter, poison_after,
               state, current_attempt_id)
           VALUES ('bob', 'y', 'default', 'task', 'file:///bin/true', repeat('0', 64), 2, 1,
                   1, 60, false, 3, 'running', -1) RETURNING id"""
    ).fetchall()
    db.execute(
        "INSERT INTO core.attempts (task_id, number, worker_id, charge_cpu, charge_memory_mb)"
        " VALUES (%s, 1, %s, 2, 1)",
        (task, worker),
    )
    return int(worker)


def _make_room(db_url: str) -> int:
    async def once() -> int:
        engine = create_async_engine(db_url)
        try:
            async with engine.begin() as conn:
                return await placement.make_room(conn, placement.Defaults(preempt_after_s=5.0))
        finally:
            await engine.dispose()

    return asyncio.run(once())


def _reserved(db: DB, worker: int) -> int | None:
    row = db.execute("SELECT reserved_for FROM core.workers WHERE id = %s", (worker,)).fetchone()
    assert row is not None
    return row[0]


def test_the_look_reads_the_head_of_each_served_line_in_the_claims_order(db: DB) -> None:
    _waiting(db, 3 * LINE)
    _waiting(db, 200, queue="unserved")
    _worker(db)
    db.execute("ANALYZE core.tasks")
    params = {"after_s": 5.0, "line": LINE, "limit": 50}
    for generic in (False, True):
        plan = analyzed(db, placement._BLOCKED, params, generic=generic)
        read = [n for n in nodes(plan) if n.get("Relation Name") == "tasks"]
        assert read, plan
        assert all(n["Node Type"] != "Seq Scan" for n in read), read
        assert sum(n["Actual Rows"] * n["Actual Loops"] for n in read) <= LINE, read
    found = [row[0] for row in db.execute(_as_psycopg(), params)]
    expected = [
        row[0]
        for row in db.execute(
            "SELECT id FROM core.tasks WHERE queue = 'default' AND state = 'waiting'"
            " AND NOT preemptible"
            " ORDER BY priority DESC, vtime, id LIMIT 50"
        )
    ]
    assert found == expected


def _as_psycopg() -> str:
    return pipeline.driver_sql(placement._BLOCKED, dialects.dialect())  # type: ignore[no-untyped-call]


def test_a_blocked_task_at_the_head_is_reserved_for_and_one_deep_in_line_waits(
    db: DB, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(placement, "BLOCKED_LINE", 100)
    big = _big(db)
    assert _make_room(db_url) == 0, "no live worker: nothing to make room on"
    worker = _worker(db)
    assert _make_room(db_url) == 1
    assert _reserved(db, worker) == big
    db.execute("UPDATE core.workers SET reserved_for = NULL")
    # The same task behind a line of preemptible work longer than the look: the line
    # comes first (the claim takes what fits of it).
    _waiting(db, 100, every=1)
    db.execute(
        "UPDATE core.tasks SET vtime = (SELECT max(vtime) + 1 FROM core.tasks) WHERE id = %s",
        (big,),
    )
    assert _make_room(db_url) == 0
    assert _reserved(db, worker) is None


def _delayed(db: DB, count: int) -> None:
    """``count`` ready tasks due tomorrow (delayed submissions, retries in backoff)."""
    insert_tasks(db, count, "ready", cpu="0.5", run_at="now() + interval '1 day'")


def test_the_deferral_pass_reads_the_deferrable_and_the_deferred_not_the_backlog(
    db: DB,
) -> None:
    """A hot pool (its queue's utilisation over ``defer_above``, as during every backlog):
    the pass that defers the deferrable waiting work and releases what it deferred reads
    those tasks, not every waiting task of the queue and every delayed one (20,000 read at
    each pass, once a second, at 10,000 of each; 24-34 ms a pass at 20,000 waiting)."""
    _waiting(db, 10_000)
    _delayed(db, 10_000)
    _waiting(db, 3)
    db.execute(
        "UPDATE core.tasks SET defer_ok = true"
        " WHERE id IN (SELECT id FROM core.tasks WHERE state = 'waiting' ORDER BY id DESC LIMIT 3)"
    )
    db.execute("INSERT INTO core.queues (name, utilisation) VALUES ('default', 0.95)")
    db.execute("ANALYZE core.tasks")
    defer, release = placement.deferral(placement.Defaults())
    for generic in (True, False):
        with db.transaction(force_rollback=True):
            plan = analyzed(db, *defer, generic=generic)
            # the three found by their index, then moved by the primary key: a handful
            assert rows_read(plan, "tasks") < 100, (generic, json.dumps(plan))
            [[moved]] = db.execute(
                "SELECT count(*) FROM core.tasks WHERE deferred AND state = 'ready'"
            ).fetchall()
            assert moved == 3
            plan = analyzed(db, *release, generic=generic)
            assert rows_read(plan, "tasks") < 100, (generic, json.dumps(plan))
