"""Tokens: made, revoked, and looked up as a caller presents one (noting its use)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common.models import TokenInfo
from services.core.db import tokens
from services.core.db.audit import Auditor
from services.core.domain.principals import Principal


async def principal_for(engine: AsyncEngine, token: str) -> Principal | None:
    """Who a live token stands for; its last use is written at most once a while."""
    async with engine.begin() as conn:
        return await tokens.principal_for(conn, token)


async def create(
    engine: AsyncEngine,
    record: Auditor,
    *,
    principal: str,
    role: str | None,
    name: str,
    created_by: str,
    expires_at: datetime | None,
    most: int,
    kid: str | None = None,
) -> tuple[str, TokenInfo]:
    """A new token (its value, shown once) and what is kept of it, audited; ``kid``, the
    provider's key the creator's credential rests on, which revokes it when withdrawn."""
    async with engine.begin() as conn:
        token, info, _ = await tokens.create(
            conn,
            principal=principal,
            role=role,
            name=name,
            created_by=created_by,
            expires_at=expires_at,
            most=most,
            kid=kid,
        )
        await record(conn, "token.create", f"token:{info.id}", after=info.model_dump())
    return token, info


async def revoke(
    engine: AsyncEngine, record: Auditor, token_id: int, owner: str | None
) -> TokenInfo | None:
    """Revoke a token of ``owner``'s (None: anyone's); None when there was none to revoke."""
    async with engine.begin() as conn:
        before = await tokens.revoke(conn, token_id, owner)
        if before is not None:
            await record(conn, "token.revoke", f"token:{token_id}", before=before.model_dump())
    return before


async def revoke_of_keys(engine: AsyncEngine, kids: list[str]) -> list[int]:
    """The provider withdrew these keys: the tokens made with credentials resting on
    them (a JWT, a session, a token one of those made) are revoked; their ids."""
    async with engine.begin() as conn:
        return await tokens.revoke_of_keys(conn, kids)
