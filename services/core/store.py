"""Core's database layer. Every state change goes through ``transition`` (one task) or a
bulk query of ``queries`` (many), both guarded by the rules of ``domain.transitions``."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import namedtuple_row
from sqlalchemy import (
    Boolean,
    Row,
    TextClause,
    and_,
    func,
    literal_column,
    or_,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common.auth import Caller, Visibility
from libs.common.errors import IdempotencyMismatch, IllegalTransition, InvalidInput, NotFound
from libs.common.models import (
    Attempt,
    Event,
    QueueHistory,
    QueueInfo,
    QueueSeries,
    Task,
    TaskCreate,
    TaskSelector,
)
from libs.common.states import FINAL, TaskState
from services.core import queries
from services.core.db import pipeline
from services.core.db.params import jsonb
from services.core.domain.transitions import Op, check, sources
from services.core.tables import (
    LABELLED,
    attempts,
    queues,
    task_events,
    tasks,
)

ROLES = ("admin", "service", "user", "worker")


@dataclass(frozen=True, kw_only=True)
class Principal(Caller):
    """A caller as core knows it: the id of its row (None for one an identity provider
    vouches for) and of the token it came with."""

    id: int | None = None
    token_id: int | None = None
    #: for one an identity provider vouches for: the id of the key that signed its token,
    #: and until when the teams it claims are kept for the leases of what it submits
    #: (its expiry, ``CAIRN_OIDC_CLAIM_MAX_S`` after it was checked at most)
    key_id: str | None = None
    claims_until: datetime | None = None


# --- the driver's fast path ------------------------------------------------------------


async def _fetch(conn: AsyncConnection, query: TextClause, params: dict[str, Any]) -> list[Any]:
    """Run a named query on the psycopg connection under ``conn``, rows as named tuples.
    For the submit path, where SQLAlchemy's result processing cost more than the query."""
    raw = await conn.get_raw_connection()
    driver: psycopg.AsyncConnection[Any] = raw.driver_connection  # type: ignore[assignment]
    sql = pipeline.driver_sql(query, conn.dialect)
    try:
        async with driver.cursor(row_factory=namedtuple_row) as cursor:
            await cursor.execute(sql, params)
            return await cursor.fetchall()
    except psycopg.Error as exc:
        # Raise what SQLAlchemy would have: the same error handlers apply, and a lost
        # connection leaves the pool instead of failing the next request too.
        lost = conn.dialect.is_disconnect(exc, raw.dbapi_connection, None)  # type: ignore[arg-type]
        if lost:
            await conn.invalidate(exc)
        raise DBAPIError.instance(
            sql, params, exc, psycopg.Error, connection_invalidated=lost, dialect=conn.dialect
        ) from exc


# --- submissions --------------------------------------------------------------------------


_LATER_FIELDS: dict[str, object] = {
    "defer_ok": False,
    "deadline": None,
    "team": None,
    "concurrency": None,
}


def spec_hash(spec: TaskCreate) -> str:
    """A digest of a submission, to tell a retried request from a different one."""
    doc = spec.model_dump(mode="json")
    # Fields added later count only when set, so a key reused across an upgrade matches.
    for name, default in _LATER_FIELDS.items():
        if doc.get(name) == default:
            del doc[name]
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _row_doc(spec: TaskCreate) -> dict[str, Any]:
    return {
        "name": spec.name,
        "queue": spec.queue,
        "priority": spec.priority,
        "kind": spec.kind,
        "artifact_uri": spec.artifact.uri,
        "artifact_sha256": spec.artifact.sha256,
        "args": spec.args,
        "env": {k: v if isinstance(v, str) else v.model_dump() for k, v in spec.env.items()},
        "input_path": spec.input_path,
        "output_path": spec.output_path,
        "cpu": spec.resources.cpu,
        "memory_mb": spec.resources.memory_mb,
        "preemptible": spec.preemptible,
        "max_attempts": spec.retry.max_attempts,
        "backoff_base_s": spec.retry.base_s,
        "backoff_cap_s": spec.retry.cap_s,
        "backoff_jitter": spec.retry.jitter,
        "poison_after": spec.retry.poison_after,
        "timeout_s": spec.timeout_s,
        "run_at": spec.run_at.isoformat() if spec.run_at else None,
        "idempotency_key": spec.idempotency_key,
        "spec_hash": spec_hash(spec) if spec.idempotency_key else None,
        "labels": spec.labels,
        "defer_ok": spec.defer_ok,
        "deadline": spec.deadline.isoformat() if spec.deadline else None,
        "team": spec.team,
        "concurrency_key": spec.concurrency.key if spec.concurrency else None,
        "concurrency_limit": spec.concurrency.limit if spec.concurrency else None,
    }


async def submit(
    conn: AsyncConnection,
    owner: str | Sequence[str],
    specs: Sequence[TaskCreate],
    quantum_s: float = 1.0,
) -> list[tuple[Any, bool]]:
    """Store the submissions in one statement; return each one's task row, in the order
    given, and whether it was created (False: its idempotency key matched a task).
    ``owner`` is one owner for all, or one per submission. Rows hold
    ``queries.SUBMITTED_COLUMNS``. ``quantum_s`` is the fair-share step of an owner of
    weight 1 (docs/sharing.md)."""
    owners = [owner] * len(specs) if isinstance(owner, str) else list(owner)
    docs = [{**_row_doc(spec), "owner": who} for spec, who in zip(specs, owners, strict=True)]
    rows = jsonb(docs)
    created = await _fetch(conn, queries.SUBMIT, {"rows": rows, "quantum": quantum_s})

    def key_of(row: Any) -> tuple[str, str] | None:
        return (row["owner"], row["idempotency_key"]) if row["idempotency_key"] else None

    created_keys = {(row.owner, row.idempotency_key) for row in created if row.idempotency_key}
    wanted = {k for k in map(key_of, docs) if k is not None}
    missing = sorted(wanted - created_keys)
    existing: dict[tuple[str, str], Any] = {}
    if missing:
        found = await _fetch(
            conn,
            queries.BY_IDEMPOTENCY_KEYS,
            {"owners": [o for o, _ in missing], "keys": [k for _, k in missing]},
        )
        existing = {(row.owner, row.idempotency_key): row for row in found}
    out: list[tuple[Any, bool]] = []
    fresh = iter(created)
    seen: set[tuple[str, str]] = set()
    for doc in docs:
        key = key_of(doc)
        if key is None or (key in created_keys and key not in seen):
            row = next(fresh)
            if key:
                seen.add(key)
            out.append((row, True))
            continue
        row = existing.get(key) or next(r for r, _ in out if (r.owner, r.idempotency_key) == key)
        if row.spec_hash != doc["spec_hash"]:
            raise IdempotencyMismatch(
                f"idempotency_key {key[1]!r} was used for task {row.id} with a different request"
            )
        out.append((row, False))
    return out


def new_task(spec: TaskCreate, row: Any) -> Task:
    """The task a submission just created, from the spec and its submitted row: what the
    database added is only ids, state and times, so nothing needs reading back."""
    return Task.model_construct(
        **{name: getattr(spec, name) for name in TaskCreate.model_fields if name != "run_at"},
        id=row.id,
        owner=row.owner,
        state=TaskState(row.state),
        run_at=row.run_at,
        attempts=0,
        last_error=None,
        current_attempt_id=None,
        created_at=row.created_at,
        updated_at=row.updated_at,
        finished_at=None,
    )


def task_from_row(m: Any) -> Task:
    """A task from a row of ``TASK_COLUMNS`` (SQLAlchemy's or psycopg's named tuple)."""
    return Task(
        id=m.id,
        owner=m.owner,
        name=m.name,
        queue=m.queue,
        priority=m.priority,
        kind=m.kind,
        artifact={"uri": m.artifact_uri, "sha256": m.artifact_sha256},
        args=m.args,
        env=m.env,
        input_path=m.input_path,
        output_path=m.output_path,
        resources={"cpu": m.cpu, "memory_mb": m.memory_mb},
        preemptible=m.preemptible,
        retry={
            "max_attempts": m.max_attempts,
            "base_s": m.backoff_base_s,
            "cap_s": m.backoff_cap_s,
            "jitter": m.backoff_jitter,
            "poison_after": m.poison_after,
        },
        timeout_s=m.timeout_s,
        run_at=m.run_at,
        idempotency_key=m.idempotency_key,
        labels=m.labels,
        state=m.state,
        attempts=m.attempts,
        last_error=m.last_error,
        current_attempt_id=m.current_attempt_id,
        created_at=m.created_at,
        updated_at=m.updated_at,
        finished_at=m.finished_at,
        defer_ok=m.defer_ok,
        deadline=m.deadline,
        team=m.team,
        concurrency=(
            {"key": m.concurrency_key, "limit": m.concurrency_limit} if m.concurrency_key else None
        ),
    )


# --- reads --------------------------------------------------------------------------------


def _visible(who: Visibility) -> Any:
    if not who.teams:
        return tasks.c.owner == who.owner
    return or_(tasks.c.owner == who.owner, tasks.c.team.in_(sorted(who.teams)))


async def get_task(conn: AsyncConnection, task_id: int, who: Visibility | None) -> Task:
    """The task, if it exists and ``who`` (when given) may see it: its owner, or a member
    of the team that owns it; else ``NotFound``."""
    query = select(tasks).where(tasks.c.id == task_id)
    if who is not None:
        query = query.where(_visible(who))
    row = (await conn.execute(query)).first()
    if row is None:
        raise NotFound(f"task {task_id} not found")
    return task_from_row(row)


@dataclass(frozen=True)
class TaskFilter:
    state: TaskState | None = None
    queue: str | None = None
    owner: str | None = None
    labels: tuple[tuple[str, str], ...] = ()
    team: str | None = None
    visible_to: Visibility | None = None
    keys: tuple[str, ...] = ()


async def list_tasks(
    conn: AsyncConnection, where: TaskFilter, before_id: int | None, limit: int
) -> list[Task]:
    """Newest first; ``before_id`` is the keyset cursor."""
    query = select(tasks).order_by(tasks.c.id.desc()).limit(limit)
    conditions = []
    if where.state is not None:
        conditions.append(tasks.c.state == where.state.value)
    if where.queue is not None:
        conditions.append(tasks.c.queue == where.queue)
    if where.owner is not None:
        conditions.append(tasks.c.owner == where.owner)
    if where.labels:
        conditions.append(tasks.c.labels.contains(dict(where.labels)))
        conditions.append(literal_column(f"core.tasks.{LABELLED}", Boolean))
    if where.team is not None:
        conditions.append(tasks.c.team == where.team)
    if where.visible_to is not None:
        conditions.append(_visible(where.visible_to))
    if where.keys:
        conditions.append(tasks.c.idempotency_key.in_(where.keys))
    if before_id is not None:
        conditions.append(tasks.c.id < before_id)
    if conditions:
        query = query.where(and_(*conditions))
    return [task_from_row(row) for row in await conn.execute(query)]


async def list_attempts(conn: AsyncConnection, task_id: int) -> list[Attempt]:
    query = select(attempts).where(attempts.c.task_id == task_id).order_by(attempts.c.id)
    return [Attempt.model_validate(row._mapping) for row in await conn.execute(query)]


def _event(row: Row[Any]) -> Event:
    m = row._mapping
    return Event(
        cursor=f"{m['xid']}.{m['id']}",
        task_id=m["task_id"],
        seq=m["seq"],
        owner=m["owner"],
        op=m["op"],
        from_state=m["from_state"],
        to_state=m["to_state"],
        reason=m["reason"],
        attempt_id=m["attempt_id"],
        at=m["at"],
    )


async def task_events_of(conn: AsyncConnection, task_id: int) -> list[Event]:
    query = select(task_events).where(task_events.c.task_id == task_id).order_by(task_events.c.seq)
    return [_event(row) for row in await conn.execute(query)]


async def read_feed(
    conn: AsyncConnection,
    after: tuple[int, int],
    limit: int,
    who: Visibility | None,
    to_state: TaskState | None = None,
) -> tuple[list[Event], tuple[int, int]]:
    """Events after the cursor, oldest first, and the cursor to read on from; with
    ``who``, only those of its own tasks and its teams'; with ``to_state``, only those
    that moved a task there (the cursor still moves past the others)."""
    query = queries.FEED if to_state is None else queries.feed_to(to_state)
    params = {
        "xid": after[0],
        "id": after[1],
        "limit": limit,
        "owner": who.owner if who is not None else None,
        "teams": sorted(who.teams) if who is not None and who.teams else None,
    }
    rows = list(await conn.execute(query, params))
    events = [_event(row) for row in rows if row.id is not None]
    if events:
        last = rows[-1]
        return events, (last.xid, last.id)
    horizon = rows[0].horizon if rows else after[0]
    # Nothing visible: every event of a transaction below the horizon is already behind
    # the cursor, so it may jump to the horizon without skipping anything.
    return [], max(after, (horizon - 1, 2**63 - 1))


# --- state changes ------------------------------------------------------------------------


async def transition(
    conn: AsyncConnection,
    task_id: int,
    op: Op,
    target: TaskState,
    *,
    owner: str | None = None,
    reason: str | None = None,
    error: str | None = None,
    reset_run_at: bool = False,
    reset_counts: bool = False,
    keep_attempt: bool = False,
    attempt_id: int | None = None,
    delay_s: float | None = None,
    crashed: bool = False,
    refund: bool = False,
) -> TaskState:
    """Move one task by ``op`` to ``target`` if its current state allows it, and append the
    event; return the state it left. ``NotFound`` if it is missing (or not ``owner``'s),
    ``IllegalTransition`` if its state refuses the move. Nothing is changed on refusal.
    ``attempt_id`` becomes the task's current attempt (a claim must name one); otherwise
    ``keep_attempt`` keeps the current one and any other move clears it. ``delay_s`` sets
    ``run_at`` that far ahead (a retry's backoff); ``crashed`` counts a lost attempt
    towards the poison-pill limit; ``refund`` gives back the attempt (handed back)."""
    allowed_from = sources(op, target)
    if target is TaskState.RUNNING and attempt_id is None and not keep_attempt:
        raise ValueError("a move to running must name its attempt")
    params = {
        "id": task_id,
        "owner": owner,
        "target": target.value,
        "sources": allowed_from,
        "final": target in FINAL,
        "reset_run_at": reset_run_at,
        "reset_counts": reset_counts,
        "keep_attempt": keep_attempt,
        "attempt_id": attempt_id,
        "delay_s": delay_s,
        "crashed": int(crashed),
        "refund": int(refund),
        "error": error,
        "op": op.value,
        "reason": reason,
    }
    row = (await conn.execute(queries.TRANSITION, params)).one()
    if row.found_state is None:
        raise NotFound(f"task {task_id} not found")
    if row.from_state is None:
        check(op, TaskState(row.found_state), target)
        raise IllegalTransition(f"cannot {op.value} a task that is {row.found_state}")
    return TaskState(row.from_state)


async def cancel(conn: AsyncConnection, task_id: int, owner: str | None, reason: str) -> None:
    """Cancel the task; a running attempt is closed here, and its worker told to stop it
    at its next heartbeat."""
    await transition(conn, task_id, Op.CANCEL, TaskState.CANCELLED, owner=owner, reason=reason)
    await conn.execute(
        update(attempts)
        .where(attempts.c.task_id == task_id, attempts.c.outcome.is_(None))
        .values(outcome="cancelled", ended_at=func.now(), error=reason)
    )


async def retry(conn: AsyncConnection, task_id: int, who: Visibility | None) -> None:
    """A person's retry: a fresh budget of attempts, eligible now (or ready if paused)."""
    task = await get_task(conn, task_id, who)
    target = TaskState.READY if await queue_paused(conn, task.queue) else TaskState.WAITING
    await transition(
        conn,
        task_id,
        Op.RETRY,
        target,
        reason="retried by a person",
        reset_run_at=True,
        reset_counts=True,
    )
    # A fresh turn in fair share: an old stamp would age it straight to the top.
    await conn.execute(
        update(tasks)
        .where(tasks.c.id == task_id)
        .values(vtime=func.greatest(tasks.c.vtime, func.extract("epoch", func.now())))
    )


_BULK_OPS = {
    Op.RETRY: (queries.BULK_RETRY, TaskState.WAITING),
    Op.CANCEL: (queries.BULK_CANCEL, TaskState.CANCELLED),
}


def bulk_sources(op: Op, selector: TaskSelector) -> list[str]:
    """The states a bulk ``op`` takes tasks from (those of the transitions table, or the
    one the filter names); ``InvalidInput`` naming ``filter.state`` if it never can."""
    allowed = sources(op, _BULK_OPS[op][1])
    if selector.state is None:
        return allowed
    if selector.state.value not in allowed:
        reason = f"{op.value} takes tasks that are {', '.join(allowed)}, not {selector.state.value}"
        raise InvalidInput(
            f"filter.state: {reason}", errors=[{"field": "body.filter.state", "reason": reason}]
        )
    return [selector.state.value]


def _selector_params(op: Op, selector: TaskSelector, owner: str | None) -> dict[str, Any]:
    return {
        "sources": bulk_sources(op, selector),
        "queue": selector.queue,
        "owner": owner,
        "team": selector.team,
        "labels": jsonb(selector.labels) if selector.labels else None,
        "created_after": selector.created_after,
        "created_before": selector.created_before,
        "finished_after": selector.finished_after,
        "finished_before": selector.finished_before,
    }


async def count_selected(
    conn: AsyncConnection, op: Op, selector: TaskSelector, owner: str | None, cap: int
) -> int:
    """How many tasks a bulk ``op`` would take (up to ``cap``)."""
    params = {**_selector_params(op, selector, owner), "after": 0, "cap": cap}
    return int((await conn.execute(queries.COUNT_SELECTED, params)).scalar_one())


async def selected_page(
    conn: AsyncConnection, op: Op, selector: TaskSelector, owner: str | None, after: int, limit: int
) -> list[Task]:
    """The next page of the tasks a bulk ``op`` selects (ids above ``after``), unlocked."""
    params = {**_selector_params(op, selector, owner), "after": after, "limit": limit}
    return [task_from_row(row) for row in await conn.execute(queries.SELECTED_PAGE, params)]


async def bulk_move(
    conn: AsyncConnection,
    op: Op,
    selector: TaskSelector,
    owner: str | None,
    *,
    after: int,
    limit: int,
    reason: str,
    ids: Sequence[int] | None = None,
) -> tuple[int, int]:
    """Move one page of the selected tasks (ids above ``after``; with ``ids``, of those
    only) as ``op`` does one task; return how many moved and the last id taken (0: none)."""
    query, _ = _BULK_OPS[op]
    params = {
        **_selector_params(op, selector, owner),
        "after": after,
        "limit": limit,
        "op": op.value,
        "reason": reason,
        "ids": list(ids) if ids is not None else None,
    }
    row = (await conn.execute(query, params)).one()
    return int(row.changed), int(row.last_id)


async def promote_and_park(conn: AsyncConnection, limit: int, after_s: float = 0.0) -> int:
    """One pass of the promoter: due work becomes eligible (ready work ``after_s`` past its
    run_at: claims take it before), paused queues' work steps back."""
    moved = 0
    for query in (queries.PARK_WAITING, queries.PARK_FAILED, queries.PROMOTE_FAILED):
        moved += (await conn.execute(query, {"limit": limit})).scalar_one()
    promote = {"limit": limit, "after_s": after_s}
    moved += int((await conn.execute(queries.PROMOTE_READY, promote)).scalar_one())
    return moved


async def next_due_in(conn: AsyncConnection, after_s: float = 0.0) -> float | None:
    """Seconds until the next delayed task (in a running queue) is due, or due ready work
    is to be promoted (``after_s`` past its run_at); None if none waits."""
    due: float | None = (await conn.execute(queries.NEXT_DUE, {"after_s": after_s})).scalar_one()
    return due


async def purge_finished(conn: AsyncConnection, age_s: float, limit: int) -> int:
    """Delete up to ``limit`` tasks finished more than ``age_s`` ago, with their attempts
    and events; return how many went."""
    result = await conn.execute(queries.PURGE_FINISHED, {"age_s": age_s, "limit": limit})
    return int(result.rowcount)


async def purge_workers(conn: AsyncConnection, age_s: float, limit: int) -> int:
    """Delete up to ``limit`` workers gone (dead or left) more than ``age_s`` ago."""
    result = await conn.execute(queries.PURGE_WORKERS, {"age_s": age_s, "limit": limit})
    return int(result.rowcount)


# --- queues -------------------------------------------------------------------------------


async def queue_paused(conn: AsyncConnection, name: str) -> bool:
    row = (await conn.execute(select(queues.c.paused).where(queues.c.name == name))).first()
    return bool(row and row.paused)


async def set_paused(conn: AsyncConnection, name: str, paused: bool) -> None:
    stmt = pg_insert(queues).values(name=name, paused=paused)
    stmt = stmt.on_conflict_do_update(
        index_elements=[queues.c.name], set_={"paused": paused, "updated_at": func.now()}
    )
    await conn.execute(stmt)


async def list_queues(conn: AsyncConnection) -> list[QueueInfo]:
    infos: dict[str, QueueInfo] = {}

    def info(name: str) -> QueueInfo:
        return infos.setdefault(
            name, QueueInfo(name=name, paused=False, depth={}, oldest_waiting_age_s=None)
        )

    for row in await conn.execute(queries.QUEUE_DEPTHS):
        entry = info(row.queue)
        entry.depth[TaskState(row.state)] = row.n
        if row.oldest is not None:
            entry.oldest_waiting_age_s = float(row.oldest)
    for row in await conn.execute(select(queues)):
        info(row.name).paused = row.paused
    for entry in infos.values():
        for state in TaskState:
            if state not in FINAL or state is TaskState.DEAD:
                entry.depth.setdefault(state, 0)
    return sorted(infos.values(), key=lambda q: q.name)


async def queue_history(conn: AsyncConnection, minutes: int) -> QueueHistory:
    """Per queue and minute: tasks submitted, finished, and the backlog (unfinished tasks)
    worked back from the backlog now."""
    counts: dict[str, dict[str, list[int]]] = {}
    until = (await conn.execute(select(func.now()))).scalar_one()
    for row in await conn.execute(queries.QUEUE_HISTORY, {"minutes": minutes}):
        series = counts.setdefault(
            row.queue, {k: [0] * minutes for k in ("submitted", "finished", "live")}
        )
        if 0 <= row.ago < minutes:
            series[row.kind][row.ago] += row.n
    items = []
    for name, series in sorted(counts.items()):
        backlog, level = [], series["live"][0]
        for ago in range(minutes):
            backlog.append(level)
            level = max(0, level - series["submitted"][ago] + series["finished"][ago])
        items.append(
            QueueSeries(
                name=name,
                submitted=series["submitted"][::-1],
                finished=series["finished"][::-1],
                backlog=backlog[::-1],
            )
        )
    return QueueHistory(minutes=minutes, until=until, items=items)
