"""Whether a principal is disabled (someone who left): the one place of that rule. A
disabled name's tokens, JWTs and sessions are refused (``tokens.principal_for``,
``ops.login``), and so is what a service submits on its behalf (``refuse_disabled``);
enabling it again restores them. A name core has no row for (a person the identity
provider vouches for, who never made a token) gets one, as a user, when disabled."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from libs.common.errors import Forbidden, NotFound
from libs.common.expiring import Expiring
from libs.common.models import PrincipalInfo
from services.core.db.tables import principals

#: the condition, on ``core.principals`` as ``p``, that its principal is enabled: for
#: the queries that join it already (the token lookup)
ENABLED = "p.disabled_at IS NULL"


def enabled_name(name: str) -> str:
    """The condition that the principal named by the SQL expression ``name`` is not
    disabled (a name with no row is not): for the queries of what a principal owns."""
    return f"NOT EXISTS (SELECT 1 FROM core.principals p WHERE p.name = {name} AND NOT ({ENABLED}))"


_DISABLED_AMONG = text(f"""
SELECT p.name FROM core.principals p WHERE p.name = ANY(:names) AND NOT ({ENABLED})
""")

_INFO = (
    principals.c.name,
    principals.c.role,
    principals.c.created_at,
    principals.c.disabled_at,
    principals.c.disabled_by,
)


def _info(row: Any) -> PrincipalInfo:
    return PrincipalInfo.model_validate(row._mapping)


async def disabled_among(conn: AsyncConnection, names: Sequence[str]) -> set[str]:
    """Which of ``names`` are disabled."""
    if not names:
        return set()
    rows = await conn.execute(_DISABLED_AMONG, {"names": sorted(set(names))})
    return {row.name for row in rows}


async def is_disabled(conn: AsyncConnection, name: str) -> bool:
    return bool(await disabled_among(conn, [name]))


def disabled_problem(owner: str, field: str) -> Forbidden:
    """The 403 for work submitted for a disabled owner, naming where the owner was given."""
    reason = f"principal {owner!r} is disabled"
    return Forbidden(f"owner: {reason}", errors=[{"field": field, "reason": reason}])


async def refuse_disabled(
    conn: AsyncConnection, owners: Sequence[str], field: Callable[[int], str]
) -> None:
    """403 naming the first owner of ``owners`` that is disabled (``field(i)``: where the
    i-th was given), if any."""
    gone = await disabled_among(conn, owners)
    for i, owner in enumerate(owners):
        if owner in gone:
            raise disabled_problem(owner, field(i))


class DisabledOwners:
    """Whether owners are disabled, as this replica last read them, each answer kept for
    ``ttl_s`` (the token cache time: a name disabled through another replica is refused
    within it, as its tokens are), so that a service's submissions for the same owners (a
    cron burst, a workflow's nodes) do not each read them again: the read cost a service's
    lone submission a connection and three round trips. Disabling or enabling a name
    through this replica forgets it at once; 0 keeps nothing."""

    def __init__(
        self, ttl_s: float, size: int = 10_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._kept: Expiring[str, bool] = Expiring(ttl_s, size, clock)

    async def refuse(
        self, engine: AsyncEngine, owners: Sequence[str], field: Callable[[int], str]
    ) -> None:
        """``refuse_disabled``, reading only the owners not known lately."""
        known = {o: v for o in set(owners) if (v := self._kept.get(o)) is not None}
        missing = sorted(set(owners) - known.keys())
        if missing:
            async with engine.connect() as conn:
                gone = await disabled_among(conn, missing)
            for owner in missing:
                known[owner] = owner in gone
                self._kept.put(owner, known[owner])
        for i, owner in enumerate(owners):
            if known[owner]:
                raise disabled_problem(owner, field(i))

    def forget(self, name: str) -> None:
        self._kept.forget(name)


async def get(conn: AsyncConnection, name: str) -> PrincipalInfo:
    row = (await conn.execute(select(*_INFO).where(principals.c.name == name))).first()
    if row is None:
        raise NotFound(f"principal {name!r} not found")
    return _info(row)


async def set_disabled(
    conn: AsyncConnection, name: str, by: str | None
) -> tuple[PrincipalInfo | None, PrincipalInfo]:
    """Disable ``name`` (``by`` an admin) or, with ``by`` None, enable it: its state before
    (None: no row, made now as a user) and after. Enabling a name with no row is a 404;
    doing what is done already changes nothing (the same before and after)."""
    before: PrincipalInfo | None
    if by is not None:
        made = await conn.execute(
            pg_insert(principals)
            .values(name=name, role="user")
            .on_conflict_do_nothing()
            .returning(principals.c.id)
        )
        before = None if made.first() is not None else await get(conn, name)
        changed = principals.c.disabled_at.is_(None)
        values: dict[str, Any] = {"disabled_at": text("now()"), "disabled_by": by}
    else:
        before = await get(conn, name)
        changed = principals.c.disabled_at.is_not(None)
        values = {"disabled_at": None, "disabled_by": None}
    await conn.execute(
        update(principals).where(principals.c.name == name, changed).values(**values)
    )
    return before, await get(conn, name)
