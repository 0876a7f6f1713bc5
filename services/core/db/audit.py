"""The audit trail: one append-only row per security-relevant action (who, what, on what,
from where, when, before and after). A trigger refuses to change or delete rows, except
the retention purge, which says so in its own transaction."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
from sqlalchemy import insert, select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common.auth import Caller
from libs.common.models import AuditEntry
from services.core.db.tables import audit

_PURGE = text("""
WITH old AS (
    SELECT id FROM core.audit
    WHERE at < now() - make_interval(secs => :age_s)
    ORDER BY id LIMIT :limit
)
DELETE FROM core.audit a USING old WHERE a.id = old.id
""")


def _jsonable(value: dict[str, Any] | None) -> Any:
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
) -> None:
    """Append one row, in the caller's transaction: the action and its record commit
    together, or neither does."""
    await conn.execute(
        insert(audit).values(
            actor=actor.name,
            actor_role=actor.role,
            action=action,
            target=target,
            source=source,
            before=_jsonable(before),
            after=_jsonable(after),
        )
    )


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


async def purge(conn: AsyncConnection, age_s: float, limit: int) -> int:
    """Delete up to ``limit`` entries older than ``age_s``; the only delete allowed."""
    await conn.execute(text("SET LOCAL cairn.audit_purge = 'on'"))
    return int((await conn.execute(_PURGE, {"age_s": age_s, "limit": limit})).rowcount)


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
