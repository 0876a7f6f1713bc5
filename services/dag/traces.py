"""The DAG service's spans (libs/common/tracing.py): a run's trace has its creation as the
root and a span for each node release, linked to the trace of the task it released."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from libs.common import tracing


def started(run: Any) -> None:
    """The root span of a new run's trace."""
    if not tracing.enabled():
        return
    tracing.root(
        "dag",
        "cairn.dag.run",
        tracing.run_context(run.id, run.created_at),
        {"cairn.run_id": run.id, "cairn.workflow": run.workflow},
    )


def released(
    nodes: Sequence[Any], tasks: Sequence[tuple[int, datetime | None]], start_ns: int
) -> None:
    """A span per node released (``ready_nodes`` rows) in its run's trace, linked to its
    task's trace; ``tasks`` holds each node's task id (0: refused) and creation time."""
    if not tracing.enabled():
        return
    for node, (task_id, created_at) in zip(nodes, tasks, strict=True):
        if not task_id:
            continue
        tracing.child(
            "dag",
            "cairn.dag.release",
            tracing.run_context(node.run_id, node.run_created_at),
            {
                "cairn.run_id": node.run_id,
                "cairn.node": node.name,
                "cairn.try": node.try_number,
                "cairn.task_id": task_id,
            },
            start_ns=start_ns,
            links=[tracing.task_context(task_id, created_at) if created_at else None],
        )
