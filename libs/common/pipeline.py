"""Statements sent together: psycopg's pipeline mode on the connection of a SQLAlchemy
transaction, so that a chain of statements whose parameters need no answer of the chain
costs one round trip (the transaction's BEGIN included) instead of one each.

The statements run in order, in the caller's transaction, as ``conn.execute`` would run
them one by one; an error in one raises here and aborts the transaction (the rest of the
chain is not run). Rows are named tuples (``row.id``), as SQLAlchemy's rows read.

They are the hot path's named statements, each prepared on its connection at its first
run, not after psycopg's five unprepared runs on each pooled connection (each parsed and
planned anew: the claim's pick took 7 ms to plan behind 20,000 tasks, more than it took
to run). Where prepared statements are off (a transaction pooler) they run unprepared.

They go out with ``$n`` placeholders (``raw_sql``) on psycopg's raw cursors, which read
no query text: psycopg's own cursors parse a ``%(name)s`` query at every run unless it is
at most 4,096 bytes, and the claim's pick is 7,274 (185 µs a parse, loaded)."""

from __future__ import annotations

import re
from collections.abc import Generator, Mapping, Sequence
from typing import Any

from psycopg import AsyncConnection as PsycopgConnection
from psycopg import AsyncPipeline, AsyncRawCursor
from psycopg.pq import ExecStatus
from psycopg.rows import RowMaker, namedtuple_row
from sqlalchemy import TextClause, text
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection

Statement = tuple[TextClause, Mapping[str, Any]]

#: The transaction's COMMIT as the last of a chain: the chain and the commit in one round
#: trip, when nothing follows it in the transaction (the transaction's own commit on
#: leaving then finds nothing to do: psycopg sends no COMMIT on an idle connection).
COMMIT: Statement = (text("COMMIT"), {})

# Each named statement's text as the driver takes it (``%(name)s``), compiled once.
_COMPILED: dict[int, tuple[TextClause, str]] = {}

#: How many statements ``_COMPILED`` and ``_RAW`` keep each: the services' named ones are
#: a few hundred. Past it the one kept longest goes: a statement built anew at each run
#: (``text(f"...")`` in a function) was kept for good, with its texts (1.4 kB a run).
STATEMENTS_KEPT = 1024


def _keep(cache: dict[int, Any], clause: TextClause, found: Any) -> None:
    """``found`` kept for ``clause`` in ``cache``, within ``STATEMENTS_KEPT``."""
    if id(clause) not in cache and len(cache) >= STATEMENTS_KEPT:
        del cache[next(iter(cache))]
    cache[id(clause)] = found


def driver_sql(clause: TextClause, dialect: Dialect) -> str:
    """``clause`` as psycopg takes it, compiled once, comments and indentation dropped:
    psycopg caches the parse of a query's placeholders only up to 4,096 bytes, and SUBMIT
    with its comments is longer (4,590 bytes; 3,345 without): it was parsed again at
    every submission."""
    found = _COMPILED.get(id(clause))
    if found is None or found[0] is not clause:
        found = (clause, compact_sql(str(clause.compile(dialect=dialect))))
        _keep(_COMPILED, clause, found)
    return found[1]


def compact_sql(sql: str) -> str:
    """``sql`` without ``--`` comments, each line trimmed and its runs of blanks outside
    string literals made one space; literals are kept byte for byte. SQL this cannot
    read safely line by line (a literal that goes on to the next line, an ``E''``
    escape string, dollar quotes, block comments) is returned as written."""
    if "/*" in sql or _DOLLAR_QUOTE.search(sql) or _ESCAPE_STRING.search(sql):
        return sql
    lines = []
    for line in sql.splitlines():
        parts = line.split("'")
        kept = []
        for i, part in enumerate(parts):
            if i % 2:  # inside a literal ('' inside one splits into empty parts)
                kept.append(part)
                continue
            code, dashes, _ = part.partition("--")
            kept.append(_BLANKS.sub(" ", code))
            if dashes:  # the rest of the line is a comment, quotes and all
                break
        else:
            if len(parts) % 2 == 0:  # an odd count of quotes: a literal spans lines
                return sql
        code = "'".join(kept).strip()
        if code:
            lines.append(code)
    return "\n".join(lines)


# Each named statement with ``$n`` placeholders, the parameter each number takes, and
# the row factory of its cursors (``_Rows``).
_RAW: dict[int, tuple[TextClause, str, tuple[str, ...], _Rows]] = {}

# What psycopg's own parse reads in a query (``psycopg._queries``): a named placeholder,
# or ``%%`` (a literal %, as SQLAlchemy writes one).
_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%")


def raw_sql(clause: TextClause, dialect: Dialect) -> tuple[str, tuple[str, ...]]:
    """``driver_sql(clause)`` with ``$1, $2, ...`` for its named placeholders (the same
    name, the same number) and ``%`` for ``%%``, as psycopg's parse would make it, and
    the names in number order: what a raw cursor takes. Made once per statement."""
    found = _numbered(clause, dialect)
    return found[1], found[2]


def _numbered(
    clause: TextClause, dialect: Dialect
) -> tuple[TextClause, str, tuple[str, ...], _Rows]:
    """``clause``'s entry of ``_RAW`` (``raw_sql``), made if it has none."""
    found = _RAW.get(id(clause))
    if found is None or found[0] is not clause:
        numbers: dict[str, int] = {}

        def number(match: re.Match[str]) -> str:
            if match.group(1) is None:
                return "%"
            return f"${numbers.setdefault(match.group(1), len(numbers) + 1)}"

        sql = _PLACEHOLDER.sub(number, driver_sql(clause, dialect))
        found = (clause, sql, tuple(numbers), _Rows())
        _keep(_RAW, clause, found)
    return found


class _Rows:
    """One statement's row factory: its rows as named tuples (``namedtuple_row``), the
    names read from its first result and kept while its results have as many columns.
    psycopg's ``namedtuple_row`` reads and decodes every column's name of every result
    and looks the tuple type up by them (the turn's statements return up to 30 columns
    each: 4.7 % of core's py-spy samples at one task a turn, 0.5 % kept). A statement's
    text fixes its columns: a prepared one whose result changed is refused by PostgreSQL
    ('cached plan must not change result type'), and one run unprepared (``SELECT *``)
    would change its count with a column added or dropped."""

    __slots__ = ("fields", "maker")

    def __init__(self) -> None:
        self.fields = -1
        self.maker: RowMaker[Any] | None = None

    def __call__(self, cursor: AsyncRawCursor[Any]) -> RowMaker[Any]:
        result = cursor.pgresult
        if result is None or result.status != ExecStatus.TUPLES_OK:
            return namedtuple_row(cursor)  # no rows (psycopg's own answer for that)
        if self.maker is None or result.nfields != self.fields:
            self.maker, self.fields = namedtuple_row(cursor), result.nfields
        return self.maker


_BLANKS = re.compile(r"\s+")
_DOLLAR_QUOTE = re.compile(r"\$(?:[A-Za-z_][A-Za-z_0-9]*)?\$")
_ESCAPE_STRING = re.compile(r"(?<![A-Za-z_0-9])[eE]'")


async def _driver(conn: AsyncConnection) -> PsycopgConnection[Any]:
    sync = conn.sync_connection
    if sync is not None and not (sync.closed or sync.invalidated):
        # Checked out and valid: its DBAPI connection is at hand, with no greenlet to
        # reach it (``get_raw_connection``'s, which only a revalidation needs: 1 % of
        # core's CPU a turn, two or three pipelines a turn).
        raw = sync.connection
    else:
        raw = await conn.get_raw_connection()
    driver = raw.driver_connection
    if not isinstance(driver, PsycopgConnection):
        raise TypeError(f"pipelines need psycopg's async connection, not {type(driver)}")
    return driver


async def run(conn: AsyncConnection, statements: Sequence[Statement]) -> list[list[Any]]:
    """Run ``statements`` in one round trip; the rows of each (``[]`` for one that
    returns none)."""
    driver = await _driver(conn)
    cursors: list[AsyncRawCursor[Any]] = []
    held: _HeldUntilSync | None = None
    try:
        async with driver.pipeline() as pipe:
            held = _HeldUntilSync.of(pipe)
            dialect = conn.dialect
            for clause, params in statements:
                _, sql, names, rows = _numbered(clause, dialect)
                cursor = AsyncRawCursor(driver, row_factory=rows)
                await cursor.execute(sql, [params[name] for name in names], prepare=True)
                cursors.append(cursor)
    finally:
        if held is not None:
            held.release()
    return [await c.fetchall() if _has_rows(c) else [] for c in cursors]


def _has_rows(cursor: AsyncRawCursor[Any]) -> bool:
    """Whether the statement returned rows (a SELECT, a RETURNING), read from its result's
    status: psycopg's ``description``, which says the same, builds a ``Column`` for each
    of its fields first (the turn's statements return up to 30 each: 2 % of core's CPU
    a turn at one task a turn)."""
    result = cursor.pgresult
    return result is not None and result.status == ExecStatus.TUPLES_OK


class _HeldUntilSync:
    """A pipeline whose statements go out in one write with its Sync. psycopg sends
    each statement as it is queued (``cursor.execute``), and at a Sync runs what is
    queued one command at a time with a flush before each, then asks the server to
    flush: a system call and a segment per statement, each waking PostgreSQL (a
    worker's turn made 15 where its 3 round trips need 3). Here a statement is only
    queued; a Sync (the pipeline's end, or a BEGIN's in psycopg's own transactions)
    runs the queue and flushes once, and the Sync's answer needs no flush request.
    psycopg's internals, as ``database.KeepingConnection``: a psycopg without them
    runs as it would."""

    def __init__(self, pipe: AsyncPipeline) -> None:
        self.pipe = pipe
        self.send, self.sync, self.fetch = (
            pipe._communicate_gen,
            pipe._enqueue_sync,
            pipe._fetch_gen,
        )
        self.syncing = self.synced = False
        pipe._communicate_gen = self._communicate  # type: ignore[method-assign]
        pipe._enqueue_sync = self._enqueue_sync  # type: ignore[method-assign]
        pipe._fetch_gen = self._fetch  # type: ignore[method-assign]

    @classmethod
    def of(cls, pipe: AsyncPipeline) -> _HeldUntilSync | None:
        names = ("_communicate_gen", "_enqueue_sync", "_fetch_gen", "command_queue")
        if not all(hasattr(pipe, n) for n in names) or "_communicate_gen" in vars(pipe):
            return None  # another psycopg, or held already (a pipeline nested in one)
        return cls(pipe)

    def release(self) -> None:
        for name in ("_communicate_gen", "_enqueue_sync", "_fetch_gen"):
            vars(self.pipe).pop(name, None)

    def _enqueue_sync(self) -> None:
        self.sync()
        self.syncing, self.synced = True, False

    def _communicate(self) -> Generator[Any, Any, None]:
        if not self.syncing:
            self.synced = False
            return  # queued only: the Sync sends it
        self.syncing = False
        self._queue_all()
        yield from self.send()
        self.synced = True

    def _queue_all(self) -> None:
        queue = self.pipe.command_queue
        while queue:
            queue.popleft()()  # libpq queues each in its buffer, unflushed

    def _fetch(self, *, flush: bool) -> Generator[Any, Any, None]:
        if self.pipe.command_queue:  # rows asked for before a Sync: send what waits
            self._queue_all()
            self.synced = False
        # After a Sync sent whole, the server flushes its answers without being asked.
        yield from self.fetch(flush=flush and not self.synced)
