"""Each read whose index migration 0040_task_indexes moved to another keeps an index plan
on a filled table (its generic plan, as a prepared statement runs once cached): the
running placed tasks and the running services by ``ix_tasks_running_named`` (one index
now, where there were two), a task's events by the events' key ``(task_id, seq)`` (the
primary key now; ``id`` has no index; the purge deletes a batch's events by the same
lookup), the feed by ``ix_task_events_xid_id``. Dropping the index that serves one of
them fails the test: the read would fall back to every running task, or every event."""

from __future__ import annotations

from typing import Any

import psycopg

from services.core.db import placement
from services.core.db import services as services_db
from services.core.db import tasks as tasks_db
from tests.support.plans import generic, indexes, nodes

DB = psycopg.Connection[tuple[Any, ...]]
FINISHED = 20_000
RUNNING = 2_000


def _fill(db: DB) -> None:
    """20,000 finished tasks and 2,000 running (one in ten placed by label, twenty of them
    services), 200 owners; two events a task."""
    columns = """owner, name, queue, kind, artifact_uri, artifact_sha256, cpu, memory_mb,
        max_attempts, backoff_cap_s, backoff_jitter, poison_after, state, finished_at,
        current_attempt_id, placement"""
    db.execute(
        f"""INSERT INTO core.tasks ({columns})
            SELECT 'u' || (g %% 200), 'job' || (g %% 50), 'q' || (g %% 4), 'task',
                   'file:///bin/true', repeat('0', 64), 0.1, 1, 1, 60, false, 3,
                   'succeeded', now() - make_interval(secs => g), NULL, NULL
            FROM generate_series(1, %s) g""",
        (FINISHED,),
    )
    db.execute(
        f"""INSERT INTO core.tasks ({columns})
            SELECT 'u' || (g %% 200), CASE WHEN g <= 20 THEN 'svc' ELSE 'job' || (g %% 50) END,
                   'q' || (g %% 4), CASE WHEN g <= 20 THEN 'service' ELSE 'task' END,
                   'file:///bin/true', repeat('0', 64), 0.1, 1, 1, 60, false, 3,
                   'running', NULL, -g,
                   CASE WHEN g %% 10 = 0 THEN '{{"spread": "host"}}'::jsonb END
            FROM generate_series(1, %s) g""",
        (RUNNING,),
    )
    for seq in (1, 2):
        db.execute(
            """INSERT INTO core.task_events (task_id, seq, owner, op, to_state)
               SELECT id, %s, owner, 'submit', state FROM core.tasks""",
            (seq,),
        )
    db.execute("ANALYZE core.tasks, core.task_events")


def _reads(db: DB, clause: Any, table: str) -> tuple[set[str], list[str]]:
    """The indexes of ``table`` that ``clause``'s generic plan reads, and the tables it
    reads whole."""
    plan = generic(db, clause)
    scans = [n["Relation Name"] for n in nodes(plan) if n["Node Type"] == "Seq Scan"]
    return indexes(plan, table), scans


# (what reads, its statement, the table, the index that serves it); one filled table for
# all of them (its fill is most of the test's time)
_READS = [
    ("service endpoints", services_db._REPLICAS, "tasks", "ix_tasks_running_named"),
    ("spread groups", placement._GROUPS_RUNNING, "tasks", "ix_tasks_running_named"),
    ("a task's history", tasks_db.EVENTS_OF, "task_events", "pk_task_events"),
    ("the feed", tasks_db.FEED, "task_events", "ix_task_events_xid_id"),
    ("a user's feed", tasks_db.FEED_OWN, "task_events", "ix_task_events_owner"),
]


def test_each_moved_read_keeps_its_index_and_an_event_has_one_entry_less(db: DB) -> None:
    _fill(db)
    for what, clause, table, index in _READS:
        used, scans = _reads(db, clause, table)
        assert index in used, (what, used, scans)
        assert table not in scans, (what, scans)
    # the change itself: the events' indexes, ``id`` in none of them (the owner's is
    # migration 0041_feed_owner's, for a user's feed)
    found = db.execute(
        """SELECT indexrelid::regclass::text, pg_get_indexdef(indexrelid) FROM pg_index
           WHERE indrelid = 'core.task_events'::regclass ORDER BY 1"""
    ).fetchall()
    assert [name for name, _ in found] == [
        "core.ix_task_events_dead",
        "core.ix_task_events_owner",
        "core.ix_task_events_xid_id",
        "core.pk_task_events",
    ], found
    assert "(task_id, seq)" in dict(found)["core.pk_task_events"]
