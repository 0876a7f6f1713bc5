"""The reaper's hearing gap (docs/faults.md, "Silence counts from when core could hear"):
a pause of the reaper short enough that it could not have hidden a healthy worker's beats
keeps core's hearing, so a worker that really died is reaped at once and pays for it; a
longer one restarts the count. Core's own reaper is kept out of the way (a one-hour
timeout); these tests turn a reaper of their own on a clock they move."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from services.core import loops
from services.core.db.feed import Notifier
from services.core.settings import CoreSettings
from tests.support import REAPER_AWAY, Core, register_worker, spec

DB = psycopg.Connection[tuple[Any, ...]]
OFFER = {"hostname": "w.test", "queues": ["default"], "cpu": 8, "memory_mb": 16384}


pytestmark = REAPER_AWAY


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _settings(tmp_path: Path, db_url: str, interval_s: float, timeout_s: float) -> CoreSettings:
    return CoreSettings(
        home=tmp_path, database_url=db_url,
        heartbeat_interval_s=interval_s, heartbeat_timeout_s=timeout_s,
    )  # fmt: skip


def _running_worker(core: Core) -> tuple[int, int]:
    """A worker holding one attempt of a new task, seen running: (worker id, task id)."""
    with core.client("alice") as alice:
        task = alice.post("/v1/tasks", json=spec()).json()["id"]
    with core.client("w", "worker") as http:
        worker = register_worker(http, OFFER)
        room = {"cpu": 8, "memory_mb": 16384, "max": 1}
        [attempt] = http.post(f"/v1/workers/{worker}/claim", json=room).json()["attempts"]
        beat = {"attempts": [attempt["attempt_id"]]}
        http.post(f"/v1/workers/{worker}/heartbeat", json=beat).raise_for_status()
    assert attempt["task_id"] == task
    return worker, task


def _reap(db_url: str, settings: CoreSettings, hearing: loops.Hearing) -> int:
    async def once() -> int:
        engine = create_async_engine(db_url)
        try:
            return await loops.reap_once(engine, Notifier(db_url), settings, hearing)
        finally:
            await engine.dispose()

    return asyncio.run(once())


def _heard_for(hearing: loops.Hearing, clock: Clock, seconds: float, turn_s: float) -> None:
    """The reaper's turns, every ``turn_s`` for ``seconds`` of the clock."""
    end = clock.now + seconds
    while clock.now < end:
        hearing.heard()
        clock.now += turn_s


def _silent_for(db: DB, worker: int, seconds: float) -> None:
    db.execute(
        "UPDATE core.workers SET last_heartbeat_at = now() - make_interval(secs => %s)"
        " WHERE id = %s",
        (seconds, worker),
    )


def _loss(db: DB, task: int) -> tuple[Any, ...]:
    return db.execute(
        "SELECT t.state, t.attempts, a.outcome, a.error FROM core.tasks t"
        " JOIN core.attempts a ON a.task_id = t.id WHERE t.id = %s",
        (task,),
    ).fetchone()


def test_a_pause_shorter_than_the_gap_keeps_hearing_and_a_dead_worker_pays(
    core: Core, db: DB, db_url: str, tmp_path: Path
) -> None:
    # 10 s beats, 60 s timeout: the reaper turns every 5 s, so 3 turns are 15 s; a pause
    # of 20 s (a database failover) hides a healthy worker's beats for 30 s at most.
    settings = _settings(tmp_path, db_url, 10, 60)
    clock = Clock()
    hearing = loops.Hearing.of(settings, clock)
    worker, task = _running_worker(core)
    _heard_for(hearing, clock, 80, loops.reap_period(settings))
    clock.now += 20
    _silent_for(db, worker, 70)  # it stopped beating 50 s before the pause
    assert _reap(db_url, settings, hearing) > 0
    state, spent, outcome, error = _loss(db, task)
    assert (state, spent, outcome) == ("failed", 1, "lost")
    assert error == f"its worker {worker} stopped heartbeating"


def test_a_pause_longer_than_timeout_less_interval_restarts_the_count(
    core: Core, db: DB, db_url: str, tmp_path: Path
) -> None:
    # 60 s beats, 90 s timeout: a worker beating on time may be silent 60 s + the pause,
    # so a 40 s pause could bury a healthy one: it must count as core not hearing.
    settings = _settings(tmp_path, db_url, 60, 90)
    clock = Clock()
    hearing = loops.Hearing.of(settings, clock)
    worker, task = _running_worker(core)
    _heard_for(hearing, clock, 120, loops.reap_period(settings))
    clock.now += 40
    _silent_for(db, worker, 100)  # its last beat came 60 s before the pause
    assert _reap(db_url, settings, hearing) == 0
    assert db.execute("SELECT state FROM core.workers WHERE id = %s", (worker,)).fetchone() == (
        "live",
    )
    # Heard for a whole timeout since, and still silent: dead, at no cost.
    _heard_for(hearing, clock, 95, loops.reap_period(settings))
    _silent_for(db, worker, 240)
    assert _reap(db_url, settings, hearing) > 0
    state, spent, outcome, error = _loss(db, task)
    assert (state, spent, outcome) == ("waiting", 0, "lost")
    assert error == f"its worker {worker} stopped heartbeating while core could not hear it"


@pytest.mark.parametrize(
    ("interval_s", "timeout_s", "gap_s"),
    [
        (60, 180, 90),  # the defaults: half the timeout
        (10, 60, 30),
        (0.2, 1.0, 0.75),  # short timeouts: three turns of a quarter timeout
        (60, 90, 30),  # a long interval: timeout - interval
        (1, 15, 11.25),
    ],
)
def test_the_gap_is_half_the_timeout_within_three_turns_and_timeout_less_interval(
    tmp_path: Path, db_url: str, interval_s: float, timeout_s: float, gap_s: float
) -> None:
    settings = _settings(tmp_path, db_url, interval_s, timeout_s)
    assert loops.hearing_gap(settings) == pytest.approx(gap_s)


def test_a_beat_on_time_never_outlasts_the_timeout_within_the_gap(
    tmp_path: Path, db_url: str
) -> None:
    """Wherever three reaper turns fit in timeout - interval, a deafness that keeps hearing
    cannot make a worker that beats on time look silent for the timeout."""
    for interval_s in (0.2, 0.5, 1, 5, 10, 20, 30, 45, 60, 90):
        for timeout_s in (1, 2, 3, 10, 15, 30, 60, 90, 120, 180, 600):
            if timeout_s <= interval_s:
                continue  # refused by the settings
            settings = _settings(tmp_path, db_url, interval_s, timeout_s)
            if 3 * loops.reap_period(settings) > timeout_s - interval_s:
                continue
            assert loops.hearing_gap(settings) + interval_s <= timeout_s, (interval_s, timeout_s)


def test_a_worker_declared_dead_is_logged_with_its_id_why_and_what_it_cost(
    core: Core, db: DB, db_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # the metrics counted it, the task's events said it; core's log had no line at all
    settings = _settings(tmp_path, db_url, 10, 60)
    clock = Clock()
    hearing = loops.Hearing.of(settings, clock)
    worker, _ = _running_worker(core)
    _heard_for(hearing, clock, 80, loops.reap_period(settings))
    _silent_for(db, worker, 70)
    with caplog.at_level("WARNING", logger="cairn.core.dispatch"):
        assert _reap(db_url, settings, hearing) > 0
    [line] = [r for r in caplog.records if r.name == "cairn.core.dispatch"]
    assert line.getMessage() == (
        f"worker {worker} declared dead (worker {worker} stopped heartbeating); attempts lost: 1"
    )
    assert line.worker_id == worker  # type: ignore[attr-defined]
