"""Group commit of single submissions: concurrent ``POST /v1/tasks`` of one process are
written together, in one statement and one commit, on a plain psycopg connection of
their own (the task rows and their events in the same statement, ``db.tasks.SUBMIT``;
the other replicas told of them in the same transaction and round trip, not by the
notifier's own NOTIFY: a transaction and a commit less; none when there is no other).

One writer task takes every submission waiting, writes them, answers each, and takes the
next lot: while one lot is being written the next collects, and a submission that finds
the writer idle goes at once, alone, with no wait added. Each submission gets its own
answer: a key that matched a different request is its own 409, the others stand; a
statement the database refuses is written again one submission at a time, so the one at
fault gets its own error and the others are stored. A submission is answered only after
its commit, so an answer given is a task stored. One that waits in line longer than
``wait_s`` (core's ``CAIRN_DB_POOL_TIMEOUT_S``, as a request waits for a pooled
connection) while a write is held up (a lock, a slow disk) leaves the line unwritten and
is answered 503, before its client gives up: never stored later for a client that
stopped listening.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from sqlalchemy.exc import DBAPIError

from libs.common.database import outage
from libs.common.errors import DATABASE_UNAVAILABLE, Unavailable
from services.core.db import tasks as tasks_db
from services.core.db.feed import Notifier, Work, notes_of
from services.core.domain.sharing import FairShare
from services.core.settings import CoreSettings

log = logging.getLogger("cairn.core.groupcommit")

#: the most submissions written in one statement
MAX_GROUP = 500


@dataclass
class _Waiting:
    doc: dict[str, Any]
    work: Work
    answer: asyncio.Future[tuple[Any, bool]]
    #: the event loop's time when it leaves the line unwritten
    due: float


@dataclass
class GroupCommit:
    """The writer of one process's single submissions (``submit``), over ``url`` (libpq
    form) with psycopg's ``connect_args``; ``quantum_s`` is core's fair-share step. With
    ``notifier``, each commit tells the other replicas of what it stored."""

    url: str
    connect_args: dict[str, Any]
    quantum_s: float
    notifier: Notifier | None = None
    #: how submissions are stamped across flows (``CoreSettings.fair_share_rule``)
    fair: FairShare | None = None
    #: the longest a submission waits in line for its write to begin (then a 503)
    wait_s: float = CoreSettings.model_fields["db_pool_timeout_s"].default
    max_group: int = MAX_GROUP
    _waiting: deque[_Waiting] = field(default_factory=deque)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _conn: psycopg.AsyncConnection[Any] | None = None
    _writer: asyncio.Task[None] | None = None
    _closed: bool = False

    def start(self) -> None:
        self._writer = asyncio.create_task(self._run(), name="cairn-submit-writer")

    async def stop(self) -> None:
        """Write what waits, then close: a submission after this is a 503."""
        self._closed = True
        self._wake.set()
        if self._writer is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
        await self._drop()

    @property
    def told(self) -> bool:
        """Whether its commits tell the other replicas (``Notifier.announce(told=...)``)."""
        return self.notifier is not None

    async def submit(self, doc: dict[str, Any], work: Work | None = None) -> tuple[Any, bool]:
        """Store one submission (``db.tasks.submission_docs``) with whatever else waits;
        its row and whether it was created, once committed. Raises its own refusal.
        ``work``: what it makes claimable, for the other replicas (``feed.Work``)."""
        if self._closed:
            raise Unavailable("core is stopping")
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[tuple[Any, bool]] = loop.create_future()
        due = loop.time() + self.wait_s
        self._waiting.append(_Waiting(doc, work or Work(), answer, due))
        self._wake.set()
        timer = loop.call_at(due, self._expire)
        result = await answer
        timer.cancel()
        return result

    def _expire(self) -> None:
        """Those whose time in line is up out of it, answered 503 (once a write has taken
        one, its answer is the write's outcome, stored or not); also when its caller went
        away. The line is first in, first out and every wait the same: they are at its
        head."""
        now = asyncio.get_running_loop().time()
        refused = 0
        while self._waiting and self._waiting[0].due <= now:
            waiting = self._waiting.popleft()
            if not waiting.answer.done():
                waiting.answer.set_exception(Unavailable(DATABASE_UNAVAILABLE))
            refused += 1
        if refused:
            log.warning(
                "%d submissions waited %g s in line for their write; refused",
                refused,
                self.wait_s,
            )

    async def _run(self) -> None:
        while not (self._closed and not self._waiting):
            await self._wake.wait()
            self._wake.clear()
            while self._waiting:
                group = [
                    self._waiting.popleft() for _ in range(min(len(self._waiting), self.max_group))
                ]
                try:
                    await self._write(group)
                except Exception as exc:  # the loop goes on; each is told
                    log.exception("writing %d submissions failed", len(group))
                    _fail(group, exc)

    async def _write(self, group: Sequence[_Waiting]) -> None:
        try:
            conn = await self._connection()
            # no other replica listens (``Notifier.alone``): no note, no echo of it
            tell = self.notifier is not None and not self.notifier.alone
            notes = notes_of(sum((w.work for w in group), Work())) if tell else []
            docs = [w.doc for w in group]
            stored = await tasks_db.submit_docs(conn, docs, self.quantum_s, notes, self.fair)
        except DBAPIError as exc:
            if exc.connection_invalidated or outage(exc):
                await self._drop()
                _fail(group, exc)  # committed or not is unknown: a retry with its key tells
            elif len(group) > 1:
                for one in group:  # the one at fault gets its own error, the others stand
                    await self._write([one])
            else:
                _fail(group, exc)
            return
        except psycopg.OperationalError as exc:  # no connection
            log.warning("database unavailable: %s", exc)
            await self._drop()
            _fail(group, Unavailable(DATABASE_UNAVAILABLE))
            return
        for one, outcome in zip(group, stored, strict=True):
            if one.answer.done():  # its caller went away; the task is stored all the same
                continue
            if isinstance(outcome, Exception):
                one.answer.set_exception(outcome)
            else:
                one.answer.set_result(outcome)

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(
                self.url, autocommit=True, **self.connect_args
            )
            if self.notifier is not None:
                self.notifier.telling(self._conn.info.backend_pid)
        return self._conn

    async def _drop(self) -> None:
        if self._conn is not None:
            if self.notifier is not None:
                self.notifier.telling(self._conn.info.backend_pid, gone=True)
            with contextlib.suppress(psycopg.Error):
                await self._conn.close()
            self._conn = None


def _fail(group: Sequence[_Waiting], exc: BaseException) -> None:
    for one in group:
        if not one.answer.done():
            one.answer.set_exception(exc)
