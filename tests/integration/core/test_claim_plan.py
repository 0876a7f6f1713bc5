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
from services.core.db import services as services_db
from services.core.db import tasks as tasks_db
from services.core.domain.transitions import Op, sources
from tests.support.plans import analyzed, generic, insert_tasks, nodes, rows_read

BACKLOG = 5000
MOVED = 64
DB = psycopg.Connection[tuple[Any, ...]]


def _backlog(db: DB, count: int = BACKLOG) -> int:
    insert_tasks(db, count)
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


FINISHED = 20_000


def _analysed_before_the_backlog(db: DB) -> int:
    """A table whose statistics were taken while nearly all its tasks were finished (a
    month of retention, no work waiting), then a backlog that autoanalyze has not seen
    yet (10 % of the table must change first): the worker's id."""
    insert_tasks(db, FINISHED, "succeeded", finished_at="now() - interval '1 day'")
    db.execute("ANALYZE core.tasks")
    return _backlog(db)


def _pick_params(worker: int) -> dict[str, Any]:
    return {  # as ``attempts.Ask`` sends them for a worker of one queue, no labels
        "worker": worker,
        "cpu": 4000.0,
        "memory_mb": 1_000_000.0,
        "devices": "{}",
        "facts": "[]",
        "fact_names": "{}",
        "defer_above": 0.8,
        "defer_margin_s": 600.0,
        "defer_max_s": 21600.0,
        "limit": 96,
        "queue": "default",
        "aging_s": 60.0,
        "aged_limit": 64,
        "aging_max": 200,
        "ahead_s": 0.0,
    }


def test_a_pick_reads_what_it_takes_when_the_statistics_predate_the_backlog(db: DB) -> None:
    """The pick's generic plan behind 5,000 waiting tasks that the table's statistics do
    not know of: its reserved work (none here) is found by ids, not by walking every
    waiting task's index entry to test each against them (5,000 rows read a pick, 7.5 ms
    at 20,000 waiting behind 1,000,000 finished: every turn's)."""
    worker = _analysed_before_the_backlog(db)
    with db.transaction(force_rollback=True):
        db.execute(attempts_db._GENERIC.text)
        plan = analyzed(db, attempts_db._WAITING_IN_QUEUE, _pick_params(worker), generic=True)
    assert plan["Actual Rows"] == 96, json.dumps(plan)
    # the best 96 found by the waiting index, then their details by the primary key
    assert rows_read(plan, "tasks") <= 3 * 96, json.dumps(plan)


RUNNING = 1000


def _running(db: DB, worker: int, count: int = RUNNING) -> list[int]:
    """``count`` tasks running on ``worker``, none of their starts seen yet: their
    attempts' ids."""
    insert_tasks(db, count, "running", current_attempt_id="nextval('core.attempts_id_seq')")
    db.execute(
        """INSERT INTO core.attempts (id, task_id, number, worker_id) OVERRIDING SYSTEM VALUE
           SELECT current_attempt_id, id, 1, %s FROM core.tasks WHERE state = 'running'""",
        (worker,),
    )
    return [
        r[0]
        for r in db.execute(
            "SELECT current_attempt_id FROM core.tasks WHERE state = 'running' ORDER BY id"
        )
    ]


def test_statements_by_attempt_read_their_tasks_by_key_when_the_statistics_predate(
    db: DB,
) -> None:
    """Statements that reach running tasks through their attempts, planned on statistics
    taken before the backlog and the running work: each reads the tasks it names, not
    every live one for each attempt (the resend after a lost answer read 1,000,000 rows
    at 1,000 running; a service's status report every running task). The bound is twice
    what each reads by key."""
    worker = _analysed_before_the_backlog(db)
    ids = _running(db, worker)
    statuses = [{"attempt_id": a, "ready": True, "address": None, "ports": None} for a in ids]
    cases = {
        # each of the worker's unseen attempts' task once, then the 256 it hands out again
        "resend": (
            attempts_db._RESEND, {"worker": worker, "holding": "{}", "most": 256}, RUNNING + 256
        ),
        "held": (attempts_db._HELD_STARTS, {"attempts": params_db.ints(ids[:64]), "worker": worker}, 64),
        "confirm": (attempts_db._CONFIRM_START, {"attempt": ids[0], "worker": worker}, 1),
        "status": (services_db._REPORT, {"worker": worker, "rows": json.dumps(statuses[:64])}, 64),
    }  # fmt: skip
    for name, (clause, params, by_key) in cases.items():
        with db.transaction(force_rollback=True):
            db.execute(attempts_db._GENERIC.text)
            plan = analyzed(db, clause, params, generic=True)
        assert rows_read(plan, "tasks") <= 2 * by_key, (name, json.dumps(plan))


def test_the_promoters_park_reads_the_paused_queues_work_only(db: DB) -> None:
    """The promoter's park of waiting work in paused queues, once a second, planned on
    statistics that predate the backlog: with no queue paused it reads nothing, with one
    paused only that queue's waiting tasks (it read every waiting task's entry, 5,000
    here, 37-162 ms a pass at 100,000 waiting behind 1,000,000 finished)."""
    _analysed_before_the_backlog(db)
    insert_tasks(db, 10, queue="'slow'")
    db.execute("INSERT INTO core.queues (name) VALUES ('default'), ('slow')")
    for paused, parked in ((None, 0), ("slow", 10)):
        if paused:
            db.execute("UPDATE core.queues SET paused = true WHERE name = %s", (paused,))
        for on_generic in (True, False):
            with db.transaction(force_rollback=True):
                plan = analyzed(db, tasks_db.PARK_WAITING, {"limit": 1000}, generic=on_generic)
                [[ready]] = db.execute(
                    "SELECT count(*) FROM core.tasks WHERE queue = 'slow' AND state = 'ready'"
                ).fetchall()
            assert ready == parked
            # each found by its queue's entry, locked, then moved by the primary key
            assert rows_read(plan, "tasks") <= 3 * parked, (paused, on_generic, json.dumps(plan))


def test_the_park_reads_nothing_with_no_queue_paused_behind_an_analysed_backlog(db: DB) -> None:
    """Planned on statistics that know the backlog (a quarter of 20,000 tasks waiting, all
    in one queue), the park's walk of the primary key in id order looks cheap: with no
    queue paused it read every task at every pass (354 ms a pass at 1,100,000 tasks).
    The check for a paused queue runs first, once, whatever the plan."""
    _backlog(db, 20_000)
    db.execute(
        "UPDATE core.tasks SET state = 'succeeded', finished_at = now()"
        " WHERE id IN (SELECT id FROM core.tasks ORDER BY id LIMIT 15000)"
    )
    db.execute("INSERT INTO core.queues (name) VALUES ('default')")
    db.execute("ANALYZE core.tasks")
    for on_generic in (True, False):
        with db.transaction(force_rollback=True):
            plan = analyzed(db, tasks_db.PARK_WAITING, {"limit": 1000}, generic=on_generic)
        # at most the one row a hash join of the move reads before it finds nothing to move
        assert rows_read(plan, "tasks") <= 1, (on_generic, json.dumps(plan))
