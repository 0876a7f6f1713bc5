"""Bearer tokens: only their SHA-256 is stored (a token is 32 random bytes, so a plain
digest is enough: there is nothing to guess). Each has a name, an optional expiry, and
the time it was last used (written at most once a minute)."""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime
from typing import Any

from sqlalchemy import func, insert, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common.errors import Conflict, InvalidInput, NotFound
from libs.common.models import TokenInfo
from services.core.db.tables import principals, tokens
from services.core.domain.principals import ROLES, Principal

PREFIX = "cairn_"
LAST_USED_EVERY_S = 60

_INFO = (
    tokens.c.id,
    tokens.c.name,
    principals.c.name.label("principal"),
    principals.c.role,
    tokens.c.created_at,
    tokens.c.created_by,
    tokens.c.expires_at,
    tokens.c.last_used_at,
    tokens.c.revoked_at,
)

_LOOKUP = text("""
SELECT p.id, p.name, p.role, t.id AS token_id, t.expires_at, t.kid,
       t.last_used_at IS NULL
           OR t.last_used_at < now() - make_interval(secs => :every) AS stale,
       ARRAY(SELECT m.team FROM core.team_members m WHERE m.member = p.name
             ORDER BY m.team) AS teams
FROM core.tokens t JOIN core.principals p ON p.id = t.principal_id
WHERE t.token_hash = :hash AND t.revoked_at IS NULL
  AND (t.expires_at IS NULL OR t.expires_at > now())
""")


def hash_token(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _info(row: Any) -> TokenInfo:
    return TokenInfo.model_validate(row._mapping)


async def _principal_row(conn: AsyncConnection, name: str, role: str | None) -> Any:
    """The principal ``name``, made with ``role`` if new; a role that differs is a 409."""
    if role is not None:
        if role not in ROLES:
            raise InvalidInput(f"role: must be one of {', '.join(ROLES)}")
        await conn.execute(
            pg_insert(principals).values(name=name, role=role).on_conflict_do_nothing()
        )
    row = (await conn.execute(select(principals).where(principals.c.name == name))).first()
    if row is None:
        raise InvalidInput(f"role: principal {name!r} does not exist yet; name its role")
    if role is not None and row.role != role:
        raise Conflict(f"principal {name!r} exists with role {row.role!r}")
    return row


async def create(
    conn: AsyncConnection,
    *,
    principal: str,
    role: str | None,
    name: str,
    created_by: str,
    expires_at: datetime | None = None,
    token: str | None = None,
    most: int = 100,
    kid: str | None = None,
) -> tuple[str, TokenInfo, bool]:
    """A token for ``principal`` (made with ``role`` if new): a fresh one, or ``token`` as
    given (a deployment's own secret; registering it again returns it unchanged, and
    False for "not created"). ``kid``: the identity provider's key the credential that
    makes it rests on, which revokes it when withdrawn (``revoke_of_keys``)."""
    row = await _principal_row(conn, principal, role)
    if token is None:
        token = PREFIX + secrets.token_urlsafe(32)
    else:
        if not 24 <= len(token) <= 200 or not token.isprintable() or " " in token:
            raise InvalidInput("token: 24 to 200 printable characters, no spaces")
        known = (
            await conn.execute(
                select(*_INFO)
                .join(principals, principals.c.id == tokens.c.principal_id)
                .where(tokens.c.token_hash == hash_token(token))
            )
        ).first()
        if known is not None:
            if known.principal != principal:
                raise Conflict(f"that token belongs to {known.principal!r} already")
            return token, _info(known), False
    live = (
        await conn.execute(
            select(func.count())
            .select_from(tokens)
            .where(tokens.c.principal_id == row.id, tokens.c.revoked_at.is_(None))
        )
    ).scalar_one()
    if live >= most:
        raise Conflict(f"{principal!r} has {live} live tokens, the most allowed; revoke some")
    new_id = (
        await conn.execute(
            insert(tokens)
            .values(
                principal_id=row.id,
                token_hash=hash_token(token),
                name=name,
                expires_at=expires_at,
                created_by=created_by,
                kid=kid,
            )
            .returning(tokens.c.id)
        )
    ).scalar_one()
    return token, await get(conn, new_id, None), True


async def principal_for(conn: AsyncConnection, token: str) -> Principal | None:
    """Who a live token stands for (with its teams), noting that it was used."""
    found = (
        await conn.execute(_LOOKUP, {"hash": hash_token(token), "every": LAST_USED_EVERY_S})
    ).first()
    if found is None:
        return None
    if found.stale:
        await conn.execute(
            update(tokens).where(tokens.c.id == found.token_id).values(last_used_at=func.now())
        )
    return Principal(
        id=found.id,
        name=found.name,
        role=found.role,
        teams=frozenset(found.teams),
        expires_at=found.expires_at,
        token_id=found.token_id,
        key_id=found.kid,
    )


async def revoke_of_keys(conn: AsyncConnection, kids: list[str]) -> list[int]:
    """Revoke the live tokens that rest on these withdrawn keys of the provider; their ids."""
    rows = await conn.execute(
        update(tokens)
        .where(tokens.c.kid.in_(kids), tokens.c.revoked_at.is_(None))
        .values(revoked_at=func.now())
        .returning(tokens.c.id)
    )
    return [int(row.id) for row in rows]


async def role_of(conn: AsyncConnection, principal: str) -> str | None:
    """The recorded role of ``principal``, or None if it has no row."""
    found = await conn.execute(select(principals.c.role).where(principals.c.name == principal))
    return found.scalar_one_or_none()


def _query(principal: str | None) -> Any:
    query = select(*_INFO).join(principals, principals.c.id == tokens.c.principal_id)
    return query if principal is None else query.where(principals.c.name == principal)


async def get(conn: AsyncConnection, token_id: int, principal: str | None) -> TokenInfo:
    row = (await conn.execute(_query(principal).where(tokens.c.id == token_id))).first()
    if row is None:
        raise NotFound(f"token {token_id} not found")
    return _info(row)


async def list_(
    conn: AsyncConnection,
    principal: str | None,
    include_revoked: bool,
    before: int | None,
    limit: int,
) -> list[TokenInfo]:
    """Newest first; ``principal`` limits it to one principal's tokens."""
    query = _query(principal).order_by(tokens.c.id.desc()).limit(limit)
    if not include_revoked:
        query = query.where(tokens.c.revoked_at.is_(None))
    if before is not None:
        query = query.where(tokens.c.id < before)
    return [_info(row) for row in await conn.execute(query)]


async def revoke(conn: AsyncConnection, token_id: int, principal: str | None) -> TokenInfo | None:
    """Revoke the token (``principal``'s only, when given): its state before, or None if
    it was revoked already. ``NotFound`` if it is not there to see."""
    before = await get(conn, token_id, principal)
    changed = await conn.execute(
        update(tokens)
        .where(tokens.c.id == token_id, tokens.c.revoked_at.is_(None))
        .values(revoked_at=func.now())
    )
    return before if changed.rowcount else None


async def revoke_all(conn: AsyncConnection, principal: str) -> int:
    ids = select(principals.c.id).where(principals.c.name == principal).scalar_subquery()
    stmt = (
        update(tokens)
        .where(tokens.c.principal_id == ids, tokens.c.revoked_at.is_(None))
        .values(revoked_at=func.now())
    )
    return int((await conn.execute(stmt)).rowcount)
