"""Core away for longer than the heartbeat timeout: when it comes back it counts a
worker's silence only from when it could hear again, so healthy workers live on; an
attempt lost because its worker fell silent while core was away costs nothing."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.support import Core, register_worker, spec, start_core, wait_for

pytestmark = pytest.mark.slow

DB = psycopg.Connection[tuple[Any, ...]]
TIMING = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.0}


# Each worker's lease secret, by its id: its heartbeats must carry it.
LEASES: dict[int, str] = {}


class Beater:
    """A sidecar in a thread: beats every 0.2 s with the attempts it runs, whichever core
    answers, until stopped."""

    def __init__(self, urls: list[str], token: str, worker: int, attempts: list[int]) -> None:
        self.urls = urls
        self.token = token
        self.worker = worker
        self.attempts = attempts
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        headers = {
            "Authorization": f"Bearer {self.token}",
            "X-Cairn-Worker-Lease": LEASES[self.worker],
        }
        while not self.stopped.wait(0.2):
            for url in list(self.urls):
                try:
                    httpx.post(
                        f"{url}/v1/workers/{self.worker}/heartbeat",
                        json={"attempts": self.attempts},
                        headers=headers,
                        timeout=1,
                    )
                except httpx.HTTPError:
                    continue

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)


def _lease(core: Core) -> tuple[int, int, int]:
    """A worker holding one running attempt: (worker, task, attempt)."""
    with core.client("alice") as alice, core.client("w", "worker") as http:
        task_id = alice.post("/v1/tasks", json=spec()).json()["id"]
        offer = {"hostname": "w", "queues": ["default"], "cpu": 4, "memory_mb": 4096}
        worker = register_worker(http, offer)
        LEASES[worker] = http.headers["X-Cairn-Worker-Lease"]
        room = {"cpu": 4, "memory_mb": 4096, "max": 1, "wait": 5}
        (attempt,) = http.post(f"/v1/workers/{worker}/claim", json=room).json()["attempts"]
        return worker, task_id, attempt["attempt_id"]


def _silent_for(db: DB, worker: int) -> float:
    row = db.execute(
        "SELECT EXTRACT(EPOCH FROM now() - last_heartbeat_at) FROM core.workers WHERE id = %s",
        (worker,),
    ).fetchone()
    assert row is not None
    return float(row[0])


def _seen(db: DB, attempt: int) -> bool:
    row = db.execute("SELECT seen_at IS NOT NULL FROM core.attempts WHERE id = %s", (attempt,))
    return row.fetchone() == (True,)


def _outage(core: Core, db: DB, worker: int, db_url: str, home: Path) -> Core:
    """Stop core until the worker has been silent for twice the timeout; start another."""
    core.stop()
    wait_for(lambda: _silent_for(db, worker) > 2.5, timeout=15, interval=0.1)
    return start_core(db_url, home, **TIMING)


def test_workers_that_beat_again_survive_a_core_outage_longer_than_the_timeout(
    db_url: str, db: DB, tmp_path: Path
) -> None:
    first = start_core(db_url, tmp_path / "a", **TIMING)
    worker, task_id, attempt = _lease(first)
    beater = Beater([first.url], first.tokens["w"], worker, [attempt])
    try:
        wait_for(lambda: _seen(db, attempt))
        second = _outage(first, db, worker, db_url, tmp_path / "b")
        beater.urls.append(second.url)
        started = db.execute("SELECT now()").fetchone()
        assert started is not None
        # Heard again for three timeouts: the old reaper declared it dead at once.
        wait_for(
            lambda: (
                db.execute(
                    "SELECT last_heartbeat_at > %s + interval '3 seconds' OR state <> 'live'"
                    " FROM core.workers WHERE id = %s",
                    (started[0], worker),
                ).fetchone()
                == (True,)
            ),
            timeout=20,
        )
        state = db.execute("SELECT state FROM core.workers WHERE id = %s", (worker,)).fetchone()
        assert state == ("live",)
        task = db.execute("SELECT state, crashes FROM core.tasks WHERE id = %s", (task_id,))
        assert task.fetchone() == ("running", 0)
        second.stop()
    finally:
        beater.stop()


def test_an_attempt_lost_while_core_was_away_costs_no_crash(
    db_url: str, db: DB, tmp_path: Path
) -> None:
    first = start_core(db_url, tmp_path / "a", **TIMING)
    worker, task_id, attempt = _lease(first)
    beater = Beater([first.url], first.tokens["w"], worker, [attempt])
    wait_for(lambda: _seen(db, attempt))  # a beat has shown it running
    beater.stop()  # its sidecar gave up during the outage: it never beats again
    second = _outage(first, db, worker, db_url, tmp_path / "b")
    try:
        wait_for(
            lambda: (
                db.execute("SELECT state FROM core.workers WHERE id = %s", (worker,)).fetchone()
                == ("dead",)
            ),
            timeout=15,
        )
        task = db.execute(
            "SELECT state, crashes, attempts FROM core.tasks WHERE id = %s", (task_id,)
        ).fetchone()
        assert task == ("waiting", 0, 0)
        outcome = db.execute("SELECT outcome FROM core.attempts WHERE id = %s", (attempt,))
        assert outcome.fetchone() == ("lost",)
    finally:
        second.stop()
