"""What a newcomer trips on in their first minutes (issue 29): `cairn queues` counted
0 ended after nine tasks had succeeded, the demo's script printed an error of `id` into
the first log they read, and `cairn why` on an ended task said "is succeeded: it is
succeeded". Run through the real CLI against a real core."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cairn.cli import app
from cairn.demo import HERE as DEMO
from tests.support import Core, cli_as, spec


@pytest.fixture
def cairn(core: Core, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> CliRunner:
    return cli_as(core, monkeypatch, tmp_path)


def _run(runner: CliRunner, *args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_cairn_queues_shows_the_counts_core_keeps_and_none_it_does_not(
    core: Core, cairn: CliRunner, db
) -> None:
    with core.client("alice") as alice:
        ids = [alice.post("/v1/tasks", json=spec(queue="q")).json()["id"] for _ in range(3)]
    db.execute(
        "UPDATE core.tasks SET state = 'succeeded', finished_at = now() WHERE id = ANY(%s)",
        (ids[:2],),
    )
    db.execute("UPDATE core.tasks SET state = 'dead', finished_at = now() WHERE id = %s", (ids[2],))
    shown = _run(cairn, "queues").splitlines()
    [header] = [line for line in shown if line.startswith("┃ queue")]
    [row] = [line for line in shown if line.startswith("│ q ")]
    columns = [c.strip() for c in header.split("┃")[1:-1]]
    values = [c.strip() for c in row.split("│")[1:-1]]
    assert "ended" not in columns and "succeeded" not in columns  # not counted per queue
    assert dict(zip(columns, values, strict=True))["dead"] == "1"


def test_cairn_why_says_how_an_ended_task_ended(core: Core, cairn: CliRunner, db) -> None:
    with core.client("alice") as alice:
        done, dead, gone, waiting = (
            alice.post("/v1/tasks", json=spec()).json()["id"] for _ in range(4)
        )
        alice.post(f"/v1/tasks/{gone}/cancel").raise_for_status()
    db.execute(
        "UPDATE core.tasks SET state = 'succeeded', finished_at = now(), attempts = 1 "
        "WHERE id = %s",
        (done,),
    )
    db.execute(
        "UPDATE core.tasks SET state = 'dead', finished_at = now(), attempts = 3, "
        "last_error = 'exit 2' WHERE id = %s",
        (dead,),
    )
    said = _run(cairn, "why", str(done))
    assert "it is succeeded" not in said
    assert "ended at" in said and "after 1 attempt(s)" in said and "nothing holds it" in said
    assert "the last error: exit 2" in _run(cairn, "why", str(dead))
    assert "was cancelled" in _run(cairn, "why", str(gone))
    assert "no live worker" in _run(cairn, "why", str(waiting))


def test_the_demo_script_names_an_unnamed_uid_without_an_error(tmp_path: Path) -> None:
    """An attempt runs as a uid of the worker's range, which has no passwd entry."""
    uid = 27737
    done = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
         "sh", str(DEMO / "hello.sh"), "world"],
        capture_output=True, text=True, cwd=tmp_path, timeout=30, check=True,
    )  # fmt: skip
    assert done.stderr == ""
    assert f"running as uid {uid} in" in done.stdout
