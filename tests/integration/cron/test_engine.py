"""The firing engine against real core and PostgreSQL, on a clock the test moves."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg

from tests.fixtures.cron import EPOCH, Cron, FakeClock, start_cron
from tests.integration.cron.test_api import schedule
from tests.support import Core, spec, start_core, stop_as_woken, wait_for

Conn = psycopg.Connection[tuple[Any, ...]]
#: generous: a stopped engine ends within one pass of its loop (a query or a call to core
#: under way is cancelled, which psycopg and the client bound); before, it never ended
STOPPED_WITHIN_S = 10.0


def fires(db: Conn, sid: int) -> list[tuple[datetime, str, int | None]]:
    return db.execute(
        "SELECT fire_time, outcome, task_id FROM cron.fires WHERE schedule_id = %s"
        " ORDER BY fire_time",
        (sid,),
    ).fetchall()


def tasks_of(db: Conn, sid: int) -> list[tuple[int, str, str, str]]:
    return db.execute(
        "SELECT id, owner, idempotency_key, labels->>'cairn.cron/fire-time' FROM core.tasks"
        " WHERE labels->>'cairn.cron/schedule' = %s ORDER BY id",
        (str(sid),),
    ).fetchall()


def create(cron: Cron, **overrides: Any) -> int:
    with cron.client() as alice:
        made = alice.post("/v1/schedules", json=schedule(**overrides))
        assert made.status_code == 201, made.text
        return int(made.json()["id"])


def settled(db: Conn, sid: int, count: int) -> bool:
    rows = fires(db, sid)
    return len(rows) >= count and all(r[1] != "pending" for r in rows)


def test_a_minutely_schedule_fires_once_each_minute_for_its_owner(
    cron: Cron, clock: FakeClock, db: Conn
) -> None:
    wait_for(lambda: cron.engine.leader)
    sid = create(cron, expression="* * * * *", timezone="UTC")
    for minute in (1, 2, 3):
        clock.set(EPOCH.replace(second=0) + timedelta(minutes=minute))
        wait_for(lambda m=minute: settled(db, sid, m))
    got = fires(db, sid)
    assert [r[0] for r in got] == [datetime(2027, 1, 4, 12, m, tzinfo=UTC) for m in (1, 2, 3)]
    assert {r[1] for r in got} == {"submitted"}
    tasks = tasks_of(db, sid)
    assert [t[0] for t in tasks] == [r[2] for r in got]
    assert {t[1] for t in tasks} == {"alice"}
    assert tasks[0][2] == f"cron:{sid}:2027-01-04T12:01:00+00:00"
    assert tasks[0][3] == "2027-01-04T12:01:00+00:00"


def test_no_slot_fires_early_or_twice_when_the_clock_jumps_and_skews(
    cron: Cron, clock: FakeClock, db: Conn
) -> None:
    wait_for(lambda: cron.engine.leader)
    sid = create(cron, expression="*/5 * * * *", timezone="UTC")
    slot = datetime(2027, 1, 4, 12, 5, tzinfo=UTC)
    clock.set(slot)
    wait_for(lambda: settled(db, sid, 1))
    # The clock jumps back an hour after the fire, then runs forward over the slot again.
    clock.set(slot - timedelta(hours=1))
    time.sleep(0.3)
    for step in range(0, 61, 10):
        clock.set(slot - timedelta(minutes=60 - step))
        time.sleep(0.05)
    # Skew back and forth just before the next slot: it must not fire early.
    nxt = slot + timedelta(minutes=5)
    for skew in (-1, -30, -0.5, -10, -0.001):
        clock.set(nxt + timedelta(seconds=skew))
        time.sleep(0.1)
        assert len(fires(db, sid)) == 1, f"fired early at skew {skew}"
    clock.set(nxt)
    wait_for(lambda: settled(db, sid, 2))
    clock.set(nxt - timedelta(seconds=20))
    time.sleep(0.3)
    clock.set(nxt + timedelta(seconds=1))
    time.sleep(0.3)
    assert [r[0] for r in fires(db, sid)] == [slot, nxt]
    assert len(tasks_of(db, sid)) == 2


def test_daily_0230_new_york_fires_once_a_day_across_spring_forward(
    cron: Cron, clock: FakeClock, db: Conn
) -> None:
    wait_for(lambda: cron.engine.leader)
    clock.set(datetime(2027, 3, 13, 0, 0, tzinfo=UTC))
    sid = create(cron)  # 02:30 America/New_York
    at = datetime(2027, 3, 13, 0, 0, tzinfo=UTC)
    while at < datetime(2027, 3, 16, 12, tzinfo=UTC):
        at += timedelta(minutes=30)
        clock.set(at)
        time.sleep(0.03)
    wait_for(lambda: settled(db, sid, 4))
    time.sleep(0.2)
    assert [r[0] for r in fires(db, sid)] == [
        datetime(2027, 3, 13, 7, 30, tzinfo=UTC),  # 02:30 EST
        datetime(2027, 3, 14, 7, 30, tzinfo=UTC),  # 03:30 EDT: 02:30 does not exist
        datetime(2027, 3, 15, 6, 30, tzinfo=UTC),  # 02:30 EDT
        datetime(2027, 3, 16, 6, 30, tzinfo=UTC),
    ]
    assert len(tasks_of(db, sid)) == 4


def test_after_a_week_down_each_misfire_policy_bounds_the_catch_up(
    core: Core, tmp_path: Path, db: Conn
) -> None:
    clock = FakeClock(EPOCH)
    cron = start_cron(core, tmp_path, clock)
    wait_for(lambda: cron.engine.leader)
    hourly = {"expression": "0 * * * *", "timezone": "UTC"}
    skip = create(cron, name="skip", misfire_policy="skip", **hourly)
    once = create(cron, name="once", misfire_policy="fire_once", **hourly)
    catch = create(cron, name="catch", misfire_policy="catch_up", catch_up_limit=5, **hourly)
    cron.stop()
    # A week later (and half an hour past the hour, beyond the 60 s grace) it comes back.
    clock.set(EPOCH + timedelta(days=7, minutes=30))
    cron = start_cron(core, tmp_path, clock)
    try:
        wait_for(lambda: settled(db, catch, 6) and settled(db, once, 2) and settled(db, skip, 1))
        time.sleep(0.3)
        assert len(tasks_of(db, skip)) == 0
        assert [r[1] for r in fires(db, skip)] == ["missed"]
        assert len(tasks_of(db, once)) == 1
        latest = datetime(2027, 1, 11, 12, tzinfo=UTC)
        assert [(r[0], r[1]) for r in fires(db, once)] == [
            (latest - timedelta(hours=1), "missed"),
            (latest, "submitted"),
        ]
        caught = [r for r in fires(db, catch) if r[1] == "submitted"]
        assert [r[0] for r in caught] == [latest - timedelta(hours=h) for h in (4, 3, 2, 1, 0)]
        assert len(tasks_of(db, catch)) == 5
        # Then each goes on hourly, once.
        clock.set(latest + timedelta(hours=1))
        wait_for(lambda: len(tasks_of(db, skip)) == 1 and len(tasks_of(db, once)) == 2)
    finally:
        cron.stop()


def test_overlap_forbid_skips_and_replace_cancels_the_previous_task(
    cron: Cron, clock: FakeClock, db: Conn
) -> None:
    wait_for(lambda: cron.engine.leader)
    minutely = {"expression": "* * * * *", "timezone": "UTC"}
    forbid = create(cron, name="forbid", overlap_policy="forbid", **minutely)
    replace = create(cron, name="replace", overlap_policy="replace", **minutely)
    allow = create(cron, name="allow", **minutely)
    start = EPOCH.replace(second=0)
    # No worker runs, so each fire's task stays waiting: the previous fire is still live.
    clock.set(start + timedelta(minutes=1))
    wait_for(lambda: all(settled(db, s, 1) for s in (forbid, replace, allow)))
    clock.set(start + timedelta(minutes=2))
    wait_for(lambda: all(settled(db, s, 2) for s in (forbid, replace, allow)))
    assert [r[1] for r in fires(db, forbid)] == ["submitted", "skipped_overlap"]
    assert [r[1] for r in fires(db, replace)] == ["submitted", "submitted"]
    assert [r[1] for r in fires(db, allow)] == ["submitted", "submitted"]
    first_replaced = fires(db, replace)[0][2]
    state = db.execute("SELECT state FROM core.tasks WHERE id = %s", (first_replaced,)).fetchone()
    assert state == ("cancelled",)
    # Once the previous task is over, forbid fires again.
    forbid_task = fires(db, forbid)[0][2]
    with cron.client() as alice, cron.core.client("alice") as core:
        assert core.post(f"/v1/tasks/{forbid_task}/cancel").status_code == 200
        clock.set(start + timedelta(minutes=3))
        wait_for(lambda: settled(db, forbid, 3))
        assert fires(db, forbid)[2][1] == "submitted"
        del alice


def test_fires_wait_while_core_is_down_and_are_sent_once_when_it_returns(
    core: Core, tmp_path: Path, db: Conn
) -> None:
    clock = FakeClock(EPOCH)
    cron = start_cron(core, tmp_path, clock)
    try:
        wait_for(lambda: cron.engine.leader)
        once = create(cron, name="once", expression="* * * * *", timezone="UTC")
        catch = create(
            cron,
            name="catch",
            expression="* * * * *",
            timezone="UTC",
            misfire_policy="catch_up",
            catch_up_limit=2,
            misfire_grace_s=3600,
        )
        port = int(core.url.rsplit(":", 1)[1])
        core.stop()
        start = EPOCH.replace(second=0)
        for minute in (1, 2, 3):
            clock.set(start + timedelta(minutes=minute))
            wait_for(lambda m=minute: len(fires(db, once)) == m and len(fires(db, catch)) == m)
        time.sleep(0.5)  # several tries while core is down
        tries = db.execute(
            "SELECT max(tries) FROM cron.fires WHERE schedule_id = %s", (catch,)
        ).fetchone()
        # Nothing reached core; the newest fire of each waits, retried, and the misfire
        # policy already let older ones go.
        assert fires(db, once)[-1][1] == "pending"
        assert [r[1] for r in fires(db, catch)][-2:] == ["pending", "pending"]
        assert tries is not None
        assert tries[0] >= 2
        assert tasks_of(db, once) == tasks_of(db, catch) == []
        revived = start_core(core.db_url, tmp_path / "core2", port=port)
        try:
            wait_for(lambda: settled(db, once, 3) and settled(db, catch, 3), timeout=20)
        finally:
            revived.stop()
        # fire_once: only the newest; catch_up with limit 2: the two newest.
        assert [r[1] for r in fires(db, once)] == ["missed", "missed", "submitted"]
        assert [r[1] for r in fires(db, catch)] == ["missed", "submitted", "submitted"]
        assert len(tasks_of(db, once)) == 1
        assert len(tasks_of(db, catch)) == 2
    finally:
        cron.stop()


def test_trigger_now_fires_at_once_even_when_paused(cron: Cron, clock: FakeClock, db: Conn) -> None:
    sid = create(cron, paused=True)
    with cron.client() as alice:
        fired = alice.post(f"/v1/schedules/{sid}/trigger")
        assert fired.status_code == 201, fired.text
        body = fired.json()
        assert body["manual"] is True
        assert body["outcome"] == "submitted"
        history = alice.get(f"/v1/schedules/{sid}/fires").json()["items"]
    assert [f["task_id"] for f in history] == [body["task_id"]]
    [(task_id, owner, key, _)] = tasks_of(db, sid)
    assert (task_id, owner) == (body["task_id"], "alice")
    assert key.startswith(f"cron:{sid}:manual:")


def test_a_fire_over_its_owners_quota_waits_and_is_sent_when_the_quota_allows(
    cron: Cron, db: Conn
) -> None:
    """Core's 429 means try again after Retry-After, nothing stored: the fire was recorded
    failed and its slot never got a task. It waits as for a core that is down."""
    sid = create(cron, paused=True)
    wait_for(lambda: cron.engine.leader)
    with cron.core.client("root", "admin") as admin, cron.core.client() as alice_core:
        assert admin.patch("/v1/owners/alice/share", json={"max_waiting": 1}).status_code == 200
        assert alice_core.post("/v1/tasks", json=spec()).status_code == 201
        with cron.client() as alice:
            held = alice.post(f"/v1/schedules/{sid}/trigger")
        assert held.status_code == 503, held.text
        assert "waiting quota" in held.json()["detail"]
        assert [r[1] for r in fires(db, sid)] == ["pending"]
        assert tasks_of(db, sid) == []
        lifted = admin.patch("/v1/owners/alice/share", json={"max_waiting": None})
        assert lifted.status_code == 200
    wait_for(lambda: settled(db, sid, 1), timeout=20)
    [(_, outcome, task_id)] = fires(db, sid)
    assert outcome == "submitted"
    assert [t[0] for t in tasks_of(db, sid)] == [task_id]


def test_shutdown_is_prompt_when_the_next_fire_is_an_hour_away(core: Core, tmp_path: Path) -> None:
    clock = FakeClock(EPOCH)
    cron = start_cron(core, tmp_path, clock, cron_tick_s=3600, cron_stall_s=7201)
    wait_for(lambda: cron.engine.leader)
    create(cron, expression="0 * * * *", timezone="UTC")
    time.sleep(0.2)
    began = time.monotonic()
    cron.stop()
    assert not cron.thread.is_alive()
    assert time.monotonic() - began < 1.0


def test_the_engine_stops_when_its_stop_comes_as_a_change_wakes_its_fire_loop(
    core: Core, tmp_path: Path
) -> None:
    """The lifespan stops the engine by cancelling its task. A cancel that reached the fire
    loop as a schedule change woke it (``asyncio.wait_for`` on Python 3.11 returns the
    wake instead) was lost: the fire loop turned on, the engine waited on it for good, and
    so did the replica's shutdown (a test's teardown hung until its join gave up)."""
    cron = start_cron(core, tmp_path, FakeClock(EPOCH), cron_tick_s=3600, cron_stall_s=7201)
    try:
        # past its first turn (which purges): asleep until a change wakes it
        wait_for(lambda: cron.engine.leader and cron.engine._purged_at)
        wake = cron.engine.wake.set  # what a schedule change's notification does
        stopped = stop_as_woken(cron, "cron-engine", wake, STOPPED_WITHIN_S)
        assert stopped, "the engine's task outlived its stop"
    finally:
        cron.stop()


def test_a_paused_or_ended_schedule_is_not_in_the_heap(
    cron: Cron, clock: FakeClock, db: Conn
) -> None:
    wait_for(lambda: cron.engine.leader)
    sid = create(cron, expression="* * * * *", timezone="UTC", ends_at="2027-01-04T12:02:30Z")
    create(cron, name="paused", paused=True)
    wait_for(lambda: cron.engine.status()["schedules"] == 1)
    for minute in range(1, 6):
        clock.set(EPOCH.replace(second=0) + timedelta(minutes=minute))
        time.sleep(0.1)
    wait_for(lambda: settled(db, sid, 2))
    assert len(fires(db, sid)) == 2
    wait_for(lambda: cron.engine.status()["next_fire_at"] is None)
