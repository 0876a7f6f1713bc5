"""What a page of the event feed costs PostgreSQL, by who reads and where their cursor is.

    .venv/bin/python TREE/bench/feed_scan.py [--tasks 333334] [--generic]

A private PostgreSQL (``stack.core_database``: the script's own checkout, TREE, first on the
path), migrated by TREE's core, is filled straight in SQL (no API) with
``--tasks`` finished tasks and three events each (1,000,002 events by default), in commit
order: 30 % of the tasks are one dense owner's, the rest spread over 5,000 owners; the
sparse owner has 10 tasks spread over the whole history; team ``crew`` owns 34 tasks of
other owners, team ``big`` one in twenty. Each case runs TREE's feed statement for a page
of 100 under ``EXPLAIN (ANALYZE, BUFFERS)`` (the second of two runs, so warm) and prints
the buffers it touched, the rows it read from ``core.task_events``, its time and the
parallel workers it started. ``--generic``: the statement prepared and run on its generic
plan (``plan_cache_mode = force_generic_plan``), as a prepared statement may be.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import psycopg
from psycopg import sql as pgsql
from sqlalchemy.dialects.postgresql import psycopg as dialects
from stack import core_database

from libs.common import pipeline
from libs.common.auth import Visibility
from libs.common.settings import libpq_url
from services.core.db import tasks as tasks_db
from tests.support.plans import _numbered

PAGE = 100


def fill(db: psycopg.Connection[Any], n: int) -> None:
    horizon = int(db.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()[0]) - 2
    db.execute(
        """INSERT INTO core.tasks (owner, name, queue, kind, artifact_uri, artifact_sha256,
               cpu, memory_mb, max_attempts, backoff_cap_s, backoff_jitter, poison_after,
               state, finished_at, team)
           SELECT CASE WHEN g %% 33334 = 5 THEN 'sparse' WHEN g %% 10 < 3 THEN 'dense'
                       ELSE 'u' || (g %% 5000) END,
                  'job', 'q' || (g %% 4), 'task', 'file:///bin/true', repeat('0', 64), 0.1,
                  1, 1, 60, false, 3, 'succeeded', now(),
                  CASE WHEN g %% 10000 = 17 THEN 'crew' WHEN g %% 20 = 3 THEN 'big'
                       WHEN g %% 100 = 42 THEN 'mid' END
           FROM generate_series(1, %(n)s) g""",
        {"n": n},
    )
    # the events in commit order: xid rises with the task (three spread over the
    # history's transactions below the horizon), ids in the same order
    db.execute(
        """INSERT INTO core.task_events (xid, task_id, seq, owner, op, from_state, to_state)
           SELECT 3 + ((t.id - 1) * 3 + s) * (%(h)s - 4) / (%(n)s * 3 + 3), t.id, s, t.owner,
                  'op', NULL, CASE s WHEN 1 THEN 'waiting' WHEN 2 THEN 'running'
                                     ELSE 'succeeded' END
           FROM core.tasks t, generate_series(1, 3) s ORDER BY t.id, s""",
        {"h": horizon, "n": n},
    )
    db.execute("VACUUM ANALYZE core.tasks, core.task_events")


def statement(after: tuple[int, int], who: Visibility | None) -> tuple[Any, dict[str, Any]]:
    """The tree's feed statement and its parameters, as ``read_feed`` runs it."""
    if hasattr(tasks_db, "feed_query"):
        return tasks_db.feed_query(after, PAGE, who, None)  # type: ignore[no-any-return]
    return tasks_db.FEED, {
        "xid": after[0],
        "id": after[1],
        "limit": PAGE,
        "owner": who.owner if who is not None else None,
        "teams": sorted(who.teams) if who is not None and who.teams else None,
    }


def scanned(node: dict[str, Any]) -> int:
    rows = 0
    if node.get("Relation Name") == "task_events" or "task_events" in node.get("Index Name", ""):
        rows += int(node["Actual Rows"]) * int(node["Actual Loops"])
        rows += int(node.get("Rows Removed by Filter", 0)) * int(node["Actual Loops"])
    for child in node.get("Plans", []):
        rows += scanned(child)
    return rows


def workers(node: dict[str, Any]) -> int:
    return int(node.get("Workers Launched", 0)) + sum(map(workers, node.get("Plans", [])))


def explain(
    db: psycopg.Connection[Any],
    after: tuple[int, int],
    who: Visibility | None,
    show: bool,
    generic: bool = False,
) -> str:
    clause, params = statement(after, who)
    if generic:  # prepared, its parameters unknown to the plan
        numbered, names = _numbered(clause)
        db.execute(pgsql.SQL("PREPARE feed AS " + numbered))
        db.execute("SET plan_cache_mode = force_generic_plan")
        values = pgsql.SQL(", ").join(pgsql.Literal(params[name]) for name in names)
        sql: Any = pgsql.SQL("EXECUTE feed ({})").format(values)
        params = {}
    else:
        sql = pgsql.SQL(pipeline.driver_sql(clause, dialects.dialect()))  # type: ignore[no-untyped-call]
    try:
        if show:
            for (line,) in db.execute(pgsql.SQL("EXPLAIN (ANALYZE, BUFFERS) ") + sql, params):
                print(line)
        for _ in range(2):
            [[plan]] = db.execute(
                pgsql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + sql, params
            ).fetchall()
    finally:
        if generic:
            db.execute("DEALLOCATE feed")
            db.execute("RESET plan_cache_mode")
    top = plan[0]["Plan"]
    buffers = top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0)
    return (
        f"{buffers:>8} buffers {scanned(top):>9} event rows "
        f"{plan[0]['Execution Time']:>9.2f} ms  {top['Actual Rows']} rows out"
        f"  {workers(top)} workers"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=333_334)
    parser.add_argument("--show", default="", help="print the plans of cases so named")
    parser.add_argument("--generic", action="store_true", help="on the generic plan")
    args = parser.parse_args()
    with (
        core_database("cairn-feed-") as url,
        psycopg.connect(libpq_url(url), autocommit=True) as db,
    ):
        fill(db, args.tasks)
        [[lo, hi]] = db.execute("SELECT min(xid), max(xid) FROM core.task_events").fetchall()
        middle = ((lo + hi) // 2, 0)
        head = (hi - 1, 0)
        cases = [
            ("sparse, cursor 0", (0, 0), Visibility("sparse")),
            ("sparse, cursor mid", middle, Visibility("sparse")),
            ("sparse, cursor head", head, Visibility("sparse")),
            ("team crew member, cursor 0", (0, 0), Visibility("nobody", frozenset({"crew"}))),
            ("team crew member, mid", middle, Visibility("nobody", frozenset({"crew"}))),
            ("sparse + crew, cursor 0", (0, 0), Visibility("sparse", frozenset({"crew"}))),
            ("team big member, cursor 0", (0, 0), Visibility("nobody", frozenset({"big"}))),
            ("team big member, head", head, Visibility("nobody", frozenset({"big"}))),
            ("team mid member, cursor 0", (0, 0), Visibility("nobody", frozenset({"mid"}))),
            ("u7 (67 tasks) + big, mid", middle, Visibility("u7", frozenset({"big"}))),
            ("dense, cursor 0", (0, 0), Visibility("dense")),
            ("dense, cursor mid", middle, Visibility("dense")),
            ("admin, cursor head", head, None),
            ("admin, cursor 0", (0, 0), None),
        ]
        events = db.execute("SELECT count(*) FROM core.task_events").fetchone()
        print(json.dumps({"events": events[0] if events else 0, "xids": [lo, hi]}))
        for name, after, who in cases:
            show = bool(args.show and args.show in name)
            print(f"{name:<30} {explain(db, after, who, show, args.generic)}")


if __name__ == "__main__":
    main()
