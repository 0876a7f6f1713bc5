"""An agent asks core before it starts an attempt: a lease the reaper took back between
the claim and the start is refused (409), so the agent never runs it beside its retry."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from tests.support import Core, register_worker, spec, wait_for

DB = psycopg.Connection[tuple[Any, ...]]


pytestmark = pytest.mark.core(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)


def test_a_lease_lost_before_its_start_is_refused_and_a_held_one_is_confirmed(
    core: Core, db: DB
) -> None:
    with core.client("alice") as alice, core.client("w", "worker") as http:
        first, second = (alice.post("/v1/tasks", json=spec()).json()["id"] for _ in range(2))
        offer = {"hostname": "w", "queues": ["default"], "cpu": 4, "memory_mb": 4096}
        worker = register_worker(http, offer)
        room = {"cpu": 4, "memory_mb": 4096, "max": 2, "wait": 5}
        leased = http.post(f"/v1/workers/{worker}/claim", json=room).json()["attempts"]
        by_task = {a["task_id"]: a["attempt_id"] for a in leased}
        assert set(by_task) == {first, second}
        held = http.post(f"/v1/workers/{worker}/attempts/{by_task[first]}/start")
        assert held.status_code == 200, held.text
        assert held.json() == {"task_id": first, "state": "running"}
        # The worker goes silent before it starts the second: the reaper takes it back.
        wait_for(
            lambda: (
                db.execute("SELECT state FROM core.tasks WHERE id = %s", (second,)).fetchone()
                == ("waiting",)
            ),
            timeout=15,
        )
        late = http.post(f"/v1/workers/{worker}/attempts/{by_task[second]}/start")
        assert late.status_code == 409, late.text
        assert late.json()["type"].endswith("stale-attempt")
    seen = db.execute("SELECT id, seen_at IS NOT NULL FROM core.attempts ORDER BY id").fetchall()
    assert dict(seen) == {by_task[first]: True, by_task[second]: False}
