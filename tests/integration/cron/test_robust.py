"""The engine keeps firing through what used to stop it: an unexpected error steps it down
to campaign again; readiness says whether it runs; a slot fired again never treats its own
task as the previous run; a pending manual fire is found without a leader change."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg

from services.cron.engine import CronEngine
from tests.fixtures.cron import EPOCH, Cron, FakeClock, start_cron
from tests.integration.cron.test_engine import create, fires, settled
from tests.support import Core, wait_for

Conn = psycopg.Connection[tuple[Any, ...]]
SLOT = datetime(2027, 1, 4, 12, 1, tzinfo=UTC)


def _leading(core: Core, tmp_path: Path, **settings: Any) -> tuple[FakeClock, Cron]:
    """A cron engine on a clock at ``EPOCH``, once it leads and its fire loop turned."""
    clock = FakeClock(EPOCH)
    cron = start_cron(core, tmp_path, clock, **settings)
    try:
        wait_for(lambda: cron.engine.leader and cron.engine.turned_at)
    except BaseException:
        cron.stop()
        raise
    return clock, cron


def test_an_unexpected_error_steps_the_engine_down_and_it_leads_again(
    core: Core, tmp_path: Path, db: Conn, monkeypatch: Any
) -> None:
    original = CronEngine._rebuild
    failures = []

    async def flaky(self: CronEngine) -> None:
        if not failures:
            failures.append(1)
            raise RuntimeError("a bug, or sqlalchemy.exc.TimeoutError from a busy pool")
        await original(self)

    monkeypatch.setattr(CronEngine, "_rebuild", flaky)
    clock = FakeClock(EPOCH)
    cron = start_cron(core, tmp_path, clock)
    try:
        wait_for(lambda: failures and cron.engine.leader and cron.engine.turned_at)
        sid = create(cron, expression="* * * * *")
        clock.set(SLOT)
        wait_for(
            lambda: (
                db.execute(
                    "SELECT outcome FROM cron.fires WHERE schedule_id = %s", (sid,)
                ).fetchall()
                == [("submitted",)]
            )
        )
        assert httpx.get(cron.url + "/readyz").status_code == 200
    finally:
        cron.stop()


def test_readiness_reports_a_stalled_leading_engine(
    core: Core, tmp_path: Path, monkeypatch: Any
) -> None:
    async def stuck(self: CronEngine) -> None:
        import asyncio

        await asyncio.Event().wait()

    monkeypatch.setattr(CronEngine, "_fire_loop", stuck)
    cron = start_cron(core, tmp_path, FakeClock(EPOCH), cron_stall_s=0.5)
    try:
        wait_for(lambda: cron.engine.leader)
        answer = wait_for(
            lambda: (r := httpx.get(cron.url + "/readyz")).status_code == 503 and r, timeout=10
        )
        assert "has not turned" in answer.json()["detail"]
    finally:
        cron.stop()


def test_a_slot_fired_again_does_not_replace_its_own_task(
    core: Core, tmp_path: Path, db: Conn
) -> None:
    clock = FakeClock(EPOCH)
    cron = start_cron(core, tmp_path, clock)
    try:
        wait_for(lambda: cron.engine.leader)
        sid = create(cron, expression="* * * * *", overlap_policy="replace")
        clock.set(SLOT)
        wait_for(
            lambda: (
                db.execute(
                    "SELECT outcome FROM cron.fires WHERE schedule_id = %s", (sid,)
                ).fetchall()
                == [("submitted",)]
            )
        )
        [(task_id,)] = db.execute(
            "SELECT task_id FROM cron.fires WHERE schedule_id = %s", (sid,)
        ).fetchall()
        # As after a crash between recording the slot and moving the schedule past it.
        db.execute(
            "UPDATE cron.schedules SET next_fire_at = %s, fired_through = %s,"
            " version = version + 1 WHERE id = %s",
            (SLOT, SLOT - timedelta(minutes=1), sid),
        )
        db.execute("SELECT pg_notify('cron_schedules', %s)", (str(sid),))
        wait_for(
            lambda: (
                db.execute(
                    "SELECT next_fire_at FROM cron.schedules WHERE id = %s", (sid,)
                ).fetchone()
                == (SLOT + timedelta(minutes=1),)
            )
        )
        state = db.execute("SELECT state FROM core.tasks WHERE id = %s", (task_id,)).fetchone()
        assert state == ("waiting",)  # not cancelled as "the previous run"
        tasks = db.execute(
            "SELECT count(*) FROM core.tasks WHERE labels->>'cairn.cron/schedule' = %s",
            (str(sid),),
        ).fetchone()
        assert tasks == (1,)
    finally:
        cron.stop()


def test_a_pending_manual_fire_is_sent_without_a_leader_change(
    core: Core, tmp_path: Path, db: Conn
) -> None:
    _, cron = _leading(core, tmp_path, cron_pending_scan_s=0.2)
    try:
        sid = create(cron, expression="0 3 * * *")
        # What an API process that died after claiming a trigger leaves: a pending fire,
        # and no notification.
        db.execute(
            "INSERT INTO cron.fires (schedule_id, fire_time, outcome, manual, detail)"
            " VALUES (%s, %s, 'pending', true, 'triggered by alice')",
            (sid, EPOCH),
        )
        wait_for(
            lambda: (
                db.execute(
                    "SELECT outcome FROM cron.fires WHERE schedule_id = %s", (sid,)
                ).fetchone()
                == ("submitted",)
            )
        )
        keys = db.execute(
            "SELECT idempotency_key FROM core.tasks WHERE labels->>'cairn.cron/schedule' = %s",
            (str(sid),),
        ).fetchall()
        assert keys == [(f"cron:{sid}:manual:{EPOCH.isoformat()}",)]
    finally:
        cron.stop()


def test_a_schedule_that_cannot_be_planned_fails_alone_and_the_others_fire(
    core: Core, tmp_path: Path, db: Conn
) -> None:
    """A stored schedule the engine cannot plan (its zone gone from the tz database:
    US/Pacific-New was dropped in 2020b) records a failed fire at its slot naming why, and
    waits, with no next fire, until it is changed. It failed the turn of every schedule
    due with it: the engine stepped down, led again and met it again, once a poll, and no
    schedule fired any more (readiness said 200 throughout)."""
    clock, cron = _leading(core, tmp_path)
    try:
        (epoch,) = db.execute("SELECT epoch FROM cron.leader").fetchone() or (None,)
        good = create(cron, name="good", expression="* * * * *", timezone="UTC")
        bad = create(cron, name="bad", expression="* * * * *", timezone="UTC")
        db.execute("UPDATE cron.schedules SET timezone = 'US/Pacific-New' WHERE id = %s", (bad,))
        clock.set(SLOT)
        wait_for(lambda: settled(db, good, 1) and settled(db, bad, 1))
        assert [r[1] for r in fires(db, good)] == ["submitted"]
        row = db.execute(
            "SELECT f.fire_time, f.outcome, f.detail, s.next_fire_at FROM cron.fires f"
            " JOIN cron.schedules s ON s.id = f.schedule_id WHERE s.id = %s",
            (bad,),
        ).fetchone()
        assert row is not None
        assert row[:2] == (SLOT, "failed") and "US/Pacific-New" in row[2], row
        assert row[3] is None, "it waits until it is changed"
        clock.set(SLOT + timedelta(minutes=1))
        wait_for(lambda: settled(db, good, 2))
        assert len(fires(db, bad)) == 1
        assert db.execute("SELECT epoch FROM cron.leader").fetchone() == (epoch,)
        assert httpx.get(cron.url + "/readyz").status_code == 200
    finally:
        cron.stop()


def test_leads_that_keep_failing_back_off_and_readiness_says_so(
    core: Core, tmp_path: Path, db: Conn, caplog: Any
) -> None:
    """Every write of the fires refused (by a trigger here; a privilege taken away, a
    constraint alike) failed every lead: the engine stepped down and led again
    once a poll for as long as it lasted, the epoch bumped each time, and /readyz said 200
    (each lead set the fire loop's turn anew). Now the pause between failed leads doubles
    (to 30 s), readiness says 503 once they have failed for CAIRN_CRON_STALL_S, and once
    the writes go through the fires are recorded and readiness is 200 again."""
    clock, cron = _leading(core, tmp_path, cron_stall_s=0.5)
    try:
        sid = create(cron, expression="* * * * *")
        db.execute(
            "CREATE FUNCTION cron.refuse() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN RAISE EXCEPTION 'refused (a test)'; END $$"
        )
        db.execute(
            "CREATE TRIGGER refuse BEFORE INSERT OR UPDATE ON cron.fires"
            " FOR EACH ROW EXECUTE FUNCTION cron.refuse()"
        )
        with caplog.at_level("ERROR", logger="cairn.leader"):
            clock.set(SLOT)
            # A failing lead's fire loop does not turn either: on a loaded machine readiness
            # may first say that (a 503 as right), until the failed leads span the bound.
            answer = wait_for(
                lambda: (
                    (r := httpx.get(cron.url + "/readyz")).status_code == 503
                    and "leads have failed" in r.json()["detail"]
                    and r
                ),
                timeout=20,
            )

            def pauses() -> list[float]:
                return [
                    float(r.getMessage().rsplit(" in ", 1)[1].split(" s")[0])
                    for r in caplog.records
                    if "campaigning again in" in r.getMessage()
                ]

            # On a loaded machine two failed leads may already span the bound: the third
            # follows its doubled pause.
            wait_for(lambda: len(pauses()) >= 3, timeout=20)
        assert answer.json()["status"] == "unavailable", answer.json()
        seen = pauses()
        assert len(seen) >= 3 and seen == sorted(seen) and seen[-1] > seen[0], seen
        db.execute("DROP TRIGGER refuse ON cron.fires")
        wait_for(lambda: settled(db, sid, 1), timeout=30)
        wait_for(lambda: httpx.get(cron.url + "/readyz").status_code == 200, timeout=30)
    finally:
        cron.stop()


def test_a_token_core_refuses_makes_cron_and_dag_unready_until_one_it_takes(
    core: Core, tmp_path: Path
) -> None:
    """Both started and said ready with a ``CAIRN_TOKEN`` core refuses, and every fire and
    every node then failed with a 401. Now their readiness says so, from the start."""
    from tests.fixtures.dag import start_dag

    cron = start_cron(core, tmp_path / "cron", FakeClock(EPOCH), token="not-a-token")
    dag = start_dag(core, tmp_path / "dag", token="not-a-token")
    try:
        for url in (cron.url, dag.url):
            answer = wait_for(
                lambda u=url: (r := httpx.get(u + "/readyz")).status_code == 503 and r, timeout=10
            )
            assert "CAIRN_TOKEN" in answer.json()["detail"], answer.text
    finally:
        cron.stop()
        dag.stop()
    # The same with a token core takes: ready.
    cron = start_cron(core, tmp_path / "cron2", FakeClock(EPOCH))
    try:
        wait_for(lambda: httpx.get(cron.url + "/readyz").status_code == 200, timeout=10)
    finally:
        cron.stop()
