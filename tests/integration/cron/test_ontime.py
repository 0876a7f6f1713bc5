"""Fires sent ahead of their slot with ``run_at`` = the slot, and withdrawn by a change
before it; the slot in the task's env; jitter. Real core, real cron, a clock the test
moves (its ``real`` maps a slot to the real instant core is given as run_at)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from services.core.settings import CoreSettings
from services.cron.domain import ontime
from tests.fixtures.cron import Cron, FakeClock, start_cron
from tests.integration.core.test_dispatch import Agent, _close_agents  # noqa: F401 - closes them
from tests.integration.cron.test_engine import create
from tests.support import Core, wait_for

Conn = psycopg.Connection[tuple[Any, ...]]
SLOT = datetime(2027, 1, 4, 12, 1, tzinfo=UTC)  # the first `* * * * *` slot after EPOCH
LEAD_S = 5.0
AFTER_S = CoreSettings.model_fields["promote_after_s"].default


@pytest.fixture
def ahead(core: Core, tmp_path: Path, clock: FakeClock) -> Any:
    server = start_cron(core, tmp_path, clock, cron_lead_s=LEAD_S)
    wait_for(lambda: server.engine.leader)
    yield server
    server.stop()


def fire_rows(db: Conn, sid: int) -> list[tuple[Any, ...]]:
    return db.execute(
        "SELECT fire_time, outcome, task_id, withdrawn FROM cron.fires WHERE schedule_id = %s"
        " ORDER BY fire_time",
        (sid,),
    ).fetchall()


def task_rows(db: Conn, sid: int) -> list[tuple[Any, ...]]:
    return db.execute(
        "SELECT id, state, idempotency_key, env, args, EXTRACT(EPOCH FROM run_at)::float"
        "  FROM core.tasks WHERE labels->>'cairn.cron/schedule' = %s ORDER BY id",
        (str(sid),),
    ).fetchall()


def test_a_fire_is_sent_ahead_and_core_starts_it_at_its_slot(
    ahead: Cron, clock: FakeClock, db: Conn
) -> None:
    sid = create(ahead, expression="* * * * *")
    clock.set(SLOT - timedelta(seconds=3))  # inside the lead: sent now, to start in 3 s
    wait_for(lambda: [r[1] for r in fire_rows(db, sid)] == ["submitted"])
    [(task_id, state, key, env, _, run_at)] = task_rows(db, sid)
    assert state == "ready"  # not before its slot
    assert key == f"cron:{sid}:2027-01-04T12:01:00+00:00"
    assert env["CAIRN_CRON_SLOT"] == "2027-01-04T12:01:00+00:00"
    assert env["CAIRN_CRON_SCHEDULE_ID"] == str(sid)
    # The slot is 3 s of real time away, as the clock runs at speed 1 from here.
    promoted = wait_for(
        lambda: db.execute(
            "SELECT EXTRACT(EPOCH FROM at)::float FROM core.task_events"
            " WHERE task_id = %s AND op = 'promote'",
            (task_id,),
        ).fetchone(),
        timeout=15,
    )
    # Claimable from its run_at on (no worker here takes it), promoted once claims had
    # their turn.
    assert AFTER_S <= promoted[0] - run_at < AFTER_S + 0.5


@pytest.mark.parametrize("change", ["edit", "pause", "delete"])
def test_a_change_before_the_slot_withdraws_what_was_sent_ahead(
    ahead: Cron, clock: FakeClock, db: Conn, change: str, caplog: pytest.LogCaptureFixture
) -> None:
    sid = create(ahead, expression="* * * * *")
    clock.set(SLOT - timedelta(seconds=4))
    wait_for(lambda: [r[1] for r in fire_rows(db, sid)] == ["submitted"])
    [(first, *_)] = task_rows(db, sid)
    with ahead.client() as alice:
        if change == "edit":
            target = {"kind": "task", "task": {**_task(), "args": ["changed"]}}
            assert alice.patch(f"/v1/schedules/{sid}", json={"target": target}).status_code == 200
        elif change == "pause":
            assert alice.post(f"/v1/schedules/{sid}/pause").status_code == 200
        else:
            assert alice.delete(f"/v1/schedules/{sid}").status_code == 204
    wait_for(lambda: task_rows(db, sid)[0][1] == "cancelled")
    if change == "edit":
        # The slot is sent again from the edited schedule, under a key of its own.
        wait_for(lambda: len(task_rows(db, sid)) == 2)
        old, new = task_rows(db, sid)
        assert old[0] == first
        assert new[1] == "ready"
        assert new[2] == f"cron:{sid}:2027-01-04T12:01:00+00:00:w1"
        assert new[4] == ["changed"]
        wait_for(lambda: fire_rows(db, sid)[0][1:] == ("submitted", new[0], 1))
        # The next slot is sent ahead once, by the same lead (no step-down on the way).
        clock.set(SLOT + timedelta(minutes=1) - timedelta(seconds=3))
        wait_for(lambda: [r[1] for r in fire_rows(db, sid)] == ["submitted"] * 2)
        assert len(task_rows(db, sid)) == 3
        assert not [r for r in caplog.records if "stepping down" in r.getMessage()]
    elif change == "pause":
        wait_for(lambda: fire_rows(db, sid)[0][1] == "withdrawn")
        assert len(task_rows(db, sid)) == 1
    else:
        assert fire_rows(db, sid) == []
        assert len(task_rows(db, sid)) == 1


def test_forbid_is_decided_at_the_slot_not_sent_ahead(
    ahead: Cron, clock: FakeClock, db: Conn
) -> None:
    sid = create(ahead, expression="* * * * *", overlap_policy="forbid")
    clock.set(SLOT - timedelta(seconds=3))
    wait_for(lambda: ahead.engine.status()["schedules"] == 1)
    assert fire_rows(db, sid) == []
    clock.set(SLOT)
    wait_for(lambda: [r[1] for r in fire_rows(db, sid)] == ["submitted"])
    [(_, state, *_)] = task_rows(db, sid)
    assert state == "waiting"


def test_jitter_is_a_fixed_offset_per_schedule_within_its_bound(
    ahead: Cron, clock: FakeClock, db: Conn
) -> None:
    sid = create(ahead, expression="1 * * * *", jitter_s=600)
    offset = ontime.jitter(sid, 600)
    assert timedelta(0) <= offset <= timedelta(seconds=600)
    assert offset == ontime.jitter(sid, 600)
    assert {ontime.jitter(n, 600) for n in range(1, 50)} != {offset}
    # Sent the jitter (longer than the lead) before its start, on the second: never after
    # its slot, and a jittered burst is sent spread out as its tasks start.
    sent = ontime.send_at(SLOT, sid, "task", "allow", 600, timedelta(seconds=LEAD_S))
    assert sent == (SLOT + offset - timedelta(seconds=600)).replace(microsecond=0) <= SLOT
    short = ontime.send_at(SLOT, sid, "task", "allow", 2, timedelta(seconds=LEAD_S))
    assert short == (SLOT + ontime.jitter(sid, 2) - timedelta(seconds=LEAD_S)).replace(
        microsecond=0
    )
    clock.set(max(clock.now(), sent))
    real_slot = clock.real(SLOT).timestamp()
    wait_for(lambda: len(task_rows(db, sid)) == 1)
    [(_, state, _, env, _, run_at)] = task_rows(db, sid)
    assert state == "ready"
    assert env["CAIRN_CRON_SLOT"] == "2027-01-04T12:01:00+00:00"  # the slot, not the start
    assert abs(run_at - (real_slot + offset.total_seconds())) < 1.0


def _task() -> dict[str, Any]:
    from tests.integration.cron.test_api import schedule

    task: dict[str, Any] = schedule()["target"]["task"]
    return task


def test_a_pause_withdraws_a_fire_a_worker_has_leased_ahead_and_holds(
    ahead: Cron, clock: FakeClock, db: Conn, core: Core
) -> None:
    """The task is running in core (leased ahead, held by its worker until the slot):
    the withdrawal cancels it there, closing the attempt, which the worker's check before
    the start then finds gone (tests/faults/worker/test_claim_ahead_agent.py)."""
    sid = create(ahead, expression="* * * * *")
    clock.set(SLOT - timedelta(seconds=4))
    wait_for(lambda: [r[1] for r in fire_rows(db, sid)] == ["submitted"])
    [(task_id, *_)] = task_rows(db, sid)
    worker = Agent(core)
    room = {"cpu": 8, "memory_mb": 16384, "ahead_s": 10}
    [leased] = worker.http.post(f"/v1/workers/{worker.id}/claim", json=room).json()["attempts"]
    assert leased["task_id"] == task_id and leased["start_at"] is not None
    with ahead.client() as alice:
        assert alice.post(f"/v1/schedules/{sid}/pause").status_code == 200
    wait_for(lambda: fire_rows(db, sid)[0][1] == "withdrawn")
    assert task_rows(db, sid)[0][1] == "cancelled"
    assert db.execute(
        "SELECT outcome, seen_at FROM core.attempts WHERE task_id = %s", (task_id,)
    ).fetchall() == [("cancelled", None)]
    starts = {"attempts": [leased["attempt_id"]]}
    answer = worker.http.post(f"/v1/workers/{worker.id}/starts", json=starts).json()
    assert answer == {"held": [], "gone": [leased["attempt_id"]]}
