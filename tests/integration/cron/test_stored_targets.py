"""A schedule whose target was stored under older, looser rules (a digest in upper
case) is shown as stored: the answers re-validated it with the request model and were
a 500 for every read of the schedule and of the list that holds it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cairn.cli import app
from tests.fixtures.cron import Cron
from tests.integration.cron.test_api import schedule
from tests.support import TRUE_SHA, cli_as


def test_a_schedule_stored_under_older_rules_is_read_as_stored(
    cron: Cron,
    db: psycopg.Connection[tuple[Any, ...]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
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
    cli = cli_as(cron.core, monkeypatch, tmp_path)
    monkeypatch.setenv("CAIRN_CRON_URL", cron.url)
    listed_by_cli = cli.invoke(app, ["--json", "cron", "ls"])
    assert listed_by_cli.exit_code == 0, listed_by_cli.output
    [shown] = json.loads(listed_by_cli.output)
    assert shown["target"]["task"]["artifact"]["sha256"] == TRUE_SHA.upper()


def test_a_move_to_a_team_that_keeps_a_target_stored_under_older_rules_is_a_422(
    cron: Cron, db: psycopg.Connection[tuple[Any, ...]]
) -> None:
    """A move keeps the target, bound to the team: today's rules refuse it as stored, so
    the move is a 422 naming the target (a new one may go with it), not a 500."""
    with cron.core.client("root", "admin") as root:
        assert root.post("/v1/teams", json={"name": "sre"}).status_code == 201
        assert root.put("/v1/teams/sre/members/alice").status_code == 200
    with cron.client("alice") as alice:
        sid = alice.post("/v1/schedules", json=schedule()).json()["id"]
        db.execute(
            "UPDATE cron.schedules SET target = jsonb_set(target,"
            " '{task,artifact,sha256}', to_jsonb(upper(%s))) WHERE id = %s",
            (TRUE_SHA, sid),
        )
        moved = alice.patch(f"/v1/schedules/{sid}", json={"team": "sre"})
        assert moved.status_code == 422, moved.text
        assert moved.json()["errors"][0]["field"] == "body.target", moved.text
        assert "sha256" in moved.json()["detail"]
        renewed = schedule()["target"]
        both = alice.patch(f"/v1/schedules/{sid}", json={"team": "sre", "target": renewed})
    assert both.status_code == 200, both.text
    row = db.execute("SELECT team FROM cron.schedules WHERE id = %s", (sid,)).fetchone()
    assert row == ("sre",)
