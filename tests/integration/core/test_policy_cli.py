"""A task's policy through the real CLI against a real core: `cairn queues NAME` sets a
queue's time limits, `cairn submit` takes the policy's flags, and `cairn get` shows what
the task may count on."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cairn.cli import app
from tests.support import Core, cli_as


@pytest.fixture
def cairn(core: Core, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> CliRunner:
    # an admin: it sets queues
    return cli_as(core, monkeypatch, tmp_path, "root", "admin", columns=250)


def _run(runner: CliRunner, *args: str, code: int = 0) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == code, result.output
    return result.output


def test_queue_limits_are_set_and_shown_and_a_bad_pair_is_refused(
    core: Core, cairn: CliRunner, db
) -> None:
    shown = _run(cairn, "queues", "batch", "--default-timeout", "600", "--max-timeout", "3600")
    assert "batch" in shown and "600/3600" in shown
    refused = _run(cairn, "queues", "batch", "--max-timeout", "60", code=1)
    assert "max_timeout_s" in refused
    _run(cairn, "queues", "batch", "--unset", "max-timeout", "--max-wait", "120")
    stored = db.execute(
        "SELECT default_timeout_s, max_timeout_s, max_wait_s FROM core.queues WHERE name = 'batch'"
    ).fetchone()
    assert stored == (600, None, 120)


def test_submit_takes_the_policys_flags_and_get_shows_them(
    core: Core, cairn: CliRunner, db
) -> None:
    _run(cairn, "queues", "batch", "--default-timeout", "600")
    out = _run(
        cairn,
        "submit",
        "nightly",
        "--artifact",
        "file:///bin/true",
        "--queue",
        "batch",
        "--max-wait",
        "300",
        "--no-retry-exit",
        "3",
        "--no-retry-exit",
        "4",
        "--retry-exit",
        "75",
        "--no-retry-signal",
        "11",
        "--poison-window",
        "3600",
        "--progress-timeout",
        "120",
        "--json",
    )
    task_id = int(out.split('"id":')[1].split(",")[0])
    row = db.execute(
        "SELECT timeout_s, start_by IS NOT NULL, poison_window_s, retry_causes,"
        " progress_timeout_s FROM core.tasks WHERE id = %s",
        (task_id,),
    ).fetchone()
    assert row == (
        600,
        True,
        3600,
        {
            "never": {"exit_codes": [3, 4], "signals": [11]},
            "always": {"exit_codes": [75], "signals": []},
        },
        120,
    )
    shown = _run(cairn, "get", str(task_id))
    assert "600 s" in shown and "within 3600 s" in shown
    assert "120 s without progress" in shown
    assert "exit 3, 4; signal 11" in shown and "exit 75" in shown
    too_long = _run(
        cairn, "submit", "x", "--artifact", "file:///bin/true", "--retry-exit", "300", code=2
    )
    assert "exit_codes" in too_long


def test_a_queues_disk_quota_is_set_and_a_submission_asks_its_own(
    core: Core, cairn: CliRunner, db
) -> None:
    shown = _run(cairn, "queues", "scratch", "--default-disk", "256", "--max-disk", "2048")
    assert "256/2048" in shown
    refused = _run(cairn, "queues", "scratch", "--max-disk", "100", code=1)
    assert "max_disk_mb" in refused
    args = ("submit", "big", "--artifact", "file:///bin/true", "--queue", "scratch", "--json")
    out = _run(cairn, *args, "--disk-mb", "2048")
    plain = _run(cairn, *args)
    over = _run(cairn, *args, "--disk-mb", "4096", code=1)
    assert "resources.disk_mb" in over
    stored = [
        db.execute(
            "SELECT disk_mb FROM core.tasks WHERE id = %s",
            (int(text.split('"id":')[1].split(",")[0]),),
        ).fetchone()
        for text in (out, plain)
    ]
    assert stored == [(2048,), (256,)]
