"""A schedule's jitter must stay under its shortest interval between fires, or a jittered
task would start at or after the next slot's: refused with a 422 naming ``jitter_s``."""

from __future__ import annotations

import pytest

from services.cron.domain.timing import shortest_gap_s
from tests.fixtures.cron import Cron
from tests.integration.cron.test_api import schedule


@pytest.mark.parametrize(
    ("expression", "jitter_s", "refused"),
    [
        ("* * * * *", 59, False),
        ("* * * * *", 60, True),
        ("*/7 * * * *", 240, True),  # :56 to the next hour's :00 is 4 minutes
        ("*/7 * * * *", 239, False),
        ("@hourly", 3599, False),
        ("0 * * * *", 3600, True),
        ("0 0,23 * * 1,2", 3600, True),  # Monday 23:00, then Tuesday 00:00
        ("0 0,23 * * 1", 3600, False),  # Monday 23:00, then Monday 00:00 a week on
        ("0 0 * * *", 3600, False),
    ],
)
def test_jitter_is_refused_when_it_reaches_the_next_slot(
    cron: Cron, expression: str, jitter_s: int, refused: bool
) -> None:
    with cron.client("alice") as alice:
        made = alice.post(
            "/v1/schedules", json=schedule(expression=expression, jitter_s=jitter_s, timezone="UTC")
        )
    if not refused:
        assert made.status_code == 201, made.text
        return
    assert made.status_code == 422, made.text
    [error] = made.json()["errors"]
    assert error["field"] == "body.jitter_s"
    assert f"({shortest_gap_s(expression, jitter_s)} s)" in error["reason"]


def test_a_change_that_leaves_jitter_no_room_is_refused(cron: Cron) -> None:
    with cron.client("alice") as alice:
        made = alice.post("/v1/schedules", json=schedule(expression="0 * * * *", jitter_s=600))
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        tighter = alice.patch(f"/v1/schedules/{sid}", json={"expression": "*/5 * * * *"})
        assert tighter.status_code == 422, tighter.text
        assert [e["field"] for e in tighter.json()["errors"]] == ["body.jitter_s"]
        more = alice.patch(f"/v1/schedules/{sid}", json={"jitter_s": 3600})
        assert more.status_code == 422
        assert alice.get(f"/v1/schedules/{sid}").json()["jitter_s"] == 600
        both = alice.patch(
            f"/v1/schedules/{sid}", json={"expression": "*/5 * * * *", "jitter_s": 60}
        )
        assert both.status_code == 200, both.text
