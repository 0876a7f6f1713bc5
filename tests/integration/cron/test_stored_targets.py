"""A schedule whose target was stored under older, looser rules (a digest in upper
case) is shown as stored: the answers re-validated it with the request model and were
a 500 for every read of the schedule and of the list that holds it."""

from __future__ import annotations

from typing import Any

import psycopg

from tests.fixtures.cron import Cron
from tests.integration.cron.test_api import schedule
from tests.support import TRUE_SHA


def test_a_schedule_stored_under_older_rules_is_read_as_stored(
    cron: Cron, db: psycopg.Connection[tuple[Any, ...]]
) -> None:
    with cron.client("alice") as alice:
        made = alice.post("/v1/schedules", json=schedule())
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        db.execute(
            "UPDATE cron.schedules SET target = jsonb_set(target,"
            " '{task,artifact,sha256}', to_jsonb(upper(%s))) WHERE id = %s",
            (TRUE_SHA, sid),
        )
        one = alice.get(f"/v1/schedules/{sid}")
        listed = alice.get("/v1/schedules")
        paused = alice.post(f"/v1/schedules/{sid}/pause")
    assert one.status_code == 200, one.text
    assert one.json()["target"]["task"]["artifact"]["sha256"] == TRUE_SHA.upper()
    assert listed.status_code == 200, listed.text
    assert [s["id"] for s in listed.json()["items"]] == [sid]
    assert paused.status_code == 200, paused.text
    row = db.execute("SELECT paused FROM cron.schedules WHERE id = %s", (sid,)).fetchone()
    assert row == (True,)
