"""Wake-ups for long polls and, later, the dispatcher.

Whoever commits new events calls ``Notifier.announce()`` after the commit: it wakes this
process's waiters at once and sends one ``pg_notify`` for the other replicas, coalesced
over a few milliseconds on a connection of its own. NOTIFY is deliberately kept out of
the writing transactions: PostgreSQL serialises the commits of transactions that notify
on one lock, which capped submits. One LISTEN connection per process receives the
others' announcements. Lost wake-ups cost latency only: waiters also poll.

The same two connections carry due hints (channel ``cairn_due``, payload UNIX seconds):
whoever stores a delayed task calls ``announce_due(run_at)``, and every replica's promoter
(``loops.Promoter``) hears of it, so its timer can be set on the earliest due instant.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import psycopg

from libs.common.settings import libpq_url

log = logging.getLogger("cairn.core.feed")

CHANNEL = "cairn_events"
DUE_CHANNEL = "cairn_due"
COALESCE_S = 0.005

Session = Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]]


class Notifier:
    def __init__(self, database_url: str) -> None:
        self._url = libpq_url(database_url)
        self._changed = asyncio.Event()
        self._outgoing = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._due_out: float | None = None
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
        self._outgoing.set()

    def announce_due(self, at: datetime) -> None:
        """A delayed task due at ``at`` is committed: hint this process's promoter, and
        the other replicas' (the earliest of the hints since the last send goes out)."""
        when = at.timestamp()
        if self.on_due is not None:
            self.on_due(when)
        if self._due_out is None or when < self._due_out:
            self._due_out = when
        self._outgoing.set()

    async def wait(self, timeout: float) -> None:
        """Return when an event is announced, or after ``timeout`` seconds."""
        event = self._changed
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
            self._wake()
            async for note in conn.notifies():
                if note.channel != DUE_CHANNEL:
                    self._wake()
                elif self.on_due is not None:
                    with contextlib.suppress(ValueError):
                        self.on_due(float(note.payload))

        await self._connected("event listener", body)

    async def _send(self) -> None:
        async def body(conn: psycopg.AsyncConnection[Any]) -> None:
            while True:
                await self._outgoing.wait()
                self._outgoing.clear()
                due, self._due_out = self._due_out, None
                if due is None:
                    await conn.execute("SELECT pg_notify(%s, '')", (CHANNEL,))
                else:
                    await conn.execute(
                        "SELECT pg_notify(%s, ''), pg_notify(%s, %s)",
                        (CHANNEL, DUE_CHANNEL, repr(due)),
                    )
                await asyncio.sleep(COALESCE_S)

        await self._connected("event announcer", body)
