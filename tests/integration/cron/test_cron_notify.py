"""Cron tells core of fires the misfire policy skipped, for the owner's notifications."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from tests.fixtures.cron import EPOCH, FakeClock, start_cron
from tests.integration.cron.test_engine import Conn, create, fires, settled
from tests.support import Core, wait_for
from tests.webhooks import Receiver, subscribe


def test_a_fire_skipped_by_the_misfire_policy_reaches_the_owners_webhook(
    core: Core, tmp_path: Path, db: Conn
) -> None:
    hook = Receiver()
    clock = FakeClock(EPOCH)
    cron = start_cron(core, tmp_path, clock)
    try:
        with core.client() as alice:
            made = subscribe(alice, hook.url, events=["fire.missed", "fire.failed"])
        wait_for(lambda: cron.engine.leader)
        sid = create(cron, name="skip", misfire_policy="skip", expression="0 * * * *")
        cron.stop()
        clock.set(EPOCH + timedelta(days=7, minutes=30))  # back a week later
        cron = start_cron(core, tmp_path, clock)
        wait_for(lambda: settled(db, sid, 1))
        wait_for(
            lambda: (
                db.execute(
                    "SELECT count(*) FROM core.notifications WHERE state = 'delivered'"
                ).fetchone()
                == (1,)
            ),
            timeout=20,
        )
    finally:
        cron.stop()
        hook.close()
    [(slot, outcome, _)] = fires(db, sid)
    assert outcome == "missed"
    [got] = hook.all()
    assert got.signed_by(made["secret"])
    assert got.doc["event"] == "fire.missed"
    assert got.doc["owner"] == "alice"
    assert got.doc["data"]["subject"] == {
        "schedule_id": str(sid),
        "fire_time": slot.isoformat(),
    }
    assert "misfire policy skip" in got.doc["data"]["summary"]
