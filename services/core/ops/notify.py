"""Notifications' background work: the matcher (core's feed to the outbox), the deadline
scan, and webhook delivery. Each step is short transactions; no HTTP call is made while a
transaction is open, and none from a request (docs/notifications.md)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx
import orjson
from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common import egress
from libs.common.settings import database_hosts
from libs.common.states import TaskState
from services.core.db import notifications
from services.core.db import tasks as tasks_db
from services.core.domain import notify
from services.core.domain.retry import Backoff
from services.core.identity.crypto import SecretBox, Unreadable
from services.core.settings import CoreSettings

log = logging.getLogger("cairn.core.notify")

#: how much of a failed answer's body is read (the rest is never read), and logged
MAX_READ = 4096
MAX_EXCERPT = 200
MAX_REASON = 100
MATCHER_JUMP_XIDS = 10_000  # how far the horizon runs ahead before a deathless page moves


async def match_once(engine: AsyncEngine, limit: int) -> int:
    """Read the next page of core's feed after the matcher's cursor and queue a delivery
    per matching subscription. One replica at a time; a page read twice (a crash before
    the commit) queues nothing twice, by the outbox's unique key. Return the events read."""
    async with engine.begin() as conn:
        at = await notifications.locked_cursor(conn, notifications.MATCHER_CURSOR, "matcher")
        if at is None:  # another replica's turn
            return 0
        cursor = (at.feed_xid, at.feed_id)
        # Only deaths become deliveries from the feed (the other events are posted or
        # scanned), so only they are read.
        events, after = await tasks_db.read_feed(conn, cursor, limit, None, TaskState.DEAD)
        await notifications.queue_dead(conn, events)
        # With no death read, the cursor may jump to the feed's horizon, but need not: the
        # next read from here finds the same nothing (the deaths' own index). Each jump
        # is a write, whose transaction id moves the horizon again: jumping on every
        # pass kept an idle core writing (and flushing WAL) twice a second for ever.
        if events or after[0] - cursor[0] >= MATCHER_JUMP_XIDS:
            await notifications.move_cursor(conn, "matcher", feed_xid=after[0], feed_id=after[1])
    return len(events)


async def deadlines_once(engine: AsyncEngine, limit: int) -> int:
    """Queue ``task.deadline_missed`` for tasks whose deadline passed unfinished."""
    async with engine.begin() as conn:
        scanned, _ = await notifications.queue_deadlines(conn, limit)
    return scanned


def body_of(leased: notifications.Leased) -> bytes:
    """The JSON a webhook receives; the same bytes on every try."""
    doc = {
        "id": str(leased.delivery_id),
        "event": leased.event,
        "owner": leased.owner,
        "subscription": {"id": leased.subscription_id, "name": leased.subscription},
        "created_at": leased.created_at.isoformat(),
        "data": leased.payload,
    }
    return orjson.dumps(doc)


@dataclass(frozen=True)
class Webhooks:
    """What sending webhooks needs beside the database: the keys the signing secrets are
    sealed with, and which addresses may be reached (``libs/common/egress.py``)."""

    box: SecretBox
    egress: egress.Policy

    @classmethod
    async def of(cls, box: SecretBox, settings: CoreSettings, *database_urls: str) -> Webhooks:
        """Refused beside loopback, private and link-local: the database's hosts (every
        one of a cluster that fails over; their ports on them even inside
        ``CAIRN_NOTIFY_ALLOW_CIDRS``), and so a pooler's in front of it when both URLs are
        given."""
        policy = egress.Policy(allow=settings.notify_allowed)
        for url in dict.fromkeys(database_urls):
            for host, port in database_hosts(url):
                guard = await egress.guarding(host, port, settings.notify_allowed)
                policy = policy.also(guard)
        return cls(box, policy)


class Deliverer:
    """Sends due deliveries by webhook, at least once, and records every answer. At most
    ``batch`` are in flight; a slow webhook holds only its own."""

    def __init__(
        self,
        engine: AsyncEngine,
        policy: notify.Policy,
        http: httpx.AsyncClient,
        batch: int,
        lease_s: float,
        box: SecretBox,
    ) -> None:
        self.engine = engine
        self.policy = policy
        self.http = http
        self.batch = batch
        self.lease_s = lease_s
        self.box = box
        self._inflight: set[asyncio.Task[None]] = set()

    @classmethod
    def of(cls, engine: AsyncEngine, settings: CoreSettings, webhooks: Webhooks) -> Deliverer:
        policy = notify.Policy(
            backoff=Backoff(settings.notify_backoff_base_s, settings.notify_backoff_cap_s),
            max_tries=settings.notify_max_tries,
            disable_after=settings.notify_disable_after,
        )
        limit = settings.notify_timeout_s
        http = egress.client(webhooks.egress, httpx.Timeout(limit, connect=min(2.0, limit)))
        return cls(engine, policy, http, settings.notify_batch, settings.notify_lease, webhooks.box)

    async def aclose(self) -> None:
        for task in self._inflight:
            task.cancel()
        await asyncio.gather(*self._inflight, return_exceptions=True)
        await self.http.aclose()

    async def deliver_once(self) -> int:
        """Lease due deliveries up to the room left and start sending them; return how
        many started (with no room, wait for one to end and count that)."""
        room = self.batch - len(self._inflight)
        if room <= 0:
            await asyncio.wait(self._inflight, return_when=asyncio.FIRST_COMPLETED)
            return 1
        async with self.engine.connect() as conn:
            # one statement: in autocommit, no BEGIN and COMMIT round trips around it
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            leased = await notifications.claim(conn, room, self.lease_s)
        for item in leased:
            task = asyncio.create_task(self._deliver(item), name=f"cairn-deliver-{item.id}")
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
        return len(leased)

    async def _deliver(self, leased: notifications.Leased) -> None:
        try:
            status, error, took_ms = await self._send(leased)
        except Exception as exc:
            # A try that failed inside core (a bug, a stored secret AES-GCM refuses) is a
            # failed try like any other: recorded, retried on the curve, counted toward
            # disabling, so logged once a try. Unrecorded, it went again at each lease's
            # end for ever, and the task's exception was seen by no one. The owner is
            # told its kind; its words (core's insides) stay in core's log.
            log.exception("delivery %s failed inside core", leased.delivery_id)
            why = f"could not deliver: core failed ({type(exc).__name__}; see core's log)"
            status, error, took_ms = None, why, 0.0
        delivered = self.policy.delivered(status)
        retry_in = None if delivered else self.policy.retry_in_s(leased.tries, leased.event)
        outcome = notifications.Outcome(status, error, took_ms, delivered, retry_in)
        reason = notify.disabled_reason(self.policy.disable_after, status, error)
        try:
            async with self.engine.begin() as conn:
                held = await notifications.record(
                    conn, leased, outcome, self.policy.disable_after, reason
                )
        except Exception:
            # The lease runs out and another try follows: at least once.
            log.exception("could not record delivery %s", leased.delivery_id)
            return
        if not held:
            log.warning("delivery %s was taken over before its answer came", leased.delivery_id)

    def _headers(self, leased: notifications.Leased, body: bytes) -> dict[str, str]:
        """The try's headers, signed over its timestamp and the body."""
        kid, nonce, sealed = leased.secret
        secret = self.box.open(
            kid, nonce, sealed, notify.secret_context(leased.owner, leased.subscription)
        )
        now = int(time.time())
        return {
            "Content-Type": "application/json",
            "User-Agent": "cairn-webhooks/1",
            notify.SIGNATURE_HEADER: notify.signature(secret, now, body),
            notify.DELIVERY_HEADER: str(leased.delivery_id),
            notify.TIMESTAMP_HEADER: str(now),
            notify.EVENT_HEADER: leased.event,
        }

    async def _send(self, leased: notifications.Leased) -> tuple[int | None, str | None, float]:
        body = body_of(leased)
        try:
            headers = self._headers(leased, body)
        except Unreadable:
            return None, "the signing secret does not open with the configured keys", 0.0
        started = time.monotonic()
        try:
            # The whole exchange, not only each read, ends within the timeout.
            async with asyncio.timeout(self.http.timeout.read or 10.0):
                answer = await egress.post(self.http, leased.url, body, headers, MAX_READ)
        except TimeoutError:
            return None, "no answer within the timeout", (time.monotonic() - started) * 1000
        except egress.Refused as exc:
            return None, f"could not deliver: {exc}", (time.monotonic() - started) * 1000
        except (httpx.HTTPError, httpx.InvalidURL):
            # Why a connection failed (refused, reset, unreachable) is not told: it
            # would say which ports of the target's host are open.
            return None, "could not deliver", (time.monotonic() - started) * 1000
        took_ms = (time.monotonic() - started) * 1000
        if 200 <= answer.status < 300:
            return answer.status, None, took_ms
        return answer.status, _excerpt(answer), took_ms


def _excerpt(answer: egress.Answer) -> str:
    """What the log keeps of a failed answer: its status line and the body's first
    characters, clipped (the body is the receiver's, not to be echoed whole)."""
    reason = _printable(answer.reason, MAX_REASON)
    text = _printable(answer.head.decode("utf-8", "replace"), MAX_EXCERPT)
    return f"HTTP {answer.status} {reason}: {text}".rstrip(": ")


def _printable(text: str, limit: int) -> str:
    return "".join(c if c.isprintable() else " " for c in text[:limit])


async def purge_once(engine: AsyncEngine, settings: CoreSettings) -> int:
    async with engine.begin() as conn:
        return await notifications.purge(
            conn, settings.retention_days * 86400, settings.retention_batch
        )
