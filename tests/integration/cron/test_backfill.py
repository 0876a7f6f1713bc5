"""Backfill through real services: core, cron and a worker agent running real processes.
Each backfilled task learns its slot from ``CAIRN_CRON_SLOT``."""

from __future__ import annotations

import hashlib
import signal
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg

from tests.fixtures.cron import Cron, FakeClock
from tests.integration.cron.test_engine import create
from tests.support import Core, spawn_worker, stop_process, wait_for

Conn = psycopg.Connection[tuple[Any, ...]]
SH = Path("/bin/sh")
SH_SHA = hashlib.sha256(SH.read_bytes()).hexdigest()


def _hourly() -> dict[str, Any]:
    task = {
        "name": "hourly-report",
        "artifact": {"uri": f"file://{SH}", "sha256": SH_SHA},
        "args": ["-c", 'echo "slot=$CAIRN_CRON_SLOT backfill=$CAIRN_CRON_BACKFILL"'],
        "resources": {"cpu": 0.01, "memory_mb": 16},
    }
    return {"expression": "0 * * * *", "timezone": "UTC", "target": {"kind": "task", "task": task}}


def test_a_backfill_of_48_hourly_slots_runs_48_tasks_each_seeing_its_slot(
    core: Core, cron: Cron, clock: FakeClock, db: Conn, tmp_path: Path
) -> None:
    wait_for(lambda: cron.engine.leader)
    sid = create(cron, **_hourly())
    start = datetime(2027, 1, 2, 12, tzinfo=UTC)
    end = datetime(2027, 1, 4, 11, 30, tzinfo=UTC)  # EPOCH is 12:00:30 on the 4th
    with cron.client() as alice:
        answer = alice.post(
            f"/v1/schedules/{sid}/backfill", json={"from": start.isoformat(), "to": end.isoformat()}
        )
        assert answer.status_code == 202, answer.text
        assert answer.json() | {"first": None, "last": None} == {
            "schedule_id": sid, "slots": 48, "queued": 48, "already": 0,
            "first": None, "last": None,
        }  # fmt: skip
        # A repeat is a no-op: every slot has its fire already.
        again = alice.post(
            f"/v1/schedules/{sid}/backfill", json={"from": start.isoformat(), "to": end.isoformat()}
        ).json()
        assert (again["queued"], again["already"]) == (0, 48)
        too_many = alice.post(
            f"/v1/schedules/{sid}/backfill",
            json={"from": "2020-01-01T00:00:00Z", "to": end.isoformat()},
        )
        assert too_many.status_code == 422
        assert too_many.json()["errors"][0]["field"] == "body.to"
    # Each task's log is read below: on a loaded machine, let its end take longer than
    # the 5 s an agent waits for it by default before it reports anyway (docs/logs.md).
    worker = spawn_worker(
        core, tmp_path / "w", "w", cpu=2, memory_mb=2000, CAIRN_WORKER_LOG_FLUSH_S="60"
    )
    try:
        wait_for(
            lambda: (
                db.execute(
                    "SELECT count(*) FROM core.tasks WHERE state = 'succeeded'"
                    " AND labels->>'cairn.cron/schedule' = %s",
                    (str(sid),),
                ).fetchone()[0]
                == 48
            ),
            timeout=120,
            interval=0.2,
        )
    finally:
        stop_process(worker, signal.SIGKILL)
    fired = db.execute(
        "SELECT fire_time, outcome, backfill, task_id FROM cron.fires WHERE schedule_id = %s"
        " ORDER BY fire_time",
        (sid,),
    ).fetchall()
    slots = [start + timedelta(hours=h) for h in range(48)]
    assert [f[0] for f in fired] == slots
    assert {(f[1], f[2]) for f in fired} == {("submitted", True)}
    with core.client() as reader:
        for slot, *_, task_id in fired:
            log = reader.get(f"/v1/tasks/{task_id}/logs").text
            assert f"slot={slot.isoformat()} backfill=true" in log
    keys = db.execute(
        "SELECT count(DISTINCT idempotency_key), count(*) FROM core.tasks"
        " WHERE labels->>'cairn.cron/backfill' = 'true'"
    ).fetchone()
    assert keys == (48, 48)
