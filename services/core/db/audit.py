"""The audit trail: one append-only row per security-relevant action (who, what, on what,
from where, when, before and after), chained by hashes (``domain.auditchain``). A
trigger refuses to change or delete rows, except the writer's one seal of its row's hash
and the retention purge, which says so in its own transaction."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
from sqlalchemy import select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common.auth import Caller
from libs.common.models import AuditEntry
from services.core.db.tables import audit, audit_chain, audit_export
from services.core.domain import auditchain

_PURGE = text("""
WITH old AS (
    SELECT id FROM core.audit
    WHERE at < now() - make_interval(secs => :age_s)
      AND (NOT :exported_only OR id <= (SELECT last_id FROM core.audit_export))
    ORDER BY id LIMIT :limit
)
DELETE FROM core.audit a USING old WHERE a.id = old.id
""")


def jsonable(value: dict[str, Any] | None) -> Any:
    """``value`` as JSON gives it back (what a jsonb column returns, keys aside)."""
    return None if value is None else orjson.loads(orjson.dumps(value, default=str))


async def record(
    conn: AsyncConnection,
    actor: Caller,
    action: str,
    target: str,
    *,
    source: str | None = None,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    key: str | None = None,
) -> bool:
    """Append one row, in the caller's transaction: the action and its record commit
    together, or neither does. The row links to the chain's head, whose row lock (held
    to the commit) orders every replica's inserts into one chain: audited actions commit
    one at a time from their audit insert on (docs/security.md, "Audit export"). With a
    ``key`` a row already holds, nothing is appended: returns whether a row was."""
    prev = (await conn.execute(select(audit_chain.c.head_hash).with_for_update())).scalar_one()
    row = (
        (
            await conn.execute(
                pg_insert(audit)
                .values(
                    actor=actor.name,
                    actor_role=actor.role,
                    action=action,
                    target=target,
                    source=source,
                    before=jsonable(before),
                    after=jsonable(after),
                    prev_hash=prev,
                    idempotency_key=key,
                )
                .on_conflict_do_nothing(
                    index_elements=[audit.c.idempotency_key],
                    index_where=audit.c.idempotency_key.is_not(None),
                )
                .returning(audit)
            )
        )
        .mappings()
        .one_or_none()
    )
    if row is None:
        return False
    # Hashed as stored (jsonb may normalise what was given), then sealed.
    digest = auditchain.link(prev, row)
    await conn.execute(update(audit).where(audit.c.id == row["id"]).values(hash=digest))
    await conn.execute(update(audit_chain).values(head_id=row["id"], head_hash=digest))
    return True


async def keyed(conn: AsyncConnection, key: str) -> dict[str, Any] | None:
    """The row recorded under ``key`` (its action, target and after), if one is."""
    found = await conn.execute(
        select(audit.c.action, audit.c.target, audit.c.after).where(audit.c.idempotency_key == key)
    )
    row = found.mappings().one_or_none()
    return None if row is None else dict(row)


@dataclass(frozen=True)
class AuditFilter:
    actor: str | None = None
    action: str | None = None
    target: str | None = None
    since: datetime | None = None
    until: datetime | None = None


async def page(
    conn: AsyncConnection, where: AuditFilter, before: int | None, limit: int
) -> list[AuditEntry]:
    """Newest first; ``before`` is the keyset cursor (an entry's id)."""
    query = select(audit).order_by(audit.c.id.desc()).limit(limit)
    if where.actor is not None:
        query = query.where(audit.c.actor == where.actor)
    if where.action is not None:
        # "token" matches every token.* action; "token.create" only that one.
        query = query.where(
            (audit.c.action == where.action) | audit.c.action.startswith(where.action + ".")
        )
    if where.target is not None:
        query = query.where(audit.c.target == where.target)
    if where.since is not None:
        query = query.where(audit.c.at >= where.since)
    if where.until is not None:
        query = query.where(audit.c.at < where.until)
    if before is not None:
        query = query.where(audit.c.id < before)
    return [AuditEntry.model_validate(row._mapping) for row in await conn.execute(query)]


async def purge(
    conn: AsyncConnection, age_s: float, limit: int, *, exported_only: bool = False
) -> int:
    """Delete up to ``limit`` entries older than ``age_s`` (and, with ``exported_only``,
    already exported); the only delete allowed."""
    await conn.execute(text("SET LOCAL cairn.audit_purge = 'on'"))
    args = {"age_s": age_s, "limit": limit, "exported_only": exported_only}
    return int((await conn.execute(_PURGE, args)).rowcount)


async def chain(conn: AsyncConnection, after: int, limit: int) -> list[dict[str, Any]]:
    """Up to ``limit`` sealed rows with ids above ``after``, oldest first: export order.
    Committed rows only, and in chain order: the head's lock makes ids commit in order."""
    query = (
        select(audit)
        .where(audit.c.id > after, audit.c.hash.is_not(None))
        .order_by(audit.c.id)
        .limit(limit)
    )
    return [dict(row._mapping) for row in await conn.execute(query)]


async def export_mark(conn: AsyncConnection) -> int | None:
    """The last id the scheduled export wrote, locked to this transaction; ``None`` while
    another export holds it."""
    query = select(audit_export.c.last_id).with_for_update(skip_locked=True)
    return (await conn.execute(query)).scalar_one_or_none()


async def exported_through(conn: AsyncConnection) -> int:
    return int((await conn.execute(select(audit_export.c.last_id))).scalar_one())


async def set_export_mark(conn: AsyncConnection, last_id: int) -> None:
    await conn.execute(update(audit_export).values(last_id=last_id, exported_at=text("now()")))


@dataclass(frozen=True)
class Auditor:
    """Writes the caller's audit rows, each in the transaction of the action it records."""

    actor: Caller
    source: str | None

    async def __call__(
        self,
        conn: AsyncConnection,
        action: str,
        target: str,
        before: dict[str, Any] | None = None,
        after: dict[str, Any] | None = None,
    ) -> None:
        await record(
            conn, self.actor, action, target, source=self.source, before=before, after=after
        )
