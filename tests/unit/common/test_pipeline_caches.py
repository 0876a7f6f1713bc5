"""What the pipeline keeps of each statement (its compiled text, its ``$n`` form, its row
maker) stays bounded, and the statement a DAG leader sends with every feed page's
transaction (its fence) is one statement, not a new one each time: each new one was kept
for good, with its compiled text (``libs/common/pipeline.py``)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.dialects.postgresql import psycopg as dialects

from libs.common import pipeline
from libs.common.leader import Elector, Lease


def test_the_leaders_fence_is_the_same_statement_at_every_transaction() -> None:
    elector = Elector("postgresql://u@localhost/db", name="dag", key=7, table="dag.leader")
    lease = Lease(elector, None, 3)  # type: ignore[arg-type]  # (no session needed)
    for durable in (True, False):
        first, params = lease.fencing(durable=durable)
        again, _ = Lease(elector, None, 4).fencing(durable=durable)  # type: ignore[arg-type]
        assert again is first
        assert params == {"name": "dag"}
    assert lease.fencing(durable=False)[0] is not lease.fencing(durable=True)[0]
    assert "synchronous_commit" in lease.fencing(durable=False)[0].text


def test_statements_built_anew_at_every_run_leave_the_caches_bounded() -> None:
    dialect: Any = dialects.dialect()  # type: ignore[no-untyped-call]
    kept = pipeline.STATEMENTS_KEPT
    for n in range(kept * 2 + 5):
        sql, names = pipeline.raw_sql(text(f"SELECT {n} AS n, :a AS a"), dialect)
        assert (sql, names) == (f"SELECT {n} AS n, $1 AS a", ("a",))
    assert len(pipeline._RAW) <= kept
    assert len(pipeline._COMPILED) <= kept
    # a statement kept answers as it did
    clause = text("SELECT :b AS b, :a AS a")
    assert pipeline.raw_sql(clause, dialect) == pipeline.raw_sql(clause, dialect)
