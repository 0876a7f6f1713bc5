"""One leader among a service's replicas, for every service that needs one (cron, dag).

Leadership is a PostgreSQL session advisory lock held on a connection of the elector's
own, used for nothing else but what the leader chooses to (cron LISTENs on it). The lock
goes free the moment that session ends: the process died, the server terminated the
backend, or a network cut was noticed (TCP keepalives on both ends of the connection:
``database.keepalive``).

Holding the lock is not enough to write safely: a leader whose session was killed keeps
running until it notices. So every win bumps a **leader epoch** (a row of the service's
``leader`` table), and each write transaction of the leader first *fences* itself: it
reads the row ``FOR SHARE`` and goes on only while the epoch is still its own. A new
leader's bump waits for the row, so it cannot commit while an old leader's write is in
flight, and every write the old leader starts afterwards sees the new epoch and is
refused (``LeadershipLost``). The leader also checks its lock session at every turn of
its loop, so it stops turning within one turn of losing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from sqlalchemy import BigInteger, Column, DateTime, MetaData, Table, Text, TextClause, text
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common.database import connect_timeout, keepalive, outage
from libs.common.settings import libpq_url

log = logging.getLogger("cairn.leader")


class LeadershipLost(Exception):
    """This process no longer leads: its lock session ended or a newer epoch exists."""


def leader_table(metadata: MetaData) -> Table:
    """The ``leader`` table of a service's schema: one row per election, its epoch."""
    return Table(
        "leader",
        metadata,
        Column("name", Text, primary_key=True),
        Column("epoch", BigInteger, nullable=False),
        Column("holder", Text, nullable=False),
        Column("since", DateTime(timezone=True), nullable=False),
    )


def _lock_parts(key: int) -> tuple[int, int]:
    """How ``pg_locks`` shows a bigint advisory key: (classid, objid)."""
    unsigned = key & 0xFFFF_FFFF_FFFF_FFFF
    return unsigned >> 32, unsigned & 0xFFFF_FFFF


class Lease:
    """A won election: the lock's connection and the epoch this leader writes under."""

    def __init__(self, elector: Elector, conn: psycopg.AsyncConnection[Any], epoch: int) -> None:
        self.elector = elector
        self.conn = conn
        self.epoch = epoch

    async def check(self) -> None:
        """Raise ``LeadershipLost`` unless the lock session is alive, still holds the
        lock, and the epoch is still this one. Bounded by the elector's check timeout."""
        e = self.elector
        classid, objid = _lock_parts(e.key)
        sql = (
            f"SELECT (SELECT epoch FROM {e.table} WHERE name = %s), EXISTS (SELECT 1 FROM"
            " pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted"
            " AND classid = %s AND objid = %s AND objsubid = 1)"
        )
        try:
            async with asyncio.timeout(e.check_timeout_s):
                cur = await self.conn.execute(sql, (e.name, classid, objid))
                row = await cur.fetchone()
        except (psycopg.Error, OSError, TimeoutError) as exc:
            raise LeadershipLost(f"the lock session of {e.name} failed: {exc!r}") from exc
        if row is None or row[0] != self.epoch or not row[1]:
            raise LeadershipLost(f"{e.name}: lock or epoch {self.epoch} no longer held")

    async def fence(self, conn: AsyncConnection, *, durable: bool = True) -> None:
        """Inside a write transaction on ``conn``: go on only under this epoch. The row
        stays share-locked until the transaction ends, so no new leader commits between.
        ``durable=False``: see ``fencing``."""
        clause, params = self.fencing(durable=durable)
        self.fenced(await conn.scalar(clause, params))

    def fencing(self, *, durable: bool = True) -> tuple[TextClause, dict[str, Any]]:
        """``fence``'s statement, to send first of a transaction's statements in one round
        trip (``pipeline.run``); its answer goes to ``fenced`` before anything is written.
        ``durable=False`` also sets the transaction's commit asynchronous (no wait for its
        WAL flush; ``synchronous_commit = off`` for it alone): for a leader whose writes
        are all derived from durable sources and would be derived again if a server crash
        lost them."""
        e = self.elector
        return _fencing(e.table, durable), {"name": e.name}

    def fenced(self, current: Any) -> None:
        """Go on only if ``current`` (the fencing statement's answer) is this epoch."""
        if current != self.epoch:
            e = self.elector
            raise LeadershipLost(f"{e.name}: epoch {self.epoch} was superseded by {current}")

    async def close(self) -> None:
        """Give the lock up (closing its session frees it)."""
        with contextlib.suppress(Exception):
            await self.conn.close()


@functools.lru_cache(maxsize=64)
def _fencing(table: str, durable: bool) -> TextClause:
    """``Lease.fencing``'s statement, one for each table and form: a statement is kept by
    the pipeline that sends it (its compiled text, its row maker), so a new one at every
    transaction was kept for good, 1.4 kB each (a DAG leader fences each feed page's)."""
    sync = "" if durable else ", set_config('synchronous_commit', 'off', true)"
    return text(f"SELECT epoch{sync} FROM {table} WHERE name = :name FOR SHARE")


class Elector:
    """Campaigns for the advisory lock ``key``; ``campaign()`` returns once it leads."""

    def __init__(
        self,
        database_url: str,
        *,
        name: str,
        key: int,
        table: str,
        poll_s: float = 1.0,
        check_timeout_s: float = 5.0,
    ) -> None:
        self.url = libpq_url(database_url)
        self.name = name
        self.key = key
        self.table = table
        self.poll_s = poll_s
        self.check_timeout_s = check_timeout_s
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"

    async def campaign(self) -> Lease:
        """Wait until this process leads; survives the database coming and going."""
        while True:
            try:
                return await self._try_until_won()
            except (psycopg.Error, OSError) as exc:
                log.warning("%s election: cannot reach the database: %r", self.name, exc)
                await asyncio.sleep(self.poll_s)

    async def _try_until_won(self) -> Lease:
        conn = await psycopg.AsyncConnection.connect(
            # Both ends notice a vanished peer (``database.keepalive``): this process
            # stops leading, and the server ends the session and frees the lock. A
            # connect timeout (5 s) unless the URL sets its own (``database.connect_timeout``).
            psycopg.conninfo.make_conninfo(
                self.url, **connect_timeout(self.url), **keepalive(self.url)
            ),
            autocommit=True,
        )
        try:
            while True:
                cur = await conn.execute("SELECT pg_try_advisory_lock(%s)", (self.key,))
                row = await cur.fetchone()
                if row and row[0]:
                    lease = Lease(self, conn, await self._bump(conn))
                    log.info("%s leader: %s, epoch %d", self.name, self.holder, lease.epoch)
                    return lease
                await asyncio.sleep(self.poll_s)
        except BaseException:
            with contextlib.suppress(Exception):
                await conn.close()
            raise

    async def _bump(self, conn: psycopg.AsyncConnection[Any]) -> int:
        """A new epoch; waits (boundedly) for the old leader's fenced writes to end."""
        async with conn.transaction():
            await conn.execute(f"SET LOCAL lock_timeout = '{int(self.check_timeout_s * 1000)}ms'")
            cur = await conn.execute(
                f"INSERT INTO {self.table} AS t (name, epoch, holder, since)"
                " VALUES (%s, 1, %s, now()) ON CONFLICT (name) DO UPDATE"
                " SET epoch = t.epoch + 1, holder = EXCLUDED.holder, since = now()"
                " RETURNING epoch",
                (self.name, self.holder),
            )
            row = await cur.fetchone()
        assert row is not None
        return int(row[0])


#: the longest pause between leads that failed one after another (``lead_forever``)
FAILED_LEAD_PAUSE_MAX_S = 30.0


async def lead_forever(
    elector: Elector,
    lead: Callable[[Lease], Awaitable[None]],
    *,
    pause_s: float,
    stepped_down: Callable[[], None] | None = None,
    failed: Callable[[Exception], None] | None = None,
) -> None:
    """Campaign, ``lead`` while the lock is held (it returns or raises once the lead is
    lost), step down, campaign again, after ``pause_s``. Any failure of ``lead`` (a lost
    lock, the database gone, a pool timeout, a bug) steps down: it never stops the
    replica from leading again. A lead that failed otherwise than by losing the lead or
    the database (``failed`` hears why) is followed by a pause that doubles from
    ``pause_s`` to ``FAILED_LEAD_PAUSE_MAX_S`` while leads keep failing, and starts again
    from ``pause_s`` after a lead that lasted that long: a fault that fails every lead
    (a write refused, a bug) was met again, a traceback logged and the epoch bumped, once a
    ``pause_s``, for as long as it lasted."""
    loop = asyncio.get_running_loop()
    failures = 0
    while True:
        lease = await elector.campaign()
        began = loop.time()
        pause = pause_s
        try:
            await lead(lease)
        except Exception as exc:
            if isinstance(exc, LeadershipLost | OSError) or outage(exc) is not None:
                failures = 0
                log.warning("%s leadership lost: %s", elector.name, outage(exc) or exc)
            else:
                lasted = loop.time() - began >= FAILED_LEAD_PAUSE_MAX_S
                failures = 1 if lasted else failures + 1
                pause = min(FAILED_LEAD_PAUSE_MAX_S, pause_s * 2 ** min(failures - 1, 30))
                log.exception(
                    "%s leader failed; stepping down, campaigning again in %.2f s",
                    elector.name,
                    pause,
                )
                if failed is not None:
                    failed(exc)
        else:
            failures = 0
        finally:
            if stepped_down is not None:
                stepped_down()
            await lease.close()
        await asyncio.sleep(pause)
