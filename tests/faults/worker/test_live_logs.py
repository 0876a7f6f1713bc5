"""Live logs with real processes (docs/logs.md): a real worker agent runs a script that
prints a line every 0.2 s; its log is readable through core while it runs, and
``cairn logs -f`` (the CLI, a process of its own) prints the lines as they are written
and exits when the task ends."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from libs.common.settings import libpq_url
from tests.support import Core, spawn_worker, start_core, stop_process, wait_for

pytestmark = pytest.mark.slow

SH = Path("/bin/sh")
SH_SHA = hashlib.sha256(SH.read_bytes()).hexdigest()
LINES = 15
TICKER = f'for i in $(seq 1 {LINES}); do echo "line $i"; sleep 0.2; done'


@pytest.fixture
def core(db_url: str, tmp_path: Path) -> Iterator[Core]:
    server = start_core(db_url, tmp_path / "core", heartbeat_interval_s=0.5)
    yield server
    server.stop()


@pytest.fixture
def worker(core: Core, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    proc = spawn_worker(core, tmp_path / "worker", "log-worker")
    yield proc
    stop_process(proc, signal.SIGTERM)


def _ticker(core: Core) -> int:
    body = {
        "name": "ticker",
        "artifact": {"uri": f"file://{SH}", "sha256": SH_SHA},
        "args": ["-c", TICKER],
    }
    with core.client() as alice:
        answer = alice.post("/v1/tasks", json=body)
    assert answer.status_code == 201, answer.text
    return int(answer.json()["id"])


def _row(db_url: str, query: str, task_id: int) -> tuple:
    with psycopg.connect(libpq_url(db_url)) as conn:
        row = conn.execute(query, (task_id,)).fetchone()
    assert row is not None
    return row


def test_a_running_tasks_log_is_readable_before_it_ends(core: Core, worker) -> None:
    task_id = _ticker(core)
    with core.client() as alice:
        early = wait_for(
            lambda: (
                (r := alice.get(f"/v1/tasks/{task_id}/logs")).status_code == 200
                and "line 3\n" in r.text
                and r
            ),
            timeout=60,
        )
        # The attempt had not ended when its first lines were read.
        (ended,) = _row(
            core.db_url, "SELECT ended_at FROM core.attempts WHERE task_id = %s", task_id
        )
        assert ended is None
        assert early.headers["x-cairn-log-complete"] == "false"
        assert f"line {LINES}\n" not in early.text
        wait_for(lambda: alice.get(f"/v1/tasks/{task_id}").json()["state"] == "succeeded", 60)
        whole = alice.get(f"/v1/tasks/{task_id}/logs")
    assert whole.text == "".join(f"line {i}\n" for i in range(1, LINES + 1))
    assert whole.headers["x-cairn-log-complete"] == "true"


def test_logs_follow_prints_lines_as_they_are_written_and_exits_when_the_task_ends(
    core: Core, worker, tmp_path: Path
) -> None:
    task_id = _ticker(core)
    env = {
        **os.environ,
        "CAIRN_URL": core.url,
        "CAIRN_TOKEN": core.tokens["alice"],
        "CAIRN_HOME": str(tmp_path / "cli"),
        "CAIRN_CONFIG": str(tmp_path / "no-config.toml"),
    }
    seen: list[tuple[float, str]] = []
    with subprocess.Popen(
        [sys.executable, "-m", "cairn", "logs", "-f", str(task_id)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as cli:

        def read() -> None:
            assert cli.stdout is not None
            for line in cli.stdout:
                seen.append((time.time(), line))

        reader = threading.Thread(target=read)
        reader.start()
        try:
            code = cli.wait(timeout=90)
        finally:
            if cli.poll() is None:
                cli.kill()
            reader.join(timeout=10)
        assert cli.stderr is not None
        errors = cli.stderr.read()
    assert code == 0, errors
    assert [line for _, line in seen] == [f"line {i}\n" for i in range(1, LINES + 1)]
    assert "ended: succeeded" in errors
    (finished,) = _row(core.db_url, "SELECT finished_at FROM core.tasks WHERE id = %s", task_id)
    # Lines 0.2 s apart, shipped every 0.5 s: the first ones were printed seconds before
    # the end, and the CLI left right after it.
    assert seen[0][0] < finished.timestamp() - 1.5
    assert seen[LINES // 2][0] < finished.timestamp() - 0.5
    assert seen[-1][0] < finished.timestamp() + 2.0


def test_every_running_task_of_a_busy_worker_has_its_log_read_while_it_runs(
    core: Core, tmp_path: Path
) -> None:
    # More attempts running at once than one log request holds allowances for (8 at the
    # default rate and interval): each one's first line is readable while they all run,
    # not only the first 8 started (the others' went at their end).
    count = 12
    proc = spawn_worker(core, tmp_path / "busy", "busy-log-worker")
    body = {
        "name": "busy",
        "artifact": {"uri": f"file://{SH}", "sha256": SH_SHA},
        "args": ["-c", "echo hello; sleep 20"],
        "resources": {"cpu": 0.25, "memory_mb": 128},
    }
    try:
        with core.client() as alice:
            answers = [alice.post("/v1/tasks", json=body) for _ in range(count)]
            assert all(a.status_code == 201 for a in answers), answers[-1].text
            ids = [a.json()["id"] for a in answers]

            def running() -> bool:
                states = [alice.get(f"/v1/tasks/{i}").json()["state"] for i in ids]
                return states.count("running") == count

            wait_for(running, timeout=30)

            def unread() -> list[int]:
                return [i for i in ids if "hello" not in alice.get(f"/v1/tasks/{i}/logs").text]

            with contextlib.suppress(TimeoutError, AssertionError):
                wait_for(lambda: not unread(), timeout=5)
            assert unread() == []
    finally:
        stop_process(proc, signal.SIGKILL)
