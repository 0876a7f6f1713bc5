"""The database restarts under the cron service: the leader loses its lock connection,
steps down, takes the lead again when PostgreSQL is back, and every slot fires once."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest

from libs.common.embedded import EmbeddedPostgres
from libs.common.settings import libpq_url
from tests.fixtures.cron import EPOCH, FakeClock, start_cron
from tests.integration.cron.test_api import schedule
from tests.support import MIGRATIONS, start_core, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def own_pg() -> Iterator[EmbeddedPostgres]:
    root = Path(tempfile.mkdtemp(prefix="cairn-cron-fault-"))
    server = EmbeddedPostgres(root / "pg", fast=True)
    server.start()
    yield server
    server.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_a_database_restart_costs_no_fire_and_doubles_none(
    own_pg: EmbeddedPostgres, tmp_path: Path
) -> None:
    url = own_pg.url
    for upgrade in MIGRATIONS:
        upgrade(url)
    core = start_core(url, tmp_path / "core")
    clock = FakeClock(EPOCH)
    cron = start_cron(core, tmp_path / "cron", clock)
    try:
        wait_for(lambda: cron.engine.leader)
        with cron.client() as alice:
            made = alice.post(
                "/v1/schedules", json=schedule(expression="* * * * *", timezone="UTC")
            )
            assert made.status_code == 201, made.text
        start = EPOCH.replace(second=0)
        clock.set(start + timedelta(minutes=1))

        def fired() -> list[tuple[object, str]]:
            with psycopg.connect(libpq_url(url)) as conn:
                return conn.execute(
                    "SELECT fire_time, outcome FROM cron.fires ORDER BY fire_time"
                ).fetchall()

        wait_for(lambda: [o for _, o in fired()] == ["submitted"], timeout=20)
        own_pg.stop()
        wait_for(lambda: not cron.engine.leader, timeout=10)
        own_pg.start()
        wait_for(lambda: cron.engine.leader, timeout=30)
        clock.set(start + timedelta(minutes=2))
        wait_for(lambda: [o for _, o in fired()] == ["submitted", "submitted"], timeout=30)
        with psycopg.connect(libpq_url(url)) as conn:
            keys = conn.execute(
                "SELECT idempotency_key, count(*) FROM core.tasks GROUP BY 1 ORDER BY 1"
            ).fetchall()
        assert [n for _, n in keys] == [1, 1]
    finally:
        cron.stop()
        core.stop()
