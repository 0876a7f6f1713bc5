"""The request pools' SQLAlchemy engines, made in one place for every service.

Behind a transaction pooler (``CAIRN_DATABASE_POOLER=transaction``) a connection prepares
no statement on the server: psycopg prepares one after its fifth run on a connection, and
the pooler may run the next transaction on a server connection that never saw it (PgBouncer
before 1.21 carries no prepared statements at all, later ones only with
``max_prepared_statements`` set)."""

from __future__ import annotations

import json
import re
from collections.abc import Generator
from typing import Any

import orjson
import psycopg
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from libs.common.settings import MULTI_HOST_CONNECT_TIMEOUT_S, CairnSettings, libpq_url

_IN_TRANSACTION = psycopg.pq.TransactionStatus.INTRANS
_IDLE = psycopg.pq.TransactionStatus.IDLE
# set on a psycopg pipeline (one ``with conn.pipeline()`` block) whose BEGIN is queued
_BEGUN = "_cairn_begun"

# A peer that vanished without a word (its host lost power, a network cut: no FIN, no RST)
# is noticed in about 5 + 2 x 2 s, on both ends, instead of the kernels' two hours:
# - by Cairn (libpq's keepalives, and ``tcp_user_timeout`` for data sent and never
#   acknowledged), so a pool or a listener waiting on a dead primary gives up and connects
#   again (to the new primary, after a failover);
# - by the server (its ``tcp_keepalives_*`` for this session, sent as startup options on
#   a direct connection), so a vanished leader's session ends and frees its advisory lock
#   for another replica, and a vanished client's open transaction releases its row locks.
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_COUNT = 2
USER_TIMEOUT_MS = 10_000
_CLIENT_KEEPALIVE: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": KEEPALIVE_IDLE_S,
    "keepalives_interval": KEEPALIVE_INTERVAL_S,
    "keepalives_count": KEEPALIVE_COUNT,
    "tcp_user_timeout": USER_TIMEOUT_MS,
}
_SERVER_KEEPALIVE = (
    f"-c tcp_keepalives_idle={KEEPALIVE_IDLE_S} -c tcp_keepalives_interval={KEEPALIVE_INTERVAL_S}"
    f" -c tcp_keepalives_count={KEEPALIVE_COUNT} -c tcp_user_timeout={USER_TIMEOUT_MS}"
)


def keepalive(url: str, direct: bool = True) -> dict[str, Any]:
    """libpq's parameters for a connection to ``url`` that notices a vanished peer (above),
    leaving alone any the URL sets itself. ``direct``: to the server itself, which then
    watches this session too (a transaction pooler refuses the ``options`` startup
    parameter; PgBouncer keeps its own server connections alive)."""
    given = psycopg.conninfo.conninfo_to_dict(libpq_url(url))
    args = {k: v for k, v in _CLIENT_KEEPALIVE.items() if k not in given}
    if direct and "options" not in given:
        args["options"] = _SERVER_KEEPALIVE
    return args


def connect_timeout(url: str) -> dict[str, Any]:
    """libpq's ``connect_timeout`` (:data:`MULTI_HOST_CONNECT_TIMEOUT_S`) for a connection
    to ``url``, unless the URL sets its own: a host that answers nothing (its SYNs dropped)
    otherwise holds each try until ``tcp_user_timeout`` (10 s) on Linux, the kernel's two
    minutes of SYN retries where there is none."""
    given = psycopg.conninfo.conninfo_to_dict(libpq_url(url))
    return {} if "connect_timeout" in given else {"connect_timeout": MULTI_HOST_CONNECT_TIMEOUT_S}


class KeepingConnection(psycopg.AsyncConnection[Any]):
    """psycopg's connection, except that a ROLLBACK of a transaction that did not fail
    keeps the statements it prepared. psycopg forgets them all at every ROLLBACK (and
    sends DEALLOCATE ALL), in case the rollback undid a change of the schema they read;
    the pools' connections change no schema (migrations have engines of their own), but
    every read of theirs ends with a ROLLBACK (SQLAlchemy closes a connection that way),
    so no statement ran five times between two of them and none was ever prepared: the
    claim's pick, for one, was planned at every look (2-6 ms of PostgreSQL's CPU,
    against 0.1-0.4 ms to run it). A transaction in error is rolled back as psycopg does,
    forgetting them: a statement whose cached plan the server refused (a table's columns
    changed under it) is prepared afresh at its next run. And a transaction whose first
    statements go in a pipeline sends its BEGIN with them (``_start_query``)."""

    def _start_query(self) -> Generator[Any, Any, None]:
        """The transaction's BEGIN, before its first statement. In a pipeline psycopg
        queues it and then syncs, a round trip of its own before the statements (one of
        a worker's turn's four, and 8 % of core's CPU a turn, with its wake-ups); here it
        goes in the pipeline's first round trip with them. The statements queued after it
        in that pipeline see the connection still idle (nothing sent yet) and would each
        queue a BEGIN of their own: the pipeline remembers that one is queued."""
        try:  # psycopg's internals, as ``rollback`` below (the dependency is >=3.2)
            pipe, idle = self._pipeline, self.pgconn.transaction_status == _IDLE
            begin = self._get_tx_start_command
        except AttributeError:  # a psycopg that moved them: begin as it does
            pipe, idle = None, False
        if pipe is None or self._autocommit or not idle:
            yield from super()._start_query()
            return
        if getattr(pipe, _BEGUN, False):
            return
        yield from self._exec_command(begin())  # queued, not sent: nothing to wait for
        setattr(pipe, _BEGUN, True)

    async def rollback(self) -> None:
        try:  # psycopg's internals, not its public API (the dependency is >=3.2)
            keep = self.pgconn.transaction_status == _IN_TRANSACTION and not (
                self._num_transactions or self._tpc or self._pipeline
            )
            lock, command = self.lock, self._exec_command
        except AttributeError:  # a psycopg that moved them: roll back as it does
            keep = False
        if not keep:
            await super().rollback()
            return
        async with lock:
            await self.wait(command(b"ROLLBACK"))


def connect_args(settings: CairnSettings, url: str = "") -> dict[str, Any]:
    """psycopg's connection arguments for a pool over ``url`` (``settings.database_url``)."""
    pooled = settings.pooler == "transaction"
    args = keepalive(url, direct=not pooled)
    return {**args, "prepare_threshold": None} if pooled else args


#: 19 digits in a row: an integer orjson may read as a float (below -2**63, above 2**64-1)
_LONG_DIGITS = re.compile(rb"[0-9]{19}")


def json_loads(data: bytes | bytearray | memoryview | str) -> Any:
    """A json or jsonb value as PostgreSQL sends it, read by orjson: a claim's rows carry
    each task's args, env and resources as jsonb, and the standard library's parser
    (psycopg's default) was 5 % of core's CPU a claimed task. orjson reads an integer
    beyond 64 bits as a float, losing its digits: a value with 19 digits in a row
    anywhere (in a number or a string) is read by the standard library, as is one orjson
    refuses."""
    raw = data.encode() if isinstance(data, str) else data
    if _LONG_DIGITS.search(raw) is None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(bytes(raw))


def pool(url: str, settings: CairnSettings, **options: Any) -> AsyncEngine:
    """An engine over ``url`` (the request pools' URL), with ``options`` for its pool."""
    args = connect_args(settings, url)
    if "prepare_threshold" not in args:  # statements are prepared: keep them (above)
        args["async_creator_fn"] = KeepingConnection.connect
    return create_async_engine(url, connect_args=args, json_deserializer=json_loads, **options)


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
