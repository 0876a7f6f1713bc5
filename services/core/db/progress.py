"""Progress and checkpoints (docs/progress.md): what a running attempt last wrote, as its
worker's turn carries it, kept per task in ``core.task_progress`` (one row per task that
reported any); and what a read of tasks shows of it."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common import pipeline
from libs.common.models import ProgressNote, Task, TaskProgress
from services.core.db.params import jsonb

# Kept only from the worker the attempt is leased to, while it is open and its task's
# current attempt (the same fence as a report's, without the task's lock: nothing here
# moves the task). Runs before the turn's reports, so the last words of an attempt
# reported in the same turn still count. Rows are written in task order (no deadlock
# between two turns). A note without progress keeps the progress; without a checkpoint,
# the checkpoint: the latest checkpoint outlives its attempt, for the next one.
_NOTE = text("""
WITH input AS (
    SELECT * FROM jsonb_to_recordset(CAST(:input AS jsonb)) AS i(
        attempt_id bigint, progress boolean, fraction float8, message text, checkpoint text)
), valid AS (
    SELECT i.*, a.task_id FROM input i
    JOIN core.attempts a ON a.id = i.attempt_id AND a.worker_id = :worker AND a.outcome IS NULL
    JOIN core.tasks t ON t.id = a.task_id AND t.current_attempt_id = a.id
)
INSERT INTO core.task_progress AS p (
    task_id, attempt_id, fraction, message, progress_at, checkpoint, checkpoint_attempt_id,
    checkpoint_at
)
SELECT task_id, attempt_id,
       CASE WHEN progress THEN fraction END, CASE WHEN progress THEN message END,
       CASE WHEN progress THEN now() END,
       decode(checkpoint, 'base64'),
       CASE WHEN checkpoint IS NOT NULL THEN attempt_id END,
       CASE WHEN checkpoint IS NOT NULL THEN now() END
FROM valid ORDER BY task_id
ON CONFLICT (task_id) DO UPDATE SET
    attempt_id = EXCLUDED.attempt_id,
    fraction = CASE WHEN EXCLUDED.progress_at IS NOT NULL THEN EXCLUDED.fraction
                    ELSE p.fraction END,
    message = CASE WHEN EXCLUDED.progress_at IS NOT NULL THEN EXCLUDED.message
                   ELSE p.message END,
    progress_at = COALESCE(EXCLUDED.progress_at, p.progress_at),
    checkpoint = COALESCE(EXCLUDED.checkpoint, p.checkpoint),
    checkpoint_attempt_id = COALESCE(EXCLUDED.checkpoint_attempt_id, p.checkpoint_attempt_id),
    checkpoint_at = COALESCE(EXCLUDED.checkpoint_at, p.checkpoint_at)
""")


def noted(worker_id: int, notes: Sequence[ProgressNote]) -> list[pipeline.Statement]:
    """What keeps a turn's progress notes (``_NOTE``), if it carries any."""
    if not notes:
        return []
    rows = [note.model_dump() for note in notes]
    return [(_NOTE, {"input": jsonb(rows), "worker": worker_id})]


_OF_TASKS = text("""
SELECT task_id, attempt_id, fraction, message, progress_at, octet_length(checkpoint) AS size,
       checkpoint_attempt_id, checkpoint_at
FROM core.task_progress WHERE task_id = ANY(CAST(:ids AS bigint[]))
""")


async def of_tasks(conn: AsyncConnection, ids: Sequence[int]) -> dict[int, TaskProgress]:
    """The latest progress of each of these tasks that reported any."""
    if not ids:
        return {}
    found = await conn.execute(_OF_TASKS, {"ids": sorted(set(ids))})
    return {
        r.task_id: TaskProgress(
            attempt_id=r.attempt_id,
            fraction=r.fraction,
            message=r.message,
            updated_at=r.progress_at,
            checkpoint_bytes=r.size,
            checkpoint_attempt_id=r.checkpoint_attempt_id,
            checkpoint_at=r.checkpoint_at,
        )
        for r in found
    }


async def with_progress(conn: AsyncConnection, tasks: Sequence[Task]) -> list[Task]:
    """The tasks, each with its latest progress (one read for them all)."""
    found = await of_tasks(conn, [t.id for t in tasks])
    if not found:
        return list(tasks)
    return [t.model_copy(update={"progress": found[t.id]}) if t.id in found else t for t in tasks]
