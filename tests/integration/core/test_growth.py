"""Nothing grows without bound: gone workers and finished DAG runs are deleted after the
retention, and GET /v1/workers answers a page at a time."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy.ext.asyncio import create_async_engine

from services.core.ops import upkeep
from services.core.settings import CoreSettings
from services.dag import store as dag_store
from tests.support import Core, spec, with_engine

DB = psycopg.Connection[tuple[Any, ...]]


def _register(core: Core, n: int) -> list[int]:
    offer = {"hostname": "w", "queues": ["default"], "cpu": 4, "memory_mb": 4096}
    with core.client("w", "worker") as http:
        return [http.post("/v1/workers", json=offer).json()["worker"]["id"] for _ in range(n)]


def test_workers_gone_past_retention_are_purged_and_their_attempts_kept(
    core: Core, db: DB, tmp_path: Path
) -> None:
    old, young, live = _register(core, 3)
    with core.client("alice") as alice:
        task = alice.post("/v1/tasks", json=spec()).json()["id"]
    db.execute(
        "INSERT INTO core.attempts (task_id, number, worker_id, outcome, ended_at)"
        " VALUES (%s, 1, %s, 'lost', now())",
        (task, old),
    )
    db.execute(
        "UPDATE core.workers SET state = 'dead', gone_at = now() - interval '31 days'"
        " WHERE id = %s",
        (old,),
    )
    db.execute("UPDATE core.workers SET state = 'left', gone_at = now() WHERE id = %s", (young,))
    settings = CoreSettings(home=tmp_path, database_url=core.db_url, retention_batch=1)

    assert with_engine(core.db_url, lambda engine: upkeep.purge(engine, settings)) == 1
    assert {r[0] for r in db.execute("SELECT id FROM core.workers")} == {young, live}
    assert db.execute("SELECT worker_id FROM core.attempts").fetchall() == [(None,)]


def test_workers_are_listed_a_page_at_a_time_newest_first(core: Core) -> None:
    ids = _register(core, 5)
    with core.client("root", "admin") as admin:
        seen: list[int] = []
        params: dict[str, Any] = {"limit": 2}
        while True:
            page = admin.get("/v1/workers", params=params).json()
            assert len(page["items"]) <= 2
            seen += [w["id"] for w in page["items"]]
            if page["next_cursor"] is None:
                break
            params["cursor"] = page["next_cursor"]
        assert seen == sorted(ids, reverse=True)
        admin.post(f"/v1/workers/{ids[0]}/drain")
        draining = admin.get("/v1/workers", params={"state": "draining"}).json()["items"]
        assert [w["id"] for w in draining] == [ids[0]]
        assert admin.get("/v1/workers", params={"limit": 0}).status_code == 422


def test_finished_runs_past_retention_are_purged_with_their_nodes(db: DB, db_url: str) -> None:
    db.execute(
        "INSERT INTO dag.workflows (owner, name, version, definition, definition_hash,"
        " node_count) VALUES ('alice', 'w', 1, '{}', 'h', 1)"
    )
    for age in ("40 days", "1 day"):
        db.execute(
            "INSERT INTO dag.runs (workflow_id, owner, workflow, workflow_version, params,"
            " state, started_at, finished_at) SELECT id, 'alice', 'w', 1, '{}', 'succeeded',"
            f" now() - interval '{age}', now() - interval '{age}' FROM dag.workflows"
        )
    db.execute(
        "INSERT INTO dag.nodes (run_id, name, state, try_number)"
        " SELECT id, 'a', 'succeeded', 1 FROM dag.runs"
    )

    async def purge() -> int:
        engine = create_async_engine(db_url)
        try:
            async with engine.begin() as conn:
                return await dag_store.purge_runs(conn, 30 * 86400, 500)
        finally:
            await engine.dispose()

    assert asyncio.run(purge()) == 1
    assert db.execute("SELECT count(*) FROM dag.runs").fetchone() == (1,)
    assert db.execute("SELECT count(*) FROM dag.nodes").fetchone() == (1,)
