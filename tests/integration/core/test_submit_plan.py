"""What a submission's fair-share stamp reads, under the plan PostgreSQL caches for the
prepared SUBMIT (the generic plan), measured by the buffers EXPLAIN counts on a real
PostgreSQL: a few, whatever waits in the queue. A flow's last stamp once walked the
queue's backlog of other owners' work (221 buffers behind 5,000 of alice's tasks), and a
first respelling moved the walk onto the flow's own delayed and paused work (191-195
buffers filling a paused queue); both cases are here, for an owner's flow and a team's,
by the form for one row (SUBMIT_ONE, a single submission's) and by the form for many."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy.dialects.postgresql import psycopg as dialects

from libs.common import pipeline
from libs.common.models import TaskCreate
from services.core.db import tasks as tasks_db

BACKLOG = 5000
DB = psycopg.Connection[tuple[Any, ...]]


def _rows(n: int, owner: str, team: str | None = None) -> str:
    spec = TaskCreate.model_validate(
        {"name": "x", "artifact": {"uri": "file:///bin/true", "sha256": "0" * 64}}
    )
    return json.dumps([{**tasks_db._row_doc(spec), "owner": owner, "team": team}] * n)


def _buffers(plan: dict[str, Any]) -> int:
    node = plan["Plan"]
    return int(node["Shared Hit Blocks"]) + int(node["Shared Read Blocks"])


def _prepared(db: DB) -> None:
    """SUBMIT as ``submit_rows``, and its form for one row (SUBMIT_ONE) as ``submit_one``."""
    for name, clause in (("submit_rows", tasks_db.SUBMIT), ("submit_one", tasks_db.SUBMIT_ONE)):
        text = pipeline.driver_sql(clause, dialects.dialect())  # type: ignore[no-untyped-call]
        db.execute(
            sql.SQL("PREPARE {}(json, float8, text, float8, float8, json) AS {}").format(
                sql.Identifier(name),
                sql.SQL(
                    text.replace("%(rows)s", "$1")
                    .replace("%(quantum)s", "$2")
                    .replace("%(fair_share)s", "$3")
                    .replace("%(fair_half_life)s", "$4")
                    .replace("%(fair_unit)s", "$5")
                    .replace("%(waits)s", "$6")
                ),
            )
        )


def _waits(rows: str) -> sql.Literal:
    """The rows' wait bounds (none), as SUBMIT takes them beside the rows."""
    return sql.Literal(json.dumps([None] * len(json.loads(rows))))


def _submit(db: DB, rows: str, fair: str = "tasks") -> None:
    db.execute(
        sql.SQL("EXECUTE submit_rows({}, 1.0, {}, 604800, 60, {})").format(
            sql.Literal(rows), sql.Literal(fair), _waits(rows)
        )
    )


def _spent(db: DB, rows: str, fair: str = "tasks") -> int:
    """The buffers one submission of ``rows`` reads: one row by the form a single
    submission takes (SUBMIT_ONE), more by SUBMIT."""
    name = "submit_one" if len(json.loads(rows)) == 1 else "submit_rows"
    [[plan]] = db.execute(
        sql.SQL(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE {}({}, 1.0, {}, 604800, 60, {})"
        ).format(sql.Identifier(name), sql.Literal(rows), sql.Literal(fair), _waits(rows))
    ).fetchall()
    return _buffers(plan[0])


@pytest.mark.parametrize(("flow", "fair"), [("owner", "tasks"), ("team", "usage")])
def test_a_flows_stamp_behind_another_owners_backlog_reads_a_few_buffers(
    db_url: str, db: DB, flow: str, fair: str
) -> None:
    """(In a queue that weighs usage, the flow's decayed usage is one more row, by key.)"""
    _prepared(db)
    for _ in range(BACKLOG // 1000):
        _submit(db, _rows(1000, "alice"), fair)
    db.execute("INSERT INTO core.fair_usage (kind, name, cpu_s) VALUES ('team', 'ops', 600)")
    db.execute("ANALYZE core.tasks")  # the statistics see one owner, no team
    db.execute("SET plan_cache_mode = force_generic_plan")
    team = "ops" if flow == "team" else None
    spent = [_spent(db, _rows(n, "bob", team), fair) for n in (1, 1, 2)]
    # Each of bob's submissions: the insert, its indexes and its event, a few dozen
    # buffers a row; the walk over alice's 5,000 waiting tasks read about 220.
    assert max(spent) < 100, spent
    # bob's first stamp: now (past alice's head), or 600 core-seconds / 60 = 10 steps later.
    [[behind]] = db.execute(
        "SELECT min(vtime) - extract(epoch FROM now())::float8 FROM core.tasks WHERE owner = 'bob'"
    ).fetchall()
    assert behind == pytest.approx(10.0 if fair == "usage" else 0.0, abs=1.0)


@pytest.mark.parametrize("flow", ["owner", "team"])
def test_filling_a_paused_queue_reads_a_few_buffers_a_submission(
    db_url: str, db: DB, flow: str
) -> None:
    team = "ops" if flow == "team" else None
    db.execute("INSERT INTO core.queues (name, paused) VALUES ('default', true)")
    _prepared(db)
    for _ in range(BACKLOG // 1000):
        _submit(db, _rows(1000, "alice", team))
    db.execute("ANALYZE core.tasks")
    db.execute("SET plan_cache_mode = force_generic_plan")
    spent = [_spent(db, _rows(n, "alice", team)) for n in (1, 1, 2)]
    assert max(spent) < 100, spent
    [(ready,)] = db.execute("SELECT count(*) FROM core.tasks WHERE state = 'ready'").fetchall()
    assert ready == BACKLOG + 4
