"""Moving every sealed value to the newest secrets key (docs/security.md, "Rotating the
secrets key"), so that an old or leaked key can be removed.

Each batch is one transaction: its rows are locked, opened with their old key, sealed
with the current one and written back, with one audit row. A value is under one key or the
other at every instant, and both are configured meanwhile, so nothing is ever unreadable;
a value being replaced meanwhile is skipped (its new value is sealed with the current key
anyway). Running it again visits only what is left: it is idempotent."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from libs.common.errors import InvalidInput
from libs.common.models import KeyStatus, RekeyResult, SealedCount
from services.core.db import sealed as db
from services.core.identity.crypto import SecretBox, Unreadable

#: values re-sealed in one transaction
BATCH = 100

# (conn, action, target, before, after): deps.Auditor, the caller's audit rows
Record = Callable[
    [AsyncConnection, str, str, dict[str, Any] | None, dict[str, Any] | None], Awaitable[None]
]


@dataclass
class _Tally:
    visited: int = 0
    rekeyed: int = 0
    unreadable: int = 0


async def rekey(
    engine: AsyncEngine, box: SecretBox, record: Record, limit: int, after: str | None = None
) -> RekeyResult:
    """Seal anew under ``box.current`` up to ``limit`` values that another configured key
    seals, column after column of ``db.SEALED``, going on from ``after`` (an earlier
    answer's ``next``): values that do not open are passed, not visited again and again."""
    old = [kid for kid in box.key_ids if kid != box.current]
    tally = _Tally()
    columns, last = _resume(after)
    stopped: str | None = None
    for column in columns if old else ():
        while True:
            if tally.visited >= limit:
                stopped = f"{column.name}:{last}"
                break
            async with engine.begin() as conn:
                rows = await db.under(conn, column, old, last, min(BATCH, limit - tally.visited))
                if not rows:
                    break
                last = rows[-1].id
                moved = await _reseal(conn, box, column, rows, tally)
                if moved:
                    detail = {"key_id": box.current, "rekeyed": moved, "ids": [rows[0].id, last]}
                    await record(conn, "secret.rekey", f"sealed:{column.name}", None, detail)
        if stopped is not None:
            break
        last = 0
    remaining = (await status(engine, box)).remaining
    return RekeyResult(
        key_id=box.current,
        rekeyed=tally.rekeyed,
        unreadable=tally.unreadable,
        remaining=remaining,
        next=stopped,
    )


def _resume(after: str | None) -> tuple[tuple[db.Sealed, ...], int]:
    """The columns left to visit from ``after`` (``COLUMN:ID``), and the id to go on
    from in the first of them."""
    if after is None:
        return db.SEALED, 0
    name, _, last = after.partition(":")
    names = [column.name for column in db.SEALED]
    if name not in names:
        reason = f"no sealed column {name!r} (one of {', '.join(names)})"
        raise InvalidInput(
            f"body.after: {reason}", errors=[{"field": "body.after", "reason": reason}]
        )
    return db.SEALED[names.index(name) :], int(last)


async def _reseal(
    conn: AsyncConnection, box: SecretBox, column: db.Sealed, rows: list[Any], tally: _Tally
) -> int:
    moved = 0
    for row in rows:
        tally.visited += 1
        mapping = row._mapping
        context = column.context(row)
        try:
            value = box.open(
                mapping[column.key_id], mapping[column.nonce], mapping[column.ciphertext], context
            )
        except Unreadable:
            tally.unreadable += 1  # left as it is: no key here can open it
            continue
        kid, nonce, sealed = box.seal(value, context)
        moved += await db.reseal(conn, column, row, kid, nonce, sealed)
    tally.rekeyed += moved
    return moved


async def status(engine: AsyncEngine, box: SecretBox) -> KeyStatus:
    """Which keys seal how many values of each sealed column."""
    known = set(box.key_ids)
    found: list[SealedCount] = []
    async with engine.connect() as conn:
        for column in db.SEALED:
            for kid, rows in sorted((await db.counts(conn, column)).items()):
                found.append(
                    SealedCount(
                        column=column.name,
                        key_id=kid,
                        rows=rows,
                        configured=kid in known,
                        current=kid == box.current,
                    )
                )
    return KeyStatus(
        current=box.current,
        configured=list(box.key_ids),
        columns=found,
        remaining=sum(c.rows for c in found if not c.current),
    )
