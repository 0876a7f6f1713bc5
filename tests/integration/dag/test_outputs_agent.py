"""Outputs through a real worker agent (``python -m services.worker``, attempts under
uids of their own): a task writes ``$CAIRN_OUTPUTS``, the agent sends it with the report,
core keeps it, and the DAG service hands it to a mapped node and to a fan-in, which
checks what it got. A symbolic link in place of the file is refused, not followed."""

from __future__ import annotations

import hashlib
import signal
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.fixtures.dag import Runner, states, workflow
from tests.support import Core, spawn_worker, stop_process

pytestmark = pytest.mark.slow

SH = Path("/bin/sh")
SH_SHA = hashlib.sha256(SH.read_bytes()).hexdigest()


def sh(name: str, script: str, *args: str, **extra: object) -> dict:
    task = {"artifact": {"uri": f"file://{SH}", "sha256": SH_SHA}, "args": ["-c", script, *args]}
    return {"name": name, "task": task, **extra}


@pytest.fixture
def agent(core: Core, tmp_path: Path) -> Iterator[None]:
    proc = spawn_worker(core, tmp_path / "worker", "outputs-worker")
    yield
    stop_process(proc, signal.SIGTERM)


def test_outputs_written_by_real_processes_reach_a_map_and_a_fan_in(
    runner: Runner, agent: None
) -> None:
    body = workflow(
        "real-outputs",
        [
            sh(
                "list",
                """printf '{"files": ["a", "b", "c"]}' > "$CAIRN_OUTPUTS" """,
                outputs={"files": {}},
            ),
            sh(
                "each",
                """printf '{"done": "%s-done"}' "$0" > "$CAIRN_OUTPUTS" """,
                "{{ map.item }}",
                depends_on=["list"],
                map={"over": "{{ nodes.list.outputs.files }}"},
                outputs={"done": {}},
            ),
            sh(
                "check",
                """test "$0" = '["a-done","b-done","c-done"]'""",
                "{{ nodes.each.outputs.done }}",
                depends_on=["each"],
            ),
        ],
    )
    run = runner.run(body, timeout=90)
    assert states(run) == {
        "list": "succeeded",
        "each": "succeeded",
        "each[0]": "succeeded",
        "each[1]": "succeeded",
        "each[2]": "succeeded",
        "check": "succeeded",
    }
    each = next(n for n in run["nodes"] if n["name"] == "each")
    assert each["outputs"] == {"done": ["a-done", "b-done", "c-done"]}


def test_a_symlink_in_place_of_the_outputs_file_fails_the_node_unread(
    runner: Runner, agent: None, db: psycopg.Connection
) -> None:
    body = workflow(
        "sneaky",
        [sh("leak", """ln -s /etc/passwd "$CAIRN_OUTPUTS" """, outputs={"root": {}})],
    )
    run = runner.run(body, timeout=90)
    assert run["state"] == "failed"
    leak = run["nodes"][0]
    assert leak["state"] == "failed"
    assert leak["outputs"] is None
    error, outputs = db.execute(
        "SELECT t.last_error, a.outputs FROM core.tasks t"
        " JOIN core.attempts a ON a.id = t.current_attempt_id WHERE t.id = %s",
        (leak["task_id"],),
    ).fetchone()
    assert error.startswith("CAIRN_OUTPUTS: cannot be opened")
    assert outputs is None
