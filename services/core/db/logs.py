"""Every SQL statement of live logs (docs/logs.md): the head row per attempt, its chunks,
what was moved to the object store."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncConnection

# Whether an ended attempt's log is whole: its report did not say more was on its way
# (``log_bytes`` NULL: core had it all, or core itself closed the attempt), core now
# holds that much, or the wait for the rest (``late_s``, CAIRN_LOG_LATE_S) is over.
_WHOLE = """(a.log_bytes IS NULL OR coalesce(h.size, 0) >= a.log_bytes
    OR a.ended_at <= now() - make_interval(secs => :late_s))"""

# The heads of logs the worker may still append to: their attempts must be leased to
# this worker and open, or ended by its report less than ``late_s`` ago with the rest of
# their log on its way (docs/logs.md: late chunks), and not archived. FOR SHARE holds off
# the report that would close one until this commits, and the upsert locks the heads
# (in id order), so two batches take turns, and a batch and the archive loop too.
_HELD_HEADS: TextClause = text("""
WITH held AS (
    SELECT id, log_bytes FROM core.attempts
    WHERE id = ANY(:attempts) AND worker_id = :worker
      AND (outcome IS NULL
           OR (log_bytes IS NOT NULL AND ended_at > now() - make_interval(secs => :late_s)))
    ORDER BY id
    FOR SHARE
), heads AS (
    INSERT INTO core.attempt_logs (attempt_id) SELECT id FROM held ORDER BY id
    ON CONFLICT (attempt_id) DO UPDATE SET size = core.attempt_logs.size
    WHERE core.attempt_logs.archived_at IS NULL
    RETURNING attempt_id, size, length, start_pos
)
SELECT heads.*, held.log_bytes AS until FROM heads JOIN held ON held.id = heads.attempt_id
""")

# Why the worker may not append to these attempts' logs (the refused chunks' answers).
_REFUSED: TextClause = text("""
SELECT a.id, a.outcome, a.log_bytes IS NOT NULL AS late,
       EXTRACT(EPOCH FROM now() - a.ended_at)::float8 AS ended_s,
       h.archived_at IS NOT NULL AS archived
FROM core.attempts a LEFT JOIN core.attempt_logs h ON h.attempt_id = a.id
WHERE a.id = ANY(:attempts) AND a.worker_id = :worker
""")

_APPEND: TextClause = text("""
INSERT INTO core.log_chunks (attempt_id, pos, bytes, content)
SELECT * FROM unnest(
    CAST(:attempts AS bigint[]), CAST(:positions AS bigint[]), CAST(:bytes AS integer[]),
    CAST(:contents AS text[]))
""")

_ADVANCE: TextClause = text("""
UPDATE core.attempt_logs h
SET size = n.size, length = n.length, truncated = h.truncated OR n.gap
FROM unnest(
    CAST(:attempts AS bigint[]), CAST(:sizes AS bigint[]), CAST(:lengths AS bigint[]),
    CAST(:gaps AS boolean[])) AS n(attempt_id, size, length, gap)
WHERE h.attempt_id = n.attempt_id
""")

# Over the cap: the oldest chunks that end before ``keep_from`` go; the log now starts at
# the first chunk left.
_TRIM: TextClause = text("""
WITH gone AS (
    DELETE FROM core.log_chunks WHERE attempt_id = :attempt AND pos + bytes <= :keep_from
)
UPDATE core.attempt_logs SET truncated = true, start_pos = coalesce(
    (SELECT min(pos) FROM core.log_chunks
     WHERE attempt_id = :attempt AND pos + bytes > :keep_from),
    length)
WHERE attempt_id = :attempt
RETURNING start_pos
""")

_VIEW: TextClause = text(f"""
SELECT a.id AS attempt_id, a.task_id, a.outcome, coalesce(h.length, 0) AS length,
       coalesce(h.start_pos, 0) AS start_pos, coalesce(h.truncated, false) AS truncated,
       h.archived_at, a.outcome IS NOT NULL AND {_WHOLE} AS complete
FROM core.attempts a LEFT JOIN core.attempt_logs h ON h.attempt_id = a.id
WHERE a.id = :attempt AND a.task_id = :task
""")

_LATEST: TextClause = text("""
SELECT id FROM core.attempts WHERE task_id = :task ORDER BY id DESC LIMIT 1
""")

_CHUNKS: TextClause = text("""
SELECT pos, content FROM core.log_chunks
WHERE attempt_id = :attempt AND pos + bytes > :after
ORDER BY pos
LIMIT :limit
""")

# Ended attempts whose log is whole and still in chunks, for the object store.
_UNARCHIVED: TextClause = text(f"""
SELECT h.attempt_id, a.task_id, h.length, h.start_pos
FROM core.attempt_logs h JOIN core.attempts a ON a.id = h.attempt_id
WHERE h.archived_at IS NULL AND a.outcome IS NOT NULL AND {_WHOLE}
ORDER BY h.attempt_id
LIMIT :limit
FOR UPDATE OF h SKIP LOCKED
""")

_ARCHIVED: TextClause = text("""
WITH gone AS (
    DELETE FROM core.log_chunks WHERE attempt_id = :attempt
), listed AS (
    INSERT INTO core.log_objects (key, task_id, attempt_id) VALUES (:key, :task, :attempt)
    ON CONFLICT (key) DO NOTHING
)
UPDATE core.attempt_logs SET archived_at = now() WHERE attempt_id = :attempt
""")

# Objects whose task the retention purge has deleted (and only those old enough that it
# may have): their keys, oldest first.
_ORPHANS: TextClause = text("""
SELECT o.key FROM core.log_objects o
WHERE o.archived_at < now() - make_interval(secs => :age_s)
  AND NOT EXISTS (SELECT 1 FROM core.tasks t WHERE t.id = o.task_id)
ORDER BY o.archived_at
LIMIT :limit
""")

_FORGET: TextClause = text("DELETE FROM core.log_objects WHERE key = ANY(:keys)")


@dataclass(frozen=True)
class Head:
    size: int
    length: int
    start_pos: int
    until: int | None = None  # an ended attempt's: the output's length its report gave


@dataclass(frozen=True)
class View:
    """A log as a reader sees it: where it starts and ends, and whether it can grow."""

    attempt_id: int
    task_id: int
    outcome: str | None
    length: int
    start_pos: int
    truncated: bool
    archived_at: datetime | None
    #: the attempt ended and its log is whole: it will not grow
    complete: bool


@dataclass(frozen=True)
class Unarchived:
    attempt_id: int
    task_id: int
    length: int
    start_pos: int


async def held_heads(
    conn: AsyncConnection, worker_id: int, attempt_ids: Sequence[int], late_s: float
) -> dict[int, Head]:
    """The locked heads of the logs this worker may append to (the others are absent)."""
    params = {"attempts": sorted(set(attempt_ids)), "worker": worker_id, "late_s": late_s}
    rows = await conn.execute(_HELD_HEADS, params)
    return {row.attempt_id: Head(row.size, row.length, row.start_pos, row.until) for row in rows}


@dataclass(frozen=True)
class Refused:
    """Why a worker may not append to the log of one of its attempts."""

    id: int
    outcome: str | None
    late: bool  # its report said the rest of its log was on its way
    ended_s: float | None
    archived: bool


async def refused(
    conn: AsyncConnection, worker_id: int, attempt_ids: Sequence[int]
) -> dict[int, Refused]:
    """The worker's attempts among these (another worker's, or none, are absent)."""
    params = {"attempts": sorted(set(attempt_ids)), "worker": worker_id}
    return {row.id: Refused(**row._mapping) for row in await conn.execute(_REFUSED, params)}


@dataclass(frozen=True)
class NewChunk:
    attempt_id: int
    pos: int
    content: str

    @property
    def bytes(self) -> int:
        return len(self.content.encode())


async def append(
    conn: AsyncConnection, chunks: Sequence[NewChunk], heads: dict[int, tuple[Head, bool]]
) -> None:
    """Store the chunks and move their heads (``heads``: each one's new value, and
    whether output was skipped), in two statements whatever their number."""
    if not chunks:
        return
    await conn.execute(
        _APPEND,
        {
            "attempts": [c.attempt_id for c in chunks],
            "positions": [c.pos for c in chunks],
            "bytes": [c.bytes for c in chunks],
            "contents": [c.content for c in chunks],
        },
    )
    await conn.execute(
        _ADVANCE,
        {
            "attempts": list(heads),
            "sizes": [h.size for h, _ in heads.values()],
            "lengths": [h.length for h, _ in heads.values()],
            "gaps": [gap for _, gap in heads.values()],
        },
    )


async def trim(conn: AsyncConnection, attempt_id: int, keep_from: int) -> int:
    """Drop the chunks wholly before ``keep_from``; where the kept log now starts."""
    params = {"attempt": attempt_id, "keep_from": keep_from}
    return int((await conn.execute(_TRIM, params)).scalar_one())


async def latest_attempt(conn: AsyncConnection, task_id: int) -> int | None:
    value = (await conn.execute(_LATEST, {"task": task_id})).scalar()
    return None if value is None else int(value)


async def view(conn: AsyncConnection, task_id: int, attempt_id: int, late_s: float) -> View | None:
    params = {"attempt": attempt_id, "task": task_id, "late_s": late_s}
    row = (await conn.execute(_VIEW, params)).first()
    return None if row is None else View(**row._mapping)


async def chunks(conn: AsyncConnection, attempt_id: int, after: int, limit: int) -> Sequence[Any]:
    """Chunks holding bytes past ``after``, oldest first (``pos``, ``content``)."""
    params = {"attempt": attempt_id, "after": after, "limit": limit}
    return list(await conn.execute(_CHUNKS, params))


async def unarchived(conn: AsyncConnection, limit: int, late_s: float) -> list[Unarchived]:
    rows = await conn.execute(_UNARCHIVED, {"limit": limit, "late_s": late_s})
    return [Unarchived(**row._mapping) for row in rows]


async def mark_archived(conn: AsyncConnection, attempt_id: int, task_id: int, key: str) -> None:
    await conn.execute(_ARCHIVED, {"attempt": attempt_id, "task": task_id, "key": key})


async def orphaned_objects(conn: AsyncConnection, age_s: float, limit: int) -> list[str]:
    rows = await conn.execute(_ORPHANS, {"age_s": age_s, "limit": limit})
    return [row.key for row in rows]


async def forget_objects(conn: AsyncConnection, keys: Sequence[str]) -> None:
    await conn.execute(_FORGET, {"keys": list(keys)})


async def task_state(conn: AsyncConnection, task_id: int) -> str | None:
    row = (await conn.execute(_TASK_STATE, {"task": task_id})).first()
    return None if row is None else str(row.state)


_TASK_STATE: TextClause = text("SELECT state FROM core.tasks WHERE id = :task")
