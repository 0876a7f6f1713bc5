"""The pools keep the statements psycopg prepared across reads (``database.KeepingConnection``):
psycopg forgot them at every ROLLBACK, which ends every read, so no hot statement (the
claim's pick, planned in 2-6 ms and run in 0.1-0.4 ms) was ever prepared."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from libs.common import database
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
