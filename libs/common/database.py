"""The request pools' SQLAlchemy engines, made in one place for every service.

Behind a transaction pooler (``CAIRN_DATABASE_POOLER=transaction``) a connection prepares
no statement on the server: psycopg prepares one after its fifth run on a connection, and
the pooler may run the next transaction on a server connection that never saw it (PgBouncer
before 1.21 carries no prepared statements at all, later ones only with
``max_prepared_statements`` set)."""

from __future__ import annotations

from typing import Any

import psycopg
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from libs.common.settings import CairnSettings


def connect_args(settings: CairnSettings) -> dict[str, Any]:
    """psycopg's connection arguments for a pool over ``settings.database_url``."""
    return {"prepare_threshold": None} if settings.pooler == "transaction" else {}


def pool(url: str, settings: CairnSettings, **options: Any) -> AsyncEngine:
    """An engine over ``url`` (the request pools' URL), with ``options`` for its pool."""
    return create_async_engine(url, connect_args=connect_args(settings), **options)


def outage(exc: BaseException) -> str | None:
    """One line saying why, when ``exc`` is the database out of reach or every pooled
    connection taken (a restart, a failover, an overload): a loop that meets one logs
    that line and goes on, instead of a traceback on every turn until it is back. None
    for anything else (a bug, bad data), whose traceback is worth the space."""
    if isinstance(exc, PoolTimeout):
        return "no database connection free"
    if isinstance(exc, DBAPIError) and (
        exc.connection_invalidated or isinstance(exc, OperationalError)
    ):
        return f"database unavailable: {str(exc.orig).strip().splitlines()[0][:200]}"
    if isinstance(exc, psycopg.OperationalError | ConnectionError):
        return f"database unavailable: {str(exc).strip()[:200]}"
    return None
