"""Core's spans in a task's trace (libs/common/tracing.py): the submission is the root,
each claim a child of it, each report a child of the worker's run span."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from libs.common import tracing
from libs.common.models import TaskCreate
from libs.common.states import TaskState


def submitted(
    headers: Mapping[str, str], created: Iterable[tuple[Any, TaskCreate]], start_ns: int
) -> None:
    """Root spans of the tasks just created, linked to the caller's span (a DAG release,
    a cron fire) when the request carried one."""
    if not tracing.enabled():
        return
    caller = tracing.incoming(headers)
    for row, spec in created:
        tracing.root(
            "core",
            "cairn.task.submit",
            tracing.task_context(row.id, row.created_at),
            {"cairn.task_id": row.id, "cairn.queue": spec.queue, "cairn.task_name": spec.name},
            start_ns=start_ns,
            links=[caller],
        )


def claimed(task_id: int, created_at: Any, attempt_id: int, number: int) -> str | None:
    """A claim span under the task's root; its ``traceparent`` goes to the worker."""
    if not tracing.enabled():
        return None
    return tracing.child(
        "core",
        "cairn.task.claim",
        tracing.task_context(task_id, created_at),
        {"cairn.task_id": task_id, "cairn.attempt_id": attempt_id, "cairn.attempt": number},
    )


def reported(
    headers: Mapping[str, str], task_id: int, attempt_id: int, outcome: str, state: TaskState
) -> None:
    """A report span under the worker's run span (from the request's ``traceparent``)."""
    if not tracing.enabled():
        return
    tracing.child(
        "core",
        "cairn.task.report",
        tracing.incoming(headers),
        {
            "cairn.task_id": task_id,
            "cairn.attempt_id": attempt_id,
            "cairn.outcome": outcome,
            "cairn.state": state.value,
        },
    )
