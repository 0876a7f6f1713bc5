"""What the claim's move reads, on a real PostgreSQL whose statistics predate the backlog
(as they do when work arrives in a burst and is claimed before autovacuum analyses it):
the chosen tasks through the primary key, whatever waits. A state guard written as a
constant on the task's state was planned as a bitmap scan of every live task's entry in
``ix_tasks_live_queue_state`` (5,000 behind 5,000 waiting), at every claim."""

from __future__ import annotations

import json
from typing import Any

import psycopg
from sqlalchemy.dialects.postgresql import psycopg as dialects

from libs.common import pipeline
from libs.common.states import TaskState
from services.core.db import attempts as attempts_db
from services.core.db import params as params_db
from services.core.db import placement
from services.core.domain.transitions import Op, sources
from tests.support.plans import generic, nodes

BACKLOG = 5000
MOVED = 64
DB = psycopg.Connection[tuple[Any, ...]]


def _backlog(db: DB, count: int = BACKLOG) -> int:
    db.execute(
        """INSERT INTO core.tasks (owner, name, queue, kind, artifact_uri, artifact_sha256,
               cpu, memory_mb, max_attempts, backoff_cap_s, backoff_jitter, poison_after,
               state)
           SELECT 'alice', 'x', 'default', 'task', 'file:///bin/true', repeat('0', 64),
                  0.01, 1, 1, 60, false, 3, 'waiting'
           FROM generate_series(1, %s)""",
        (count,),
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
    params = {  # as ``attempts.lease`` sends them: arrays as their text literals
        "ids": params_db.ints(ids),
        "cpus": params_db.floats([0.01] * MOVED),
        "memories": params_db.floats([1.0] * MOVED),
        "froms": params_db.words([TaskState.WAITING.value] * MOVED),
        "devices": params_db.words([None] * MOVED),
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
        n for n in nodes(plan[0]["Plan"]) if n.get("Relation Name") == "tasks" or (
            n["Node Type"] == "Bitmap Index Scan" and n["Index Name"].startswith("ix_tasks")
        )
    ]  # fmt: skip
    assert scans, json.dumps(plan)
    # Each scan of the tasks reads the rows it moves, not the backlog.
    assert max(n["Actual Rows"] for n in scans) <= MOVED, [
        (n["Node Type"], n.get("Index Name"), n["Actual Rows"]) for n in scans
    ]


def _task_scans(db: DB, clause: Any) -> list[str]:
    """The tables among tasks and attempts that ``clause``'s generic plan reads whole."""
    return [
        n["Relation Name"]
        for n in nodes(generic(db, clause))
        if n["Node Type"] == "Seq Scan" and n["Relation Name"] in ("tasks", "attempts")
    ]


# The statements of a turn (``attempts.hear``, ``finish_and_pick``, ``lease``)
_TURN = {
    "heard": attempts_db._HEARD,
    "use": placement.USE,
    "reported": attempts_db._REPORTED,
    "finish": attempts_db._FINISH,
    # (a worker of several queues sorts their waiting work: an ANY is no index order)
    "pick": attempts_db._WAITING_IN_QUEUE,
    "claim": attempts_db._CLAIM,
}


def test_the_turns_generic_plans_read_tasks_by_key_behind_an_analysed_backlog(db: DB) -> None:
    """Each statement of a turn, planned without its values, still finds the tasks and
    attempts by ids, a worker or a queue: no scan of the whole table."""
    worker = _backlog(db)
    # as many attempts of earlier work, ended
    db.execute(
        """INSERT INTO core.attempts (task_id, number, worker_id, outcome, ended_at)
           SELECT id, 1, %s, 'succeeded', now() FROM core.tasks""",
        (worker,),
    )
    db.execute("ANALYZE core.tasks, core.attempts")
    for name, clause in _TURN.items():
        seq = _task_scans(db, clause)
        assert not seq, (name, seq)


def test_the_turns_generic_plans_read_tasks_by_key_on_a_young_unanalysed_table(db: DB) -> None:
    """As a pooled connection's first turns plan them on a young install: a few hundred
    tasks, never analysed, no attempt yet, and the turn's settings (``attempts._GENERIC``).
    The plan is kept for as long as the connection lives (``database.KeepingConnection``),
    so a scan here is one at every turn while the tables grow (planned with sequential
    scans on, four of the seven scanned every task)."""
    _backlog(db, 300)
    with db.transaction():
        db.execute(attempts_db._GENERIC.text)
        for name, clause in _TURN.items():
            seq = _task_scans(db, clause)
            assert not seq, (name, seq)
