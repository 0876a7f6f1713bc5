"""Every read and write of notifications: subscriptions, the outbox, the answers log and
the matcher's cursors (docs/notifications.md)."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Row, TextClause, delete, func, insert, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common import locks
from libs.common.errors import Conflict, NotFound, QuotaExceeded
from libs.common.models import (
    MAX_SUBSCRIPTIONS,
    Answer,
    Delivery,
    Event,
    NotificationEvent,
    Subscription,
    SubscriptionCreate,
)
from services.core.db.params import jsonb
from services.core.db.principals import enabled_name
from services.core.db.tables import (
    notification_answers,
    notifications,
    notify_cursors,
    subscriptions,
)
from services.core.domain import notify
from services.core.identity.crypto import SecretBox

# One replica at a time runs each scan: a transaction-scoped advisory lock, taken without
# waiting (the other replicas skip the turn). 4707 is core's namespace (placement: 1).
# A loop's cursor, read only if its transaction took the loop's lock (one replica at a
# time; no row: another has it): the lock and the read in one round trip.
_LOCKED_CURSOR = """SELECT c.* FROM core.notify_cursors c
WHERE c.name = :name AND (SELECT pg_try_advisory_xact_lock{lock})"""
MATCHER_CURSOR = text(_LOCKED_CURSOR.format(lock=locks.MATCHER))
DEADLINE_CURSOR = text(_LOCKED_CURSOR.format(lock=locks.DEADLINE_SCAN))

# A disabled principal's subscriptions match nothing (``principals.enabled_name``).
_MATCHES = (
    """
JOIN core.subscriptions s ON s.owner = {owner} AND s.enabled AND {event} = ANY(s.events)
     AND (s.queue IS NULL OR s.queue = {queue}) AND {labels} @> s.labels
     AND """
    + enabled_name("s.owner").replace("{", "{{").replace("}", "}}")
    + "\n"
)

QUEUE_DEAD: TextClause = text(
    """
INSERT INTO core.notifications (subscription_id, event, dedupe_key, payload)
SELECT s.id, 'task.dead', 'task.dead:' || t.id || ':' || d.seq,
       jsonb_build_object(
           'task', jsonb_build_object('id', t.id, 'name', t.name, 'queue', t.queue,
                                      'labels', t.labels, 'attempts', t.attempts,
                                      'last_error', t.last_error),
           'reason', d.reason, 'at', d.at)
FROM unnest(CAST(:task_ids AS bigint[]), CAST(:seqs AS integer[]), CAST(:reasons AS text[]),
            CAST(:ats AS timestamptz[])) AS d(task_id, seq, reason, at)
JOIN core.tasks t ON t.id = d.task_id
"""
    + _MATCHES.format(owner="t.owner", event="'task.dead'", queue="t.queue", labels="t.labels")
    + "ON CONFLICT (subscription_id, dedupe_key) DO NOTHING"
)

# Tasks whose deadline passed, after the scan's cursor, and the deliveries they make.
QUEUE_DEADLINES: TextClause = text(
    """
WITH due AS (
    SELECT t.id, t.owner, t.name, t.queue, t.labels, t.state, t.deadline, t.finished_at
    FROM core.tasks t
    WHERE t.deadline IS NOT NULL AND (t.deadline, t.id) > (:after_at, :after_id)
      AND t.deadline <= now()
    ORDER BY t.deadline, t.id
    LIMIT :limit
), queued AS (
    INSERT INTO core.notifications (subscription_id, event, dedupe_key, payload)
    SELECT s.id, 'task.deadline_missed', 'task.deadline_missed:' || d.id,
           jsonb_build_object(
               'task', jsonb_build_object('id', d.id, 'name', d.name, 'queue', d.queue,
                                          'labels', d.labels, 'state', d.state),
               'deadline', d.deadline)
    FROM due d
"""
    + _MATCHES.format(
        owner="d.owner", event="'task.deadline_missed'", queue="d.queue", labels="d.labels"
    )
    + """
    WHERE d.finished_at IS NULL OR d.finished_at > d.deadline
    ON CONFLICT (subscription_id, dedupe_key) DO NOTHING
    RETURNING 1
)
SELECT (SELECT count(*) FROM due) AS scanned, (SELECT count(*) FROM queued) AS queued,
       last.deadline AS last_at, last.id AS last_id
FROM (SELECT 1) one
LEFT JOIN (SELECT deadline, id FROM due ORDER BY deadline DESC, id DESC LIMIT 1) last ON true
"""
)

QUEUE_POSTED: TextClause = text(
    """
INSERT INTO core.notifications (subscription_id, event, dedupe_key, payload)
SELECT s.id, :event, :event || ':' || :key, CAST(:payload AS jsonb)
FROM (SELECT 1) one
"""
    + _MATCHES.format(
        owner=":owner",
        event=":event",
        queue="CAST(:queue AS text)",
        labels="CAST(:labels AS jsonb)",
    )
    + "ON CONFLICT (subscription_id, dedupe_key) DO NOTHING RETURNING id"
)

# Due deliveries of enabled subscriptions (a test is delivered even to a disabled one),
# leased to this replica: ``next_at`` moves past the lease, ``tries`` is its fence. Those
# of a disabled principal's subscriptions wait, and go once it is enabled again.
CLAIM: TextClause = text(f"""
WITH due AS (
    SELECT n.id
    FROM core.notifications n
    JOIN core.subscriptions s ON s.id = n.subscription_id
    WHERE n.state = 'pending' AND n.next_at <= now() AND (s.enabled OR n.event = 'test')
      AND {enabled_name("s.owner")}
    ORDER BY n.next_at
    LIMIT :limit
    FOR UPDATE OF n SKIP LOCKED
)
UPDATE core.notifications n
SET tries = n.tries + 1, next_at = now() + make_interval(secs => :lease_s)
FROM due, core.subscriptions s
WHERE n.id = due.id AND s.id = n.subscription_id
RETURNING n.id, n.tries, n.delivery_id, n.event, n.payload, n.created_at, n.subscription_id,
          s.name, s.owner, s.url, s.secret_key_id, s.secret_nonce, s.secret_sealed
""")

# Two tests of one owner's subscriptions at once wait for each other (until the first
# commits), so that the second's statement sees the first's stamp.
LOCK_TESTS: TextClause = text(
    f"SELECT pg_advisory_xact_lock({locks.WEBHOOK_TESTS}, hashtext(:owner))"
)

# Stamp a subscription's test, unless a test of any of its owner's subscriptions was
# within the interval (so many subscriptions are not many tests).
TESTED: TextClause = text("""
UPDATE core.subscriptions s SET tested_at = now()
WHERE s.id = :id
  AND NOT EXISTS (
      SELECT 1 FROM core.subscriptions o
      WHERE o.owner = s.owner AND o.tested_at > now() - make_interval(secs => :interval_s)
  )
RETURNING s.id
""")

# Seconds until the subscription's owner may test one again.
TEST_WAIT: TextClause = text("""
SELECT CAST(extract(epoch FROM max(o.tested_at) + make_interval(secs => :interval_s) - now())
            AS double precision)
FROM core.subscriptions s JOIN core.subscriptions o ON o.owner = s.owner
WHERE s.id = :id
""")

RECORD: TextClause = text("""
UPDATE core.notifications
SET state = :state,
    finished_at = CASE WHEN :state = 'pending' THEN NULL ELSE now() END,
    next_at = now() + make_interval(secs => :retry_in_s),
    last_status = :status, last_error = :error, last_at = now()
WHERE id = :id AND tries = :tries AND state = 'pending'
RETURNING id
""")

SUCCEEDED: TextClause = text("""
UPDATE core.subscriptions SET failures = 0, updated_at = now()
WHERE id = :id AND failures <> 0
""")

FAILED: TextClause = text("""
UPDATE core.subscriptions
SET failures = failures + 1,
    enabled = enabled AND failures + 1 < :disable_after,
    disabled_reason = CASE WHEN enabled AND failures + 1 >= :disable_after THEN :reason
                           ELSE disabled_reason END,
    updated_at = now()
WHERE id = :id
RETURNING enabled
""")


# --- subscriptions ------------------------------------------------------------------------


def _subscription(row: Row[Any]) -> Subscription:
    m = row._mapping
    return Subscription(
        id=m["id"],
        owner=m["owner"],
        name=m["name"],
        events=list(m["events"]),
        filter={"queue": m["queue"], "labels": m["labels"]},
        url=m["url"],
        enabled=m["enabled"],
        disabled_reason=m["disabled_reason"],
        failures=m["failures"],
        created_at=m["created_at"],
        updated_at=m["updated_at"],
    )


def _owned(owner: str | None) -> Any:
    return True if owner is None else subscriptions.c.owner == owner


async def create_subscription(
    conn: AsyncConnection, box: SecretBox, owner: str, spec: SubscriptionCreate, secret: str
) -> Subscription:
    """Store a subscription, its signing secret sealed; a name the owner already uses is
    a conflict."""
    kid, nonce, sealed = box.seal(secret, notify.secret_context(owner, spec.name))
    count = await conn.scalar(
        select(func.count()).select_from(subscriptions).where(subscriptions.c.owner == owner)
    )
    if (count or 0) >= MAX_SUBSCRIPTIONS:
        raise Conflict(f"name: an owner may have at most {MAX_SUBSCRIPTIONS} subscriptions")
    query = (
        pg_insert(subscriptions)
        .values(
            owner=owner,
            name=spec.name,
            events=sorted(set(spec.events)),
            queue=spec.filter.queue,
            labels=spec.filter.labels,
            url=spec.url,
            secret_key_id=kid,
            secret_nonce=nonce,
            secret_sealed=sealed,
        )
        .on_conflict_do_nothing(index_elements=["owner", "name"])
        .returning(subscriptions)
    )
    row = (await conn.execute(query)).first()
    if row is None:
        raise Conflict(f"name: you already have a subscription named {spec.name!r}")
    return _subscription(row)


async def list_subscriptions(conn: AsyncConnection, owner: str | None) -> list[Subscription]:
    query = select(subscriptions).where(_owned(owner)).order_by(subscriptions.c.id).limit(1000)
    return [_subscription(row) for row in await conn.execute(query)]


async def get_subscription(
    conn: AsyncConnection, subscription_id: int, owner: str | None
) -> Subscription:
    query = select(subscriptions).where(subscriptions.c.id == subscription_id, _owned(owner))
    row = (await conn.execute(query)).first()
    if row is None:
        raise NotFound(f"no subscription {subscription_id}")
    return _subscription(row)


async def delete_subscription(
    conn: AsyncConnection, subscription_id: int, owner: str | None
) -> None:
    """Delete it with its outbox rows and answers. The outbox rows are locked first: a
    delivery locks its row and then updates the subscription (its failures), and the
    cascade from the subscription took the two the other way round, a deadlock."""
    await conn.execute(
        select(notifications.c.id)
        .where(notifications.c.subscription_id == subscription_id)
        .order_by(notifications.c.id)
        .with_for_update()
    )
    query = delete(subscriptions).where(subscriptions.c.id == subscription_id, _owned(owner))
    if (await conn.execute(query)).rowcount == 0:
        raise NotFound(f"no subscription {subscription_id}")


async def enable_subscription(
    conn: AsyncConnection, subscription_id: int, owner: str | None
) -> Subscription:
    query = (
        update(subscriptions)
        .where(subscriptions.c.id == subscription_id, _owned(owner))
        .values(enabled=True, disabled_reason=None, failures=0, updated_at=func.now())
        .returning(subscriptions)
    )
    row = (await conn.execute(query)).first()
    if row is None:
        raise NotFound(f"no subscription {subscription_id}")
    return _subscription(row)


# --- the outbox ---------------------------------------------------------------------------


async def queue_test(
    conn: AsyncConnection, subscription: Subscription, interval_s: float
) -> Delivery:
    """A delivery of a ``test`` event to the subscription, delivered by the loop (tried
    once), at most one per ``interval_s`` of its owner's: sooner is a 429 (nothing
    queued)."""
    params = {"id": subscription.id, "interval_s": interval_s}
    await conn.execute(LOCK_TESTS, {"owner": subscription.owner})
    if await conn.scalar(TESTED, params) is None:
        left = await conn.scalar(TEST_WAIT, params)
        raise QuotaExceeded(
            f"a test of one of {subscription.owner}'s subscriptions was queued less than "
            f"{interval_s:g} s ago (CAIRN_NOTIFY_TEST_INTERVAL_S)",
            quota="test_deliveries",
            retry_after_s=max(1, math.ceil(left or 1)),
        )
    payload = {"message": f"a test of subscription {subscription.name!r}"}
    query = (
        insert(notifications)
        .values(
            subscription_id=subscription.id,
            event=notify.TEST_EVENT,
            dedupe_key=f"test:{uuid.uuid4()}",
            payload=payload,
        )
        .returning(notifications)
    )
    row = (await conn.execute(query)).one()
    return _delivery(row)


async def queue_posted(conn: AsyncConnection, event: NotificationEvent, at: datetime) -> int:
    """Queue a posted event for each of its owner's matching subscriptions."""
    payload = {"summary": event.summary, "subject": event.subject, "at": at.isoformat()}
    if event.queue:
        payload["queue"] = event.queue
    if event.labels:
        payload["labels"] = event.labels
    rows = await conn.execute(
        QUEUE_POSTED,
        {
            "event": event.event,
            "key": event.key,
            "owner": event.owner,
            "queue": event.queue,
            "labels": jsonb(event.labels),
            "payload": jsonb(payload),
        },
    )
    return len(rows.all())


async def queue_dead(conn: AsyncConnection, events: list[Event]) -> int:
    """Queue ``task.dead`` deliveries for feed events that moved a task to dead (the
    matcher reads only those: ``store.read_feed`` with ``to_state``)."""
    if not events:
        return 0
    result = await conn.execute(
        QUEUE_DEAD,
        {
            "task_ids": [e.task_id for e in events],
            "seqs": [e.seq for e in events],
            "reasons": [e.reason for e in events],
            "ats": [e.at for e in events],
        },
    )
    return result.rowcount


async def cursor(conn: AsyncConnection, name: str) -> Row[Any]:
    query = select(notify_cursors).where(notify_cursors.c.name == name)
    return (await conn.execute(query)).one()


async def locked_cursor(conn: AsyncConnection, lock: TextClause, name: str) -> Row[Any] | None:
    """The cursor ``name`` if this transaction took its loop's ``lock`` (``MATCHER_CURSOR``,
    ``DEADLINE_CURSOR``); None if another replica holds it."""
    return (await conn.execute(lock, {"name": name})).one_or_none()


async def move_cursor(conn: AsyncConnection, name: str, **values: Any) -> None:
    query = (
        update(notify_cursors)
        .where(notify_cursors.c.name == name)
        .values(**values, updated_at=func.now())
    )
    await conn.execute(query)


async def queue_deadlines(conn: AsyncConnection, limit: int) -> tuple[int, int]:
    """Scan the next passed deadlines, if this transaction takes the scan's lock (else
    (0, 0)); return (tasks scanned, deliveries queued)."""
    at = await locked_cursor(conn, DEADLINE_CURSOR, "deadlines")
    if at is None:
        return 0, 0
    found = (
        await conn.execute(
            QUEUE_DEADLINES,
            {"after_at": at.deadline_at, "after_id": at.deadline_id, "limit": limit},
        )
    ).one()
    if found.scanned:
        await move_cursor(conn, "deadlines", deadline_at=found.last_at, deadline_id=found.last_id)
    return found.scanned, found.queued


@dataclass(frozen=True)
class Leased:
    """A delivery this replica holds until its lease ends."""

    id: int
    tries: int
    delivery_id: uuid.UUID
    event: str
    payload: Any
    created_at: datetime
    subscription_id: int
    subscription: str
    owner: str
    url: str
    #: the signing secret as stored: (key id, nonce, ciphertext), opened by the sender
    secret: tuple[str, bytes, bytes]


async def claim(conn: AsyncConnection, limit: int, lease_s: float) -> list[Leased]:
    rows = await conn.execute(CLAIM, {"limit": limit, "lease_s": lease_s})
    return [
        Leased(
            id=r.id,
            tries=r.tries,
            delivery_id=r.delivery_id,
            event=r.event,
            payload=r.payload,
            created_at=r.created_at,
            subscription_id=r.subscription_id,
            subscription=r.name,
            owner=r.owner,
            url=r.url,
            secret=(r.secret_key_id, r.secret_nonce, r.secret_sealed),
        )
        for r in rows
    ]


@dataclass(frozen=True)
class Outcome:
    """One try's answer and what follows from it."""

    status: int | None
    error: str | None
    duration_ms: float
    delivered: bool
    #: None: no further try (delivered, or given up)
    retry_in_s: float | None


async def record(
    conn: AsyncConnection, leased: Leased, outcome: Outcome, disable_after: int, reason: str
) -> bool:
    """Log the answer; if this replica still holds the delivery, settle it and count the
    subscription's failures. Return whether it still held it."""
    await conn.execute(
        insert(notification_answers).values(
            notification_id=leased.id,
            subscription_id=leased.subscription_id,
            **{"try": leased.tries},
            status=outcome.status,
            error=outcome.error,
            duration_ms=outcome.duration_ms,
        )
    )
    if outcome.delivered:
        state = "delivered"
    else:
        state = "pending" if outcome.retry_in_s is not None else "failed"
    held = await conn.scalar(
        RECORD,
        {
            "id": leased.id,
            "tries": leased.tries,
            "state": state,
            "retry_in_s": outcome.retry_in_s or 0.0,
            "status": outcome.status,
            "error": outcome.error,
        },
    )
    if held is None:
        return False
    if outcome.delivered:
        await conn.execute(SUCCEEDED, {"id": leased.subscription_id})
    else:
        params = {"id": leased.subscription_id, "disable_after": disable_after, "reason": reason}
        await conn.execute(FAILED, params)
    return True


def _delivery(row: Row[Any]) -> Delivery:
    return Delivery.model_validate(dict(row._mapping))


async def deliveries(conn: AsyncConnection, subscription_id: int, limit: int) -> list[Delivery]:
    query = (
        select(notifications)
        .where(notifications.c.subscription_id == subscription_id)
        .order_by(notifications.c.id.desc())
        .limit(limit)
    )
    return [_delivery(row) for row in await conn.execute(query)]


async def answers(conn: AsyncConnection, subscription_id: int, limit: int) -> list[Answer]:
    a, n = notification_answers, notifications
    query = (
        select(
            n.c.delivery_id,
            n.c.event,
            a.c["try"],
            a.c.at,
            a.c.status,
            a.c.error,
            a.c.duration_ms,
        )
        .join(n, n.c.id == a.c.notification_id)
        .where(a.c.subscription_id == subscription_id)
        .order_by(a.c.id.desc())
        .limit(limit)
    )
    return [Answer.model_validate(dict(row._mapping)) for row in await conn.execute(query)]


async def purge(conn: AsyncConnection, age_s: float, limit: int) -> int:
    """Delete settled deliveries older than ``age_s`` (with their answers)."""
    doomed = (
        select(notifications.c.id)
        .where(
            notifications.c.finished_at < func.now() - func.make_interval(0, 0, 0, 0, 0, 0, age_s)
        )
        .limit(limit)
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    result = await conn.execute(delete(notifications).where(notifications.c.id.in_(doomed)))
    return result.rowcount
