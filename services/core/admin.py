"""Operator actions run outside the API (from the `cairn` command): tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

from services.core import store
from services.core.store import Principal

T = TypeVar("T")


def _in_transaction(database_url: str, work: Callable[[AsyncConnection], Awaitable[T]]) -> T:
    async def run() -> T:
        engine = create_async_engine(database_url)
        try:
            async with engine.begin() as conn:
                return await work(conn)
        finally:
            await engine.dispose()

    return asyncio.run(run())


def create_token(database_url: str, name: str, role: str, token: str | None = None) -> str:
    """Create the principal if new, and a token for it (fresh, or ``token`` as given);
    return the token."""
    return _in_transaction(database_url, lambda conn: store.create_token(conn, name, role, token))


def principal_for(database_url: str, token: str) -> Principal | None:
    return _in_transaction(database_url, lambda conn: store.principal_for_token(conn, token))


def revoke_tokens(database_url: str, name: str) -> int:
    return _in_transaction(database_url, lambda conn: store.revoke_tokens(conn, name))
