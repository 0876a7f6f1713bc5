"""What the claim's move reads, on a real PostgreSQL whose statistics predate the backlog
(as they do when work arrives in a burst and is claimed before autovacuum analyses it):
the chosen tasks through the primary key, whatever waits. A state guard written as a
constant on the task's state was planned as a bitmap scan of every live task's entry in
``ix_tasks_live_queue_state`` (5,000 behind 5,000 waiting), at every claim."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
from sqlalchemy.dialects.postgresql import psycopg as dialects

from libs.common.states import TaskState
from services.core.db import attempts as attempts_db
from services.core.db import pipeline
from services.core.domain.transitions import Op, sources

BACKLOG = 5000
MOVED = 64
DB = psycopg.Connection[tuple[Any, ...]]


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)


def _backlog(db: DB) -> int:
    db.execute(
        """INSERT INTO core.tasks (owner, name, queue, kind, artifact_uri, artifact_sha256,
               cpu, memory_mb, max_attempts, backoff_cap_s, backoff_jitter, poison_after,
               state)
           SELECT 'alice', 'x', 'default', 'task', 'file:///bin/true', repeat('0', 64),
                  0.01, 1, 1, 60, false, 3, 'waiting'
           FROM generate_series(1, %s)""",
        (BACKLOG,),
    )
    row = db.execute(
        "INSERT INTO core.workers (principal, hostname, queues, cpu, memory_mb)"
        " VALUES ('w', 'w', '{default}', 4000, 1000000) RETURNING id"
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_claim_moves_its_tasks_through_the_primary_key_behind_a_backlog(db: DB) -> None:
    worker = _backlog(db)
    ids = [r[0] for r in db.execute("SELECT id FROM core.tasks ORDER BY id LIMIT %s", (MOVED,))]
    params = {
        "ids": ids,
        "cpus": [0.01] * MOVED,
        "memories": [1.0] * MOVED,
        "froms": [TaskState.WAITING.value] * MOVED,
        "devices": [None] * MOVED,
        "worker": worker,
        "target": TaskState.RUNNING.value,
        "sources": sources(Op.CLAIM, TaskState.RUNNING),
        "op": Op.CLAIM.value,
    }
    claim = pipeline.driver_sql(attempts_db._CLAIM, dialects.dialect())  # type: ignore[no-untyped-call]
    with db.transaction(force_rollback=True):
        [[plan]] = db.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + claim, params).fetchall()
        moved = db.execute("SELECT count(*) FROM core.tasks WHERE state = 'running'").fetchone()
    assert moved == (MOVED,)
    scans = [
        n for n in _nodes(plan[0]["Plan"]) if n.get("Relation Name") == "tasks" or (
            n["Node Type"] == "Bitmap Index Scan" and n["Index Name"].startswith("ix_tasks")
        )
    ]  # fmt: skip
    assert scans, json.dumps(plan)
    # Each scan of the tasks reads the rows it moves, not the backlog.
    assert max(n["Actual Rows"] for n in scans) <= MOVED, [
        (n["Node Type"], n.get("Index Name"), n["Actual Rows"]) for n in scans
    ]
