"""The outcome table: what each reported outcome does to a task, and when the agent may
start a lease without asking core (the last answered turn vouches for it)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest

from libs.common.models import Report
from libs.common.states import TaskState
from services.core.domain import outcomes
from services.core.domain.transitions import TRANSITIONS, Op
from services.worker.agent import vouches

S = TaskState


@dataclass(frozen=True)
class Task:
    kind: str = "task"
    attempts: int = 1
    max_attempts: int = 3
    recent_crashes: int = 0
    poison_after: int = 3
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 60.0
    backoff_jitter: bool = False
    poison_window_s: float = 72 * 3600.0
    retry_causes: dict[str, Any] | None = None
    artifact_uri: str = "file:///opt/jobs/report"
    source_handbacks: int = 0


def test_every_outcome_a_worker_may_report_is_in_the_table() -> None:
    reported = set(Report.model_fields["outcome"].annotation.__args__)  # type: ignore[union-attr]
    assert set(outcomes.OUTCOMES) == reported


@pytest.mark.parametrize(
    ("outcome", "op", "target", "refund"),
    [
        ("succeeded", Op.SUCCEED, S.SUCCEEDED, False),
        ("handed_back", Op.REQUEUE, S.WAITING, True),
        ("preempted", Op.PREEMPT, S.WAITING, True),
        ("failed", Op.FAIL, S.FAILED, False),
        ("timeout", Op.FAIL, S.FAILED, False),
        ("oom_killed", Op.FAIL, S.FAILED, False),
        ("crashed", Op.FAIL, S.FAILED, False),
    ],
)
def test_each_outcome_makes_a_move_the_transitions_table_allows(
    outcome: str, op: Op, target: TaskState, refund: bool
) -> None:
    move = outcomes.reported(Task(), outcome, None, retryable=True)
    assert move is not None
    assert (move.op, move.target, move.refund) == (op, target, refund)
    assert S.RUNNING in TRANSITIONS[move.op].sources and move.target in TRANSITIONS[move.op].targets
    assert move.crashed == (outcome == "crashed")


def test_failures_are_buried_when_not_retryable_spent_or_poisoned() -> None:
    assert outcomes.reported(Task(), "failed", "x", retryable=False).reason == "not retryable"  # type: ignore[union-attr]
    spent = outcomes.reported(Task(attempts=3), "failed", None, retryable=True)
    assert spent is not None and (spent.target, spent.reason) == (S.DEAD, "attempts spent (3)")
    poisoned = outcomes.reported(Task(recent_crashes=2), "crashed", None, retryable=True)
    assert poisoned is not None and poisoned.reason == "poison pill: lost 3 times within 72 h"
    retried = outcomes.reported(Task(), "failed", None, retryable=True)
    assert retried is not None and retried.delay_s == 1.0 and retried.error == "attempt failed"


def test_a_services_exit_is_left_to_its_restart_history_but_a_hand_back_is_not() -> None:
    service = Task(kind="service")
    assert outcomes.reported(service, "succeeded", None, retryable=True) is None
    assert outcomes.reported(service, "crashed", None, retryable=True) is None
    back = outcomes.reported(service, "handed_back", "draining", retryable=True)
    assert back is not None and (back.op, back.reason) == (Op.REQUEUE, "draining")
    final = outcomes.reported(service, "failed", None, retryable=False)
    assert final is not None and final.target is S.DEAD


def test_a_preemption_names_the_task_it_made_room_for() -> None:
    move = outcomes.reported(Task(), "preempted", "memory", retryable=True, preempted_by=7)
    assert move is not None and move.reason == "preempted by task 7, requeued"


def test_a_recent_turn_vouches_for_a_lease_and_an_old_one_does_not() -> None:
    # Heartbeat every 1 s, dead after 8 s of silence: a turn vouches for 6 s after it was sent.
    assert vouches(100.0, 105.9, 1.0, 8.0)
    assert not vouches(100.0, 106.0, 1.0, 8.0)
    assert not vouches(-math.inf, 0.0, 1.0, 8.0)


def test_a_turn_vouches_for_less_by_how_far_the_stored_liveness_may_lag_it() -> None:
    # The same bounds, the worker's times rewritten only when 2 s old: 4 s.
    assert vouches(100.0, 103.9, 1.0, 8.0, lag_s=2.0)
    assert not vouches(100.0, 104.0, 1.0, 8.0, lag_s=2.0)


def test_a_calls_counts_are_its_moves_added_up() -> None:
    """What the dispatch path counts for the metrics is returned with each result and
    added by the caller (no out-parameter): a burial, a poison pill, losses, waits."""
    from collections import Counter

    from services.core.db.attempts import Tally

    buried = outcomes.Move(Op.FAIL, TaskState.DEAD, "attempts exhausted")
    poisoned = outcomes.Move(Op.FAIL, TaskState.DEAD, "poison pill: crashed 3 times")
    retried = outcomes.Move(Op.FAIL, TaskState.FAILED, "exit 1")
    total = (
        Tally.of(buried)
        + Tally.of(poisoned)
        + Tally.of(retried)
        + Tally(lost=2, waits=[0.5], held=Counter(quota=1))
        + Tally(waits=[1.5], held=Counter(quota=2, rate=1))
    )
    assert (total.buried, total.poisoned, total.lost) == (2, 1, 2)
    assert total.waits == [0.5, 1.5] and total.held == Counter(quota=3, rate=1)
    assert Tally.of(retried) == Tally()


def test_an_attempt_missing_from_beats_is_gone_after_two_beats_and_a_second() -> None:
    from services.core.domain.workers import missing_grace_s

    assert missing_grace_s(60.0) == 121.0
    assert missing_grace_s(0.5) == 2.0


def _causes(**lists: dict[str, list[int]]) -> dict[str, Any]:
    return {
        name: {"exit_codes": [], "signals": [], **lists.get(name, {})}
        for name in ("never", "always")
    }


def test_a_listed_cause_decides_before_the_budget_and_the_poison_count() -> None:
    from libs.common.models import ALWAYS_RETRY_LIMIT, NO_RETRY_EXIT_CODE

    task = Task(retry_causes=_causes(never={"exit_codes": [3]}, always={"signals": [15]}))
    never = outcomes.reported(task, "failed", None, retryable=True, cause=outcomes.Cause(3))
    assert never is not None and (never.op, never.reason) == (
        Op.BURY,
        "not retryable: exit code 3 is never retried",
    )
    # the last crash before a poison pill, but SIGTERM is always retried: not a crash
    spent = Task(attempts=3, recent_crashes=2, retry_causes=task.retry_causes)
    kept = outcomes.reported(
        spent, "crashed", None, retryable=True, cause=outcomes.Cause(None, 15, 3)
    )
    assert kept is not None and (kept.op, kept.refund, kept.crashed) == (Op.FAIL, True, False)
    assert kept.delay_s == 4.0  # the curve at the attempt's number, not the budget's
    late = outcomes.Cause(None, 15, ALWAYS_RETRY_LIMIT)
    assert outcomes.reported(spent, "crashed", None, retryable=True, cause=late).target is S.DEAD  # type: ignore[union-attr]
    code = outcomes.Cause(NO_RETRY_EXIT_CODE)
    assert outcomes.reported(Task(), "failed", None, retryable=True, cause=code).target is S.DEAD  # type: ignore[union-attr]
    listed = Task(retry_causes=_causes(always={"exit_codes": [NO_RETRY_EXIT_CODE]}))
    assert outcomes.reported(listed, "failed", None, retryable=True, cause=code).refund  # type: ignore[union-attr]
    # a timeout carries no cause of the task's own
    assert (
        outcomes.reported(task, "timeout", None, retryable=True, cause=outcomes.Cause()).target
        is S.FAILED
    )  # type: ignore[union-attr]


def test_windows_read_as_people_say_them() -> None:
    assert [outcomes.span(s) for s in (259200, 3600, 1800, 45, 90.5)] == [
        "72 h",
        "1 h",
        "30 min",
        "45 s",
        "90.5 s",
    ]


@pytest.mark.parametrize("kind", ["task", "service"])
def test_a_source_that_does_not_answer_is_handed_back_until_the_cap_then_buried(
    kind: str,
) -> None:
    def back(count: int, cause: Any = "source") -> outcomes.Move | None:
        task = Task(kind=kind, source_handbacks=count)
        return outcomes.reported(
            task, "handed_back", "hung", retryable=True, hand_back_cause=cause, source_cap=3
        )

    assert back(1) == outcomes.Move(Op.REQUEUE, S.WAITING, "hung", refund=True, unanswered=True)
    buried = back(2)
    assert buried is not None and (buried.op, buried.target) == (Op.BURY, S.DEAD)
    assert buried.reason.startswith("its source file:///opt/jobs/report did not answer on 3 ")
    assert (buried.error, buried.refund, buried.unanswered) == ("hung", True, True)
    assert back(50, None) == outcomes.Move(Op.REQUEUE, S.WAITING, "hung", refund=True)


def test_a_source_cause_counts_only_for_a_file_source() -> None:
    """A worker checks only a ``file://`` source: the cause on any other task is an
    ordinary hand-back, and the reason never names a URI that may carry credentials in
    its query (a presigned URL's)."""
    signed = "https://bucket.example/job?X-Amz-Signature=secret"
    for uri, counted in (("FILE:///opt/jobs/report", True), (signed, False)):
        task = Task(artifact_uri=uri, source_handbacks=2)
        move = outcomes.reported(
            task, "handed_back", "hung", retryable=True, hand_back_cause="source", source_cap=3
        )
        assert move is not None and move.unanswered is counted, (uri, move)
        assert (move.target is S.DEAD) is counted and "secret" not in move.reason, move
