"""The shared leader elector (libs/common/leader.py): a killed lock session ends the lead
within a turn, and the old leader's writes are fenced by the new epoch."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from libs.common.leader import Elector, LeadershipLost
from libs.common.locks import CORE_LEADER
from services.core.loops import Leadership
from services.dag.engine import _LEADER_KEY as DAG_KEY
from tests.fixtures.dag import start_dag
from tests.integration.system.test_metrics import scrape, value
from tests.support import Core, wait_for

DB = psycopg.Connection[tuple[Any, ...]]


def _holders(db: DB, key: int) -> list[int]:
    rows = db.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objid = %s"
        " AND objsubid = 1 AND database = (SELECT oid FROM pg_database"
        " WHERE datname = current_database())",
        (key,),
    ).fetchall()
    return [pid for (pid,) in rows]


def test_a_new_epoch_fences_the_old_leaders_writes(db_url: str, db: DB) -> None:
    async def scenario() -> None:
        engine = create_async_engine(db_url)
        first = Elector(db_url, name="dag", key=DAG_KEY, table="dag.leader", poll_s=0.05)
        second = Elector(db_url, name="dag", key=DAG_KEY, table="dag.leader", poll_s=0.05)
        old = await first.campaign()
        await old.check()
        contender = asyncio.create_task(second.campaign())
        await asyncio.sleep(0.2)
        assert not contender.done()  # one leader at a time
        (pid,) = _holders(db, DAG_KEY)
        db.execute("SELECT pg_terminate_backend(%s)", (pid,))
        new = await asyncio.wait_for(contender, 10)
        assert new.epoch == old.epoch + 1
        with pytest.raises(LeadershipLost):
            await old.check()
        async with engine.begin() as conn:
            with pytest.raises(LeadershipLost):
                await old.fence(conn)
        async with engine.begin() as conn:
            await new.fence(conn)
            await new.check()
        await new.close()
        await old.close()
        await engine.dispose()

    asyncio.run(scenario())


def test_a_fence_not_durable_makes_its_own_transactions_commit_asynchronous(db_url: str) -> None:
    """``fence(durable=False)`` (the DAG loop's feed writes) turns ``synchronous_commit``
    off for that transaction alone; the session's next transaction waits for its flush."""

    async def scenario() -> None:
        engine = create_async_engine(db_url)
        elector = Elector(db_url, name="dag", key=DAG_KEY, table="dag.leader", poll_s=0.05)
        lease = await elector.campaign()
        show = text("SHOW synchronous_commit")
        async with engine.connect() as conn:
            await conn.execute(text("SET synchronous_commit = on"))
            await conn.commit()
            async with conn.begin():
                await lease.fence(conn, durable=False)
                assert await conn.scalar(show) == "off"
            async with conn.begin():
                assert await conn.scalar(show) == "on"
                await lease.fence(conn)
                assert await conn.scalar(show) == "on"
        await lease.close()
        await engine.dispose()

    asyncio.run(scenario())


def test_a_dag_replica_whose_lock_session_is_killed_stops_leading(
    core: Core, db: DB, tmp_path: Path
) -> None:
    a = start_dag(core, tmp_path / "a")
    b = start_dag(core, tmp_path / "b")
    try:

        def leaders() -> list[float]:
            return [value(scrape(s.url), "cairn_dag_leader") for s in (a, b)]

        wait_for(lambda: sum(leaders()) == 1 and len(_holders(db, DAG_KEY)) == 1, timeout=20)
        (pid,) = _holders(db, DAG_KEY)
        db.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_for(lambda: _holders(db, DAG_KEY) not in ([], [pid]), timeout=20)
        # Whoever holds the lock now, only one replica believes it leads.
        wait_for(lambda: leaders().count(1.0) == 1, timeout=20)
        epoch = db.execute("SELECT epoch FROM dag.leader WHERE name = 'dag'").fetchone()
        assert epoch is not None and epoch[0] == 2
    finally:
        a.stop()
        b.stop()


def test_a_core_singleton_loop_that_ends_fails_the_lead_and_every_loop_starts_again(
    db_url: str, db: DB
) -> None:
    """A loop of core's leader that ended (here by a stray ``CancelledError``) steps the
    replica down: the lead is won again under a new epoch with every loop started again,
    where before the replica led on without that loop."""
    leads: list[list[asyncio.Task[None]]] = []

    async def ends() -> None:
        await asyncio.sleep(0.05)
        raise asyncio.CancelledError

    def singletons() -> list[asyncio.Task[None]]:
        tasks = [asyncio.create_task(asyncio.sleep(3600), name="cairn-steady")]
        if not leads:
            tasks.append(asyncio.create_task(ends(), name="cairn-fragile"))
        leads.append(tasks)
        return tasks

    async def scenario() -> list[tuple[Any, ...]]:
        elector = Elector(db_url, name="core", key=CORE_LEADER, table="core.leader", poll_s=0.05)
        leadership = Leadership(elector, singletons, check_s=0.05)
        runner = asyncio.create_task(leadership.run())
        for _ in range(1000):
            if len(leads) == 2 and leadership.leading:
                break
            await asyncio.sleep(0.01)
        epochs = db.execute("SELECT epoch FROM core.leader WHERE name = 'core'").fetchall()
        assert all(task.done() for task in leads[0])
        assert not any(task.done() for task in leads[1])
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
        return epochs

    (epoch,) = asyncio.run(scenario())
    assert epoch == (2,)  # won twice: the lead failed once and was won again
