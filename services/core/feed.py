"""Wake-ups for long polls: one LISTEN connection per process, fanned out to waiters."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import psycopg

from libs.common.settings import libpq_url

log = logging.getLogger("cairn.core.feed")

CHANNEL = "cairn_events"


class Notifier:
    """Listens on ``cairn_events`` and wakes everyone waiting. Reconnects by itself; while
    it is down, waiters simply time out and poll, so nothing is lost, only later."""

    def __init__(self, database_url: str) -> None:
        self._url = libpq_url(database_url)
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="cairn-notifier")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def wait(self, timeout: float) -> None:
        """Return when an event is announced, or after ``timeout`` seconds."""
        event = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _run(self) -> None:
        delay = 0.1
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self._url, autocommit=True
                ) as conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    delay = 0.1
                    self._wake()
                    async for _ in conn.notifies():
                        self._wake()
            except psycopg.Error as exc:
                log.warning("event listener lost its connection (%s); retrying", exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
