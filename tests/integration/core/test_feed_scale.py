"""A user's feed costs what the user sees, not the whole history: a user with a few events
among 120,000 reads its own events by owner (``ix_task_events_owner``), and a member of a
small team reads the team's tasks' events through the tasks, with the walk of the history
capped (``db.tasks.NEAR``), a member of a large one walks against a hash of its tasks built
once, not a lookup per event. And whichever way it reads, the feed answers exactly what one
walk of the events in ``(xid, id)`` order keeps: checked against that walk, written in
Python, on random small histories."""

from __future__ import annotations

import json
from typing import Any

import psycopg
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy.dialects.postgresql import psycopg as dialects

from libs.common import pipeline
from libs.common.auth import Visibility
from libs.common.states import TaskState
from services.core.db import tasks as tasks_db
from tests.support.plans import analyzed, nodes, rows_read

DB = psycopg.Connection[tuple[Any, ...]]
TASKS = 40_000  # three events each
_COLUMNS = """owner, name, queue, kind, artifact_uri, artifact_sha256, cpu, memory_mb,
    max_attempts, backoff_cap_s, backoff_jitter, poison_after, state, finished_at, team"""
_VALUES = """'job', 'q', 'task', 'file:///bin/true', repeat('0', 64), 0.1, 1, 1, 60, false, 3,
    'succeeded', now()"""


def _horizon(db: DB) -> int:
    row = db.execute("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint").fetchone()
    assert row is not None
    return int(row[0])


def _fill(db: DB) -> None:
    """120,000 events of 200 owners in commit order; ``sparse`` owns 4 tasks spread over
    the history, team ``crew`` 4 tasks of other owners, team ``many`` one in ten."""
    db.execute(
        f"""INSERT INTO core.tasks ({_COLUMNS})
            SELECT CASE WHEN g % 10000 = 5 THEN 'sparse' ELSE 'u' || (g % 200) END, {_VALUES},
                   CASE WHEN g % 10000 = 17 THEN 'crew' WHEN g % 10 = 3 THEN 'many' END
            FROM generate_series(1, {TASKS}) g"""
    )
    db.execute(
        f"""INSERT INTO core.task_events (xid, task_id, seq, owner, op, to_state)
            SELECT 3 + ((t.id - 1) * 3 + s) * ({_horizon(db)} - 4) / ({TASKS} * 3 + 3),
                   t.id, s, t.owner, 'op', 'succeeded'
            FROM core.tasks t, generate_series(1, 3) s ORDER BY t.id, s"""
    )
    db.execute("VACUUM ANALYZE core.tasks, core.task_events")


def test_a_sparse_users_page_reads_its_own_events_not_the_history(db: DB) -> None:
    _fill(db)
    row = db.execute("SELECT (min(xid) + max(xid)) / 2 FROM core.task_events").fetchone()
    assert row is not None
    middle = (int(row[0]), 0)
    # 300 events from the head: a long poll's cursor, whose teams' events are probed
    row = db.execute("SELECT xid, id FROM core.task_events ORDER BY xid DESC, id DESC OFFSET 300")
    head = row.fetchone()
    assert head is not None
    sparse, member = Visibility("sparse"), Visibility("nobody", frozenset({"crew"}))
    large = Visibility("nobody", frozenset({"many"}))  # 4,000 tasks: a hash of them
    # a member of 50 teams (48 of them owning nothing): by their tasks, or by a hash
    others = frozenset(f"team{i}" for i in range(48))
    fifty = Visibility("nobody", others | {"crew", "sparse"})
    fifty_large = Visibility("nobody", others | {"crew", "many"})
    near = tasks_db.NEAR
    # parallel plans as cheap as a server with more data finds them: none may start
    db.execute("SET parallel_setup_cost = 0")
    db.execute("SET min_parallel_index_scan_size = 0")
    for who, after, sees, bound in [
        (sparse, (0, 0), 12, 12),
        (sparse, middle, 6, 12),
        (sparse, head, 1, 1),  # an empty page
        (member, (0, 0), 12, near + 12),
        (member, middle, 6, near + 12),
        (member, head, 1, 2 * 300),  # the count of what is ahead, then its walk
        (large, middle, 100, near + 1100),
        (large, head, 30, 2 * 300),
        (fifty, (0, 0), 12, near + 12),
        (fifty, head, 1, 2 * 300),
        (fifty_large, middle, 100, near + 1100),
    ]:
        clause, params = tasks_db.feed_query(after, 100, who, None)
        for generic in (True, False):
            plan = analyzed(db, clause, params, generic=generic)
            assert int(plan["Actual Rows"]) == sees, (who, after, generic)
            read = rows_read(plan, "task_events")
            assert read <= bound, (who, after, generic, read)
            if who is large and after == middle:  # its tasks hashed once, not probed
                assert "hashed SubPlan" in json.dumps(plan), generic
            # no arm starts parallel workers: not one that is not chosen (its one-time
            # filter under the Gather, checked by each worker once started: 5-15 ms and
            # two processes a read, long polls included), nor the walk near the head
            workers = [
                node["Workers Launched"] for node in nodes(plan) if "Workers Launched" in node
            ]
            assert not any(workers), (who, after, generic, workers)


# --- the same answers as one walk of the history --------------------------------------------

OWNERS = ["a", "b"]
TEAMS = ["x", "y"]


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[tuple[str, str | None]], list[tuple[int, int, str]]]:
    """Tasks (owner, team) and their events (task, xid, to_state), in the order inserted
    (so ids follow neither the xids nor the tasks)."""
    tasks = draw(
        st.lists(st.tuples(st.sampled_from(OWNERS), st.sampled_from([None, *TEAMS])), max_size=8)
    )
    events = []
    for task in range(len(tasks)):
        for _ in range(draw(st.integers(1, 3))):
            # one in five not yet below the horizon
            xid = draw(st.sampled_from([10**9, *range(3, 31, 7)]) | st.integers(3, 30))
            events.append((task, xid, draw(st.sampled_from(["running", "dead"]))))
    return tasks, draw(st.permutations(events))


def _store(db: DB, tasks: list[tuple[str, str | None]], events: list[tuple[int, int, str]]) -> None:
    db.execute("DELETE FROM core.task_events")
    db.execute("DELETE FROM core.tasks")
    ids = sorted(
        row[0]
        for row in db.execute(
            f"""INSERT INTO core.tasks ({_COLUMNS})
                SELECT o, {_VALUES}, t FROM unnest(%s::text[], %s::text[]) WITH ORDINALITY
                    AS input(o, t, n)
                ORDER BY n RETURNING id""",
            ([owner for owner, _ in tasks], [team for _, team in tasks]),
        ).fetchall()
    )
    seqs: dict[int, int] = {}
    rows = []
    for task, xid, to_state in events:
        seqs[task] = seqs.get(task, 0) + 1
        rows.append((xid, ids[task], seqs[task], tasks[task][0], to_state))
    db.execute(
        """INSERT INTO core.task_events (xid, task_id, seq, owner, op, to_state)
           SELECT x, t, s, o, 'op', st
           FROM unnest(%s::bigint[], %s::bigint[], %s::int[], %s::text[], %s::text[])
               WITH ORDINALITY AS input(x, t, s, o, st, n)
           ORDER BY n""",
        [list(column) for column in zip(*rows, strict=True)] if rows else [[]] * 5,
    )


def _walk(db: DB, after: tuple[int, int], limit: int, who: Visibility | None, dead: bool) -> list:
    """The feed's page as one walk of every event in ``(xid, id)`` order keeps it."""
    horizon = _horizon(db)
    rows = db.execute(
        """SELECT e.xid, e.id, e.owner, t.team, e.to_state FROM core.task_events e
           LEFT JOIN core.tasks t ON t.id = e.task_id"""
    ).fetchall()
    kept = [
        (xid, id_)
        for xid, id_, owner, team, to_state in sorted(rows)
        if (xid, id_) > after
        and xid < horizon
        and (not dead or to_state == "dead")
        and (who is None or owner == who.owner or team in who.teams)
    ]
    return kept[:limit]


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    history=histories(),
    reader=st.none()  # an admin's
    | st.builds(
        Visibility,
        st.sampled_from([*OWNERS, "z"]),
        st.frozensets(st.sampled_from([*TEAMS, "w"]), min_size=1, max_size=2),
    )
    | st.builds(Visibility, st.sampled_from(OWNERS)),
    after=st.tuples(st.integers(0, 32), st.integers(0, 40)),
    limit=st.integers(1, 6),
    dead=st.booleans(),
)
@example(  # a team's page of three, every way (the probes' walk not cut short)
    history=([("a", "x")] * 3, [(0, 3, "running"), (1, 3, "running"), (2, 3, "running")]),
    reader=Visibility("b", frozenset({"x"})),
    after=(0, 0),
    limit=6,
    dead=False,
)
def test_every_way_of_reading_answers_what_one_walk_keeps(
    db: DB,
    history: tuple[list[tuple[str, str | None]], list[tuple[int, int, str]]],
    reader: Visibility | None,
    after: tuple[int, int],
    limit: int,
    dead: bool,
) -> None:
    assert _horizon(db) > 30  # the events' xids below 31 are all of the past
    _store(db, *history)
    expected = _walk(db, after, limit, reader, dead)
    clause, params = tasks_db.feed_query(after, limit, reader, TaskState.DEAD if dead else None)
    statements = [clause]
    if reader is not None:  # also each way the teams' events can be read, forced
        to_state = TaskState.DEAD if dead else None
        statements += [
            tasks_db.feed_statement(to_state, own=True, near=0, team_tasks=1000),  # by tasks
            tasks_db.feed_statement(to_state, own=True, near=10**6),  # by probes
            tasks_db.feed_statement(to_state, own=True, near=0, team_tasks=0),  # by hash
            # probes, their walk capped, or by tasks: the way turning at the page's size
            tasks_db.feed_statement(to_state, own=True, near=3),
        ]
    for statement in statements:
        sql = pipeline.driver_sql(statement, dialects.dialect())  # type: ignore[no-untyped-call]
        rows = db.execute(sql, params).fetchall()
        got = [(row[0], row[1]) for row in rows if row[1] is not None]
        assert got == expected, (statement is clause, got, expected)
