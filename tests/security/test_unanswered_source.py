"""A ``file://`` source behind a FUSE mount whose server never answers, against a real
root agent and core (``tests.support.fuse``: root mounts ``/dev/fuse`` itself): the start
gives up after the worker's time limit (``CAIRN_WORKER_SOURCE_TIMEOUT_S``) with a reason
naming the source and the limit. When the spawn helper's check gave up, the attempt is
handed back (the host's fault: no attempt spent), and while the path is held
(``HUNG_SOURCE_HOLD_S``) its next starts on that agent are handed back too, each one
limit after its claim, not in a hot loop; when the agent's own seal opened it, the task's
retry policy sees it. The worker goes on starting other attempts, and what hangs on the
source reaches core with its heartbeats (and leaves it once the mount is gone); asserted
from what the database holds."""

from __future__ import annotations

import hashlib
import itertools
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
from tests.support import shared_dir, wait_for
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


def _handed_back(server, db, body: dict, count: int) -> tuple[dict, list]:
    """Post the task, wait until ``count`` of its attempts were handed back, cancel it:
    the task as it was then, and its ended attempts' (outcome, error, ended_at), read
    before the cancel (which ends the attempt then in flight: each hand-back puts the
    task back in line at once, and the next attempt is leased while the test reads)."""
    with server.client() as alice:
        task = alice.post("/v1/tasks", json=body).json()

        def rows() -> list:
            return db.execute(
                "SELECT outcome, error, ended_at FROM core.attempts"
                " WHERE task_id = %s AND ended_at IS NOT NULL ORDER BY number",
                (task["id"],),
            ).fetchall()

        wait_for(lambda: len(rows()) >= count, 30)
        seen = alice.get(f"/v1/tasks/{task['id']}").json()
        ended = rows()
        assert alice.post(f"/v1/tasks/{task['id']}/cancel").status_code == 200
    return seen, ended


def test_a_source_under_a_fuse_mount_that_never_answers_is_handed_back(
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
        "retry": {"max_attempts": 1},
    }
    healthy = run(core, body)
    assert healthy["state"] == "succeeded" and "from-the-source" in healthy["log"], healthy

    # Someone mounts FUSE over the source's folder: the open of its path never returns.
    with unanswered_fuse(folder):
        jammed, rows = _handed_back(core, db, body, 3)
        # A source never sealed before: the agent's own open of it (its seal) gives up too.
        unsealed = {
            **body,
            "artifact": {**body["artifact"], "uri": (folder / "new.sh").as_uri()},
            "retry": {"max_attempts": 2, "base_s": 0.1, "jitter": False},
        }
        fresh = run(core, unsealed, until=("succeeded", "dead"))
        # The worker is not jammed: another task runs on it meanwhile.
        other = run(core, shell("echo still-serving"))
        # What hangs (the seal's thread, the helper's checker) goes from the agent's pulse
        # on its board, through its sidecar's beats, to core.
        wait_for(lambda: all(n >= 1 for n in _hung(db)), 30)
    # Handed back each time, spending none of its one attempt: it waits for a worker that
    # can read its source (or its cancel). A hand-back puts it back in line at once, so it
    # may be read with its next attempt leased (``running``): that one is counted until it
    # is handed back too.
    assert _none_spent(jammed) and jammed["state"] != "dead", jammed
    # Each told core why (``hand_back_cause``): counted towards CAIRN_SOURCE_UNANSWERED_MAX.
    counted = db.execute("SELECT source_handbacks FROM core.tasks WHERE id = %s", (jammed["id"],))
    assert counted.fetchone()[0] >= 3
    assert [outcome for outcome, _, _ in rows][:3] == ["handed_back"] * 3, rows
    for _, error, _ in rows:
        assert f"{task} did not answer within {LIMIT_S:g} s" in error, rows
    assert f"another start within {HUNG_SOURCE_HOLD_S:g} s" in rows[1][1], rows
    # A held path fails at once, but goes back one limit after its claim: no hot loop.
    gaps = [
        (later - earlier).total_seconds()
        for (_, _, earlier), (_, _, later) in itertools.pairwise(rows)
    ]
    assert all(gap >= 0.9 * LIMIT_S for gap in gaps), gaps
    assert fresh["state"] == "dead", fresh
    assert f"{folder / 'new.sh'}: it did not answer within {LIMIT_S:g} s" in fresh["last_error"]
    assert len(fresh["attempts_list"]) == 2, fresh["attempts_list"]
    assert other["state"] == "succeeded" and "still-serving" in other["log"], other
    # The mount gone, a start of that source is still handed back for a while: no helper
    # is asked again (each ask may leave a checker hanging) until HUNG_SOURCE_HOLD_S from
    # the check that hung (the first hand-back). The steps above took longer than that on
    # a loaded CI: then the hold is over, and the source, answering again, runs.
    left = db.execute(
        "SELECT EXTRACT(EPOCH FROM %s + make_interval(secs => %s) - now())::float8",
        (rows[0][2], HUNG_SOURCE_HOLD_S),
    ).fetchone()[0]
    began = time.monotonic()
    if left < 15:
        ran = run(core, body)
        assert ran["state"] == "succeeded" and "from-the-source" in ran["log"], ran
        print(f"unanswered source: the hold was {left:.0f} s from its end; the source ran")
    else:
        after, rows = _handed_back(core, db, body, 1)
        assert _none_spent(after), after
        assert rows[0][0] == "handed_back", rows
        assert f"another start within {HUNG_SOURCE_HOLD_S:g} s" in rows[0][1], rows
        assert time.monotonic() - began < 10
    # The mount gone, the open and the check returned: counted out (the helper asked
    # again by the pulse, though it started nothing since).
    wait_for(lambda: _hung(db) == (0, 0), 30)


def _none_spent(task: dict) -> bool:
    """Whether the task spent no attempt but the one it may have leased now (counted while
    it runs: a hand-back puts the task back in line at once)."""
    return task["attempts"] == (1 if task["state"] == "running" else 0)


def _hung(db) -> tuple[int, int]:
    """What core holds of the agents' threads and checkers hung on sources."""
    row = db.execute(
        "SELECT COALESCE(max(hung_source_threads), 0), COALESCE(max(hung_source_checkers), 0)"
        " FROM core.workers WHERE gone_at IS NULL"
    ).fetchone()
    return int(row[0]), int(row[1])
