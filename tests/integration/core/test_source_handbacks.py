"""A task whose ``file://`` source does not answer on any worker is handed back, each
time at no cost, until ``CAIRN_SOURCE_UNANSWERED_MAX`` such hand-backs in a row bury it
(docs/security.md, "A ``file://`` source that does not answer"); other hand-backs (a
drain) and a report without a cause (an older agent's) are never counted. What of a
worker's agent hangs on such sources reaches core with its heartbeats, for the gauge
``cairn_workers_hung_sources``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from libs.common.client import CoreClient
from services.worker import sidecar
from services.worker.state import Board
from tests.support import Core, TurnWorker, spec, wait_for

CAP = 3
pytestmark = pytest.mark.core(heartbeat_timeout_s=3600.0, source_unanswered_max=CAP)
DB = psycopg.Connection[tuple[Any, ...]]
ROOM = {"cpu": 8, "memory_mb": 16384, "max": 1}
UNANSWERED = (
    "cannot start /var/lib/cairn/attempts/1/run: its file:// source /bin/true did not "
    "answer within 5 s: its file system hangs (CAIRN_WORKER_SOURCE_TIMEOUT_S)"
)


@pytest.fixture
def worker(core: Core) -> Iterator[TurnWorker]:
    w = TurnWorker(core, "w1")
    yield w
    w.http.close()


def _submit(core: Core, **overrides: Any) -> int:
    with core.client("alice") as alice:
        answer = alice.post("/v1/tasks", json=spec(**overrides))
        assert answer.status_code == 201, answer.text
        return int(answer.json()["id"])


def _hand_back(worker: TurnWorker, **report: Any) -> dict[str, Any]:
    """Claim the one waiting task and hand its attempt back as ``report`` says: the
    verdict."""
    [attempt] = worker.turn(claim=ROOM)["attempts"]
    body = {"attempt_id": attempt["attempt_id"], "outcome": "handed_back", **report}
    [verdict] = worker.turn(reports=[body])["reports"]
    assert verdict["status"] == 200, verdict
    return dict(verdict)


def _task(db: DB, task_id: int) -> tuple[Any, ...]:
    row = db.execute(
        "SELECT state, attempts, source_handbacks, last_error FROM core.tasks WHERE id = %s",
        (task_id,),
    ).fetchone()
    assert row is not None
    return tuple(row)


def test_a_source_that_never_answers_buries_its_task_after_the_cap(
    core: Core, worker: TurnWorker, db: DB
) -> None:
    task = _submit(core, retry={"max_attempts": 1})
    for n in range(1, CAP):
        verdict = _hand_back(worker, error=UNANSWERED, hand_back_cause="source")
        assert verdict["state"] == "waiting"
        assert _task(db, task) == ("waiting", 0, n, None)
    verdict = _hand_back(worker, error=UNANSWERED, hand_back_cause="source")
    assert verdict["state"] == "dead"
    assert _task(db, task) == ("dead", 0, CAP, UNANSWERED)
    [reason] = db.execute(
        "SELECT reason FROM core.task_events WHERE task_id = %s AND to_state = 'dead'", (task,)
    ).fetchone()
    assert reason == (
        f"its source file:///bin/true did not answer on {CAP} starts in a row "
        "(CAIRN_SOURCE_UNANSWERED_MAX): retry it once its file system answers"
    )
    outcomes = db.execute(
        "SELECT outcome, error FROM core.attempts WHERE task_id = %s ORDER BY id", (task,)
    ).fetchall()
    assert outcomes == [("handed_back", UNANSWERED)] * CAP
    # A person's retry starts the count again.
    with core.client("alice") as alice:
        assert alice.post(f"/v1/tasks/{task}/retry").status_code == 200
    assert _task(db, task)[:3] == ("waiting", 0, 0)
    assert _hand_back(worker, error=UNANSWERED, hand_back_cause="source")["state"] == "waiting"
    assert _task(db, task)[2] == 1


def test_only_hand_backs_in_a_row_of_an_unanswered_source_count(
    core: Core, worker: TurnWorker, db: DB
) -> None:
    task = _submit(core, retry={"max_attempts": 5})
    for _ in range(CAP - 1):
        _hand_back(worker, error=UNANSWERED, hand_back_cause="source")
    # A drain's hand-back and an older agent's (no cause) neither count nor reset.
    for _ in range(CAP):
        assert _hand_back(worker, error="the worker is draining")["state"] == "waiting"
        assert _hand_back(worker, error=UNANSWERED)["state"] == "waiting"
    assert _task(db, task)[:3] == ("waiting", 0, CAP - 1)
    # An attempt that ran (its source answered): the count starts again.
    [attempt] = worker.turn(claim=ROOM)["attempts"]
    failed = {"attempt_id": attempt["attempt_id"], "outcome": "failed", "exit_code": 1}
    assert worker.turn(reports=[failed])["reports"][0]["status"] == 200
    assert _task(db, task)[:3] == ("failed", 1, 0)
    db.execute("UPDATE core.tasks SET run_at = now() WHERE id = %s", (task,))  # no backoff
    wait_for(lambda: _task(db, task)[0] == "waiting")
    for n in range(1, CAP):
        assert _hand_back(worker, error=UNANSWERED, hand_back_cause="source")["state"] == "waiting"
        assert _task(db, task)[2] == n


def test_a_cause_is_refused_on_any_other_outcome_and_any_other_value(worker: TurnWorker) -> None:
    for report in (
        {"attempt_id": 1, "outcome": "failed", "hand_back_cause": "source"},
        {"attempt_id": 1, "outcome": "handed_back", "hand_back_cause": "drain"},
    ):
        answer = worker.post_turn(reports=[report])
        assert answer.status_code == 422 and "hand_back_cause" in answer.text, answer.text


def test_what_hangs_on_sources_reaches_core_from_the_board_through_a_beat(
    core: Core, worker: TurnWorker, db: DB, tmp_path: Path
) -> None:
    """The agent marks on its board what of it hangs on sources (threads, checkers); its
    sidecar's beat tells core, which keeps it on the worker and reports it by pool."""
    board = Board.create()
    lease = worker.http.headers["X-Cairn-Worker-Lease"]

    async def beat() -> bool:
        async with CoreClient(core.url, core.token("w1", "worker")) as client:
            client.use_lease(lease)
            return await sidecar._beat(tmp_path, worker.id, {}, client, board.hung())

    def held() -> tuple[Any, ...]:
        row = db.execute(
            "SELECT hung_source_threads, hung_source_checkers FROM core.workers WHERE id = %s",
            (worker.id,),
        ).fetchone()
        assert row is not None
        return tuple(row)

    def gauge(kind: str) -> float:
        text = httpx.get(core.url + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "cairn_workers_hung_sources" and sample.labels == {
                    "pool": "default",
                    "kind": kind,
                }:
                    return float(sample.value)
        raise AssertionError(f"no cairn_workers_hung_sources for kind {kind}")

    try:
        board.pulse(1.0, (2, 3))
        assert asyncio.run(beat())
        assert held() == (2, 3)
        assert (gauge("thread"), gauge("checker")) == (2.0, 3.0)
        # More than a beat may say (a helper for each of thousands of busy cgroup v1
        # slots, each with its checkers held aside): told as the most it may say, and
        # the beat still goes through.
        board.pulse(2.0, (0, 80_000))
        assert asyncio.run(beat())
        assert held() == (0, 10_000)
        board.pulse(3.0)  # nothing hangs any more
        assert asyncio.run(beat())
        assert held() == (0, 0)
        assert (gauge("thread"), gauge("checker")) == (0.0, 0.0)
    finally:
        board.close()
    bad = worker.http.post(
        f"/v1/workers/{worker.id}/heartbeat", json={"attempts": [], "hung_source_threads": -1}
    )
    assert bad.status_code == 422 and "hung_source_threads" in bad.text, bad.text


def test_a_services_exit_and_a_bulk_retry_start_the_count_again(
    core: Core, worker: TurnWorker, db: DB
) -> None:
    service = _submit(core, kind="service")
    for _ in range(CAP - 1):
        assert _hand_back(worker, error=UNANSWERED, hand_back_cause="source")["state"] == "waiting"
    assert _task(db, service)[2] == CAP - 1
    # Its exit, decided with its restart history (``_FINISH``'s ``ran``): its source answered.
    [attempt] = worker.turn(claim=ROOM)["attempts"]
    exited = {"attempt_id": attempt["attempt_id"], "outcome": "failed", "exit_code": 1}
    assert worker.turn(reports=[exited])["reports"][0]["status"] == 200
    assert _task(db, service)[::2] == ("failed", 0)
    with core.client("alice") as alice:
        assert alice.post(f"/v1/tasks/{service}/cancel").status_code == 200
    # Buried for its source, then retried in bulk: the count starts again.
    task = _submit(core)
    for _ in range(CAP):
        _hand_back(worker, error=UNANSWERED, hand_back_cause="source")
    assert _task(db, task)[:3] == ("dead", 0, CAP)
    with core.client("alice") as alice:
        done = alice.post("/v1/tasks/retry", json={"filter": {"state": "dead"}})
        assert done.status_code == 200 and done.json()["changed"] == 1, done.text
    assert _task(db, task)[:3] == ("waiting", 0, 0)
