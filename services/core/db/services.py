"""Services' replicas (docs/services.md): what their agents report of each (ready, its
host's address, its ports), and where the ready ones listen."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common.auth import Visibility
from libs.common.models import MAX_REPLICAS_LISTED, Endpoint, ReplicaStatus
from libs.common.states import TaskState

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
  AND t.id = a.task_id AND t.current_attempt_id = a.id AND t.state = '{S.RUNNING}'
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
