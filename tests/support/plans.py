"""The plans PostgreSQL makes for core's statements, read by the plan tests: the nodes of
an ``EXPLAIN (FORMAT JSON)`` plan, and a statement's generic plan (its parameters unknown,
as a prepared statement runs once PostgreSQL caches it); and the rows they plan over
(``insert_tasks``)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy.dialects.postgresql import psycopg as dialects

from libs.common import pipeline

DB = psycopg.Connection[tuple[Any, ...]]


def nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """``node`` and every node under it."""
    yield node
    for child in node.get("Plans", []):
        yield from nodes(child)


def _numbered(clause: Any) -> tuple[str, list[str]]:
    """``clause``'s text with its parameters numbered ``$1``..., and their names."""
    text = pipeline.driver_sql(clause, dialects.dialect())  # type: ignore[no-untyped-call]
    names: dict[str, str] = {}

    def number(match: re.Match[str]) -> str:
        if match.group(0) == "%%":
            return "%"
        return names.setdefault(match.group(1), f"${len(names) + 1}")

    return re.sub(r"%\((\w+)\)s|%%", number, text), list(names)


def generic(db: DB, clause: Any) -> dict[str, Any]:
    """The generic plan of ``clause`` (``EXPLAIN (GENERIC_PLAN)``: its parameters
    unknown, as a turn's prepared statements run: ``attempts._GENERIC``)."""
    numbered, _ = _numbered(clause)
    [[plan]] = db.execute(sql.SQL("EXPLAIN (GENERIC_PLAN, FORMAT JSON) " + numbered)).fetchall()
    return dict(plan[0]["Plan"])


def analyzed(db: DB, clause: Any, params: dict[str, Any], *, generic: bool) -> dict[str, Any]:
    """The plan of ``clause`` run with ``params`` (``EXPLAIN (ANALYZE, BUFFERS)``), as a
    prepared statement runs it: its generic plan, or a custom one for these values."""
    numbered, names = _numbered(clause)
    db.execute(sql.SQL("PREPARE analyzed AS " + numbered))
    try:
        mode = "force_generic_plan" if generic else "force_custom_plan"
        db.execute(sql.SQL("SET plan_cache_mode = {}").format(sql.Literal(mode)))
        values = sql.SQL(", ").join(sql.Literal(params[name]) for name in names)
        [[plan]] = db.execute(
            sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE analyzed ({})").format(values)
        ).fetchall()
    finally:
        db.execute("DEALLOCATE analyzed")
        db.execute("RESET plan_cache_mode")
    return dict(plan[0]["Plan"])


def rows_read(plan: dict[str, Any], table: str) -> int:
    """How many rows of ``table`` (``core.`` omitted) ``plan`` read, kept or filtered out."""
    return sum(
        (int(node["Actual Rows"]) + int(node.get("Rows Removed by Filter", 0)))
        * int(node["Actual Loops"])
        for node in nodes(plan)
        if node.get("Relation Name") == table
    )


def indexes(plan: dict[str, Any], table: str) -> set[str]:
    """The indexes of ``table`` (``core.`` omitted) that ``plan`` reads."""
    found = set()
    for node in nodes(plan):
        name = node.get("Index Name")
        if name is not None and (node.get("Relation Name") in (table, None)):
            found.add(name)
    return found


_TASK = {  # a task's columns without defaults, as the plan tests fill them
    "owner": "'alice'",
    "name": "'x'",
    "queue": "'default'",
    "kind": "'task'",
    "artifact_uri": "'file:///bin/true'",
    "artifact_sha256": "repeat('0', 64)",
    "cpu": "0.01",
    "memory_mb": "1",
    "max_attempts": "1",
    "backoff_cap_s": "60",
    "backoff_jitter": "false",
    "poison_after": "3",
}


def insert_tasks(db: DB, count: int, state: str = "waiting", **columns: str) -> None:
    """``count`` tasks in ``state`` (alice's, in the default queue, running ``/bin/true``);
    ``columns``: other values, or other columns', as SQL expressions (``cpu="0.5"``,
    ``finished_at="now()"``)."""
    values = {**_TASK, **columns}
    db.execute(
        sql.SQL(
            "INSERT INTO core.tasks ({names}, state) SELECT {exprs}, {state}"
            " FROM generate_series(1, {count})"
        ).format(
            names=sql.SQL(", ").join(sql.Identifier(name) for name in values),
            exprs=sql.SQL(", ").join(sql.SQL(expr) for expr in values.values()),  # type: ignore[arg-type]
            state=sql.Literal(state),
            count=sql.Literal(count),
        )
    )
