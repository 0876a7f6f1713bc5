"""Every column that holds values sealed with the secrets keys (``crypto.SecretBox``), in
one list, and the reads and writes that move them to the newest key (``ops.rekey``).

A new sealed column joins by adding a :class:`Sealed` to :data:`SEALED`: its table (with
an ``id`` primary key), the names of its key id, nonce and ciphertext columns, and the
associated data each row's value was sealed with."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Column, Row, Table, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from services.core.db.secrets import Scope
from services.core.db.tables import secrets, subscriptions
from services.core.domain.notify import secret_context


@dataclass(frozen=True)
class Sealed:
    """A table's sealed column: where its key id, nonce and ciphertext are, and the
    associated data (``context``) a row's value is bound to."""

    name: str
    table: Table
    context: Callable[[Row[Any]], bytes]
    key_id: str = "key_id"
    nonce: str = "nonce"
    ciphertext: str = "ciphertext"

    def column(self, name: str) -> Column[Any]:
        return self.table.c[name]


def _secret_context(row: Row[Any]) -> bytes:
    scope = Scope(None, row.team) if row.team else Scope(row.owner, None)
    return scope.context(row.name)


def _webhook_context(row: Row[Any]) -> bytes:
    return secret_context(row.owner, row.name)


SEALED: tuple[Sealed, ...] = (
    Sealed("secrets", secrets, _secret_context),
    # webhook signing secrets (docs/notifications.md)
    Sealed(
        "subscriptions",
        subscriptions,
        _webhook_context,
        key_id="secret_key_id",
        nonce="secret_nonce",
        ciphertext="secret_sealed",
    ),
)


async def counts(conn: AsyncConnection, sealed: Sealed) -> dict[str, int]:
    """How many of the column's values each key id seals (rows without one hold none)."""
    kid = sealed.column(sealed.key_id)
    rows = await conn.execute(select(kid, func.count()).where(kid.is_not(None)).group_by(kid))
    return {row[0]: int(row[1]) for row in rows}


async def under(
    conn: AsyncConnection, sealed: Sealed, kids: Sequence[str], after: int, limit: int
) -> list[Row[Any]]:
    """Up to ``limit`` rows after id ``after`` sealed with one of ``kids``, locked; rows
    another transaction holds (a value being replaced) are skipped: it seals anew."""
    table = sealed.table
    return list(
        await conn.execute(
            select(table)
            .where(sealed.column(sealed.key_id).in_(list(kids)), table.c.id > after)
            .order_by(table.c.id)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
    )


async def reseal(
    conn: AsyncConnection, sealed: Sealed, row: Row[Any], kid: str, nonce: bytes, value: bytes
) -> bool:
    """Store ``row``'s value sealed anew, unless it changed since it was read."""
    mapping = row._mapping
    key_id, old_nonce = sealed.column(sealed.key_id), sealed.column(sealed.nonce)
    done = await conn.execute(
        update(sealed.table)
        .where(
            sealed.table.c.id == mapping["id"],
            key_id == mapping[sealed.key_id],
            old_nonce == mapping[sealed.nonce],
        )
        .values({sealed.key_id: kid, sealed.nonce: nonce, sealed.ciphertext: value})
    )
    return done.rowcount == 1
