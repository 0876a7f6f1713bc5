"""A chain of statements in one round trip (``db.pipeline``): run in order, in the caller's
transaction, each one's rows apart; an error aborts the chain and the transaction."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from libs.common import pipeline

DB = psycopg.Connection[tuple[Any, ...]]

INSERT = text("INSERT INTO core.queues (name) VALUES (:name) RETURNING name")
READ = text("SELECT name, paused FROM core.queues WHERE name = ANY(CAST(:names AS text[]))")
FAIL = text("SELECT 1 / :zero AS never")


async def _run(db_url: str, *chain: pipeline.Statement) -> list[list[Any]]:
    engine = create_async_engine(db_url)
    try:
        async with engine.begin() as conn:
            return await pipeline.run(conn, chain)
    finally:
        await engine.dispose()


def _queues(db: DB) -> set[str]:
    db.rollback()
    return {name for (name,) in db.execute("SELECT name FROM core.queues")}


def test_statements_run_in_order_and_each_answers_its_own_rows(db_url: str, db: DB) -> None:
    found = asyncio.run(
        _run(
            db_url,
            (INSERT, {"name": "q1"}),
            (INSERT, {"name": "q2"}),
            (READ, {"names": ["q1", "q2"]}),
        )
    )
    assert [[r.name for r in rows] for rows in found[:2]] == [["q1"], ["q2"]]
    assert sorted((r.name, r.paused) for r in found[2]) == [("q1", False), ("q2", False)]
    assert {"q1", "q2"} <= _queues(db)  # committed with the caller's transaction


def test_a_failing_statement_aborts_the_chain_and_the_transaction(db_url: str, db: DB) -> None:
    with pytest.raises(psycopg.errors.DivisionByZero):
        asyncio.run(_run(db_url, (INSERT, {"name": "q3"}), (FAIL, {"zero": 0})))
    assert "q3" not in _queues(db)


def test_a_statement_that_returns_no_rows_answers_an_empty_list(db_url: str) -> None:
    update = text("UPDATE core.queues SET paused = true WHERE name = :name")
    found = asyncio.run(_run(db_url, (update, {"name": "absent"}), (INSERT, {"name": "q4"})))
    assert found[0] == []
    assert [r.name for r in found[1]] == ["q4"]


def test_the_chain_goes_out_at_once_with_its_sync(
    db_url: str, db: DB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """psycopg would send each statement as it is queued, a communication each: the
    chain's statements are queued, then sent by one communication at its Sync (psycopg's
    own BEGIN, outside ``KeepingConnection``, syncs once before them); a chain after it
    in the same transaction goes the same way, in one."""
    from psycopg import _pipeline_base

    calls: list[int] = []
    communicate = _pipeline_base.pipeline_communicate

    def counted(pgconn: Any, commands: Any) -> Any:
        calls.append(len(commands))
        return communicate(pgconn, commands)

    monkeypatch.setattr(_pipeline_base, "pipeline_communicate", counted)

    async def twice() -> list[list[Any]]:
        engine = create_async_engine(db_url)
        try:
            async with engine.begin() as conn:
                chain = [(INSERT, {"name": "q5"}), (INSERT, {"name": "q6"})]
                first = await pipeline.run(conn, [*chain, (READ, {"names": ["q5", "q6"]})])
                assert len(calls) <= 2  # psycopg: 5 (BEGIN's Sync, 3 statements, Sync)
                calls.clear()
                second = await pipeline.run(conn, [(READ, {"names": ["q5"]})])
                assert calls == [0]  # everything queued was in libpq's buffer already
                return [*first, *second]
        finally:
            await engine.dispose()

    found = asyncio.run(twice())
    assert [r.name for r in found[3]] == ["q5"]
    assert {"q5", "q6"} <= _queues(db)


def test_a_statement_is_sent_without_its_comments_and_short_enough_to_be_cached(
    db_url: str, db: DB
) -> None:
    """psycopg caches the parse of a query's placeholders only up to 4,096 bytes: the
    statements go out compacted, SUBMIT (every submission's) and its group commit's form
    under it; literals are
    kept byte for byte. (The pick, 7,274 bytes compacted, stays over it: the chain goes
    out numbered, ``test_a_chain_goes_out_numbered_and_the_driver_reads_no_text``.)"""
    from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH
    from sqlalchemy.dialects.postgresql import psycopg as dialects

    from services.core.db import attempts as attempts_db
    from services.core.db import tasks as tasks_db

    dialect = dialects.dialect()  # type: ignore[no-untyped-call]
    # the group commit's forms of it (TELLING; ONE, a lone submission's), too
    forms = (tasks_db.SUBMIT_TELLING, tasks_db.SUBMIT_ONE, tasks_db.SUBMIT_ONE_TELLING)
    for submit in (tasks_db.SUBMIT, *forms):
        assert len(pipeline.driver_sql(submit, dialect).encode()) <= MAX_CACHED_STATEMENT_LENGTH
    for clause in (tasks_db.SUBMIT, attempts_db._WAITING_IN_QUEUE, attempts_db._WAITING_IN_QUEUES):
        assert "--" not in pipeline.driver_sql(clause, dialect)
    commented = text(
        "SELECT '--not  a comment' AS kept,   'it''s' AS quoted, -- the queue's comment\n"
        "       CAST(:n AS int) + 1 AS n -- another\n"
        "-- a whole line\n"
    )
    assert pipeline.driver_sql(commented, dialect) == (
        "SELECT '--not  a comment' AS kept, 'it''s' AS quoted,\nCAST(%(n)s AS int) + 1 AS n"
    )
    [[row]] = asyncio.run(_run(db_url, (commented, {"n": 41})))
    assert (row.kept, row.quoted, row.n) == ("--not  a comment", "it's", 42)
    # What it cannot read line by line goes as written.
    for written in ("SELECT 'two\n  lines' -- x", "SELECT $$ -- $$", "SELECT E'\\'' -- x"):
        assert pipeline.compact_sql(written) == written


def test_a_chain_goes_out_numbered_and_the_driver_reads_no_text(db_url: str) -> None:
    """A chain's statements go out on raw cursors, ``$n`` for each name (the same name,
    the same number) and ``%`` for SQLAlchemy's ``%%``: psycopg parses no query text,
    however long (the pick's parse cost 185 µs a turn)."""
    from sqlalchemy.dialects.postgresql import psycopg as dialects

    clause = text(
        "SELECT CAST(:a AS int) * 10 + CAST(:b AS int) + CAST(:a AS int) AS n, 'x%y' AS kept"
    )
    dialect = dialects.dialect()  # type: ignore[no-untyped-call]
    assert pipeline.raw_sql(clause, dialect) == (
        "SELECT CAST($1 AS int) * 10 + CAST($2 AS int) + CAST($1 AS int) AS n, 'x%y' AS kept",
        ("a", "b"),
    )
    # names the statement does not take are left out, as psycopg's named form leaves them
    [[row]] = asyncio.run(_run(db_url, (clause, {"a": 4, "b": 2, "unused": 9})))
    assert (row.n, row.kept) == (46, "x%y")


def test_a_statements_rows_follow_a_column_added_under_it(db_url: str, db: DB) -> None:
    """Each statement keeps its row type while its results have as many columns
    (``pipeline._Rows``): a ``SELECT p.*`` run again after a column was added (a
    migration, which only adds) names the new column, unprepared on the same connection
    (behind a transaction pooler) and prepared anew on another."""
    db.execute("CREATE TABLE public.rows_probe (a integer)")
    db.execute("INSERT INTO public.rows_probe VALUES (1)")
    star = text("SELECT p.* FROM public.rows_probe p")

    async def rows() -> tuple[Any, Any]:
        engine = create_async_engine(db_url, connect_args={"prepare_threshold": None})
        try:
            async with engine.begin() as conn:
                [[before]] = await pipeline.run(conn, [(star, {})])
            db.execute("ALTER TABLE public.rows_probe ADD COLUMN b text DEFAULT 'x'")
            async with engine.begin() as conn:
                [[after]] = await pipeline.run(conn, [(star, {})])
        finally:
            await engine.dispose()
        return before, after

    before, after = asyncio.run(rows())
    assert (before._fields, tuple(before)) == (("a",), (1,))
    assert (after._fields, tuple(after)) == (("a", "b"), (1, "x"))
    [[prepared]] = asyncio.run(_run(db_url, (star, {})))
    assert (prepared.a, prepared.b) == (1, "x")
