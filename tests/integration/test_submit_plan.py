"""A submission's fair-share stamp reads its own flow's last stamp, not the queue's backlog:
behind a large backlog of another owner's work, one owner's (or one team's) submission
costs a few buffers under the plan PostgreSQL caches for it (the generic plan), not a
walk over the backlog. Measured by the buffers EXPLAIN counts, on a real PostgreSQL.
(The owner's case read the backlog before the fix; the team's guards the same path for
a team's flow, whose plan happened to be right.)"""

from __future__ import annotations

import json
from itertools import pairwise
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy.dialects.postgresql import psycopg as dialects

from libs.common.models import TaskCreate
from services.core import queries, store
from services.core.db import pipeline

BACKLOG = 5000
DB = psycopg.Connection[tuple[Any, ...]]


def _rows(n: int, owner: str, team: str | None = None) -> str:
    spec = TaskCreate.model_validate(
        {"name": "x", "artifact": {"uri": "file:///bin/true", "sha256": "0" * 64}}
    )
    return json.dumps([{**store._row_doc(spec), "owner": owner, "team": team}] * n)


def _buffers(plan: dict[str, Any]) -> int:
    node = plan["Plan"]
    return int(node["Shared Hit Blocks"]) + int(node["Shared Read Blocks"])


@pytest.mark.parametrize("flow", ["owner", "team"])
def test_a_flows_stamp_reads_its_own_last_stamp_not_the_queues_backlog(
    db_url: str, db: DB, flow: str
) -> None:
    text = pipeline.driver_sql(queries.SUBMIT, dialects.dialect())  # type: ignore[no-untyped-call]
    db.execute(
        sql.SQL("PREPARE submit_rows(jsonb, float8) AS {}").format(
            sql.SQL(text.replace("%(rows)s", "$1").replace("%(quantum)s", "$2"))
        )
    )
    for _ in range(BACKLOG // 1000):
        db.execute(
            sql.SQL("EXECUTE submit_rows({}, 1.0)").format(sql.Literal(_rows(1000, "alice")))
        )
    db.execute("ANALYZE core.tasks")  # the statistics see one owner, no team
    db.execute("SET plan_cache_mode = force_generic_plan")
    team = "ops" if flow == "team" else None
    spent = []
    for _ in range(3):  # the first stamps at the head; the next ones after it
        [[plan]] = db.execute(
            sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE submit_rows({}, 1.0)").format(
                sql.Literal(_rows(1, "bob", team))
            )
        ).fetchall()
        spent.append(_buffers(plan[0]))
    # Each submission of bob's: the insert into core.tasks, its indexes and its event,
    # 24-31 buffers; the walk over alice's 5,000 waiting tasks read about 220.
    assert max(spent) < 100, spent
    stamps = db.execute("SELECT vtime FROM core.tasks WHERE owner = 'bob' ORDER BY id").fetchall()
    assert len(stamps) == 3
    [(last_of_alice,)] = db.execute(
        "SELECT max(vtime) FROM core.tasks WHERE owner = 'alice' AND state = 'waiting'"
    ).fetchall()
    # Interleaved with alice's backlog (stamped one second apart from its start), not
    # queued behind it; each of bob's one step after the last.
    assert stamps[0][0] < last_of_alice - BACKLOG / 2
    assert [round(b[0] - a[0], 6) for a, b in pairwise(stamps)] == [1.0, 1.0]
