"""A ``file://`` source behind a FUSE mount whose server never answers, against a real
root agent and core (``tests.support.fuse``: root mounts ``/dev/fuse`` itself): the start
fails after the worker's time limit (``CAIRN_WORKER_SOURCE_TIMEOUT_S``) with a reason
naming the source, whether the spawn helper's check or the agent's own seal opened it;
the task's retry policy sees it (its retry fails at once: ``HUNG_SOURCE_HOLD_S``), and
the worker goes on starting other attempts; asserted from what the database holds."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from services.worker.artifacts import QUIET_NS
from services.worker.host import HUNG_SOURCE_HOLD_S
from tests.security.test_hostile_tasks import (  # noqa: F401 - fixtures
    Agent,
    agents,
    core,
    run,
    shell,
)
from tests.support import shared_dir
from tests.support.fuse import unanswered_fuse

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
        reason="the agent runs as root, and root mounts FUSE itself",
    ),
]

LIMIT_S = 1.0
SCRIPT = b"#!/bin/sh\necho from-the-source\n"


def test_a_source_under_a_fuse_mount_that_never_answers_fails_its_start(
    core,  # noqa: F811
    agents,  # noqa: F811
    tmp_path,
    db,
):
    agents.append(Agent(core, tmp_path / "w", CAIRN_WORKER_SOURCE_TIMEOUT_S=str(LIMIT_S)))
    folder = shared_dir() / "tasks"
    folder.mkdir(mode=0o755)
    task = folder / "task.sh"
    task.write_bytes(SCRIPT)
    task.chmod(0o755)
    time.sleep(QUIET_NS / 1e9 + 0.2)  # quiet since: its stamp is remembered when sealed
    body = {
        **shell(""),
        "args": [],
        "artifact": {"uri": task.as_uri(), "sha256": hashlib.sha256(SCRIPT).hexdigest()},
        "retry": {"max_attempts": 2, "base_s": 0.1, "jitter": False},
    }
    healthy = run(core, body)
    assert healthy["state"] == "succeeded" and "from-the-source" in healthy["log"], healthy

    # Someone mounts FUSE over the source's folder: the open of its path never returns.
    with unanswered_fuse(folder):
        began = time.monotonic()
        jammed = run(core, body, until=("succeeded", "dead"))
        took = time.monotonic() - began
        rows = db.execute(
            "SELECT outcome, error, ended_at - started_at FROM core.attempts"
            " WHERE task_id = %s ORDER BY number",
            (jammed["id"],),
        ).fetchall()
        # A source never sealed before: the agent's own open of it (its seal) gives up too.
        unsealed = {**body, "artifact": {**body["artifact"], "uri": (folder / "new.sh").as_uri()}}
        fresh = run(core, unsealed, until=("succeeded", "dead"))
        # The worker is not jammed: another task runs on it meanwhile.
        other = run(core, shell("echo still-serving"))
    assert jammed["state"] == "dead", jammed
    assert len(rows) == 2, rows  # retried once, by the task's policy
    for outcome, error, lasted in rows:
        assert outcome == "failed", rows
        assert f"{task} did not answer within {LIMIT_S:g} s" in error, rows
        assert lasted.total_seconds() < LIMIT_S + 5, rows
    assert took < 2 * LIMIT_S + 20, took
    assert fresh["state"] == "dead", fresh
    assert f"{folder / 'new.sh'}: it did not answer within {LIMIT_S:g} s" in fresh["last_error"]
    assert len(fresh["attempts_list"]) == 2, fresh["attempts_list"]
    assert other["state"] == "succeeded" and "still-serving" in other["log"], other
    # The mount gone, a start of that source still fails at once for a while: no helper
    # is asked again (each ask may leave a checker hanging) until HUNG_SOURCE_HOLD_S.
    began = time.monotonic()
    after = run(core, {**body, "retry": {"max_attempts": 1}})
    assert after["state"] == "dead", after
    assert f"another start within {HUNG_SOURCE_HOLD_S:g} s" in after["last_error"], after
    assert time.monotonic() - began < 10
