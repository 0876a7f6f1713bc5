"""A background loop's failed turn: one line while the database is out of reach, the
traceback for anything else, told once a streak and then once a minute, and the loop goes
on either way after a pause that doubles up to a bound."""

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
    assert len(lines) == 1  # the second failure of the streak within the minute: untold
    assert all(r.levelno == logging.WARNING and r.exc_info is None for r in lines)
    assert "promoter failed; retrying: no database connection free" in lines[0].getMessage()


def test_a_loop_logs_a_bug_with_its_traceback_and_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert _turns(ZeroDivisionError("bug"), caplog) == 3
    lines = [r for r in caplog.records if r.name == "cairn.core.loops"]
    assert len(lines) == 1
    assert all(r.levelno == logging.ERROR and r.exc_info is not None for r in lines)


def test_a_lasting_failure_is_told_once_a_minute_and_its_pause_doubles_to_a_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A fault a loop met at every turn (a bug, a table refusing its writes) logged its
    # traceback every turn, 7,200 an hour for a loop of half a second, and turned as
    # often as when it worked.
    now = [0.0]
    failures = loops.Failures("notify-matcher", 0.5, clock=lambda: now[0])
    pauses = []
    with caplog.at_level(logging.WARNING, logger="cairn.core.loops"):
        for _ in range(200):  # a turn every pause, for a while
            pauses.append(failures.failed(ZeroDivisionError("bug")))
            now[0] += pauses[-1]
        failures.worked()
    assert pauses[:5] == [0.5, 1.0, 2.0, 4.0, loops.FAILED_PAUSE_MAX_S]
    assert set(pauses[4:]) == {loops.FAILED_PAUSE_MAX_S}
    lines = [r.getMessage() for r in caplog.records if r.name == "cairn.core.loops"]
    minutes = now[0] / loops.FAILED_TELL_S
    assert minutes <= len(lines) - 1 <= minutes + 2  # a line a minute and the recovery
    assert "(16 turns in a row)" in lines[1]  # the first at 60 s: 0.5 + 1 + 2 + 4 + 5 + 5 ...
    assert lines[-1] == "notify-matcher works again after 200 failed turns"
    # a loop slower than the bound keeps its own interval
    assert loops.Failures("retention", 60.0).failed(ValueError("x")) == 60.0
