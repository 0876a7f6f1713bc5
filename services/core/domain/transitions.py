"""Every legal move of a task's state, written once. Each state change in core names an
``Op``; the store turns the op's rule into a guarded UPDATE (``WHERE state = ANY(:from)``)
plus an event row, in one transaction."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from libs.common.errors import IllegalTransition
from libs.common.states import TaskState

S = TaskState


class Op(StrEnum):
    #: a submission is accepted
    SUBMIT = "submit"
    #: ``run_at`` has come (or the backoff has passed) and the queue runs
    PROMOTE = "promote"
    #: the queue is paused: eligible work steps back
    PARK = "park"
    #: a worker takes an attempt: of a waiting task, or of a ready one whose ``run_at`` has
    #: come in a running queue (as eligible as if promoted; the claim's SQL holds the time)
    CLAIM = "claim"
    #: the attempt exited 0
    SUCCEED = "succeed"
    #: the attempt failed, was lost or timed out; a retry is scheduled
    FAIL = "fail"
    #: final failure: attempts spent, poison pill, or not retryable
    BURY = "bury"
    #: the attempt was handed back (drained) without spending an attempt
    REQUEUE = "requeue"
    #: a person cancelled it
    CANCEL = "cancel"
    #: a person asked for another go
    RETRY = "retry"
    #: its attempt was stopped to make room for guaranteed work; no attempt is spent
    PREEMPT = "preempt"
    #: time-insensitive work steps back while its pool is busy, until its latest start
    DEFER = "defer"
    #: final: it was never started by its ``start_by`` (its own, or its queue's wait bound)
    EXPIRE = "expire"


class Note(StrEnum):
    """What a task's history records without moving it: the event's ``from_state`` and
    ``to_state`` are both the state it is in, which no ``Op`` ever allows."""

    #: its running attempt's CPU share was lowered for guaranteed work
    SQUEEZE = "squeeze"


#: the state a note is written in (the guard of its UPDATE)
NOTE_STATES: dict[Note, TaskState] = {Note.SQUEEZE: S.RUNNING}


@dataclass(frozen=True)
class Rule:
    sources: frozenset[TaskState | None]
    targets: frozenset[TaskState]


def _rule(sources: set[TaskState | None], targets: set[TaskState]) -> Rule:
    return Rule(frozenset(sources), frozenset(targets))


TRANSITIONS: dict[Op, Rule] = {
    Op.SUBMIT: _rule({None}, {S.READY, S.WAITING}),
    Op.PROMOTE: _rule({S.READY, S.FAILED}, {S.WAITING}),
    Op.PARK: _rule({S.WAITING, S.FAILED}, {S.READY}),
    Op.CLAIM: _rule({S.WAITING, S.READY}, {S.RUNNING}),
    Op.SUCCEED: _rule({S.RUNNING}, {S.SUCCEEDED}),
    Op.FAIL: _rule({S.RUNNING}, {S.FAILED}),
    Op.BURY: _rule({S.RUNNING, S.FAILED}, {S.DEAD}),
    Op.REQUEUE: _rule({S.RUNNING}, {S.WAITING}),
    Op.CANCEL: _rule({S.READY, S.WAITING, S.RUNNING, S.FAILED}, {S.CANCELLED}),
    Op.RETRY: _rule({S.DEAD, S.FAILED, S.CANCELLED}, {S.WAITING, S.READY}),
    Op.PREEMPT: _rule({S.RUNNING}, {S.WAITING}),
    Op.DEFER: _rule({S.WAITING}, {S.READY}),
    Op.EXPIRE: _rule({S.READY, S.WAITING}, {S.DEAD}),
}

#: every (from, to) pair some op allows; ``None`` is "not yet stored"
ALLOWED: frozenset[tuple[TaskState | None, TaskState]] = frozenset(
    (src, dst) for rule in TRANSITIONS.values() for src in rule.sources for dst in rule.targets
)


def check(op: Op, source: TaskState | None, target: TaskState) -> None:
    """Raise ``IllegalTransition`` unless ``op`` may move a task from ``source`` to ``target``."""
    rule = TRANSITIONS[op]
    if source not in rule.sources or target not in rule.targets:
        raise IllegalTransition(
            f"cannot {op.value} a task that is {source.value if source else 'new'}"
            f" (to {target.value})"
        )


def sources(op: Op, target: TaskState) -> list[str]:
    """The stored states ``op`` may start from to reach ``target`` (for the SQL guard)."""
    rule = TRANSITIONS[op]
    if target not in rule.targets:
        raise IllegalTransition(f"{op.value} never leads to {target.value}")
    return sorted(s.value for s in rule.sources if s is not None)
