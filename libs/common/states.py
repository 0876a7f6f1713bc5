"""The words for states and outcomes, one place each: a task's states (the legal
transitions live in core alone), a worker's states, and how an attempt ends. The wire
models, the tables' CHECK constraints, the SQL guards and the metrics read them here."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Final, Literal, get_args


class TaskState(StrEnum):
    #: accepted, not yet eligible: ``run_at`` in the future, or its queue is paused
    READY = "ready"
    #: eligible, waiting for a worker with room
    WAITING = "waiting"
    #: an attempt is leased to a worker
    RUNNING = "running"
    #: final: the last attempt exited 0
    SUCCEEDED = "succeeded"
    #: the last attempt failed; a retry is scheduled after backoff
    FAILED = "failed"
    #: final failure: attempts exhausted, poison pill, or not retryable
    DEAD = "dead"
    #: final, by request
    CANCELLED = "cancelled"


FINAL: frozenset[TaskState] = frozenset({TaskState.SUCCEEDED, TaskState.DEAD, TaskState.CANCELLED})
ACTIVE: frozenset[TaskState] = frozenset(TaskState) - FINAL


# --- workers -------------------------------------------------------------------------------

#: ``live``: beating, takes work; ``draining``: beating, finishes what it holds and takes
#: nothing new; ``dead``: fell silent (the reaper's word); ``left``: said goodbye
WorkerState = Literal["live", "draining", "dead", "left"]
WORKER_STATES: Final[tuple[WorkerState, ...]] = get_args(WorkerState)


class Workers:
    """A worker's states by name, and the two halves they fall in."""

    LIVE: Final[WorkerState] = "live"
    DRAINING: Final[WorkerState] = "draining"
    DEAD: Final[WorkerState] = "dead"
    LEFT: Final[WorkerState] = "left"
    #: still there: their attempts are open, their beats awaited
    PRESENT: Final[tuple[WorkerState, ...]] = (LIVE, DRAINING)
    #: gone for good (``gone_at`` set)
    GONE: Final[tuple[WorkerState, ...]] = (DEAD, LEFT)


# --- attempts ------------------------------------------------------------------------------

#: how a worker may say an attempt ended (``Report.outcome``)
ReportedOutcome = Literal[
    "succeeded",
    "failed",
    "timeout",
    "crashed",
    "oom_killed",
    "disk_exceeded",
    "handed_back",
    "preempted",
]
#: every way an attempt ends: reported, or core's (``lost`` with its worker, ``cancelled``
#: with its task)
AttemptOutcome = Literal[ReportedOutcome, "lost", "cancelled"]
REPORTED_OUTCOMES: Final[tuple[ReportedOutcome, ...]] = get_args(ReportedOutcome)
ATTEMPT_OUTCOMES: Final[tuple[AttemptOutcome, ...]] = get_args(AttemptOutcome)


def sql_in(column: str, values: Iterable[str]) -> str:
    """``column IN ('a', 'b')`` of these words, sorted: for CHECK constraints, partial
    indexes and guards written into SQL text (never user input)."""
    return f"{column} IN ({', '.join(repr(str(v)) for v in sorted(values))})"
