"""A task's retry policy with a real worker agent (``python -m services.worker``) and a
real core: a script that exits with the do-not-retry code, one killed by a signal its
policy never retries, and one whose transient exit code is always retried, each judged by
what the database holds afterwards."""

from __future__ import annotations

import pytest

from libs.common.models import NO_RETRY_EXIT_CODE
from tests.faults.worker import test_worker as base
from tests.faults.worker.test_worker import shell, start_worker
from tests.support import Core, shared_dir, wait_for

pytestmark = pytest.mark.slow

# the same core and agents as test_worker's
core, workers = base.core, base.workers


def _ended(core: Core, task_id: int, state: str) -> dict:
    with core.client() as alice:
        wait_for(lambda: alice.get(f"/v1/tasks/{task_id}").json()["state"] == state, timeout=40)
        return {
            "events": alice.get(f"/v1/tasks/{task_id}/events").json()["items"],
            "attempts": alice.get(f"/v1/tasks/{task_id}/attempts").json()["items"],
        }


def test_a_script_exiting_the_no_retry_code_runs_once_and_is_dead(core, workers, tmp_path, db):
    start_worker(core, tmp_path / "w1", workers)
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=shell(f"exit {NO_RETRY_EXIT_CODE}")).json()
    seen = _ended(core, task["id"], "dead")
    assert [(a["outcome"], a["exit_code"]) for a in seen["attempts"]] == [
        ("failed", NO_RETRY_EXIT_CODE)
    ]
    assert seen["events"][-1]["reason"].startswith(f"not retryable: exited {NO_RETRY_EXIT_CODE}")
    assert db.execute("SELECT attempts, max_attempts FROM core.tasks").fetchone() == (1, 5)


def test_a_signal_the_policy_never_retries_ends_the_task_at_once(core, workers, tmp_path, db):
    start_worker(core, tmp_path / "w1", workers)
    with core.client() as alice:
        body = shell("kill -SEGV $$", retry={"max_attempts": 5, "never": {"signals": [11]}})
        task = alice.post("/v1/tasks", json=body).json()
    seen = _ended(core, task["id"], "dead")
    assert seen["events"][-1]["reason"] == "not retryable: signal 11 is never retried"
    assert db.execute("SELECT outcome, signal FROM core.attempts").fetchall() == [("crashed", 11)]


def test_an_always_retried_exit_code_runs_again_without_spending_an_attempt(
    core, workers, tmp_path, db
):
    start_worker(core, tmp_path / "w1", workers)
    flag = shared_dir() / "second-time"
    script = f"if [ -e {flag} ]; then exit 0; fi; touch {flag}; exit 75"
    retry = {"max_attempts": 1, "base_s": 0.1, "jitter": False, "always": {"exit_codes": [75]}}
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=shell(script, retry=retry)).json()
    seen = _ended(core, task["id"], "succeeded")
    assert [(a["outcome"], a["exit_code"]) for a in seen["attempts"]] == [
        ("failed", 75),
        ("succeeded", 0),
    ]
    assert db.execute("SELECT attempts FROM core.tasks").fetchone() == (1,)
