"""A background loop's failed turn: one line while the database is out of reach, the
traceback for anything else, and the loop goes on either way."""

from __future__ import annotations

import asyncio
import logging

import psycopg
import pytest
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from libs.common.database import outage
from services.core import loops


def test_outage_names_what_is_out_of_reach() -> None:
    assert outage(PoolTimeout("QueuePool limit of size 20 reached")) == (
        "no database connection free"
    )
    down = OperationalError("SELECT 1", {}, psycopg.OperationalError("connection refused\nmore"))
    assert outage(down) == "database unavailable: connection refused"
    assert outage(psycopg.OperationalError("server closed the connection")) is not None
    assert outage(ValueError("a bug")) is None
    assert outage(KeyError("a bug")) is None


def _turns(failure: Exception, caplog: pytest.LogCaptureFixture) -> int:
    calls = 0

    async def step() -> int:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise failure
        raise asyncio.CancelledError

    with (
        caplog.at_level(logging.WARNING, logger="cairn.core.loops"),
        pytest.raises(asyncio.CancelledError),
    ):
        asyncio.run(loops.every(0.001, "promoter", step))
    return calls


def test_a_loop_logs_an_outage_in_one_line_and_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert _turns(PoolTimeout("pool"), caplog) == 3
    lines = [r for r in caplog.records if r.name == "cairn.core.loops"]
    assert len(lines) == 2
    assert all(r.levelno == logging.WARNING and r.exc_info is None for r in lines)
    assert "promoter failed; retrying: no database connection free" in lines[0].getMessage()


def test_a_loop_logs_a_bug_with_its_traceback_and_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert _turns(ZeroDivisionError("bug"), caplog) == 3
    lines = [r for r in caplog.records if r.name == "cairn.core.loops"]
    assert len(lines) == 2
    assert all(r.levelno == logging.ERROR and r.exc_info is not None for r in lines)
