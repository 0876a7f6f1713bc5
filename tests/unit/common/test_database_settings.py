"""The database settings: where the request pools connect (possibly a pooler), where the
sessions go that a transaction pooler cannot carry, and what a pooler rules out."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy import event

from libs.common import database, migrations
from libs.common.settings import CairnSettings

POOLER = "postgresql://cairn:pw@pgbouncer:6432/cairn"
SERVER = "postgresql://cairn:pw@postgres:5432/cairn"


@pytest.fixture(autouse=True)
def _no_database_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CAIRN_DATABASE_URL", "CAIRN_DATABASE_DIRECT_URL", "CAIRN_DATABASE_POOLER"):
        monkeypatch.delenv(name, raising=False)


def test_without_a_direct_url_every_connection_goes_to_the_one_url() -> None:
    settings = CairnSettings(database_url=SERVER)
    assert settings.direct_url("postgresql+psycopg://x/y") == "postgresql+psycopg://x/y"
    assert settings.pooler == "none"
    assert database.connect_args(settings, SERVER) == {**CLIENT_KEEPALIVE, "options": SERVER_SIDE}


def test_a_distinct_direct_url_means_a_transaction_pooler_unless_told_otherwise() -> None:
    settings = CairnSettings(database_url=POOLER, database_direct_url=SERVER)
    assert settings.direct_url(settings.database_url or "") == (
        "postgresql+psycopg://cairn:pw@postgres:5432/cairn"  # normalised as database_url
    )
    assert settings.pooler == "transaction"
    # No server-side keepalive through the pooler (it refuses the ``options`` parameter).
    assert database.connect_args(settings, POOLER) == {
        **CLIENT_KEEPALIVE,
        "prepare_threshold": None,
    }
    # PgBouncer 1.21+ with max_prepared_statements, or a session pooler: say so.
    keeps = CairnSettings(database_url=POOLER, database_direct_url=SERVER, database_pooler="none")
    assert "prepare_threshold" not in database.connect_args(keeps, POOLER)


CLIENT_KEEPALIVE = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 2,
    "tcp_user_timeout": 10000,
}
SERVER_SIDE = (
    "-c tcp_keepalives_idle=5 -c tcp_keepalives_interval=2 -c tcp_keepalives_count=2"
    " -c tcp_user_timeout=10000"
)


def test_keepalives_leave_alone_what_the_url_sets_itself() -> None:
    url = f"{SERVER}?keepalives_idle=30&options=-c%20statement_timeout%3D5s"
    args = database.keepalive(url)
    assert "keepalives_idle" not in args and "options" not in args
    assert args["keepalives_count"] == 2
    # Several hosts (a cluster that fails over), in the driver's form.
    many = "postgresql+psycopg://cairn:pw@/cairn?host=a,b&port=5432,5433"
    assert database.keepalive(many) == {**CLIENT_KEEPALIVE, "options": SERVER_SIDE}


def test_a_migration_connects_with_a_connect_timeout_unless_the_url_sets_one() -> None:
    # Its session's and its blockers' watch's: a database host that answers nothing would
    # otherwise hold each try for the kernel's two minutes (SYNs retried 6 times).
    args = migrations.connect_args(SERVER)
    assert args == {**database.keepalive(SERVER), "connect_timeout": 5}
    own = migrations.connect_args(f"{SERVER}?connect_timeout=30")
    assert "connect_timeout" not in own and own["keepalives"] == 1


def test_the_request_pools_connect_without_server_side_prepares_behind_a_pooler() -> None:
    settings = CairnSettings(database_url=POOLER, database_direct_url=SERVER)
    engine = database.pool(settings.database_url or "", settings, pool_size=3, max_overflow=0)
    seen: list[dict[str, Any]] = []

    def do_connect(_dialect: Any, _record: Any, _args: Any, params: dict[str, Any]) -> None:
        seen.append(dict(params))
        raise _Stop  # what psycopg would be given is all this test needs

    event.listen(engine.sync_engine, "do_connect", do_connect)
    with pytest.raises(_Stop):
        asyncio.run(engine.connect().start())
    assert seen[0]["prepare_threshold"] is None and seen[0]["host"] == "pgbouncer"
    assert engine.pool.size() == 3  # type: ignore[attr-defined]


class _Stop(Exception):
    pass


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"database_direct_url": SERVER}, "CAIRN_DATABASE_DIRECT_URL is set without"),
        ({"database_url": POOLER, "database_pooler": "transaction"}, "needs CAIRN_DATABASE_DIRECT"),
        (
            {
                "database_url": SERVER,
                "database_direct_url": SERVER,
                "database_pooler": "transaction",
            },
            "other than CAIRN_DATABASE_URL",
        ),
        ({"database_url": POOLER, "database_direct_url": "mysql://x/y"}, "PostgreSQL URL"),
        ({"database_url": POOLER, "database_pooler": "session"}, "database_pooler"),
    ],
)
def test_a_configuration_that_cannot_work_is_refused_with_the_reason(
    given: dict[str, str], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        CairnSettings(**given)  # type: ignore[arg-type]


def test_the_settings_are_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAIRN_DATABASE_URL", POOLER)
    monkeypatch.setenv("CAIRN_DATABASE_DIRECT_URL", SERVER)
    settings = CairnSettings()
    assert settings.database_direct_url == "postgresql+psycopg://cairn:pw@postgres:5432/cairn"
    assert settings.pooler == "transaction"
