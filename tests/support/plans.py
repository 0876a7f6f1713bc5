"""The plans PostgreSQL makes for core's statements, read by the plan tests: the nodes of
an ``EXPLAIN (FORMAT JSON)`` plan, and a statement's generic plan (its parameters unknown,
as a prepared statement runs once PostgreSQL caches it)."""

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


def generic(db: DB, clause: Any) -> dict[str, Any]:
    """The generic plan of ``clause`` (``EXPLAIN (GENERIC_PLAN)``: its parameters
    unknown, as a turn's prepared statements run: ``attempts._GENERIC``)."""
    text = pipeline.driver_sql(clause, dialects.dialect())  # type: ignore[no-untyped-call]
    names: dict[str, str] = {}

    def number(match: re.Match[str]) -> str:
        if match.group(0) == "%%":
            return "%"
        return names.setdefault(match.group(1), f"${len(names) + 1}")

    numbered = re.sub(r"%\((\w+)\)s|%%", number, text)
    [[plan]] = db.execute(sql.SQL("EXPLAIN (GENERIC_PLAN, FORMAT JSON) " + numbered)).fetchall()
    return dict(plan[0]["Plan"])


def indexes(plan: dict[str, Any], table: str) -> set[str]:
    """The indexes of ``table`` (``core.`` omitted) that ``plan`` reads."""
    found = set()
    for node in nodes(plan):
        name = node.get("Index Name")
        if name is not None and (node.get("Relation Name") in (table, None)):
            found.add(name)
    return found
