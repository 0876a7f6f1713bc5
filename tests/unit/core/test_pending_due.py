"""The reason given for a ready task whose run_at has come: a claim takes it as it takes
waiting work, so it is held by what holds waiting work (room, a paused queue)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from libs.common.states import TaskState
from services.core.domain.pending import Pool, Standing, pending_reason
from services.core.domain.placement import Amount

NOW = datetime(2027, 1, 4, 12, 0, tzinfo=UTC)
POOL = Pool(name="default", paused=False, nodes=(), utilisation=0.0, defer_above=0.8)


def _ready(run_at: datetime, deferred: bool = False) -> Standing:
    return Standing(TaskState.READY, run_at, Amount(1, 256), deferred=deferred)


def test_a_due_ready_task_reads_as_waiting_work() -> None:
    due = _ready(NOW - timedelta(seconds=1))
    waiting = Standing(TaskState.WAITING, NOW, Amount(1, 256))
    assert pending_reason(due, POOL, NOW) == pending_reason(waiting, POOL, NOW)


def test_a_future_one_is_scheduled_and_a_deferral_moves_through_the_promoter() -> None:
    assert pending_reason(_ready(NOW + timedelta(hours=1)), POOL, NOW).startswith("scheduled")
    due_deferral = _ready(NOW - timedelta(seconds=1), deferred=True)
    assert pending_reason(due_deferral, POOL, NOW) == "due; moving to waiting"
