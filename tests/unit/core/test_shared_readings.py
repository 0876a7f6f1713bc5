"""The backlog's counts shared by one core's callers (``db.readings.Shared``): how many
readings run, which callers share which, and how old an answer each may get."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import text
from starlette.requests import Request

from services.core.api.deps import max_age_of
from services.core.db import readings

DEPTHS = text("SELECT 'depths'")
HISTORY = text("SELECT 'history' WHERE :minutes > 0")
WAITING = text("SELECT 'waiting' WHERE :owners IS NOT NULL")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Database:
    """An engine whose every statement waits for the test to end it (``finish``); each
    reading's rows say which reading it was (its number)."""

    def __init__(self) -> None:
        self.started: list[tuple[str, dict[str, Any]]] = []
        self.gates: list[asyncio.Future[None]] = []

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[Database]:
        yield self

    async def execute(self, statement: Any, params: dict[str, Any]) -> Database._Result:
        self.started.append((statement.text, params))
        number = len(self.started)
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.gates.append(gate)
        await gate
        return Database._Result(number)

    def finish(self, i: int, error: Exception | None = None) -> None:
        if error is None:
            self.gates[i].set_result(None)
        else:
            self.gates[i].set_exception(error)

    class _Result:
        def __init__(self, n: int) -> None:
            self.n = n

        def all(self) -> list[tuple[int]]:
            return [(self.n,)]


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def shared() -> tuple[readings.Shared, Database, Clock]:
    db, clock = Database(), Clock()
    return readings.Shared(db, clock), db, clock  # type: ignore[arg-type]


async def ask(
    s: readings.Shared, max_age_s: float = 0.0, statement: Any = DEPTHS, **params: Any
) -> tuple[int, float]:
    answer = s.within(max_age_s)
    rows = await answer(statement, params)
    return rows[0][0], answer.age_s


def test_callers_that_come_during_a_reading_share_the_next_one_which_starts_after_them() -> None:
    async def run() -> None:
        s, db, clock = shared()
        first = asyncio.ensure_future(ask(s))
        await settle()
        assert len(db.started) == 1
        clock.now += 0.05
        later = [asyncio.ensure_future(ask(s)) for _ in range(5)]
        await settle()
        assert len(db.started) == 1, "no second reading while one is in flight"
        db.finish(0)
        await settle()
        assert (await first)[0] == 1
        # the first reading began before they came: they share one new reading
        assert len(db.started) == 2
        assert not any(t.done() for t in later)
        db.finish(1)
        assert [(await t)[0] for t in later] == [2] * 5

    asyncio.run(run())


def test_with_a_clock_that_does_not_tick_a_caller_still_gets_a_reading_started_after_it() -> None:
    """Whether a reading started after a call is told by the readings' order, not by the
    clock: with a coarse clock, a reading started and ended in one tick is not one that
    started after a call in that same tick."""

    async def run() -> None:
        s, db, _ = shared()  # the clock stays at 1000 throughout
        first = asyncio.ensure_future(ask(s))
        await settle()
        db.finish(0)
        assert (await first)[0] == 1
        second = asyncio.ensure_future(ask(s))
        await settle()
        assert len(db.started) == 2, "the kept reading began before this call"
        joining = asyncio.ensure_future(ask(s))
        await settle()
        db.finish(1)
        assert (await second)[0] == 2
        await settle()
        assert len(db.started) == 3, "the one in flight began before this call too"
        db.finish(2)
        assert (await joining)[0] == 3

    asyncio.run(run())


def test_a_caller_that_accepts_an_age_gets_the_last_reading_while_it_is_that_young() -> None:
    async def run() -> None:
        s, db, clock = shared()
        first = asyncio.ensure_future(ask(s, 2.0))
        await settle()
        db.finish(0)
        assert await first == (1, 0.0)
        clock.now += 1.5
        assert await ask(s, 2.0) == (1, 1.5)
        assert len(db.started) == 1
        # one that accepts no age, or less than the reading's, gets a new one
        fresh = asyncio.ensure_future(ask(s, 1.0))
        await settle()
        assert len(db.started) == 2
        db.finish(1)
        assert await fresh == (2, 0.0)
        clock.now += 2.5
        again = asyncio.ensure_future(ask(s, 2.0))
        await settle()
        assert len(db.started) == 3, "older than it accepts: read again"
        db.finish(2)
        assert (await again)[0] == 3

    asyncio.run(run())


def test_a_caller_that_accepts_an_age_takes_the_reading_in_flight_if_it_ends_that_young() -> None:
    async def run() -> None:
        s, db, clock = shared()
        first = asyncio.ensure_future(ask(s))
        await settle()
        clock.now += 1.0
        joining = asyncio.ensure_future(ask(s, 2.0))
        await settle()
        clock.now += 0.5
        db.finish(0)
        assert await first == (1, 1.5)
        assert await joining == (1, 1.5)
        assert len(db.started) == 1

    asyncio.run(run())


def test_a_caller_that_accepts_an_age_is_not_given_an_older_reading_in_flight() -> None:
    async def run() -> None:
        s, db, clock = shared()
        first = asyncio.ensure_future(ask(s))
        await settle()
        clock.now += 1.9
        joining = asyncio.ensure_future(ask(s, 2.0))
        await settle()
        clock.now += 10.0  # the reading ends 11.9 s after it began
        db.finish(0)
        assert await first == (1, pytest.approx(11.9))
        await settle()
        assert len(db.started) == 2, "too old once it ended: a reading of its own"
        db.finish(1)
        assert (await joining)[0] == 2

    asyncio.run(run())


def test_a_call_that_comes_as_a_reading_ends_does_not_wait_on_it_for_ever() -> None:
    """A call that runs after the reading's task ended but before its done callbacks
    must not find it still in flight: waiting on a finished task does not yield, so it
    would spin, and the whole event loop with it (the alarm turns that into a failure)."""

    def spun(signum: int, frame: object) -> None:
        raise TimeoutError("a call spun on a finished reading")

    async def run() -> None:
        s, db, clock = shared()
        first = asyncio.ensure_future(ask(s))
        await settle()
        db.finish(0)  # the reading resumes next, then this call starts, then callbacks
        clock.now += 0.01
        racing = asyncio.ensure_future(ask(s))
        assert (await first)[0] == 1
        await settle()
        assert len(db.started) == 2
        db.finish(1)
        assert (await racing)[0] == 2

    previous = signal.signal(signal.SIGALRM, spun)
    signal.alarm(5)
    try:
        asyncio.run(run())
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_cancelled_reading_is_read_again_for_its_callers() -> None:
    async def run() -> None:
        s, db, _ = shared()
        caller = asyncio.ensure_future(ask(s))
        await settle()
        s._flying[next(iter(s._flying))].task.cancel()
        await settle()
        assert len(db.started) == 2 and not caller.done()
        db.finish(1)
        assert (await caller)[0] == 2

    asyncio.run(run())


def test_a_failed_reading_fails_its_callers_and_the_next_call_reads_again() -> None:
    async def run() -> None:
        s, db, _ = shared()
        first = asyncio.ensure_future(ask(s))
        await settle()
        later = [asyncio.ensure_future(ask(s)) for _ in range(2)]
        await settle()
        db.finish(0, RuntimeError("connection lost"))
        with pytest.raises(RuntimeError, match="connection lost"):
            await first
        await settle()
        # the two that came during it share the next, which fails them both
        assert len(db.started) == 2
        db.finish(1, RuntimeError("connection lost again"))
        for caller in later:
            with pytest.raises(RuntimeError, match="connection lost again"):
                await caller
        again = asyncio.ensure_future(ask(s, 60.0))
        await settle()
        assert len(db.started) == 3, "a failure is not kept"
        db.finish(2)
        assert (await again)[0] == 3

    asyncio.run(run())


def test_a_caller_that_goes_away_does_not_cancel_the_reading_for_the_others() -> None:
    async def run() -> None:
        s, db, _ = shared()
        first = asyncio.ensure_future(ask(s))
        await settle()
        # both come during the first reading, so they share the next: gone starts it
        gone, staying = asyncio.ensure_future(ask(s)), asyncio.ensure_future(ask(s))
        await settle()
        db.finish(0)
        assert (await first)[0] == 1
        await settle()
        assert len(db.started) == 2
        gone.cancel()
        await settle()
        assert gone.cancelled()
        db.finish(1)
        assert (await staying)[0] == 2
        assert len(db.started) == 2

    asyncio.run(run())


def test_each_statement_and_its_parameters_are_read_on_their_own() -> None:
    async def run() -> None:
        s, db, _ = shared()
        callers = [
            asyncio.ensure_future(ask(s, 5.0)),
            asyncio.ensure_future(ask(s, 5.0, HISTORY, minutes=60)),
            asyncio.ensure_future(ask(s, 5.0, HISTORY, minutes=30)),
            asyncio.ensure_future(ask(s, 5.0, HISTORY, minutes=60)),
            asyncio.ensure_future(ask(s, 5.0, WAITING, owners=["bob", "alice"])),
            asyncio.ensure_future(ask(s, 5.0, WAITING, owners=["bob", "alice"])),
            asyncio.ensure_future(ask(s, 5.0, WAITING, owners=["bob"])),
        ]
        await settle()
        assert sorted(p.get("minutes", 0) for _, p in db.started) == [0, 0, 0, 30, 60]
        for i in range(5):
            db.finish(i)
        answers = [(await c)[0] for c in callers]
        assert answers[1] == answers[3] != answers[2]
        assert answers[4] == answers[5] != answers[6]
        assert len(set(answers)) == 5

    asyncio.run(run())


def test_the_age_a_reader_gives_is_bounded() -> None:
    s, _, _ = shared()
    assert s.within(10**9).max_age_s == readings.MAX_AGE_S
    assert s.within(-5).max_age_s == 0.0


@pytest.mark.parametrize(
    ("header", "accepted"),
    [
        (None, 0.0),
        ("max-age=2", 2.0),
        ("max-age=5, no-cache", 0.0),
        ('no-cache="x", max-age=5', 0.0),
        ("no-store,max-age=5", 0.0),
        ("no-cacher, max-age=5", 5.0),
        ('MAX-AGE="3"', 3.0),
        ('max-age="3', 0.0),
        ("max-age=3 5", 0.0),
        ("max-age=2, must-revalidate", 2.0),
        ("s-maxage=5", 0.0),
        ("x-max-age=5", 0.0),
        ("max-age=abc", 0.0),
        ("max-age=1234567890123", 0.0),
    ],
)
def test_what_age_a_request_accepts(header: str | None, accepted: float) -> None:
    headers = [] if header is None else [(b"cache-control", header.encode())]
    request = Request({"type": "http", "method": "GET", "path": "/", "headers": headers})
    assert max_age_of(request) == accepted


def test_every_cache_control_line_counts() -> None:
    lines = [(b"cache-control", b"private"), (b"cache-control", b"max-age=4")]
    assert max_age_of(Request({"type": "http", "path": "/", "headers": lines})) == 4.0
    lines.append((b"cache-control", b"no-cache"))
    assert max_age_of(Request({"type": "http", "path": "/", "headers": lines})) == 0.0
