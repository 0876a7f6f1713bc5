"""Workers: registration, the lease that proves a worker, heartbeats (which attempts it
must stop, squeeze or preempt), and the reaper of silent workers, whose open attempts are
lost through ``db.attempts``.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common import pipeline
from libs.common.errors import NotFound
from libs.common.models import (
    Worker,
    WorkerRegister,
)
from libs.common.states import TaskState, Workers, sql_in
from services.core.db import placement
from services.core.db.attempts import Tally, lose
from services.core.db.tables import workers
from services.core.domain.placement import ZERO, Amount

S = TaskState

_OPEN_ATTEMPTS_OF = text("""
SELECT a.id, a.task_id FROM core.attempts a
WHERE a.worker_id = :worker AND a.outcome IS NULL
""")


# Dead: silent for ``timeout_s`` (no heartbeat, no turn), or ``hung``: its agent took no
# turn for ``hang_s`` while its sidecar beat. ``deaf``: that silence began before this
# replica could hear it (core or its database was away), so it may be core's own doing.
_SILENT_WORKERS = text(f"""
UPDATE core.workers w SET state = '{Workers.DEAD}', gone_at = now()
FROM (SELECT id, last_heartbeat_at, last_turn_at,
             last_heartbeat_at >= now() - make_interval(secs => :timeout_s) AS hung
      FROM core.workers
      WHERE {sql_in("state", Workers.PRESENT)}
        AND (last_heartbeat_at < now() - make_interval(secs => :timeout_s)
             OR last_turn_at < now() - make_interval(secs => :hang_s))
      FOR UPDATE) silent
WHERE w.id = silent.id
RETURNING w.id, silent.hung,
          CASE WHEN silent.hung THEN silent.last_turn_at ELSE silent.last_heartbeat_at END
              < now() - make_interval(secs => :heard_for_s) AS deaf
""")

# The sidecar saw its agent hang and killed its attempts: the worker is dead at once.
_HUNG_WORKER = text(f"""
UPDATE core.workers SET state = '{Workers.DEAD}', gone_at = now()
WHERE id = :worker AND {sql_in("state", Workers.PRESENT)}
RETURNING id
""")


@dataclass(frozen=True)
class Policy:
    """The timing a worker is told at registration and the reaper enforces."""

    heartbeat_interval_s: float
    heartbeat_timeout_s: float


def _worker(row: Any, use: dict[int, tuple[Amount, int]] | None = None) -> Worker:
    held, running = (use or {}).get(row.id, (ZERO, 0))
    return Worker(
        id=row.id,
        principal=row.principal,
        hostname=row.hostname,
        queues=list(row.queues),
        labels=row.labels,
        cpu=row.cpu,
        memory_mb=row.memory_mb,
        devices=row.devices,
        state=row.state,
        registered_at=row.registered_at,
        last_heartbeat_at=row.last_heartbeat_at,
        last_turn_at=row.last_turn_at,
        used_cpu=float(held.cpu),
        used_memory_mb=round(held.memory_mb),
        used_devices=dict(held.devices),
        running=int(running),
    )


def lease_digest(lease: str) -> str:
    return hashlib.sha256(lease.encode()).hexdigest()


async def register(
    conn: AsyncConnection, principal: str, offer: WorkerRegister
) -> tuple[Worker, str]:
    """Record a worker; returns it with its new lease secret (only its hash is kept)."""
    lease = "lease_" + secrets.token_urlsafe(32)
    stmt = (
        insert(workers)
        .values(
            principal=principal,
            hostname=offer.hostname,
            queues=offer.queues,
            labels=offer.labels,
            cpu=offer.cpu,
            memory_mb=offer.memory_mb,
            devices=offer.devices,
            lease_sha256=lease_digest(lease),
            last_turn_at=func.now() if offer.hang_watch else None,
        )
        .returning(workers)
    )
    return _worker((await conn.execute(stmt)).one()), lease


async def get_worker(conn: AsyncConnection, worker_id: int, principal: str | None) -> Any:
    """The worker's row, if ``principal`` (when given) registered it; else ``NotFound``."""
    query = select(workers).where(workers.c.id == worker_id)
    if principal is not None:
        query = query.where(workers.c.principal == principal)
    row = (await conn.execute(query)).first()
    if row is None:
        raise NotFound(f"worker {worker_id} not found")
    return row


@dataclass(frozen=True)
class Holder:
    """A worker as a request that proved its lease knows it."""

    id: int
    #: who registered it
    principal: str


async def leased_worker(conn: AsyncConnection, worker_id: int, lease: str | None) -> Holder:
    """The worker if ``lease`` is its lease secret; else ``NotFound``, the same answer as
    for a missing worker, so one replica cannot act for another."""
    row = (await conn.execute(select(workers).where(workers.c.id == worker_id))).first()
    if (
        row is None
        or row.lease_sha256 is None
        or not lease
        or not hmac.compare_digest(row.lease_sha256, lease_digest(lease))
    ):
        raise NotFound(f"worker {worker_id} not found")
    return Holder(row.id, row.principal)


def held_by(holder: Holder, principal: str | None) -> Holder:
    """``holder`` if ``principal`` (when given: admins act for any) registered it; else
    ``NotFound``, as for a missing worker."""
    if principal is not None and holder.principal != principal:
        raise NotFound(f"worker {holder.id} not found")
    return holder


async def list_workers(
    conn: AsyncConnection, state: str | None, before_id: int | None, limit: int
) -> list[Worker]:
    """Newest first; ``before_id`` is the keyset cursor."""
    query = select(workers).order_by(workers.c.id.desc()).limit(limit)
    if state is not None:
        query = query.where(workers.c.state == state)
    if before_id is not None:
        query = query.where(workers.c.id < before_id)
    rows = list(await conn.execute(query))
    use = await placement.use_of(conn, [r.id for r in rows])
    return [_worker(row, use) for row in rows]


async def start_draining(conn: AsyncConnection, worker_id: int) -> bool:
    """A live worker drains (its row locked until commit, so no lease of this worker's
    commits after it: ``attempts._CLAIM``); False when it was not live."""
    moved = await conn.execute(
        update(workers)
        .where(workers.c.id == worker_id, workers.c.state == Workers.LIVE)
        .values(state=Workers.DRAINING)
        .returning(workers.c.id)
    )
    return moved.first() is not None


async def set_worker_state(conn: AsyncConnection, worker_id: int, state: str) -> None:
    gone = func.now() if state in Workers.GONE else None
    await conn.execute(
        update(workers).where(workers.c.id == worker_id).values(state=state, gone_at=gone)
    )


@dataclass(frozen=True)
class Beat:
    """What a heartbeat found: attempts the worker must stop, squeeze and preempt, and
    how many of its attempts were lost."""

    stop: list[int]
    squeeze: list[int]
    preempt: list[int]
    lost: int
    #: what losing the missing ones ended, for the metrics
    tally: Tally
    #: the worker's state as the beat wrote its liveness (None: read it again)
    state: str | None = None


_ROOM_MADE = text("""
SELECT a.id, a.squeezed_at IS NOT NULL AS squeezed, a.preempted_by IS NOT NULL AS preempted
FROM core.attempts a
WHERE a.worker_id = :worker AND a.outcome IS NULL
  AND (a.squeezed_at IS NOT NULL OR a.preempted_by IS NOT NULL)
  AND a.id = ANY(CAST(:alive AS bigint[]))
""")


async def heartbeat(
    conn: AsyncConnection,
    worker: Any,
    alive: list[int],
    grace_s: float,
    hung: tuple[int, int] = (0, 0),
    seen: int | None = None,
) -> Beat:
    """Record the worker alive, with what of its agent hangs on sources (``hung``:
    threads, checkers); open attempts it no longer reports (after ``grace_s``, for those
    just claimed; none above ``seen``, the highest attempt id its agent had been handed
    when the list was read: a list read before a lease reached the agent and heard long
    after says nothing of that lease) are lost. Say which reported attempts it must stop
    (cancelled, lost), squeeze and preempt."""
    stop, lost, tally, state = await _beat(conn, worker, alive, grace_s, hung, seen)
    if not alive:
        return Beat(stop, [], [], lost, tally, state)
    rows = list(await conn.execute(_ROOM_MADE, {"worker": worker.id, "alive": sorted(alive)}))
    squeeze = [r.id for r in rows if r.squeezed and not r.preempted]
    preempt = [r.id for r in rows if r.preempted]
    return Beat(stop, squeeze, preempt, lost, tally, state)


_BEAT = text("""
UPDATE core.workers SET last_heartbeat_at = now(), hung_source_threads = :threads,
    hung_source_checkers = :checkers
WHERE id = :worker RETURNING state
""")
_SEEN = text("""
UPDATE core.attempts SET seen_at = now()
WHERE worker_id = :worker AND outcome IS NULL AND id = ANY(CAST(:alive AS bigint[]))
""")
_MISSING = text("""
SELECT a.id FROM core.attempts a
WHERE a.worker_id = :worker AND a.outcome IS NULL
  AND a.started_at < now() - make_interval(secs => :grace)
  AND (CAST(:seen AS bigint) IS NULL OR a.id <= CAST(:seen AS bigint))
  AND NOT (a.id = ANY(CAST(:alive AS bigint[])))
""")
_STOP = text(f"""
SELECT a.id FROM core.attempts a JOIN core.tasks t ON t.id = a.task_id
WHERE a.id = ANY(CAST(:alive AS bigint[])) AND a.worker_id = :worker
  AND (a.outcome IS NOT NULL OR t.current_attempt_id IS DISTINCT FROM a.id
       OR t.state <> '{S.RUNNING}')
""")


async def _beat(
    conn: AsyncConnection,
    worker: Any,
    alive: list[int],
    grace_s: float,
    hung: tuple[int, int],
    seen: int | None,
) -> tuple[list[int], int, Tally, str | None]:
    """The beat's writes and reads in one round trip (an idle worker's beat is this
    alone): its liveness, its reported attempts seen, the open ones it no longer reports
    (lost here, rare) and those it must stop. The worker's state as written, or None when
    attempts were lost (read again)."""
    reported = sorted(set(alive))
    params = {"worker": worker.id, "alive": reported, "grace": grace_s}
    threads, checkers = hung
    beat_params = {"worker": worker.id, "threads": threads, "checkers": checkers}
    chain: list[pipeline.Statement] = [(_BEAT, beat_params), (_MISSING, {**params, "seen": seen})]
    if reported:
        chain[1:1] = [(_SEEN, params)]
        chain.append((_STOP, params))
    beat, *found = await pipeline.run(conn, chain)
    missing = found[1] if reported else found[0]
    stop = [row.id for row in found[2]] if reported else []
    tally = Tally()
    for row in missing:
        _, ended = await lose(
            conn, row.id, "the process is gone (missing from its worker's heartbeat)"
        )
        tally = tally + ended
    state = str(beat[0].state) if beat and not missing else None
    return stop, len(missing), tally, state


async def lose_all(
    conn: AsyncConnection,
    worker_id: int,
    why: str,
    *,
    host_died: bool = False,
    excused: bool = False,
) -> Tally:
    """Every open attempt of the worker is lost (``host_died``: with the worker;
    ``excused``: at no cost); what that ended (``lost`` counts them)."""
    rows = list(await conn.execute(_OPEN_ATTEMPTS_OF, {"worker": worker_id}))
    tally = Tally()
    for row in rows:
        _, ended = await lose(conn, row.id, why, host_died=host_died, excused=excused)
        tally = tally + ended
    return tally


_ANSWER = text("SELECT 1")


async def answer(conn: AsyncConnection) -> None:
    """A round trip: the database answers (a transaction has its connection)."""
    await conn.execute(_ANSWER)


async def reap(
    conn: AsyncConnection,
    timeout_s: float,
    *,
    hang_s: float = math.inf,
    heard_for_s: float = math.inf,
) -> tuple[int, Tally, list[tuple[int, str, int]]]:
    """Workers silent for ``timeout_s``, or whose agent took no turn for ``hang_s``
    (hung, while its sidecar beats), are dead; their open attempts are lost. Returns
    what changed, what that ended, and each dead worker's (id, why, attempts lost) for
    the caller's log. Silence
    counts only from when this replica could hear (``heard_for_s``: how long it has
    reached the database without a break): a worker silent since before then is dead
    only once core has listened for the bound too, and its attempts go back without
    cost, since its silence may be core's own absence."""
    if heard_for_s < min(timeout_s, hang_s):
        return 0, Tally(), []
    params = {
        "timeout_s": _bound(timeout_s, heard_for_s),
        "hang_s": _bound(hang_s, heard_for_s),
        "heard_for_s": min(heard_for_s, _NEVER_S),
    }
    dead = list(await conn.execute(_SILENT_WORKERS, params))
    tally, buried = Tally(), []
    for row in dead:
        why = f"its worker {row.id} stopped heartbeating"
        if row.hung:
            why = f"its worker {row.id}'s agent took no turn for {hang_s:g} s (hung)"
        if row.deaf:
            why += " while core could not hear it"
        ended = await lose_all(conn, row.id, why, host_died=True, excused=row.deaf)
        tally = tally + ended
        buried.append((int(row.id), why, ended.lost))
    return len(dead) + tally.lost, tally, buried


#: a bound that never passes (an interval PostgreSQL still holds)
_NEVER_S = 10.0**9


def _bound(bound_s: float, heard_for_s: float) -> float:
    """A silence bound, or never while this replica has not heard for that long."""
    return min(bound_s, _NEVER_S) if heard_for_s >= bound_s else _NEVER_S


async def bury_hung(conn: AsyncConnection, worker_id: int, hung_s: float) -> Tally:
    """The worker's sidecar saw its agent's loop stand still for ``hung_s`` and killed
    its attempts: the worker is dead now, its open attempts lost as with a dead host."""
    if (await conn.execute(_HUNG_WORKER, {"worker": worker_id})).first() is None:
        return Tally()
    why = f"its worker {worker_id}'s agent hung (its loop stood still {hung_s:g} s)"
    return await lose_all(conn, worker_id, why, host_died=True)
