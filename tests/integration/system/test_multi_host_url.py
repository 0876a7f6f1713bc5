"""A multi-host database URL whose first host hangs (a primary that died with its host:
the connection is accepted by nobody, or never answered) costs a new connection the URL's
``connect_timeout``, not psycopg's 130 s, before the next host is tried; both through the
engine every service keeps and through a plain psycopg connection (the notifier's, the
leader elector's)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from libs.common.settings import MULTI_HOST_CONNECT_TIMEOUT_S, libpq_url, normalise_database_url


@pytest.fixture
def hung_port() -> Iterator[int]:
    """A loopback port whose connections the kernel accepts and nobody ever answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


async def _through_engine(url: str) -> int:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return int((await conn.execute(text("SELECT inet_server_port()"))).scalar_one())
    finally:
        await engine.dispose()


async def _through_psycopg(url: str) -> int:
    async with await psycopg.AsyncConnection.connect(libpq_url(url)) as plain:
        row = await (await plain.execute("SELECT inet_server_port()")).fetchone()
    assert row is not None
    return int(row[0])


async def _through_both(url: str) -> list[int]:
    return list(await asyncio.gather(_through_engine(url), _through_psycopg(url)))


def test_a_hung_first_host_costs_the_connect_timeout(db_url: str, hung_port: int) -> None:
    live = db_url.split("@", 1)[1].split("/", 1)[0]  # 127.0.0.1:PORT
    given = (
        db_url.replace(live, f"127.0.0.1:{hung_port},{live}") + "?target_session_attrs=read-write"
    )
    url = normalise_database_url(given)
    started = time.monotonic()
    ports = asyncio.run(_through_both(url))
    took = time.monotonic() - started
    assert ports == [int(live.split(":")[1])] * 2
    assert took < MULTI_HOST_CONNECT_TIMEOUT_S + 5, took
