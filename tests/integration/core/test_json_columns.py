"""The pools read json and jsonb columns by ``database.json_loads`` (orjson), in SQLAlchemy's
statements and in a turn's pipelines alike, and an integer beyond 64 bits comes back whole."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import text

from libs.common import database, pipeline
from libs.common.settings import CairnSettings

_READ = text("SELECT CAST(:doc AS jsonb) AS doc, CAST(:doc AS json) AS plain")
_DOC = '{"args": ["a", 1, 2.5], "n": 123456789012345678901234567890, "none": null}'
_WANT = {"args": ["a", 1, 2.5], "n": 123456789012345678901234567890, "none": None}


async def _read(db_url: str) -> list[object]:
    engine = database.pool(db_url, CairnSettings(database_url=db_url), pool_size=1, max_overflow=0)
    try:
        async with engine.connect() as conn:
            row = (await conn.execute(_READ, {"doc": _DOC})).one()
            [[piped]] = await pipeline.run(conn, [(_READ, {"doc": _DOC})])
            small = (
                await conn.execute(text("SELECT CAST('[1, {\"a\": true}]' AS jsonb)"))
            ).scalar()
    finally:
        await engine.dispose()
    return [row.doc, row.plain, piped.doc, piped.plain, small]


def test_json_columns_are_read_by_the_pools_loader_and_keep_big_integers(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    read: list[bytes] = []
    loads = database.json_loads

    def counted(data: bytes | bytearray | memoryview | str) -> object:
        read.append(bytes(data) if not isinstance(data, str) else data.encode())
        return loads(data)

    monkeypatch.setattr(database, "json_loads", counted)
    doc, plain, piped_doc, piped_plain, small = asyncio.run(_read(db_url))
    assert doc == plain == piped_doc == piped_plain == _WANT
    assert all(type(d["n"]) is int for d in (doc, plain, piped_doc, piped_plain))  # type: ignore[index]
    assert small == [1, {"a": True}]
    assert len(read) == 5  # every json and jsonb value, by the pool's loader
