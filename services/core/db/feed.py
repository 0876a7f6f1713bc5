"""Wake-ups for long polls and, later, the dispatcher.

Whoever commits new events calls ``Notifier.announce()`` after the commit: it wakes this
process's waiters at once and sends one ``pg_notify`` for the other replicas, coalesced
over a few milliseconds on a connection of its own. NOTIFY is deliberately kept out of
the writing transactions: PostgreSQL serialises the commits of transactions that notify
on one lock, which capped submits. One LISTEN connection per process receives the
others' announcements. Its own events, which PostgreSQL delivers to every listener, are
known by the sending backend's pid and dropped: this process woke its waiters when it
announced, and the echo woke each waiting claim a second time, a lease attempt for
nothing per submission. A waiter reads, then waits: it takes ``mark()`` before its read
and waits ``since`` it, so an announcement between the read and the wait (which the
echo used to cover, 5 ms late) returns at once. Lost wake-ups cost latency only:
waiters also poll.

The same two connections carry due hints (channel ``cairn_due``, payload UNIX seconds):
whoever stores a delayed task calls ``announce_due(run_at)``, and every replica's promoter
(``loops.Promoter``) hears of it, so its timer can be set on the earliest due instant.

And log bells (channel ``cairn_logs``, payload attempt ids): whoever stores chunks of a
log, or ends an attempt, rings its bell with ``announce_log``; followers of that log
(``wait_log``) wake, and no one else does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime
from typing import Any

import psycopg

from libs.common.settings import libpq_url

log = logging.getLogger("cairn.core.feed")

CHANNEL = "cairn_events"
DUE_CHANNEL = "cairn_due"
LOG_CHANNEL = "cairn_logs"
_PAYLOAD_MAX = 7900  # under PostgreSQL's 8000-byte NOTIFY payload
COALESCE_S = 0.005

Session = Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]]


class Notifier:
    def __init__(self, database_url: str) -> None:
        self._url = libpq_url(database_url)
        self._changed = asyncio.Event()
        self._outgoing = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._due_out: float | None = None
        self._events_out = False
        self._logs_out: set[int] = set()
        self._log_waiters: dict[int, tuple[asyncio.Event, list[int]]] = {}
        self._sender_pid: int | None = None  # the backend our announcements come from
        self.on_due: Callable[[float], None] | None = None

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._listen(), name="cairn-listen"),
            asyncio.create_task(self._send(), name="cairn-notify"),
        ]

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """Its listener and its sender, for readiness."""
        return list(self._tasks)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def announce(self) -> None:
        """New events are committed: wake waiters here, and tell the other replicas."""
        self._wake()
        self._events_out = True
        self._outgoing.set()

    def announce_log(self, attempt_ids: Iterable[int]) -> None:
        """These attempts' logs grew (or the attempts ended): wake their followers here
        and on the other replicas."""
        ids = set(attempt_ids)
        self._ring(ids)
        self._logs_out |= ids
        self._outgoing.set()

    async def wait_log(self, attempt_id: int, timeout: float) -> None:
        """Return when the attempt's log bell rings, or after ``timeout`` seconds."""
        entry = self._log_waiters.setdefault(attempt_id, (asyncio.Event(), [0]))
        entry[1][0] += 1
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(entry[0].wait(), timeout)
        finally:
            entry[1][0] -= 1
            if not entry[1][0] and self._log_waiters.get(attempt_id) is entry:
                del self._log_waiters[attempt_id]

    def _ring(self, attempt_ids: Iterable[int]) -> None:
        for attempt_id in attempt_ids:
            entry = self._log_waiters.pop(attempt_id, None)
            if entry is not None:
                entry[0].set()

    def announce_due(self, at: datetime) -> None:
        """A delayed task due at ``at`` is committed: hint this process's promoter, and
        the other replicas' (the earliest of the hints since the last send goes out)."""
        when = at.timestamp()
        if self.on_due is not None:
            self.on_due(when)
        if self._due_out is None or when < self._due_out:
            self._due_out = when
        self._outgoing.set()

    def mark(self) -> asyncio.Event:
        """A token for "what is announced from now on": take it before reading, and
        ``wait(since=token)`` returns at once if something was announced after it."""
        return self._changed

    async def wait(self, timeout: float, since: asyncio.Event | None = None) -> None:
        """Return when an event is announced (after ``since``, a ``mark()``; else from
        now on), or after ``timeout`` seconds."""
        event = self._changed if since is None else since
        if event.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _connected(self, name: str, body: Session) -> None:
        delay = 0.1
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self._url, autocommit=True
                ) as conn:
                    delay = 0.1
                    await body(conn)
            except psycopg.Error as exc:
                log.warning("%s lost its connection (%s); retrying", name, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _listen(self) -> None:
        async def body(conn: psycopg.AsyncConnection[Any]) -> None:
            await conn.execute(f"LISTEN {CHANNEL}")
            await conn.execute(f"LISTEN {DUE_CHANNEL}")
            await conn.execute(f"LISTEN {LOG_CHANNEL}")
            self._wake()
            self._ring(list(self._log_waiters))
            async for note in conn.notifies():
                if note.channel == CHANNEL and note.pid == self._sender_pid:
                    continue  # our own: its waiters were woken when it was announced
                if note.channel == LOG_CHANNEL:
                    self._ring(int(i) for i in note.payload.split(",") if i.isdigit())
                elif note.channel != DUE_CHANNEL:
                    self._wake()
                elif self.on_due is not None:
                    with contextlib.suppress(ValueError):
                        self.on_due(float(note.payload))

        await self._connected("event listener", body)

    async def _send(self) -> None:
        async def body(conn: psycopg.AsyncConnection[Any]) -> None:
            self._sender_pid = conn.info.backend_pid
            try:
                while True:
                    await self._outgoing.wait()
                    self._outgoing.clear()
                    notes = self._notes()
                    if notes:
                        calls = ", ".join("pg_notify(%s, %s)" for _ in notes)
                        await conn.execute(f"SELECT {calls}", [v for note in notes for v in note])
                    await asyncio.sleep(COALESCE_S)
            finally:
                # Lost: another backend may be given its pid, and its notes are not ours.
                self._sender_pid = None

        await self._connected("event announcer", body)

    def _notes(self) -> list[tuple[str, str]]:
        """What to send now: (channel, payload) pairs; log ids in payloads under the limit."""
        due, self._due_out = self._due_out, None
        events, self._events_out = self._events_out, False
        logs, self._logs_out = sorted(self._logs_out), set()
        notes = [(CHANNEL, "")] if events or due is not None else []
        if due is not None:
            notes.append((DUE_CHANNEL, repr(due)))
        payload = ""
        for attempt_id in map(str, logs):
            if len(payload) + len(attempt_id) >= _PAYLOAD_MAX:
                notes.append((LOG_CHANNEL, payload))
                payload = ""
            payload = f"{payload},{attempt_id}" if payload else attempt_id
        if payload:
            notes.append((LOG_CHANNEL, payload))
        return notes
