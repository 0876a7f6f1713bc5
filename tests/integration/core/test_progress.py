"""Progress notes and checkpoints on a worker's turn, fenced like its reports; the next
attempt's lease carries the checkpoint; fencing tokens; what the API refuses; what
`cairn show` and `cairn logs` print. Real core over HTTP, real PostgreSQL."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from typer.testing import CliRunner

from cairn.cli import app
from libs.common.models import MAX_CHECKPOINT_BYTES
from tests.support import REAPER_AWAY, Core, TurnWorker, cli_as, spec

# The tests drive the workers' turns and reap by hand.
pytestmark = REAPER_AWAY

DB = psycopg.Connection[tuple[Any, ...]]
ROOM = {"cpu": 8, "memory_mb": 16384, "max": 1}


class Worker(TurnWorker):
    def claim(self) -> dict[str, Any]:
        """One attempt, waiting for it (a retry waits for its backoff and promotion)."""
        [leased] = self.turn(claim={**ROOM, "wait": 20})["attempts"]
        return leased


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def fence(core: Core, token: str) -> httpx.Response:
    return httpx.post(f"{core.url}/v1/fencing", json={"token": token}, timeout=10)


def _progress(db: DB, task_id: int) -> tuple[Any, ...] | None:
    return db.execute(
        "SELECT attempt_id, fraction, message, checkpoint, checkpoint_attempt_id"
        " FROM core.task_progress WHERE task_id = %s",
        (task_id,),
    ).fetchone()


def test_notes_are_kept_only_from_the_current_attempts_worker_and_reach_the_next_lease(
    core: Core, db: DB
) -> None:
    one, other = Worker(core, "w1"), Worker(core, "w2")
    with core.client("alice") as alice:
        task = alice.post(
            "/v1/tasks", json=spec(retry={"max_attempts": 3, "base_s": 0.01, "jitter": False})
        ).json()
    first = one.claim()
    assert first["checkpoint"] is None
    attempt, epoch, secret = first["fencing_token"].split(".")
    assert (int(attempt), int(epoch), len(secret)) == (first["attempt_id"], 1, 32)

    note = {"attempt_id": first["attempt_id"], "fraction": 0.25, "message": "a quarter"}
    one.turn(progress=[{**note, "checkpoint": b64(b"page=3")}])
    # Another worker cannot write the attempt's progress.
    other.turn(progress=[{**note, "fraction": 0.9, "checkpoint": b64(b"forged")}])
    assert _progress(db, task["id"]) == (
        first["attempt_id"],
        0.25,
        "a quarter",
        b"page=3",
        first["attempt_id"],
    )
    # Progress alone keeps the checkpoint; a checkpoint alone keeps the progress.
    one.turn(progress=[{"attempt_id": first["attempt_id"], "fraction": 0.5}])
    one.turn(
        progress=[
            {"attempt_id": first["attempt_id"], "progress": False, "checkpoint": b64(b"page=5")}
        ]
    )
    assert _progress(db, task["id"]) == (
        first["attempt_id"],
        0.5,
        None,
        b"page=5",
        first["attempt_id"],
    )

    # Its last words in the same turn as its report still count; after it, nothing.
    last = {"attempt_id": first["attempt_id"], "fraction": 0.6, "checkpoint": b64(b"page=6")}
    one.turn(reports=[{"attempt_id": first["attempt_id"], "outcome": "failed"}], progress=[last])
    one.turn(progress=[{**last, "checkpoint": b64(b"late")}])
    assert _progress(db, task["id"])[3] == b"page=6"

    db.execute("UPDATE core.tasks SET run_at = now() WHERE id = %s", (task["id"],))  # backoff over
    second = one.claim()
    assert base64.b64decode(second["checkpoint"]) == b"page=6"
    assert second["fencing_token"].split(".")[1] == "2"
    assert fence(core, second["fencing_token"]).json()["current"] is True
    assert fence(core, first["fencing_token"]).json() == {
        "current": False,
        "task_id": task["id"],
        "attempt_id": first["attempt_id"],
        "epoch": 1,
    }
    # The token's parts must agree: another epoch or another secret names nothing.
    assert fence(core, f"{attempt}.2.{secret}").status_code == 404
    assert fence(core, f"{second['attempt_id']}.2.{secret}").status_code == 404

    with core.client("alice") as alice:
        shown = alice.get(f"/v1/tasks/{task['id']}").json()["progress"]
        listed = alice.get("/v1/tasks").json()["items"][0]["progress"]
    assert shown == listed
    assert shown["attempt_id"] == first["attempt_id"] and shown["fraction"] == 0.6
    assert shown["checkpoint_bytes"] == 6 and shown["checkpoint_attempt_id"] == first["attempt_id"]


@pytest.mark.parametrize(
    ("note", "field"),
    [
        ({"fraction": 1.5}, "fraction"),
        ({"message": "two\nlines"}, "message"),
        ({"message": "x" * 201}, "message"),
        ({"checkpoint": "not base64!"}, "checkpoint"),
        ({"checkpoint": b64(b"x" * (MAX_CHECKPOINT_BYTES + 1))}, "checkpoint"),
    ],
)
def test_a_note_out_of_bounds_is_a_422_naming_its_field(
    core: Core, note: dict[str, Any], field: str
) -> None:
    worker = Worker(core, "w1")
    answer = worker.post_turn(progress=[{"attempt_id": 1, **note}])
    assert answer.status_code == 422
    assert any(e["field"].split(".")[-1] == field for e in answer.json()["errors"]), answer.text


def test_a_progress_timeout_out_of_range_is_a_422_and_a_malformed_token_too(core: Core) -> None:
    with core.client("alice") as alice:
        answer = alice.post("/v1/tasks", json=spec(progress_timeout_s=0))
    assert answer.status_code == 422 and "progress_timeout_s" in answer.text
    for token in ("", "1.1", "0.1." + "a" * 32, "1.1." + "A" * 32, "1.1." + "a" * 33):
        assert fence(core, token).status_code == 422, token


@pytest.fixture
def cairn(core: Core, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> CliRunner:
    return cli_as(core, monkeypatch, tmp_path)


def test_cairn_show_and_logs_print_the_progress(core: Core, cairn: CliRunner) -> None:
    worker = Worker(core, "w1")
    with core.client("alice") as alice:
        task = alice.post("/v1/tasks", json=spec(progress_timeout_s=90)).json()
    leased = worker.claim()
    note = {"attempt_id": leased["attempt_id"], "fraction": 0.4, "message": "step 2 of 5"}
    worker.turn(progress=[{**note, "checkpoint": b64(b"12345")}])
    shown = cairn.invoke(app, ["show", str(task["id"])])
    assert shown.exit_code == 0, shown.output
    assert f"40% step 2 of 5 (attempt {leased['attempt_id']}" in shown.output
    assert f"5 bytes from attempt {leased['attempt_id']}" in shown.output
    assert "90 s without progress" in shown.output
    logs = cairn.invoke(app, ["logs", str(task["id"])])
    assert logs.exit_code == 0, logs.output
    assert "progress: 40% step 2 of 5" in logs.output
