"""Alembic, the same way for every service: each service keeps its migrations beside its
code, its tables in a schema of its own, and its version table in that schema.

No statement of a migration waits longer than ``migration_lock_timeout_s`` for a lock: a
migration asking for an ACCESS EXCLUSIVE lock on a hot table behind one long transaction
would otherwise queue every later query on that table behind its request, and the service
would stop serving until that transaction ended. A run that times out rolls back the
migration it was in (one transaction per migration: the version table stays at the last
one completed), logs the sessions that blocked it, and tries again after a backoff.

An index built ``CONCURRENTLY`` is the exception: it takes a lock that blocks no read or
write, then waits for every transaction older than it to end (a report running for
minutes, on any table). That wait stalls nobody, so it has a bound of its own,
``migration_index_wait_s`` (long), and logs whom it waits for while it waits."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from alembic import command, context, op
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, MetaData, create_engine, text
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.pool import NullPool

from libs.common import locks
from libs.common.database import connect_timeout, keepalive
from libs.common.settings import MigrationSettings, database_hosts, libpq_url

log = logging.getLogger("cairn.migrations")

# Replicas starting together take turns; the loser then finds nothing to do. One key for
# every service: migrations are rare and short, so they may as well queue.
_LOCK_KEY = locks.MIGRATIONS
#: SQLSTATE of a lock wait cut short by lock_timeout (psycopg's LockNotAvailable)
_LOCK_NOT_AVAILABLE = "55P03"
_QUERY_CHARS = 100
_BACKOFF_CAP_S = 60.0
_MAX_BLOCKERS = 20
#: how often a concurrent build logs again a transaction it still waits for
_TELL_EVERY_S = 30.0
_CLIENT_CHECK = "1s"
#: SQLSTATE of a setting's value refused (a client check where the platform has none)
_INVALID_PARAMETER_VALUE = "22023"
#: set once the refusal of the client check was logged: once a process
_told_no_client_check = threading.Event()
_TURN_POLL_S = 0.2
_QUERY_CANCELED = "57014"
#: too many connections, and the server shutting down (admin, crash) or starting
_SERVER_GONE = frozenset({"53300", "57P01", "57P02", "57P03"})
#: A role's or database's timeouts, which would cut a migration short: its waits have
#: bounds of their own (the lock timeout, the index wait), an index build on a big table
#: runs long, its transaction sits idle while Python works between statements, and a run
#: waiting its turn sits idle between asks. Each is set to 0 where the server knows it.
_UNBOUNDED = (
    "SELECT set_config(name, '0', false) FROM unnest(CAST('{statement_timeout,"
    "idle_in_transaction_session_timeout,idle_session_timeout,transaction_timeout}'"
    " AS text[])) AS name WHERE current_setting(name, true) IS NOT NULL"
)


@dataclass(frozen=True)
class Blocker:
    """A session a migration's lock request waited behind."""

    pid: int
    application: str
    state: str
    xact_age_s: float | None
    #: when its current (or last) query started, UTC
    query_start: str | None
    query: str

    def __str__(self) -> str:
        app = f" {self.application!r}" if self.application else ""
        age = "no transaction" if self.xact_age_s is None else f"xact {self.xact_age_s:.1f} s"
        since = f", query started {self.query_start}" if self.query_start else ""
        return f"pid {self.pid}{app} ({self.state}, {age}{since}): {self.query!r}"


class MigrationFailed(RuntimeError):
    """A run that stopped for a reason its message tells in one line, for a person: the
    commands and services that migrate print it and exit 1, without a traceback."""


class ServerLost(MigrationFailed):
    """The database server refused the migration's connection, could not be reached, or
    was lost during the run (an ``OperationalError`` whose SQLSTATE ``_server_lost``
    names); the message names the server (its hosts and ports, never the URL's password)
    and the error."""


class MigrationBlocked(MigrationFailed):
    """A migration's statement waited longer than its bound for a lock; ``setting``
    names that bound's environment variable, and ``retry`` says whether another try
    may do better (not after an index build's long wait)."""

    def __init__(
        self, message: str, blockers: list[Blocker], setting: str, *, retry: bool = True
    ) -> None:
        super().__init__(message)
        self.blockers, self.setting, self.retry = blockers, setting, retry


def describe(blockers: list[Blocker]) -> str:
    return "; ".join(map(str, blockers)) if blockers else "none seen (they ended in between)"


def alembic_config(
    script_location: Path, database_url: str, settings: MigrationSettings | None = None
) -> Config:
    config = Config()
    config.set_main_option("script_location", str(script_location))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    settings = settings or MigrationSettings()
    config.attributes["lock_timeout_s"] = settings.migration_lock_timeout_s
    config.attributes["index_wait_s"] = settings.migration_index_wait_s
    return config


def upgrade(
    script_location: Path, database_url: str, settings: MigrationSettings | None = None
) -> None:
    """Bring the schema whose migrations live at ``script_location`` to the newest,
    trying again (``migration_lock_attempts`` in all) while a lock is not to be had;
    ``MigrationBlocked`` when it gives up, its message what to do."""
    settings = settings or MigrationSettings()
    attempts = settings.migration_lock_attempts
    for attempt in range(1, attempts + 1):
        try:
            command.upgrade(alembic_config(script_location, database_url, settings), "head")
            return
        except MigrationBlocked as blocked:
            if attempt == attempts or not blocked.retry:
                tries = "1 attempt" if attempt == 1 else f"{attempt} attempts"
                raise MigrationBlocked(
                    f"migrations of {script_location.parent.name} gave up after {tries}:"
                    f" {blocked}; end those sessions (SELECT pg_terminate_backend(pid)) or"
                    f" let them finish, or raise {blocked.setting}"
                    f"{'' if not blocked.retry else ' or CAIRN_MIGRATION_LOCK_ATTEMPTS'},"
                    " then try again",
                    blocked.blockers,
                    blocked.setting,
                    retry=False,
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
        except (OperationalError, psycopg.OperationalError) as error:
            raise _stopped(error, script_location, database_url) from error


def _stopped(error: Exception, script_location: Path, database_url: str) -> MigrationFailed:
    """A run's ``OperationalError`` as what to tell the operator; raised again as it is
    when it is a statement's own (55000, 54000, 40P01...: a traceback)."""
    orig = getattr(error, "orig", None) or error
    sqlstate = getattr(orig, "sqlstate", None)
    if not (_server_lost(sqlstate) or sqlstate == _QUERY_CANCELED):
        raise error
    reason = " ".join(str(orig).split())
    name, servers = script_location.parent.name, _servers(database_url)
    if sqlstate == _QUERY_CANCELED:  # its timeouts are 0: pg_cancel_backend
        return MigrationFailed(
            f"migrations of {name} stopped: their statement was cancelled on the"
            f" database server at {servers} ({reason}); try again"
        )
    return ServerLost(f"migrations of {name} stopped: the database server at {servers}: {reason}")


def _newer(script: ScriptDirectory, current: tuple[str, ...]) -> list[str]:
    """The revisions of ``current`` that this release's migrations do not know: a newer
    release's (its migrations ran, then this older code started: a rolling upgrade, or
    the code rolled back)."""
    known = {revision.revision for revision in script.walk_revisions()}
    return [revision for revision in current if revision not in known]


def check(script_location: Path, database_url: str) -> None:
    """For a service that does not migrate on start (``CAIRN_MIGRATE_ON_START=false``):
    ``MigrationFailed`` unless its schema is at this release's newest migration or past it
    (a newer release's, which only adds: docs/deploy.md). A schema behind, or none, made
    the service start and answer ready, then fail every request and loop on
    ``UndefinedTable``."""
    script = ScriptDirectory.from_config(alembic_config(script_location, database_url))
    head, name = script.get_current_head(), script_location.parent.name
    engine = create_engine(
        database_url, poolclass=NullPool, connect_args=connect_args(database_url)
    )
    try:
        with engine.connect() as connection:
            opts = {"version_table_schema": name}
            current = MigrationContext.configure(connection, opts=opts).get_current_heads()
    except (OperationalError, psycopg.OperationalError) as error:
        raise _stopped(error, script_location, database_url) from error
    finally:
        engine.dispose()
    if head in current or _newer(script, current):
        return
    raise MigrationFailed(
        f"the database's {name} schema is at {', '.join(current) or 'no migration'}, this"
        f" release needs {head}: run its migrations first (cairn migrate, the setup job),"
        " or start it with CAIRN_MIGRATE_ON_START=true"
    )


def _server_lost(sqlstate: str | None) -> bool:
    """Whether an ``OperationalError``'s SQLSTATE says the server refused, could not be
    reached or dropped the session: none (libpq's own: refused, unreachable, closed),
    a connection exception (08), refused authorization (28), too many connections, or a
    shutdown (57P01-57P03). psycopg raises others as ``OperationalError`` too that are a
    statement's own (55000 currval before nextval, 54000, 40P01 deadlock)."""
    return sqlstate is None or sqlstate[:2] in ("08", "28") or sqlstate in _SERVER_GONE


def _servers(url: str) -> str:
    """The hosts and ports ``url`` names, as ``host:port,...`` (no user, no password)."""
    hosts = (
        f"{f'[{host}]' if ':' in host else host or 'localhost'}{f':{port}' if port else ''}"
        for host, port in database_hosts(url)
    )
    return ",".join(hosts)


def connect_args(url: str) -> dict[str, Any]:
    """libpq's parameters for the migration's connections to ``url`` (its session's and
    its watch's): keepalives (``database.keepalive``), and a connect timeout unless the URL
    sets one, so that a replica starting while the database host answers nothing (a
    vanished host, a firewall dropping its SYNs) gives up within seconds."""
    return keepalive(url) | connect_timeout(url)


class _Watch(threading.Thread):
    """Polls, on a connection of its own, the sessions the migration's session waits
    behind: once its lock wait has timed out there is none left to ask about. While an
    index is built concurrently (``building``), it also logs each, every 30 s."""

    def __init__(self, url: str, pid: int, every_s: float) -> None:
        super().__init__(name="migration-blockers", daemon=True)
        self.url, self.pid, self.every_s = url, pid, every_s
        self.seen: dict[int, Blocker] = {}
        self.building: str | None = None
        self.told: dict[int, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        try:
            # Keepalives as the session's (``run_online``): a server that vanished fails
            # this poll within seconds, and the run's wait for this thread with it.
            with psycopg.connect(self.url, autocommit=True, **connect_args(self.url)) as conn:
                conn.execute(_UNBOUNDED)
                while not self.done.wait(self.every_s):
                    for row in conn.execute(
                        "SELECT pid, coalesce(application_name, ''), coalesce(state, ''),"
                        " extract(epoch FROM now() - xact_start)::float8,"
                        " to_char(query_start AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS')"
                        " || ' UTC',"
                        " left(regexp_replace(coalesce(query, ''), '\\s+', ' ', 'g'), %s)"
                        " FROM pg_stat_activity WHERE pid = ANY(pg_blocking_pids(%s))"
                        " ORDER BY xact_start LIMIT %s",
                        (_QUERY_CHARS, self.pid, _MAX_BLOCKERS),
                    ):
                        self.seen[row[0]] = blocker = Blocker(*row)
                        self.tell(blocker)
        except Exception:  # the watch only explains a failure: the run goes on without it
            log.warning("cannot watch the migration's lock waits", exc_info=True)

    def tell(self, blocker: Blocker) -> None:
        building, now = self.building, time.monotonic()
        if building is None or now - self.told.get(blocker.pid, -_TELL_EVERY_S) < _TELL_EVERY_S:
            return
        self.told[blocker.pid] = now
        log.warning(
            "building index %s concurrently waits for an older transaction to end: %s",
            building,
            blocker,
        )

    def blockers(self) -> list[Blocker]:
        return list(self.seen.values())[:_MAX_BLOCKERS]


def _attribute(name: str) -> float:
    """A bound ``alembic_config`` set (``lock_timeout_s``, ``index_wait_s``), else its
    default: a config made elsewhere (a test's) has none."""
    default = getattr(MigrationSettings(), f"migration_{name}")
    return float(context.config.attributes.get(name, default))


def _lock_timeout(seconds: float) -> str:
    return f"SET lock_timeout = '{max(1, round(seconds * 1000))}ms'"


def _lock_timed_out(error: DBAPIError) -> bool:
    return getattr(error.orig, "sqlstate", None) == _LOCK_NOT_AVAILABLE


def run_online(schema: str, metadata: MetaData) -> None:
    """The body of a service's ``env.py``: migrate ``schema`` under an advisory lock, each
    migration in a transaction of its own, no statement waiting longer than the lock
    timeout for a lock (``MigrationBlocked`` when one does)."""
    url = context.config.get_main_option("sqlalchemy.url")
    assert url, "sqlalchemy.url must be set"
    timeout_s = _attribute("lock_timeout_s")
    # No pool: closing the connection ends its session, so a migration that fails still
    # lets the lock go (a pooled connection kept it, and the next upgrade in this process
    # waited on it for ever). Keepalives on both ends, as a leader's lock session: a run
    # cut off without a word (its host lost power) holds the lock, and every other
    # replica's start behind it, only seconds, not the kernel's two hours
    # (client_connection_check_interval sees only a FIN). And a connect timeout
    # (``connect_args``).
    engine = create_engine(url, poolclass=NullPool, connect_args=connect_args(url))
    with engine.connect() as connection:
        connection.execute(text(_UNBOUNDED))  # kept: _take_turn commits (or we do, below)
        # The advisory lock waits as long as another replica's run takes; only then the
        # session's statements get their bound.
        _take_turn(connection)
        connection.execute(text(f"CREATE SCHEMA IF NOT EXISTS {schema}"))
        connection.execute(text(_lock_timeout(timeout_s)))
        _end_with_client(connection)
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
        newer = _newer(
            ScriptDirectory.from_config(context.config), context.get_context().get_current_heads()
        )
        if newer:
            # Alembic failed with "Can't locate revision" (a traceback), so an older
            # replica could not start again beside the newer schema it works with.
            log.warning(
                "the %s schema is at %s, a newer release's migration: this release's"
                " migrations are there already, nothing to do",
                schema,
                ", ".join(newer),
            )
            connection.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _LOCK_KEY})
            connection.commit()
            engine.dispose()
            return
        watch = _Watch(libpq_url(url), pid, min(max(timeout_s / 5, 0.01), 1.0))
        context.config.attributes["watch"] = watch
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
                "CAIRN_MIGRATION_LOCK_TIMEOUT_S",
            ) from error
        finally:
            watch.done.set()
            watch.join()
        connection.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _LOCK_KEY})
        connection.commit()
    engine.dispose()


def _take_turn(connection: Connection) -> None:
    """The migrations' advisory lock, asked for again every so often outside any
    transaction: a session waiting in ``pg_advisory_lock`` holds a snapshot, which the
    other run's index build (holding the lock) waits for, a deadlock PostgreSQL breaks
    by failing one of the runs. The transaction of the try that got it is left open."""
    told = False
    while not connection.execute(
        text("SELECT pg_try_advisory_lock(:k)"), {"k": _LOCK_KEY}
    ).scalar_one():
        connection.commit()
        if not told:
            log.info("another run is migrating: this one waits its turn")
            told = True
        time.sleep(_TURN_POLL_S)


def _end_with_client(connection: Connection) -> None:
    """A session whose client is gone (a run killed while an index build waits) notices
    within a second and ends, letting the advisory lock go, instead of waiting on for
    up to the index wait (PostgreSQL 14 and later; on Linux)."""
    known = connection.execute(
        text("SELECT current_setting('client_connection_check_interval', true)")
    ).scalar()
    if known is None:
        return
    try:
        with connection.begin_nested():  # a refusal rolls back this alone
            connection.execute(text(f"SET client_connection_check_interval = '{_CLIENT_CHECK}'"))
    except DBAPIError as error:
        # PostgreSQL without POLLRDHUP (macOS, Windows) refuses any value but 0
        if getattr(error.orig, "sqlstate", None) != _INVALID_PARAMETER_VALUE:
            raise
        if not _told_no_client_check.is_set():
            _told_no_client_check.set()
            log.info(
                "client_connection_check_interval refused (%s): the migrations' check that"
                " their client is still there is off, so a run killed while an index build"
                " waits leaves its session waiting up to CAIRN_MIGRATION_INDEX_WAIT_S",
                str(error.orig).strip().replace("\n", " "),
            )


def create_index_concurrently(schema: str, name: str, statement: str) -> None:
    """``statement`` (a ``CREATE [UNIQUE] INDEX CONCURRENTLY IF NOT EXISTS name ...``),
    in a migration's autocommit block, waiting up to ``migration_index_wait_s`` (not the
    short lock timeout) for each older transaction; safe to run again: a build cut short
    (that bound, a cancel, a killed process) leaves an INVALID index of that name, which
    IF NOT EXISTS would keep for good; it is dropped first."""
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
    with _waiting_long(f"{schema}.{name}"):
        if invalid:
            log.warning("dropping %s.%s, an invalid index left by a build cut short", schema, name)
            op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {schema}.{name}")
        op.execute(statement)


@contextmanager
def _waiting_long(index: str) -> Iterator[None]:
    """The statements inside (each a transaction of its own, taking no lock that blocks a
    read or a write) wait up to the index wait for each lock, the watch telling whom for;
    the short lock timeout is back after."""
    wait_s = _attribute("index_wait_s")
    watch: _Watch | None = context.config.attributes.get("watch")
    op.execute(_lock_timeout(wait_s))
    if watch is not None:
        watch.building = index
    try:
        yield
    except DBAPIError as error:
        if not _lock_timed_out(error):
            raise
        blockers = watch.blockers() if watch is not None else []
        raise MigrationBlocked(
            f"building index {index} concurrently waited over {wait_s:g} s for an older"
            f" transaction to end; blocked by {describe(blockers)}",
            blockers,
            "CAIRN_MIGRATION_INDEX_WAIT_S",
            retry=False,
        ) from error
    finally:
        if watch is not None:
            watch.building = None
        op.execute(_lock_timeout(_attribute("lock_timeout_s")))
