"""The task states as people see them. The legal transitions live in core alone."""

from __future__ import annotations

from enum import StrEnum


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
