"""Alembic, the same way for every service: each service keeps its migrations beside its
code, its tables in a schema of its own, and its version table in that schema.

No statement of a migration waits longer than ``migration_lock_timeout_s`` for a lock: a
migration asking for an ACCESS EXCLUSIVE lock on a hot table behind one long transaction
would otherwise queue every later query on that table behind its request, and the service
would stop serving until that transaction ended. A run that times out rolls back the
migration it was in (one transaction per migration: the version table stays at the last
one completed), logs the sessions that blocked it, and tries again after a backoff."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg
from alembic import command, context, op
from alembic.config import Config
from sqlalchemy import MetaData, create_engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from libs.common import locks
from libs.common.settings import MigrationSettings, libpq_url

log = logging.getLogger("cairn.migrations")

# Replicas starting together take turns; the loser then finds nothing to do. One key for
# every service: migrations are rare and short, so they may as well queue.
_LOCK_KEY = locks.MIGRATIONS
#: SQLSTATE of a lock wait cut short by lock_timeout (psycopg's LockNotAvailable)
_LOCK_NOT_AVAILABLE = "55P03"
_QUERY_CHARS = 100
_BACKOFF_CAP_S = 60.0
_MAX_BLOCKERS = 20


@dataclass(frozen=True)
class Blocker:
    """A session a migration's lock request waited behind."""

    pid: int
    state: str
    xact_age_s: float | None
    query: str

    def __str__(self) -> str:
        age = "no transaction" if self.xact_age_s is None else f"xact {self.xact_age_s:.1f} s"
        return f"pid {self.pid} ({self.state}, {age}): {self.query!r}"


class MigrationBlocked(RuntimeError):
    """A migration's statement waited longer than the lock timeout for a lock."""

    def __init__(self, message: str, blockers: list[Blocker]) -> None:
        super().__init__(message)
        self.blockers = blockers


def describe(blockers: list[Blocker]) -> str:
    return "; ".join(map(str, blockers)) if blockers else "none seen (they ended in between)"


def alembic_config(
    script_location: Path, database_url: str, settings: MigrationSettings | None = None
) -> Config:
    config = Config()
    config.set_main_option("script_location", str(script_location))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    config.attributes["lock_timeout_s"] = (settings or MigrationSettings()).migration_lock_timeout_s
    return config


def upgrade(
    script_location: Path, database_url: str, settings: MigrationSettings | None = None
) -> None:
    """Bring the schema whose migrations live at ``script_location`` to the newest,
    trying again (``migration_lock_attempts`` in all) while a lock is not to be had."""
    settings = settings or MigrationSettings()
    attempts = settings.migration_lock_attempts
    for attempt in range(1, attempts + 1):
        try:
            command.upgrade(alembic_config(script_location, database_url, settings), "head")
            return
        except MigrationBlocked as blocked:
            if attempt == attempts:
                raise MigrationBlocked(
                    f"migrations of {script_location.parent.name} gave up after {attempts}"
                    f" attempts: {blocked}; end those sessions (pg_terminate_backend) or wait"
                    " for them, then run the migrations again",
                    blocked.blockers,
                ) from blocked
            backoff = min(settings.migration_lock_backoff_s * 2 ** (attempt - 1), _BACKOFF_CAP_S)
            log.warning(
                "migration attempt %d of %d: %s; trying again in %.1f s",
                attempt,
                attempts,
                blocked,
                backoff,
            )
            time.sleep(backoff)


class _Watch(threading.Thread):
    """Polls, on a connection of its own, the sessions the migration's session waits
    behind: once its lock wait has timed out there is none left to ask about."""

    def __init__(self, url: str, pid: int, every_s: float) -> None:
        super().__init__(name="migration-blockers", daemon=True)
        self.url, self.pid, self.every_s = url, pid, every_s
        self.seen: dict[int, Blocker] = {}
        self.done = threading.Event()

    def run(self) -> None:
        try:
            with psycopg.connect(self.url, autocommit=True) as conn:
                while not self.done.wait(self.every_s):
                    for row in conn.execute(
                        "SELECT pid, coalesce(state, ''),"
                        " extract(epoch FROM now() - xact_start)::float8,"
                        " left(regexp_replace(coalesce(query, ''), '\\s+', ' ', 'g'), %s)"
                        " FROM pg_stat_activity WHERE pid = ANY(pg_blocking_pids(%s))"
                        " ORDER BY xact_start LIMIT %s",
                        (_QUERY_CHARS, self.pid, _MAX_BLOCKERS),
                    ):
                        self.seen[row[0]] = Blocker(*row)
        except Exception:  # the watch only explains a failure: the run goes on without it
            log.warning("cannot watch the migration's lock waits", exc_info=True)

    def blockers(self) -> list[Blocker]:
        return list(self.seen.values())[:_MAX_BLOCKERS]


def _lock_timed_out(error: DBAPIError) -> bool:
    return getattr(error.orig, "sqlstate", None) == _LOCK_NOT_AVAILABLE


def run_online(schema: str, metadata: MetaData) -> None:
    """The body of a service's ``env.py``: migrate ``schema`` under an advisory lock, each
    migration in a transaction of its own, no statement waiting longer than the lock
    timeout for a lock (``MigrationBlocked`` when one does)."""
    url = context.config.get_main_option("sqlalchemy.url")
    assert url, "sqlalchemy.url must be set"
    timeout_s = float(
        context.config.attributes.get(
            "lock_timeout_s", MigrationSettings().migration_lock_timeout_s
        )
    )
    # No pool: closing the connection ends its session, so a migration that fails still
    # lets the lock go (a pooled connection kept it, and the next upgrade in this process
    # waited on it for ever).
    engine = create_engine(url, poolclass=NullPool)
    with engine.connect() as connection:
        # The advisory lock waits as long as another replica's run takes; only then the
        # session's statements get their bound.
        connection.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _LOCK_KEY})
        connection.execute(text(f"CREATE SCHEMA IF NOT EXISTS {schema}"))
        connection.execute(text(f"SET lock_timeout = '{max(1, round(timeout_s * 1000))}ms'"))
        pid = connection.execute(text("SELECT pg_backend_pid()")).scalar_one()
        connection.commit()
        context.configure(
            connection=connection,
            target_metadata=metadata,
            version_table_schema=schema,
            include_schemas=True,
            include_name=lambda name, type_, _parents: type_ != "schema" or name == schema,
            transaction_per_migration=True,
        )
        watch = _Watch(libpq_url(url), pid, min(max(timeout_s / 5, 0.01), 1.0))
        watch.start()
        try:
            with context.begin_transaction():
                context.run_migrations()
        except DBAPIError as error:
            if not _lock_timed_out(error):
                raise
            blockers = watch.blockers()
            raise MigrationBlocked(
                f"a statement waited over {timeout_s:g} s for a lock (lock_timeout) and was"
                f" rolled back; blocked by {describe(blockers)}",
                blockers,
            ) from error
        finally:
            watch.done.set()
            watch.join()
        connection.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _LOCK_KEY})
        connection.commit()
    engine.dispose()


def create_index_concurrently(schema: str, name: str, statement: str) -> None:
    """``statement`` (a ``CREATE [UNIQUE] INDEX CONCURRENTLY IF NOT EXISTS name ...``),
    in a migration's autocommit block, safe to run again: a build cut short (a lock
    timeout, a cancel) leaves an INVALID index of that name, which IF NOT EXISTS would
    keep for good; it is dropped first."""
    invalid = (
        op.get_bind()
        .execute(
            text(
                "SELECT NOT i.indisvalid FROM pg_index i"
                " JOIN pg_class c ON c.oid = i.indexrelid"
                " JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = :schema AND c.relname = :name"
            ),
            {"schema": schema, "name": name},
        )
        .scalar()
    )
    if invalid:
        log.warning("dropping %s.%s, an invalid index left by a build cut short", schema, name)
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {schema}.{name}")
    op.execute(statement)
