"""The counts over the whole backlog that the dashboard asks for, read once for all of one
core's callers at a time (``/metrics`` counts the queues' depths on its own, at a scrape).

Each of these statements (``tasks.QUEUE_DEPTHS``, ``tasks.QUEUE_HISTORY``,
``sharing._ACTIVE``, ``sharing._TOP``, and ``sharing._WAITING_OF`` for the listed owners)
reads every live task, or every one of those owners: at 100,000 waiting, 40 to 150 ms of
PostgreSQL's CPU a call (``bench/dashboard_backlog.py``). Every open Queues page asks for
them every 2 s, so without sharing their cost grows with the backlog times the people
watching it. ``Shared`` bounds it two ways:

- **One reading in flight per statement and parameters.** A caller that comes while one
  is read waits for it to end and then shares the next, which starts after it came: so
  its answer is as fresh as a reading of its own, and however many callers come, this
  core keeps at most one such reading running a statement (``Shared.rows``).
- **A recent reading, to a caller that accepts one.** A caller that says how old an answer
  it accepts (``Cache-Control: max-age=N`` on its request, as the dashboard's pages send
  with their period) takes the last reading while it is younger than that, and is told its
  age (the ``Age`` header). Callers that say nothing always get a reading that started
  after they came.

Each reading runs on a connection of its own from the engine, so a caller that goes away
(its request cancelled) does not cancel it for the others, and a caller needs no
connection to wait for one: the handlers read their shared counts first (``Count``,
``tasks.queue_depths``, ``tasks.queue_history``, ``sharing.top_counts``,
``sharing.active_flows``) and only then take a connection for their own statements."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy import Row
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.elements import TextClause

#: the most a caller may accept as an answer's age, whatever it asks
MAX_AGE_S = 60.0
#: readings kept (statement and parameters: ``QUEUE_HISTORY``'s minutes, ``_TOP``'s limit,
#: the owners whose waiting work ``sharing._WAITING_OF`` counts)
_KEPT = 512

#: a reading's statement and its parameters (JSON: an owners' list among them)
Key = tuple[str, str]


class Count(Protocol):
    """How a ``db`` function reads one of the backlog's counts: on a connection
    (``on``) or through ``Shared`` (``Shared.within``), which needs none of its caller's,
    so a handler reads its shared counts before it takes a connection of its own (a
    caller waiting for a reading holds none meanwhile). ``age_s`` is how old the oldest
    reading it gave was when it gave it."""

    age_s: float

    async def __call__(
        self, statement: TextClause, params: Mapping[str, Any] | None = None
    ) -> Sequence[Row[Any]]: ...


class on:
    """The statements read on ``conn``, within its transaction: unshared, as fresh as
    the connection's."""

    age_s = 0.0

    def __init__(self, conn: AsyncConnection) -> None:
        self.conn = conn

    async def __call__(
        self, statement: TextClause, params: Mapping[str, Any] | None = None
    ) -> Sequence[Row[Any]]:
        return (await self.conn.execute(statement, dict(params or {}))).all()


@dataclass
class _Reading:
    #: the order in which readings started (``Shared._started``): whether one started
    #: after a call came is told by it, not by the clock, which may tick coarsely
    number: int
    started: float
    task: asyncio.Future[Sequence[Row[Any]]]


@dataclass
class _Kept:
    number: int
    started: float
    rows: Sequence[Row[Any]]


class Shared:
    """One core's readings of the backlog's counts (module docstring)."""

    def __init__(self, engine: AsyncEngine, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.clock = clock
        self._flying: dict[Key, _Reading] = {}
        self._kept: dict[Key, _Kept] = {}
        self._started = 0  # readings started so far

    def within(self, max_age_s: float = 0.0) -> Answer:
        """A reader for one answer that accepts readings up to ``max_age_s`` old (0:
        only one that starts after each read is asked for); it says the oldest it gave."""
        return Answer(self, min(max(max_age_s, 0.0), MAX_AGE_S))

    async def rows(
        self, statement: TextClause, params: Mapping[str, Any] | None, max_age_s: float
    ) -> tuple[Sequence[Row[Any]], float]:
        """The statement's rows and their age in seconds (since their reading started):
        the last reading while it started at most ``max_age_s`` ago; else the one in
        flight if it started since this call, or a new one once the one in flight ends.
        So an answer is at most ``max_age_s`` old when given, or began after the call."""
        key: Key = (statement.text, json.dumps(params or {}, sort_keys=True))
        came = self._started  # a reading numbered above it started after this call
        while True:
            now = self.clock()
            kept = self._kept.get(key)
            if kept is not None and (
                kept.number > came or (max_age_s > 0 and now - kept.started <= max_age_s)
            ):
                return kept.rows, max(0.0, now - kept.started)
            reading = self._flying.get(key)
            if reading is None or reading.task.done():
                reading = self._start(key, statement, params)
            try:
                if reading.number > came:
                    rows = await asyncio.shield(reading.task)
                    return rows, max(0.0, self.clock() - reading.started)
                # Began before this call: wait for its end, then take it if it is young
                # enough, else share the next (the first of those waiting starts it).
                with contextlib.suppress(Exception):
                    await asyncio.shield(reading.task)
            except asyncio.CancelledError:
                if _cancelled_itself() or not reading.task.cancelled():
                    raise
                # the reading was cancelled, not this call: read again

    def _start(self, key: Key, statement: TextClause, params: Mapping[str, Any] | None) -> _Reading:
        self._started += 1
        number, started = self._started, self.clock()

        async def read() -> Sequence[Row[Any]]:
            # Kept, and let go of as the one in flight, before the task ends: a call that
            # runs between its end and its done callbacks must not find it still flying
            # (it would wait on a finished task, which does not yield, for ever).
            try:
                rows = await self._read(statement, params)
            finally:
                if self._flying.get(key) is reading:
                    del self._flying[key]
            if len(self._kept) >= _KEPT and key not in self._kept:
                self._kept.clear()
            self._kept[key] = _Kept(number, started, rows)
            return rows

        reading = _Reading(number, started, asyncio.ensure_future(read()))
        self._flying[key] = reading
        # a failure nobody waited for is not "never retrieved"
        reading.task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return reading

    async def _read(
        self, statement: TextClause, params: Mapping[str, Any] | None
    ) -> Sequence[Row[Any]]:
        async with self.engine.connect() as conn:
            return await on(conn)(statement, params)


def _cancelled_itself() -> bool:
    """Whether the running task was asked to stop (``Task.cancel``), as opposed to a
    shared reading it awaited being cancelled."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


@dataclass
class Answer:
    """``Shared``'s reader for one answer; ``age_s`` is the oldest reading it gave."""

    shared: Shared
    max_age_s: float
    age_s: float = field(default=0.0)

    async def __call__(
        self, statement: TextClause, params: Mapping[str, Any] | None = None
    ) -> Sequence[Row[Any]]:
        rows, age = await self.shared.rows(statement, params, self.max_age_s)
        self.age_s = max(self.age_s, age)
        return rows
