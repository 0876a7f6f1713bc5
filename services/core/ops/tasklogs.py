"""Live logs (docs/logs.md): appending the chunks workers ship, reading a log from a
position, following it as server-sent events, and moving ended attempts' logs to the
object store. The SQL is in ``services/core/db/logs.py``.

Positions are bytes of the *stored* log (its text as UTF-8, secrets masked), so a reader
resumes exactly where it stopped, from PostgreSQL or from the object store alike; the
worker's file offsets only make a retried batch idempotent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from libs.common.errors import NotFound
from libs.common.loglimit import dropped_marker
from libs.common.models import LogAck, LogBatch, LogChunk, LogEnd, LogPiece
from libs.common.states import FINAL, TaskState
from services.core.db import logs as db
from services.core.db import secrets
from services.core.db.feed import Notifier
from services.core.identity.crypto import SecretBox
from services.core.objects import LogObjects
from services.core.settings import CoreSettings

log = logging.getLogger("cairn.core.logs")

PIECE_BYTES = 256 * 1024  # at most this much in one SSE event
_POLL_S = 1.0  # a follower's fallback when no bell rings (another replica's end, a reap)
_KEEPALIVE_S = 15.0
_MASK_TTL_S = 300.0
_MASKS_KEPT = 4096

Mask = Callable[[str], str] | None


class Maskers:
    """Each attempt's secret masker, kept a few minutes: a worker ships every half second,
    and opening the secrets each time would cost a query and a decryption."""

    def __init__(self, box: SecretBox) -> None:
        self.box = box
        self._kept: dict[int, tuple[float, Mask]] = {}

    async def get(self, conn: AsyncConnection, attempt_id: int) -> Mask:
        now = time.monotonic()
        found = self._kept.get(attempt_id)
        if found is not None and found[0] > now:
            return found[1]
        mask = await secrets.masker(conn, self.box, attempt_id)
        if len(self._kept) >= _MASKS_KEPT:
            self._kept.clear()
        self._kept[attempt_id] = (now + _MASK_TTL_S, mask)
        return mask


def _clean(text: str) -> str:
    return text.replace("\x00", "\ufffd")  # PostgreSQL text holds no NUL


def _skipped(count: int) -> str:
    return f"[cairn: {count} bytes of output skipped by the worker]\n"


@dataclass(frozen=True)
class Limits:
    """The bounds of the logs core keeps (``CoreSettings``): the bytes one attempt's log
    keeps at most, and how long after its report an attempt still takes the rest."""

    cap: int
    late_s: float

    @classmethod
    def of(cls, settings: CoreSettings) -> Limits:
        return cls(settings.log_max_bytes, settings.log_late_s)


async def append(
    engine: AsyncEngine, maskers: Maskers, worker_id: int, batch: LogBatch, limits: Limits
) -> list[LogAck]:
    """Store a worker's batch in one transaction (a few statements, whatever its size);
    each chunk answered on its own."""
    acks: list[LogAck] = []
    async with engine.begin() as conn:
        ids = [c.attempt_id for c in batch.chunks]
        heads = await db.held_heads(conn, worker_id, ids, limits.late_s)
        refused = await _refusals(conn, worker_id, ids, heads, limits.late_s)
        new: list[db.NewChunk] = []
        moved: dict[int, tuple[db.Head, bool]] = {}
        for chunk in batch.chunks:
            head = heads.get(chunk.attempt_id)
            if head is None:
                acks.append(_refused(chunk, 409, refused[chunk.attempt_id]))
                continue
            if head.until is not None and chunk.offset + chunk.length > head.until:
                why = (
                    f"attempt {chunk.attempt_id} has ended: its report said its output was "
                    f"{head.until} bytes, and this chunk ends at {chunk.offset + chunk.length}"
                )
                acks.append(_refused(chunk, 422, why))
                continue
            if chunk.offset >= head.size:  # below: sent before, its answer lost
                piece, head, skipped = await _placed(conn, maskers, head, chunk)
                heads[chunk.attempt_id] = head
                new.append(piece)
                earlier = moved.get(chunk.attempt_id, (head, False))[1]
                moved[chunk.attempt_id] = (head, earlier or skipped)
            acks.append(_ok(chunk.attempt_id, chunk.offset, head.size))
        await db.append(conn, new, moved)
        for attempt_id, (head, _) in moved.items():
            if head.length - head.start_pos > limits.cap:
                await db.trim(conn, attempt_id, head.length - limits.cap)
    return acks


async def _refusals(
    conn: AsyncConnection,
    worker_id: int,
    ids: list[int],
    heads: dict[int, db.Head],
    late_s: float,
) -> dict[int, str]:
    """Why each attempt of the batch without a head may not be appended to (one query,
    only when there is one)."""
    missing = sorted(set(ids) - set(heads))
    if not missing:
        return {}
    known = await db.refused(conn, worker_id, missing)
    why = {}
    for attempt_id in missing:
        row = known.get(attempt_id)
        if row is None or row.outcome is None:
            why[attempt_id] = f"attempt {attempt_id} is not open on worker {worker_id}"
        elif row.archived:
            why[attempt_id] = f"attempt {attempt_id}'s log is archived: it is closed"
        elif row.late:
            why[attempt_id] = (
                f"attempt {attempt_id} ended {row.ended_s:.0f} s ago, more than "
                f"CAIRN_LOG_LATE_S ({late_s:g} s): its log is closed"
            )
        else:
            why[attempt_id] = f"attempt {attempt_id} has ended ({row.outcome}): its log is closed"
    return why


def _refused(chunk: LogChunk, status: int, detail: str) -> LogAck:
    return LogAck(
        attempt_id=chunk.attempt_id,
        offset=chunk.offset,
        status=status,
        next_offset=chunk.offset,
        detail=detail,
    )


def _ok(attempt_id: int, offset: int, size: int) -> LogAck:
    return LogAck(attempt_id=attempt_id, offset=offset, status=200, next_offset=size)


async def _placed(
    conn: AsyncConnection, maskers: Maskers, head: db.Head, chunk: LogChunk
) -> tuple[db.NewChunk, db.Head, bool]:
    """The chunk as stored (masked; a marker first if output was skipped), the head after
    it, and whether output was skipped."""
    mask = await maskers.get(conn, chunk.attempt_id)
    content = _clean(mask(chunk.text) if mask else chunk.text)
    gap = chunk.offset - head.size
    if gap:
        content = _skipped(gap) + content
    piece = db.NewChunk(chunk.attempt_id, head.length, content)
    after = db.Head(chunk.offset + chunk.length, head.length + piece.bytes, head.start_pos)
    return piece, after, gap > 0


# --- reading ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Read:
    view: db.View
    pieces: list[LogPiece]

    @property
    def next_offset(self) -> int:
        return self.pieces[-1].next_offset if self.pieces else self.view.length


async def attempt_of(engine: AsyncEngine, task_id: int, attempt_id: int | None) -> int | None:
    """The named attempt (404 unless it is the task's), or the task's latest (None: it
    has none yet)."""
    async with engine.connect() as conn:
        if attempt_id is None:
            return await db.latest_attempt(conn, task_id)
        if await db.view(conn, task_id, attempt_id, 0.0) is None:  # whether it is there
            raise NotFound(f"task {task_id} has no attempt {attempt_id}")
    return attempt_id


async def read(
    engine: AsyncEngine,
    objects: LogObjects | None,
    task_id: int,
    attempt_id: int,
    after: int,
    limit: int,
    limits: Limits,
) -> Read:
    """At most ``limit`` bytes of the log from ``after``, from one snapshot: if the view
    says the log is complete, what follows is all there will ever be."""
    async with engine.connect() as conn:
        conn = await conn.execution_options(isolation_level="REPEATABLE READ")
        async with conn.begin():
            view = await db.view(conn, task_id, attempt_id, limits.late_s)
            if view is None:
                raise NotFound(f"task {task_id} has no attempt {attempt_id}")
            pieces: list[LogPiece] = []
            if after < view.start_pos:
                text = dropped_marker(view.start_pos, limits.cap)
                pieces.append(_piece(view, after, view.start_pos, text))
                after = view.start_pos
            if after < view.length and view.archived_at is None:
                rows = await db.chunks(conn, attempt_id, after, 1 + limit // 1024)
                pieces += _from_chunks(view, rows, after, limit)
    if after < view.length and view.archived_at is not None and objects is not None:
        key = objects.key(task_id, attempt_id)
        end = min(view.length, after + limit)
        data = await objects.read(key, after - view.start_pos, end - view.start_pos)
        pieces += _from_bytes(view, data, after)
    return Read(view, pieces)


def _piece(view: db.View, offset: int, next_offset: int, text: str) -> LogPiece:
    return LogPiece(attempt_id=view.attempt_id, offset=offset, next_offset=next_offset, text=text)


def _from_chunks(view: db.View, rows: Sequence[Any], after: int, limit: int) -> list[LogPiece]:
    data, start = b"", after
    for row in rows:
        pos, raw = row.pos, row.content.encode()
        if pos < after:
            raw = raw[after - pos :]
        if data and len(data) + len(raw) > limit:
            break
        data += raw
    return _from_bytes(view, data, start)


def _from_bytes(view: db.View, data: bytes, offset: int) -> list[LogPiece]:
    """One piece of whole characters: a leading part of one (a position a caller made up)
    is skipped, a trailing part left for the next read."""
    lead = 0
    while lead < min(3, len(data)) and 0x80 <= data[lead] < 0xC0:
        lead += 1
    end = len(data)
    for back in range(1, min(4, len(data) - lead) + 1):
        byte = data[end - back]
        if byte < 0x80:
            break
        if byte >= 0xC0:  # a sequence starts here: whole only if all its bytes are in
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            if back < need:
                end -= back
            break
    if end <= lead:
        return []
    text = data[lead:end].decode("utf-8", errors="replace")
    return [_piece(view, offset, offset + end, text)]


# --- following ----------------------------------------------------------------------------


def sse(event: str, body: BaseModel | None = None, event_id: str | None = None) -> bytes:
    lines = [f"event: {event}"]
    if event_id is not None:
        lines.append(f"id: {event_id}")
    lines.append("data: " + (body.model_dump_json() if body is not None else "{}"))
    return ("\n".join(lines) + "\n\n").encode()


@dataclass(frozen=True)
class Follow:
    engine: AsyncEngine
    notifier: Notifier
    objects: LogObjects | None
    limits: Limits
    gone: Callable[[], Awaitable[bool]]  # the client left, or may no longer read the log


async def follow(
    f: Follow, task_id: int, attempt_id: int | None, after: int
) -> AsyncIterator[bytes]:
    """SSE: ``log`` events as the log grows, then one ``end`` when the attempt has ended,
    its log is complete (a late end has come, or the wait for it is over) and everything
    was sent. Without an attempt, the task's latest (waiting for its
    first while the task has none and is not final)."""
    yield b": following\n\n"
    if attempt_id is None:
        found = await _first_attempt(f, task_id)
        if isinstance(found, TaskState):
            yield sse("end", LogEnd(attempt_id=None, outcome=None, next_offset=0, task_state=found))
        if not isinstance(found, int):
            return
        attempt_id = found
    quiet_since = time.monotonic()
    while True:
        got = await read(f.engine, f.objects, task_id, attempt_id, after, PIECE_BYTES, f.limits)
        for piece in got.pieces:
            yield sse("log", piece, f"{attempt_id}:{piece.next_offset}")
            after, quiet_since = piece.next_offset, time.monotonic()
        if got.pieces and after < got.view.length:
            continue
        if got.view.complete and after >= got.view.length:
            state = await _task_state(f.engine, task_id)
            end = LogEnd(
                attempt_id=attempt_id, outcome=got.view.outcome, next_offset=after, task_state=state
            )
            yield sse("end", end, f"{attempt_id}:{after}")
            return
        if await f.gone():
            return
        if time.monotonic() - quiet_since > _KEEPALIVE_S:
            yield b": keep-alive\n\n"
            quiet_since = time.monotonic()
        await f.notifier.wait_log(attempt_id, _POLL_S)


async def _first_attempt(f: Follow, task_id: int) -> int | TaskState | None:
    """The task's latest attempt once it has one; its final state if it ended without
    any; None if the client left meanwhile."""
    while True:
        since = f.notifier.mark()  # an attempt leased after this read wakes the wait
        attempt_id = await attempt_of(f.engine, task_id, None)
        if attempt_id is not None:
            return attempt_id
        state = await _task_state(f.engine, task_id)
        if state in FINAL:
            return state
        if await f.gone():
            return None
        await f.notifier.wait(_POLL_S, since)


async def _task_state(engine: AsyncEngine, task_id: int) -> TaskState:
    async with engine.connect() as conn:
        state = await db.task_state(conn, task_id)
    if state is None:
        raise NotFound(f"task {task_id} not found")
    return TaskState(state)


# --- the object store ---------------------------------------------------------------------

_ARCHIVE_PER_PASS = 50


async def archive_once(engine: AsyncEngine, objects: LogObjects, late_s: float) -> int:
    """Move ended attempts' complete logs from their chunks to one object each (a log
    whose end is late waits for it, at most ``late_s``); one attempt per transaction, so
    memory holds one log (at most the cap) at a time."""
    moved = 0
    while moved < _ARCHIVE_PER_PASS:
        async with engine.begin() as conn:
            picked = await db.unarchived(conn, 1, late_s)
            if not picked:
                return moved
            item = picked[0]
            rows = await db.chunks(conn, item.attempt_id, -1, 2**31)
            data = "".join(row.content for row in rows).encode()
            key = objects.key(item.task_id, item.attempt_id)
            if data:
                await objects.put(key, data)
            await db.mark_archived(conn, item.attempt_id, item.task_id, key)
        moved += 1
    return moved


async def purge_objects_once(
    engine: AsyncEngine, objects: LogObjects, age_s: float, batch: int
) -> int:
    """Delete the objects of tasks the retention purge has deleted."""
    async with engine.connect() as conn:
        keys = await db.orphaned_objects(conn, age_s, batch)
    if keys:
        await objects.delete(keys)
        async with engine.begin() as conn:
            await db.forget_objects(conn, keys)
    return len(keys)
