"""The pools keep the statements psycopg prepared across reads (``database.KeepingConnection``):
psycopg forgot them at every ROLLBACK, which ends every read, so no hot statement (the
claim's pick, planned in 2-6 ms and run in 0.1-0.4 ms) was ever prepared."""

from __future__ import annotations

import asyncio
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from libs.common import database, pipeline
from libs.common.settings import CairnSettings

_READ = text("SELECT count(*) FROM core.tasks WHERE state = :state")
_PREPARED = text("SELECT statement FROM pg_prepared_statements")


async def _reads_then_an_error(db_url: str) -> tuple[list[str], list[str]]:
    engine = database.pool(db_url, CairnSettings(database_url=db_url), pool_size=1, max_overflow=0)
    try:
        for _ in range(8):
            async with engine.connect() as conn:  # a read: SQLAlchemy ends it with ROLLBACK
                await conn.execute(_READ, {"state": "waiting"})
        async with engine.connect() as conn:
            kept = list((await conn.execute(_PREPARED)).scalars())
        with pytest.raises(DBAPIError):
            async with engine.connect() as conn:
                await conn.execute(_READ, {"state": "waiting"})
                await conn.execute(text("SELECT 1 / 0"))
        async with engine.connect() as conn:
            after_error = list((await conn.execute(_PREPARED)).scalars())
    finally:
        await engine.dispose()
    return kept, after_error


def test_reads_keep_prepared_statements_and_an_error_forgets_them(db_url: str) -> None:
    kept, after_error = asyncio.run(_reads_then_an_error(db_url))
    # Prepared at its sixth run, and still there after the reads' ROLLBACKs.
    assert any("FROM core.tasks WHERE state" in s for s in kept), kept
    # A transaction in error is rolled back as psycopg does: every statement forgotten
    # (DEALLOCATE ALL), so a plan the server refused is prepared afresh.
    assert not any("FROM core.tasks WHERE state" in s for s in after_error), after_error


async def _reads_across_a_migration(
    db_url: str, pipelined: bool = False
) -> list[tuple[int, str | None, int]]:
    """A read of ``t.*`` served 7 times (prepared at its 6th; at its first when
    ``pipelined``: ``libs.common.pipeline``, as a worker's turn reads its row), a column
    added to ``t`` by another connection (a rolling upgrade's migration), then the read
    twice more."""
    import httpx
    import psycopg
    from fastapi import FastAPI

    from libs.common import pipeline, problems
    from libs.common.settings import libpq_url

    with psycopg.connect(libpq_url(db_url), autocommit=True) as admin:
        admin.execute("DROP SCHEMA IF EXISTS replan CASCADE")
        admin.execute("CREATE SCHEMA replan")
        admin.execute("CREATE TABLE replan.t (id int PRIMARY KEY)")
        admin.execute("INSERT INTO replan.t VALUES (1)")
    engine = database.pool(db_url, CairnSettings(database_url=db_url), pool_size=1, max_overflow=0)
    app = FastAPI()
    problems.install(app)

    @app.get("/rows")
    async def rows() -> list[dict[str, object]]:
        async with engine.connect() as conn:
            if pipelined:
                [found] = await pipeline.run(conn, [(text("SELECT t.* FROM replan.t t"), {})])
                return [r._asdict() for r in found]
            return [
                dict(r) for r in (await conn.execute(text("SELECT t.* FROM replan.t t"))).mappings()
            ]

    answers = []
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://t"
        ) as http:
            for _ in range(7):
                assert (await http.get("/rows")).status_code == 200
            with psycopg.connect(libpq_url(db_url), autocommit=True) as admin:
                admin.execute("ALTER TABLE replan.t ADD COLUMN note text DEFAULT 'new'")
            for _ in range(2):
                got = await http.get("/rows")
                answers.append(
                    (
                        got.status_code,
                        got.headers.get("retry-after"),
                        len(got.json()[0]) if got.status_code == 200 else 0,
                    )
                )
    finally:
        await engine.dispose()
        with psycopg.connect(libpq_url(db_url), autocommit=True) as admin:
            admin.execute("DROP SCHEMA replan CASCADE")
    return answers


def test_a_column_added_under_a_prepared_read_is_a_503_then_served(db_url: str) -> None:
    # PostgreSQL refuses the cached plan of a statement whose result's columns changed:
    # a 503 the caller may retry at once (never a 500), and the retry is served with the
    # new column, prepared afresh.
    first, second = asyncio.run(_reads_across_a_migration(db_url))
    assert first == (503, "0", 0), first
    assert second == (200, None, 2), second


def test_a_column_added_under_a_pipelined_statement_is_a_503_then_served(db_url: str) -> None:
    # The hot path's statements go through psycopg's pipeline (the worker's turn reads
    # ``SELECT * FROM core.workers`` so), whose errors are psycopg's own, not SQLAlchemy's
    # DBAPIError: the same refusal must be the same 503, not a 500.
    first, second = asyncio.run(_reads_across_a_migration(db_url, pipelined=True))
    assert first == (503, "0", 0), first
    assert second == (200, None, 2), second


_XID = text("SELECT pg_current_xact_id()::text AS xid")


async def _pipelined_transaction(db_url: str, trace: Path) -> tuple[list[str], str, str]:
    engine = database.pool(db_url, CairnSettings(database_url=db_url), pool_size=1, max_overflow=0)
    try:
        async with engine.connect() as conn:
            raw = await conn.get_raw_connection()
            driver = raw.driver_connection
            assert driver is not None
            with trace.open("w") as out:
                driver.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
                driver.pgconn.trace(out.fileno())
                async with conn.begin():
                    rows = await pipeline.run(conn, [(_XID, {}), (_XID, {})])
                    after = (await conn.execute(_XID)).scalar_one()
                driver.pgconn.untrace()
        return [r[0].xid for r in rows], str(after), trace.read_text()
    finally:
        await engine.dispose()


def test_a_transaction_begun_in_a_pipeline_sends_its_begin_with_the_statements(
    db_url: str, tmp_path: Path
) -> None:
    # psycopg queues the BEGIN of a transaction whose first statements go in a pipeline
    # and then syncs, a round trip of its own; the pool's connections send it with them
    # (database.KeepingConnection._start_query). One transaction all the same.
    xids, after, wire = asyncio.run(_pipelined_transaction(db_url, tmp_path / "trace"))
    assert xids[0] == xids[1] == after
    sent = []  # the messages core sent: (type, what), timestamps (if any) left out
    for line in wire.splitlines():
        fields = line.split("\t")
        fields = fields if fields[0] in ("F", "B") else fields[1:]
        if fields[0] == "F":
            sent.append((fields[2], fields[-1]))
    first_sync = [kind for kind, _ in sent].index("Sync")
    before = sent[:first_sync]
    assert next(what for kind, what in before if kind == "Parse").endswith('"BEGIN" 0'), wire
    # the BEGIN and both statements, then the one Sync of the pipeline: one round trip
    assert [kind for kind, _ in before].count("Execute") == 3, wire
