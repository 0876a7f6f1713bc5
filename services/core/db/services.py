"""Services (docs/services.md): what agents report of each replica (ready, its host's
address, its ports), where the ready ones listen, and the services kept at N replicas
(their rows, their live tasks, the controller's steps)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, func, insert, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common.auth import Visibility
from libs.common.models import (
    MAX_REPLICAS_LISTED,
    Endpoint,
    ReplicaStatus,
    ServiceCreate,
    ServiceInfo,
    ServiceStep,
)
from libs.common.states import TaskState
from services.core.db.tables import found_by_id, service_steps, services
from services.core.domain.services import REVISION_LABEL, SERVICE_LABEL, Replica

S = TaskState

# Only an attempt still open on the reporting worker, and its task's current one, takes
# a status; ready_at moves when the flag flips.
_REPORT = text(f"""
UPDATE core.attempts a SET
    ready = r.ready,
    ready_at = CASE WHEN a.ready IS DISTINCT FROM r.ready THEN now() ELSE a.ready_at END,
    address = r.address,
    ports = r.ports
FROM jsonb_to_recordset(CAST(:rows AS jsonb))
    AS r(attempt_id bigint, ready boolean, address text, ports jsonb),
    core.tasks t
WHERE a.id = r.attempt_id AND a.worker_id = :worker AND a.outcome IS NULL
  AND t.id = a.task_id AND t.current_attempt_id = a.id AND {found_by_id(S.RUNNING)}
RETURNING a.id
""")

_REPLICAS = text(f"""
SELECT t.id AS task_id, t.owner, a.id AS attempt_id, COALESCE(a.ready, false) AS ready,
       a.address, COALESCE(a.ports, '{{}}'::jsonb) AS ports
FROM core.tasks t JOIN core.attempts a ON a.id = t.current_attempt_id
WHERE t.kind = 'service' AND t.state = '{S.RUNNING}' AND t.name = :name
  AND (CAST(:everyone AS boolean)
       OR t.owner = :owner OR t.team = ANY(CAST(:teams AS text[])))
  AND (CAST(:all AS boolean) OR a.ready)
ORDER BY t.id
LIMIT :most
""")


async def report(
    conn: AsyncConnection, worker_id: int, items: Sequence[ReplicaStatus]
) -> list[int]:
    """Keep each replica's status; the attempts that took it."""
    rows = json.dumps([item.model_dump(mode="json") for item in items])
    found = await conn.execute(_REPORT, {"rows": rows, "worker": worker_id})
    return sorted(row.id for row in found)


async def replicas(
    conn: AsyncConnection, name: str, who: Visibility | None, only_ready: bool
) -> list[Endpoint]:
    """The running replicas of the services called ``name`` that ``who`` may see (None:
    every owner's): the ready ones, or with ``only_ready`` false all of them."""
    params: dict[str, Any] = {
        "name": name,
        "everyone": who is None,
        "owner": who.owner if who else "",
        "teams": sorted(who.teams) if who else [],
        "all": not only_ready,
        "most": MAX_REPLICAS_LISTED,
    }
    return [_endpoint(row) for row in await conn.execute(_REPLICAS, params)]


def _endpoint(row: Any) -> Endpoint:
    ports = {str(k): int(v) for k, v in row.ports.items()}
    where = {k: f"{row.address}:{v}" for k, v in ports.items()} if row.address else {}
    return Endpoint(
        task_id=row.task_id,
        attempt_id=row.attempt_id,
        owner=row.owner,
        ready=row.ready,
        address=row.address,
        ports=ports,
        endpoints=where,
    )


# --- services kept at N replicas (the controller: ops.services) --------------------------

_LIVE_REPLICAS = text(f"""
SELECT t.id AS task_id, CAST(t.labels->>'{REVISION_LABEL}' AS integer) AS revision,
       (t.state = '{S.RUNNING}' AND COALESCE(a.ready, false)) AS ready
FROM core.tasks t LEFT JOIN core.attempts a ON a.id = t.current_attempt_id
WHERE t.owner = :owner AND t.name = :name AND t.labels ? '{SERVICE_LABEL}'
  AND t.state IN ('{S.READY}', '{S.WAITING}', '{S.RUNNING}', '{S.FAILED}')
  AND t.labels->>'{SERVICE_LABEL}' = :name
ORDER BY t.id
""")


async def insert_service(
    conn: AsyncConnection, owner: str, create: ServiceCreate, template: dict[str, Any]
) -> int | None:
    """A new service at revision 1; None when the owner has one of that name."""
    rollout = create.rollout
    query = (
        pg_insert(services)
        .values(
            owner=owner,
            name=create.name,
            replicas=create.replicas,
            template=template,
            revision=1,
            revisions=1,
            max_surge=rollout.max_surge,
            max_unavailable=rollout.max_unavailable,
            deadline_s=rollout.deadline_s,
            max_failures=rollout.max_failures,
            rollout="progressing",
        )
        .on_conflict_do_nothing()
        .returning(services.c.id)
    )
    found = (await conn.execute(query)).scalar()
    return int(found) if found is not None else None


async def get_service(conn: AsyncConnection, owner: str, name: str, lock: bool = False) -> Any:
    """The owner's service of that name (locked for update with ``lock``), or None."""
    query = select(services).where(services.c.owner == owner, services.c.name == name)
    if lock:
        query = query.with_for_update()
    return (await conn.execute(query)).first()


async def lock_service(conn: AsyncConnection, service_id: int) -> Any:
    """The service, locked for this pass; None when another pass holds it (or it is gone)."""
    query = select(services).where(services.c.id == service_id).with_for_update(skip_locked=True)
    return (await conn.execute(query)).first()


async def service_ids(conn: AsyncConnection, after: int, limit: int) -> list[int]:
    query = select(services.c.id).where(services.c.id > after).order_by(services.c.id).limit(limit)
    return list((await conn.execute(query)).scalars())


async def change_service(conn: AsyncConnection, service_id: int, **values: Any) -> None:
    await conn.execute(
        update(services).where(services.c.id == service_id).values(updated_at=func.now(), **values)
    )


async def delete_service(conn: AsyncConnection, service_id: int) -> None:
    await conn.execute(delete(services).where(services.c.id == service_id))


async def live_replicas(conn: AsyncConnection, owner: str, name: str) -> list[Replica]:
    """The service's tasks that are not finished (a failed one waits for its restart)."""
    rows = await conn.execute(_LIVE_REPLICAS, {"owner": owner, "name": name})
    return [Replica(row.task_id, row.revision or 0, bool(row.ready)) for row in rows]


# The failed attempts of a revision's live tasks that ended since its rollout began.
_FAILURES = text(f"""
SELECT a.outcome, a.error
FROM core.tasks t JOIN core.attempts a ON a.task_id = t.id
WHERE t.owner = :owner AND t.name = :name AND t.labels ? '{SERVICE_LABEL}'
  AND t.state IN ('{S.READY}', '{S.WAITING}', '{S.RUNNING}', '{S.FAILED}')
  AND t.labels->>'{SERVICE_LABEL}' = :name AND t.labels->>'{REVISION_LABEL}' = :revision
  AND a.ended_at >= :since AND a.outcome = ANY(CAST(:outcomes AS text[]))
ORDER BY a.ended_at DESC, a.id DESC
LIMIT :most
""")


async def failures(
    conn: AsyncConnection, row: Any, outcomes: Sequence[str], most: int
) -> list[str]:
    """Why the live replicas of the service's revision failed since its rollout began
    (``outcomes``), newest first, at most ``most``."""
    params = {
        "owner": row.owner,
        "name": row.name,
        "revision": str(row.revision),
        "since": row.rollout_at,
        "outcomes": list(outcomes),
        "most": most,
    }
    found = await conn.execute(_FAILURES, params)
    return [r.error or f"attempt {r.outcome}" for r in found]


# A service keeps its last STEPS_KEPT steps.
_TRIM_STEPS = text("""
DELETE FROM core.service_steps
WHERE service_id = :service AND id < (
    SELECT min(id) FROM (
        SELECT id FROM core.service_steps WHERE service_id = :service
        ORDER BY id DESC LIMIT :kept) newest)
""")
STEPS_KEPT = 200


async def add_step(conn: AsyncConnection, service_id: int, step: str, detail: str) -> None:
    """Record a step of the controller (shown by ``GET /v1/services/{name}``), keeping
    the service's last ``STEPS_KEPT``."""
    await conn.execute(
        insert(service_steps).values(service_id=service_id, step=step, detail=detail)
    )
    await conn.execute(_TRIM_STEPS, {"service": service_id, "kept": STEPS_KEPT})


async def list_services(conn: AsyncConnection, owner: str, limit: int) -> list[Any]:
    """The owner's services, by name (at most ``limit``)."""
    query = select(services).where(services.c.owner == owner).order_by(services.c.name)
    return list(await conn.execute(query.limit(limit)))


async def steps_of(conn: AsyncConnection, service_id: int, limit: int = 50) -> list[ServiceStep]:
    """The service's last ``limit`` steps, oldest first."""
    query = (
        select(service_steps)
        .where(service_steps.c.service_id == service_id)
        .order_by(service_steps.c.id.desc())
        .limit(limit)
    )
    rows = list(await conn.execute(query))
    return [ServiceStep(at=r.at, step=r.step, detail=r.detail) for r in reversed(rows)]


def service_info(row: Any, live: list[Replica], steps: list[ServiceStep]) -> ServiceInfo:
    current = [r for r in live if r.revision == row.revision]
    return ServiceInfo(
        name=row.name,
        owner=row.owner,
        replicas=row.replicas,
        revision=row.revision,
        template=row.template,
        rollout={
            "max_surge": row.max_surge,
            "max_unavailable": row.max_unavailable,
            "deadline_s": row.deadline_s,
            "max_failures": row.max_failures,
        },
        rollout_state=row.rollout,
        message=row.message,
        live=len(live),
        current=len(current),
        ready=sum(r.ready for r in current),
        created_at=row.created_at,
        updated_at=row.updated_at,
        steps=steps,
    )
