"""A deferred task's deferral ends when it moves on: after it fails it waits out its own
retry backoff, and every event names the state the task really left."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import psycopg
from sqlalchemy.ext.asyncio import create_async_engine

from services.core.db import placement
from tests.support import Core, register_worker, spec, wait_for

DB = psycopg.Connection[tuple[Any, ...]]


def _state(db: DB, task_id: int) -> tuple[str, bool]:
    row = db.execute("SELECT state, deferred FROM core.tasks WHERE id = %s", (task_id,)).fetchone()
    assert row is not None
    return row[0], row[1]


def _pass(db_url: str) -> None:
    async def once() -> None:
        engine = create_async_engine(db_url)
        async with engine.begin() as conn:
            await placement.defer_and_release(conn, placement.Defaults())
        await engine.dispose()

    asyncio.run(once())


def test_a_promoted_deferral_that_fails_waits_for_its_backoff(
    core: Core, db: DB, db_url: str
) -> None:
    with core.client("alice") as alice, core.client("w", "worker") as worker:
        body = spec(defer_ok=True, retry={"max_attempts": 5, "base_s": 3600, "jitter": False})
        task_id = alice.post("/v1/tasks", json=body).json()["id"]
        wait_for(lambda: _state(db, task_id)[0] == "waiting")
        # As the placement pass leaves it when its latest start has come: deferred, due now.
        db.execute(
            "UPDATE core.tasks SET state = 'ready', deferred = true, run_at = now(),"
            " version = version + 1 WHERE id = %s",
            (task_id,),
        )
        db.execute(
            "INSERT INTO core.task_events (task_id, seq, owner, op, from_state, to_state)"
            " SELECT id, version, owner, 'defer', 'waiting', 'ready' FROM core.tasks"
            " WHERE id = %s",
            (task_id,),
        )
        wait_for(lambda: _state(db, task_id)[0] == "waiting")  # the promoter's move
        assert _state(db, task_id) == ("waiting", False)
        offer = {"hostname": "w", "queues": ["default"], "cpu": 4, "memory_mb": 4096}
        wid = register_worker(worker, offer)
        room = {"cpu": 4, "memory_mb": 4096, "max": 1, "wait": 2}
        (attempt,) = worker.post(f"/v1/workers/{wid}/claim", json=room).json()["attempts"]
        path = f"/v1/workers/{wid}/attempts/{attempt['attempt_id']}/report"
        assert worker.post(path, json={"outcome": "failed", "exit_code": 1}).status_code == 200
    assert _state(db, task_id) == ("failed", False)
    _pass(db_url)
    assert _state(db, task_id) == ("failed", False)  # still waiting out its backoff
    events = db.execute(
        "SELECT from_state, to_state FROM core.task_events WHERE task_id = %s ORDER BY seq",
        (task_id,),
    ).fetchall()
    assert events[0][0] is None
    for (_, before), (after, _) in itertools.pairwise(events):
        assert after == before, events
