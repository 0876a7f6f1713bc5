"""Operator actions run outside the API (from the `cairn` command): tokens made straight
in the database, for the first admin and for a deployment's own service tokens. Each is
audited as the operator's."""

from __future__ import annotations

import asyncio
import getpass
from collections.abc import Awaitable, Callable
from typing import TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

from libs.common.auth import Caller
from services.core.db import audit, tokens
from services.core.domain.principals import Principal

T = TypeVar("T")


def _operator() -> Caller:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return Caller(name=f"operator:{user}", role="operator")


def _in_transaction(database_url: str, work: Callable[[AsyncConnection], Awaitable[T]]) -> T:
    async def run() -> T:
        engine = create_async_engine(database_url)
        try:
            async with engine.begin() as conn:
                return await work(conn)
        finally:
            await engine.dispose()

    return asyncio.run(run())


def create_token(
    database_url: str, name: str, role: str, token: str | None = None, label: str = "cli"
) -> str:
    """Create the principal if new, and a token for it (fresh, or ``token`` as given);
    return the token. ``CairnError`` if the role or the token clash with what exists."""

    async def work(conn: AsyncConnection) -> str:
        operator = _operator()
        made, info, created = await tokens.create(
            conn, principal=name, role=role, name=label, created_by=operator.name, token=token
        )
        if created:
            await audit.record(
                conn, operator, "token.create", f"token:{info.id}", after=info.model_dump()
            )
        return made

    return _in_transaction(database_url, work)


def principal_for(database_url: str, token: str) -> Principal | None:
    return _in_transaction(database_url, lambda conn: tokens.principal_for(conn, token))


def revoke_tokens(database_url: str, name: str) -> int:
    async def work(conn: AsyncConnection) -> int:
        gone = await tokens.revoke_all(conn, name)
        if gone:
            await audit.record(
                conn, _operator(), "token.revoke", f"principal:{name}", after={"revoked": gone}
            )
        return gone

    return _in_transaction(database_url, work)
