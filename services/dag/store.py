"""Every read and write of the DAG service's schema. Moves of runs and nodes are guarded
in SQL (the state they leave is part of the WHERE), so a lost race changes nothing."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from sqlalchemy import Row, TextClause, text
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common import pipeline
from libs.common.auth import Visibility
from libs.common.dag_models import (
    NodeState,
    Run,
    RunState,
    WorkflowCreate,
)
from libs.common.errors import Conflict, NotFound

RUN_COLUMNS = (
    "id, owner, team, workflow_id, workflow, workflow_version, params, state, idempotency_key,"
    " created_at, started_at, finished_at, timeout_s, deadline, reason, max_active_nodes,"
    " task_timeout_s, parent_run_id, parent_node, depth"
)
_NODE_COLUMNS = (
    "run_id, name, state, try_number, task_id, error, map_of, map_index, map_item, outputs,"
    " child_run_id"
)

# Who may see a run: any (owner NULL), or its owner and the members of the team owning it.
_VISIBLE = "(CAST(:owner AS text) IS NULL OR owner = :owner OR team = ANY(CAST(:teams AS text[])))"


def visible(row: Any, who: Visibility | None) -> bool:
    """Whether ``who`` (None: anyone) may see the run ``row``: ``_VISIBLE`` of a row read."""
    return who is None or row.owner == who.owner or row.team in who.teams


def _who(who: Visibility | None) -> dict[str, Any]:
    if who is None:
        return {"owner": None, "teams": []}
    return {"owner": who.owner, "teams": sorted(who.teams)}


@dataclass(frozen=True)
class NodeRow:
    run_id: int
    name: str
    state: NodeState
    try_number: int
    task_id: int | None
    error: str | None
    #: an instance of a mapped node: that node, and its index
    map_of: str | None = None
    map_index: int | None = None
    map_item: Any = None
    outputs: dict[str, Any] | None = None
    #: a sub-workflow node: the run it started
    child_run_id: int | None = None


def definition_hash(definition: WorkflowCreate) -> str:
    return hashlib.sha256(definition.model_dump_json().encode()).hexdigest()


async def _lock(conn: AsyncConnection, *parts: str) -> None:
    """Serialise writers of one (owner, workflow) within the transaction."""
    await conn.execute(
        text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))"),
        {"key": "dag/" + "/".join(parts)},
    )


# --- workflows ----------------------------------------------------------------------------


async def put_workflow(
    conn: AsyncConnection, owner: str, definition: WorkflowCreate
) -> tuple[Row[Any], bool]:
    """Store a new version, unless the newest version is this same definition."""
    await _lock(conn, owner, definition.name)
    digest = definition_hash(definition)
    newest = (
        await conn.execute(
            text(
                "SELECT * FROM dag.workflows WHERE owner = :owner AND name = :name"
                " ORDER BY version DESC LIMIT 1"
            ),
            {"owner": owner, "name": definition.name},
        )
    ).first()
    if newest is not None and newest.definition_hash == digest:
        return newest, False
    row = (
        await conn.execute(
            text(
                "INSERT INTO dag.workflows (owner, team, name, version, definition,"
                " definition_hash, node_count) VALUES (:owner, :team, :name, :version,"
                " CAST(:definition AS jsonb), :hash, :nodes) RETURNING *"
            ),
            {
                "owner": owner,
                "team": definition.team,
                "name": definition.name,
                "version": (newest.version + 1) if newest else 1,
                "definition": definition.model_dump_json(),
                "hash": digest,
                "nodes": len(definition.nodes),
            },
        )
    ).one()
    return row, True


async def get_workflow(
    conn: AsyncConnection,
    owner: str,
    name: str,
    version: int | None = None,
    who: Visibility | None = None,
) -> Row[Any]:
    """``owner``'s workflow ``name`` (its newest version, or ``version``). With ``who``,
    only if it may see it: its owner, or a member of the team that owns the newest
    version and the one asked for; else ``NotFound``, as for one that does not exist."""
    rows = (
        await conn.execute(
            text(
                "(SELECT * FROM dag.workflows WHERE owner = :owner AND name = :name"
                " ORDER BY version DESC LIMIT 1) UNION ALL"
                " (SELECT * FROM dag.workflows WHERE owner = :owner AND name = :name"
                " AND version = :version)"
            ),
            {"owner": owner, "name": name, "version": version},
        )
    ).all()
    newest = max(rows, key=lambda r: r.version, default=None)
    row = newest if version is None else next((r for r in rows if r.version == version), None)
    hidden = who is not None and not all(_sees(who, r) for r in rows)
    if row is None or hidden:
        which = f"version {version} of " if version else ""
        raise NotFound(f"no {which}workflow '{name}'")
    return row


def _sees(who: Visibility, row: Any) -> bool:
    return bool(row.owner == who.owner or (row.team is not None and row.team in who.teams))


async def workflow_by_id(conn: AsyncConnection, workflow_id: int) -> Row[Any]:
    return (
        await conn.execute(text("SELECT * FROM dag.workflows WHERE id = :id"), {"id": workflow_id})
    ).one()


async def list_workflows(conn: AsyncConnection, who: Visibility | None) -> list[Row[Any]]:
    """The newest version of each workflow ``who`` may see (its own, its teams')."""
    return list(
        await conn.execute(
            text(
                "SELECT * FROM (SELECT DISTINCT ON (owner, name) id, owner, team, name,"
                " version, node_count, created_at FROM dag.workflows"
                " WHERE CAST(:owner AS text) IS NULL OR owner = :owner"
                " OR (owner, name) IN (SELECT owner, name FROM dag.workflows"
                "   WHERE team = ANY(CAST(:teams AS text[])))"
                " ORDER BY owner, name, version DESC) newest"
                f" WHERE {_VISIBLE} ORDER BY owner, name LIMIT 1000"
            ),
            _who(who),
        )
    )


# --- runs ---------------------------------------------------------------------------------


async def create_run(
    conn: AsyncConnection,
    owner: str,
    workflow: Row[Any],
    params: Mapping[str, Any],
    idempotency_key: str | None,
    node_names: Sequence[str],
    timeout_s: int | None = None,
    max_active_nodes: int | None = None,
    task_timeout_s: int | None = None,
) -> tuple[Row[Any], bool]:
    """A queued run with every node pending, or the run the owner's key already names."""
    row = (
        await conn.execute(
            text(
                "INSERT INTO dag.runs (workflow_id, owner, team, workflow, workflow_version,"
                " params, idempotency_key, timeout_s, max_active_nodes, task_timeout_s)"
                " VALUES (:wid, :owner, :team, :name, :version, CAST(:params AS jsonb), :key,"
                " :timeout, :max_nodes, :task_timeout)"
                " ON CONFLICT (owner, idempotency_key) WHERE idempotency_key IS NOT NULL"
                f" DO NOTHING RETURNING {RUN_COLUMNS}"
            ),
            {
                "wid": workflow.id,
                "owner": owner,
                "team": workflow.team,
                "name": workflow.name,
                "version": workflow.version,
                "params": orjson.dumps(params).decode(),
                "key": idempotency_key,
                "timeout": timeout_s,
                "max_nodes": max_active_nodes,
                "task_timeout": task_timeout_s,
            },
        )
    ).first()
    if row is None:
        existing = (
            await conn.execute(
                text(
                    f"SELECT {RUN_COLUMNS} FROM dag.runs"
                    " WHERE owner = :owner AND idempotency_key = :key"
                ),
                {"owner": owner, "key": idempotency_key},
            )
        ).one()
        return existing, False
    await conn.execute(
        text("INSERT INTO dag.nodes (run_id, name) SELECT :run, unnest(CAST(:names AS text[]))"),
        {"run": row.id, "names": list(node_names)},
    )
    return row, True


async def get_run(conn: AsyncConnection, run_id: int, who: Visibility | None) -> Row[Any]:
    """The run, if ``who`` (when given) may see it: its owner, or a member of the team
    that owns it; else ``NotFound``."""
    row = (
        await conn.execute(
            text(f"SELECT {RUN_COLUMNS} FROM dag.runs WHERE id = :id AND {_VISIBLE}"),
            {"id": run_id, **_who(who)},
        )
    ).first()
    if row is None:
        raise NotFound(f"no run {run_id}")
    return row


async def list_runs(
    conn: AsyncConnection,
    who: Visibility | None,
    workflow: str | None,
    state: RunState | None,
    limit: int,
    before: int | None,
) -> list[Row[Any]]:
    """Runs newest first (those ``who`` may see)."""
    return list(
        await conn.execute(
            text(
                f"SELECT {RUN_COLUMNS} FROM dag.runs"
                f" WHERE {_VISIBLE}"
                " AND (CAST(:workflow AS text) IS NULL OR workflow = :workflow)"
                " AND (CAST(:state AS text) IS NULL OR state = :state)"
                " AND (CAST(:before AS bigint) IS NULL OR id < :before)"
                " ORDER BY id DESC LIMIT :limit"
            ),
            {
                **_who(who),
                "workflow": workflow,
                "state": state,
                "before": before,
                "limit": limit,
            },
        )
    )


# --- events, triggers and the history grid -----------------------------------------------


async def deliver_event(
    conn: AsyncConnection, run_id: int, name: str, data: Mapping[str, Any], sent_by: str
) -> tuple[Row[Any], bool]:
    """Keep an event for the run, once per name (the primary key makes it once under any
    number of callers): the event kept, and whether this call delivered it."""
    row = (
        await conn.execute(
            text(
                "INSERT INTO dag.run_events (run_id, name, data, sent_by)"
                " VALUES (:run, :name, CAST(:data AS jsonb), :by)"
                " ON CONFLICT (run_id, name) DO NOTHING RETURNING *"
            ),
            {"run": run_id, "name": name, "data": orjson.dumps(data).decode(), "by": sent_by},
        )
    ).first()
    if row is not None:
        return row, True
    existing = await conn.execute(
        text("SELECT * FROM dag.run_events WHERE run_id = :run AND name = :name"),
        {"run": run_id, "name": name},
    )
    return existing.one(), False


async def node_waiting_for(conn: AsyncConnection, run_id: int, event: str) -> str | None:
    name: str | None = await conn.scalar(
        text(
            "SELECT name FROM dag.nodes WHERE run_id = :run AND state = 'waiting'"
            " AND event = :event LIMIT 1"
        ),
        {"run": run_id, "event": event},
    )
    return name


async def wait_for_events(
    conn: AsyncConnection, run_id: int, waits: Mapping[str, tuple[str, int]]
) -> None:
    """Event nodes the caller just set waiting: each for (its event, timeout_s)."""
    if not waits:
        return
    names = list(waits)
    await conn.execute(
        text(
            "UPDATE dag.nodes n SET event = w.event,"
            " wait_until = now() + make_interval(secs => w.timeout_s)"
            " FROM unnest(CAST(:names AS text[]), CAST(:events AS text[]),"
            "   CAST(:timeouts AS int[])) AS w(name, event, timeout_s)"
            " WHERE n.run_id = :run AND n.name = w.name AND n.state = 'waiting'"
        ),
        {
            "run": run_id,
            "names": names,
            "events": [waits[n][0] for n in names],
            "timeouts": [waits[n][1] for n in names],
        },
    )


async def event_waits(conn: AsyncConnection, run_id: int) -> list[Row[Any]]:
    """The run's waiting event nodes: each with its event's data (None: not come) and
    whether its wait is over."""
    return list(
        await conn.execute(
            text(
                "SELECT n.name, e.data, n.wait_until <= now() AS due FROM dag.nodes n"
                " LEFT JOIN dag.run_events e ON e.run_id = n.run_id AND e.name = n.event"
                " WHERE n.run_id = :run AND n.state = 'waiting' AND n.event IS NOT NULL"
            ),
            {"run": run_id},
        )
    )


async def end_waits(
    conn: AsyncConnection,
    run_id: int,
    ended: Mapping[str, tuple[NodeState, str | None, Mapping[str, Any] | None]],
) -> list[str]:
    """Event nodes still waiting end as (state, error, outputs); the others are left
    (guarded in SQL: a node ends its wait once). Returns those that ended."""
    if not ended:
        return []
    names = list(ended)
    rows = await conn.execute(
        text(
            "UPDATE dag.nodes n SET state = w.state, error = w.error,"
            " outputs = CAST(w.outputs AS jsonb), wait_until = NULL, updated_at = now()"
            " FROM unnest(CAST(:names AS text[]), CAST(:states AS text[]),"
            "   CAST(:errors AS text[]), CAST(:outputs AS text[])) AS w(name, state, error, outputs)"
            " WHERE n.run_id = :run AND n.name = w.name AND n.state = 'waiting'"
            " AND n.event IS NOT NULL RETURNING n.name"
        ),
        {
            "run": run_id,
            "names": names,
            "states": [str(ended[n][0]) for n in names],
            "errors": [ended[n][1] for n in names],
            "outputs": [
                None if ended[n][2] is None else orjson.dumps(ended[n][2]).decode() for n in names
            ],
        },
    )
    return [r.name for r in rows]


async def create_trigger(
    conn: AsyncConnection,
    owner: str,
    workflow: str,
    secret: str,
    params: Mapping[str, str] | None,
    key_path: str | None,
    most: int,
) -> Row[Any]:
    """A new trigger of the owner's workflow; ``Conflict`` past ``most`` of them."""
    await _lock(conn, owner, workflow, "triggers")
    count = await conn.scalar(
        text("SELECT count(*) FROM dag.triggers WHERE owner = :owner AND workflow = :wf"),
        {"owner": owner, "wf": workflow},
    )
    if int(count or 0) >= most:
        raise Conflict(f"workflow '{workflow}' has {most} triggers already: delete one first")
    return (
        await conn.execute(
            text(
                "INSERT INTO dag.triggers (owner, workflow, secret, params, key_path)"
                " VALUES (:owner, :wf, :secret, CAST(:params AS jsonb), :key) RETURNING *"
            ),
            {
                "owner": owner,
                "wf": workflow,
                "secret": secret,
                "params": None if params is None else orjson.dumps(params).decode(),
                "key": key_path,
            },
        )
    ).one()


async def list_triggers(conn: AsyncConnection, owner: str, workflow: str) -> list[Row[Any]]:
    return list(
        await conn.execute(
            text("SELECT * FROM dag.triggers WHERE owner = :owner AND workflow = :wf ORDER BY id"),
            {"owner": owner, "wf": workflow},
        )
    )


async def delete_trigger(conn: AsyncConnection, owner: str, workflow: str, trigger_id: int) -> None:
    gone = await conn.scalar(
        text(
            "DELETE FROM dag.triggers WHERE id = :id AND owner = :owner AND workflow = :wf"
            " RETURNING id"
        ),
        {"id": trigger_id, "owner": owner, "wf": workflow},
    )
    if gone is None:
        raise NotFound(f"workflow '{workflow}' has no trigger {trigger_id}")


async def get_trigger(conn: AsyncConnection, trigger_id: int) -> Row[Any] | None:
    return (
        await conn.execute(text("SELECT * FROM dag.triggers WHERE id = :id"), {"id": trigger_id})
    ).first()


async def history(
    conn: AsyncConnection, owner: str, workflow: str, limit: int, who: Visibility | None
) -> tuple[list[Row[Any]], list[Row[Any]]]:
    """The workflow's newest ``limit`` runs that ``who`` (None: anyone) may see, and
    their nodes (not mapped instances) with how long each took (from its rule being met
    to its end, or now while open)."""
    runs = list(
        await conn.execute(
            text(
                "SELECT id, state, workflow_version, created_at, started_at, finished_at"
                f" FROM dag.runs WHERE owner = :wfowner AND workflow = :wf AND {_VISIBLE}"
                " ORDER BY id DESC LIMIT :limit"
            ),
            {"wfowner": owner, "wf": workflow, "limit": limit, **_who(who)},
        )
    )
    nodes = await conn.execute(
        text(
            "SELECT run_id, name, state, try_number, EXTRACT(EPOCH FROM (CASE WHEN state IN"
            " ('succeeded', 'failed', 'upstream_failed', 'skipped', 'cancelled')"
            " THEN updated_at ELSE now() END) - started_at) AS duration_s"
            " FROM dag.nodes WHERE run_id = ANY(:ids) AND map_of IS NULL"
        ),
        {"ids": [r.id for r in runs]},
    )
    return runs, list(nodes)


async def nodes_of(
    conn: AsyncConnection, run_ids: Iterable[int], *, lock: bool = False
) -> list[NodeRow]:
    rows = await conn.execute(
        text(
            f"SELECT {_NODE_COLUMNS} FROM dag.nodes WHERE run_id = ANY(:ids)"
            " ORDER BY run_id, name" + (" FOR UPDATE" if lock else "")
        ),
        {"ids": list(run_ids)},
    )
    return [_node_row(r) for r in rows]


def _node_row(r: Row[Any]) -> NodeRow:
    return NodeRow(
        r.run_id,
        r.name,
        NodeState(r.state),
        r.try_number,
        r.task_id,
        r.error,
        r.map_of,
        r.map_index,
        r.map_item,
        r.outputs,
        r.child_run_id,
    )


async def nodes_of_tasks(conn: AsyncConnection, task_ids: Iterable[int]) -> list[Row[Any]]:
    """The nodes (and their runs' workflow versions) of these tasks (a task's node never
    changes: a node's next try is another task)."""
    return list(
        await conn.execute(
            text(
                "SELECT n.run_id, n.name, n.map_of, n.task_id, r.workflow_id FROM dag.nodes n"
                " JOIN dag.runs r ON r.id = n.run_id WHERE n.task_id = ANY(:ids)"
            ),
            {"ids": list(task_ids)},
        )
    )


async def node_details(conn: AsyncConnection, run_id: int) -> dict[str, Any]:
    """What the run page shows beside states: when each node changed, its item, an
    approval gate's wait and decision."""
    rows = await conn.execute(
        text(
            "SELECT name, updated_at, map_item, wait_until, decision, decided_by, decided_at,"
            " comment FROM dag.nodes WHERE run_id = :id"
        ),
        {"id": run_id},
    )
    return {r.name: r for r in rows}


async def outputs_of(conn: AsyncConnection, run_ids: Iterable[int]) -> dict[int, list[NodeRow]]:
    """The nodes of these runs that kept outputs, and every mapped instance."""
    rows = await conn.execute(
        text(
            f"SELECT {_NODE_COLUMNS} FROM dag.nodes WHERE run_id = ANY(:ids)"
            " AND (outputs IS NOT NULL OR map_of IS NOT NULL)"
        ),
        {"ids": list(run_ids)},
    )
    found: dict[int, list[NodeRow]] = {}
    for r in rows:
        found.setdefault(r.run_id, []).append(_node_row(r))
    return found


async def expand(
    conn: AsyncConnection, run_id: int, node: str, try_number: int, items: Sequence[Any]
) -> list[str]:
    """A ready mapped node becomes ``mapped`` with one ready instance per item."""
    names = [f"{node}[{i}]" for i in range(len(items))]
    await conn.execute(
        text(
            "INSERT INTO dag.nodes (run_id, name, state, try_number, map_of, map_index, map_item)"
            " SELECT :run, n, 'ready', :try, :node, i - 1, item"
            " FROM unnest(CAST(:names AS text[]), CAST(:items AS jsonb[]))"
            "   WITH ORDINALITY AS x(n, item, i)"
        ),
        {
            "run": run_id,
            "try": try_number,
            "node": node,
            "names": names,
            "items": [orjson.dumps(item).decode() for item in items],
        },
    )
    await set_nodes(conn, run_id, {node: (NodeState.MAPPED, None)})
    return names


async def set_outputs(
    conn: AsyncConnection, run_id: int, outputs: Mapping[str, Mapping[str, Any]]
) -> None:
    for name, kept in outputs.items():
        await conn.execute(
            text(
                "UPDATE dag.nodes SET outputs = CAST(:outputs AS jsonb)"
                " WHERE run_id = :run AND name = :name"
            ),
            {"run": run_id, "name": name, "outputs": orjson.dumps(kept).decode()},
        )


async def cancel_run(conn: AsyncConnection, run_id: int, who: Visibility | None) -> Row[Any]:
    """End the run as cancelled: open nodes are cancelled, live ones wait for core."""
    row = (
        await conn.execute(
            text(
                "UPDATE dag.runs SET state = 'cancelled', finished_at = now(),"
                " updated_at = now(), started_at = COALESCE(started_at, now())"
                f" WHERE id = :id AND {_VISIBLE}"
                f" AND state IN ('queued', 'running') RETURNING {RUN_COLUMNS}"
            ),
            {"id": run_id, **_who(who)},
        )
    ).first()
    if row is None:
        current = await get_run(conn, run_id, who)
        raise Conflict(
            f"run {run_id} is {current.state}: only a queued or running run can be cancelled"
        )
    await _cancel_nodes(conn, run_id)
    return row


async def _cancel_nodes(conn: AsyncConnection, run_id: int) -> None:
    await conn.execute(
        text(
            # A ready node's task may have been submitted with its answer never recorded:
            # it waits (cancelling, no task id) for the engine to find it by its key.
            "UPDATE dag.nodes SET updated_at = now(), state = CASE"
            " WHEN state IN ('ready', 'released', 'running') THEN 'cancelling'"
            " ELSE 'cancelled' END"
            " WHERE run_id = :id"
            " AND state IN ('pending', 'ready', 'released', 'running', 'mapped', 'waiting')"
        ),
        {"id": run_id},
    )


async def time_out(conn: AsyncConnection, run_id: int) -> Row[Any] | None:
    """Fail a running run past its deadline: open nodes are cancelled, live ones wait
    for core to cancel their tasks."""
    row = (
        await conn.execute(
            text(
                "UPDATE dag.runs SET state = 'failed', finished_at = now(), updated_at = now(),"
                " reason = 'timed out after ' || timeout_s || ' s'"
                " WHERE id = :id AND state = 'running' AND deadline <= now()"
                f" RETURNING {RUN_COLUMNS}"
            ),
            {"id": run_id},
        )
    ).first()
    if row is not None:
        await conn.execute(
            text(
                "UPDATE dag.nodes SET updated_at = now(), error = 'the run timed out',"
                " state = CASE WHEN state IN ('ready', 'released', 'running') THEN 'cancelling'"
                " ELSE 'cancelled' END"
                " WHERE run_id = :id"
                " AND state IN ('pending', 'ready', 'released', 'running', 'mapped', 'waiting')"
            ),
            {"id": run_id},
        )
    return row


async def fail_unreadable(conn: AsyncConnection, workflow_id: int, why: str) -> list[Row[Any]]:
    """Fail the queued and running runs of a workflow version whose stored definition can
    no longer be read (locked in id order, as every writer takes runs): open nodes are
    cancelled, live ones wait for core to cancel their tasks, as a timed-out run's."""
    rows = list(
        await conn.execute(
            text(
                "UPDATE dag.runs SET state = 'failed', finished_at = now(), updated_at = now(),"
                " started_at = COALESCE(started_at, now()), reason = :why"
                " WHERE id IN (SELECT id FROM dag.runs WHERE workflow_id = :id"
                " AND state IN ('queued', 'running') ORDER BY id FOR UPDATE)"
                f" RETURNING {RUN_COLUMNS}"
            ),
            {"id": workflow_id, "why": why},
        )
    )
    for row in rows:
        await _cancel_nodes(conn, row.id)
    return rows


async def overdue_runs(conn: AsyncConnection, limit: int = 1000) -> list[int]:
    rows = await conn.execute(
        text(
            "SELECT id FROM dag.runs WHERE state = 'running' AND deadline IS NOT NULL"
            " AND deadline <= now() ORDER BY deadline LIMIT :limit"
        ),
        {"limit": limit},
    )
    return [r.id for r in rows]


async def seconds_to_deadline(conn: AsyncConnection) -> float | None:
    """How long until the next running run's deadline or approval gate's timeout
    (None: there is none)."""
    value = await conn.scalar(text(f"SELECT {_TO_DEADLINE}"))
    return None if value is None else max(0.0, float(value))


async def requeue(
    conn: AsyncConnection,
    run_id: int,
    who: Visibility | None,
    names: Iterable[str],
    *,
    sources: Sequence[RunState],
    action: str,
) -> Row[Any]:
    """Queue a run in one of ``sources`` again (a retry, a clear), with the nodes in
    ``names`` pending for their next try; refused while core still cancels its tasks."""
    row = (
        await conn.execute(
            text(
                "UPDATE dag.runs SET state = 'queued', finished_at = NULL, reason = NULL,"
                " updated_at = now()"
                f" WHERE id = :id AND {_VISIBLE}"
                " AND state = ANY(:sources)"
                " AND NOT EXISTS (SELECT 1 FROM dag.nodes"
                "   WHERE run_id = :id AND state = 'cancelling')"
                f" RETURNING {RUN_COLUMNS}"
            ),
            {"id": run_id, **_who(who), "sources": [str(state) for state in sources]},
        )
    ).first()
    if row is None:
        current = await get_run(conn, run_id, who)
        words = [str(state) for state in sources]
        reason = (
            "its nodes' tasks are still being cancelled in core"
            if current.state in words
            else f"only a {', '.join(words[:-1])} or {words[-1]} run can be {action}"
        )
        raise Conflict(f"run {run_id} is {current.state}: {reason}")
    await reset_nodes(conn, run_id, names)
    return row


async def reset_nodes(conn: AsyncConnection, run_id: int, names: Iterable[str]) -> None:
    """Nodes back to pending for their next try, without what they kept; instances of
    the mapped ones go (the node maps again)."""
    names = list(names)
    await conn.execute(
        text("DELETE FROM dag.nodes WHERE run_id = :id AND map_of = ANY(:names)"),
        {"id": run_id, "names": names},
    )
    await conn.execute(
        text(
            "UPDATE dag.nodes SET state = 'pending', try_number = try_number + 1,"
            " task_id = NULL, error = NULL, outputs = NULL, updated_at = now(),"
            " wait_until = NULL, decision = NULL, decided_by = NULL, decided_at = NULL,"
            " comment = NULL, child_run_id = NULL, decided_role = NULL, audit_pending = false,"
            " event = NULL, started_at = NULL"
            " WHERE run_id = :id AND name = ANY(:names)"
        ),
        {"id": run_id, "names": names},
    )


async def retry_instances(
    conn: AsyncConnection, run_id: int, mapped: Sequence[str], instances: Sequence[str]
) -> None:
    """Mapped nodes back to ``mapped`` with their next try, and only ``instances`` of
    them ready again under that try (so each release key is new); the instances that
    succeeded keep their tasks and outputs."""
    await conn.execute(
        text(
            "UPDATE dag.nodes SET state = 'mapped', try_number = try_number + 1,"
            " task_id = NULL, error = NULL, outputs = NULL, updated_at = now(),"
            " wait_until = NULL, decision = NULL, decided_by = NULL, decided_at = NULL,"
            " comment = NULL, child_run_id = NULL, decided_role = NULL, audit_pending = false"
            " WHERE run_id = :id AND name = ANY(:names)"
        ),
        {"id": run_id, "names": list(mapped)},
    )
    await conn.execute(
        text(
            "UPDATE dag.nodes i SET state = 'ready', try_number = m.try_number,"
            " task_id = NULL, error = NULL, outputs = NULL, updated_at = now()"
            " FROM dag.nodes m"
            " WHERE i.run_id = :id AND i.name = ANY(:names)"
            "   AND m.run_id = i.run_id AND m.name = i.map_of"
        ),
        {"id": run_id, "names": list(instances)},
    )


# --- what the engine does -----------------------------------------------------------------

# What each of the loop's chores looks for, in one place: ``chores`` asks whether any
# exists, the chore itself reads them.
#: seconds until the next running run's deadline or approval gate's timeout (NULL: none)
_TO_DEADLINE = (
    "EXTRACT(EPOCH FROM LEAST("
    " (SELECT min(deadline) FROM dag.runs"
    "   WHERE state = 'running' AND deadline IS NOT NULL),"
    " (SELECT min(wait_until) FROM dag.nodes"
    "   WHERE state = 'waiting' AND decision IS NULL)) - now())"
)
#: a waiting node (``n``) to move on: decided, past its wait, or its event came
_GATE_DUE = (
    "n.state = 'waiting' AND (n.decision IS NOT NULL OR n.wait_until <= now()"
    " OR (n.event IS NOT NULL AND EXISTS (SELECT 1 FROM dag.run_events e"
    "   WHERE e.run_id = n.run_id AND e.name = n.event)))"
)
#: a sub-workflow node (``n``) live whose child run (``c``) ended
_CHILD_ENDED = (
    "FROM dag.nodes n JOIN dag.runs c ON c.id = n.child_run_id"
    " WHERE n.child_run_id IS NOT NULL AND n.state IN ('running', 'cancelling')"
    " AND c.state IN ('succeeded', 'failed', 'cancelled')"
)
#: a node (``n``) whose decision core's audit trail has not taken yet
_AUDIT_PENDING = "n.audit_pending AND n.decision IS NOT NULL"


_CHORES = text(
    "SELECT EXISTS (SELECT 1 FROM dag.runs WHERE state = 'queued') AS queued,"
    f" {_TO_DEADLINE} AS to_deadline,"
    f" EXISTS (SELECT 1 FROM dag.nodes n WHERE {_GATE_DUE}) AS gates,"
    f" EXISTS (SELECT 1 {_CHILD_ENDED}) AS children,"
    " EXISTS (SELECT 1 FROM dag.nodes WHERE state = 'ready') AS ready,"
    " EXISTS (SELECT 1 FROM dag.nodes WHERE state = 'cancelling') AS cancelling,"
    f" EXISTS (SELECT 1 FROM dag.nodes n WHERE {_AUDIT_PENDING}) AS audits"
)


async def chores(conn: AsyncConnection) -> Any:
    """What the loop has to do this turn besides the feed, in one round trip (each a look
    along its own partial index): runs queued, the seconds to the next deadline or gate
    timeout (None: none), gates or event nodes to move on (``due_gates``), sub-workflow
    nodes whose child ended (``children_ended``), nodes ready to release or cancelling,
    decisions not yet audited. Each part then reads what it does in full. Built once and
    sent as the hot path's statements are (``pipeline.run``: prepared at its first run):
    the loop asks at most every ``_CHORES_EVERY_S`` and at each turn something woke, as
    each workflow hop's does."""
    [[row]] = await pipeline.run(conn, [(_CHORES, {})])
    return row


async def mark_running(conn: AsyncConnection, task_ids: Iterable[int]) -> None:
    """The nodes released on these tasks are running (a move no trigger rule reads, so
    nothing else in their runs changes)."""
    await conn.execute(
        text(
            "UPDATE dag.nodes SET state = 'running', updated_at = now()"
            " WHERE task_id = ANY(:ids) AND state = 'released'"
        ),
        {"ids": list(task_ids)},
    )


async def queued_runs(conn: AsyncConnection, limit: int = 1000) -> list[Row[Any]]:
    return list(
        await conn.execute(
            text(
                f"SELECT {RUN_COLUMNS} FROM dag.runs WHERE state = 'queued'"
                " ORDER BY id LIMIT :limit"
            ),
            {"limit": limit},
        )
    )


async def admit(
    conn: AsyncConnection, owner: str, workflow: str, max_active: int
) -> list[Row[Any]]:
    """Move the oldest queued runs of one workflow to running, as many as there is room
    for under ``max_active``."""
    await _lock(conn, owner, workflow)
    return list(
        await conn.execute(
            text(
                "WITH room AS (SELECT :max - count(*) AS n FROM dag.runs"
                "   WHERE owner = :owner AND workflow = :workflow AND state = 'running'),"
                " picked AS (SELECT id FROM dag.runs"
                "   WHERE owner = :owner AND workflow = :workflow AND state = 'queued'"
                "   ORDER BY id LIMIT GREATEST((SELECT n FROM room), 0) FOR UPDATE)"
                " UPDATE dag.runs r SET state = 'running', updated_at = now(),"
                "   started_at = COALESCE(r.started_at, now()),"
                "   deadline = now() + make_interval(secs => r.timeout_s)"
                f" FROM picked WHERE r.id = picked.id RETURNING {RUN_COLUMNS.replace('id,', 'r.id,', 1)}"
            ),
            {"owner": owner, "workflow": workflow, "max": max_active},
        )
    )


async def newest_max_active(conn: AsyncConnection, owner: str, workflow: str) -> int:
    value = await conn.scalar(
        text(
            "SELECT (definition->>'max_active_runs')::int FROM dag.workflows"
            " WHERE owner = :owner AND name = :name ORDER BY version DESC LIMIT 1"
        ),
        {"owner": owner, "name": workflow},
    )
    return int(value) if value is not None else 16


_LOCK_RUNS = text(f"SELECT {RUN_COLUMNS} FROM dag.runs WHERE id = ANY(:ids) ORDER BY id FOR UPDATE")
_NODES_OF_RUNS = text(
    f"SELECT {_NODE_COLUMNS} FROM dag.nodes WHERE run_id = ANY(:ids) ORDER BY run_id, name"
)


async def lock_runs(conn: AsyncConnection, run_ids: Iterable[int]) -> list[Row[Any]]:
    return list(await conn.execute(_LOCK_RUNS, {"ids": list(run_ids)}))


async def locked_with_nodes(
    conn: AsyncConnection, run_ids: Iterable[int], first: pipeline.Statement
) -> tuple[list[Any], list[Any], list[NodeRow]]:
    """``first``'s rows (the leader's fence), then these runs locked (``lock_runs``) and
    their nodes read (``nodes_of``, no lock: under their runs' locks), in one round trip
    with the transaction's BEGIN: a workflow hop's transaction waited on four."""
    ids = {"ids": list(run_ids)}
    fenced, runs, nodes = await pipeline.run(
        conn, [first, (_LOCK_RUNS, ids), (_NODES_OF_RUNS, ids)]
    )
    return fenced, runs, [_node_row(r) for r in nodes]


_SOME_NODES = text(
    f"SELECT {_NODE_COLUMNS} FROM dag.nodes"
    " WHERE (run_id, name) IN (SELECT * FROM unnest(CAST(:runs AS bigint[]),"
    "   CAST(:names AS text[]))) ORDER BY run_id, name"
)
# The runs with a node still open besides the ones named (``_SOME_NODES``'s pairs).
_OPEN_ELSEWHERE = text(
    "SELECT r.id FROM unnest(CAST(:ids AS bigint[])) AS r(id) WHERE EXISTS ("
    " SELECT 1 FROM dag.nodes n WHERE n.run_id = r.id"
    " AND n.state NOT IN ('succeeded', 'failed', 'upstream_failed', 'skipped', 'cancelled')"
    " AND (n.run_id, n.name) NOT IN (SELECT * FROM unnest(CAST(:runs AS bigint[]),"
    "   CAST(:names AS text[]))))"
)


async def locked_with_some_nodes(
    conn: AsyncConnection,
    run_ids: Iterable[int],
    names: Mapping[int, Iterable[str]],
    first: pipeline.Statement,
    last: Sequence[pipeline.Statement] = (),
) -> tuple[list[Any], list[Any], list[NodeRow], set[int]]:
    """As ``locked_with_nodes``, for a page's runs: all nodes of the runs not in ``names``,
    only the named nodes of those in it; and which of those have a node still open besides
    the named ones. One round trip with the transaction's BEGIN, and ``last`` (writes
    whose rows are not read: the feed's cursor) after them. A read with nothing to read
    (no run read whole, as in a chain's hop; none read in part) is not sent."""
    ids = {"ids": list(run_ids)}
    pairs = [(run, name) for run, some in names.items() for name in some]
    some = {"runs": [r for r, _ in pairs], "names": [n for _, n in pairs]}
    whole = {"ids": [r for r in ids["ids"] if r not in names]}
    reads: list[pipeline.Statement] = [first, (_LOCK_RUNS, ids)]
    if whole["ids"]:
        reads.append((_NODES_OF_RUNS, whole))
    if pairs:
        reads += [(_SOME_NODES, some), (_OPEN_ELSEWHERE, {"ids": list(names), **some})]
    found = await pipeline.run(conn, [*reads, *last])
    fenced, runs = found[0], found[1]
    nodes = found[2] if whole["ids"] else []
    few, open_elsewhere = found[len(reads) - 2 : len(reads)] if pairs else ([], [])
    rows = [_node_row(r) for r in [*nodes, *few]]
    return fenced, runs, rows, {r.id for r in open_elsewhere}


async def stale_nodes(conn: AsyncConnection, age_s: float, limit: int) -> list[Row[Any]]:
    """Nodes whose task is live as far as the feed said, unchanged for ``age_s``: the
    resync reads their tasks from core (oldest first; ``ix_nodes_live``)."""
    return list(
        await conn.execute(
            text(
                "SELECT run_id, name, task_id FROM dag.nodes"
                " WHERE state IN ('released', 'running', 'cancelling') AND task_id IS NOT NULL"
                " AND updated_at < now() - make_interval(secs => :age)"
                " ORDER BY updated_at LIMIT :limit"
            ),
            {"age": age_s, "limit": limit},
        )
    )


async def touch_live(conn: AsyncConnection, task_ids: Iterable[int]) -> None:
    """The resync found these tasks still live: their nodes are not checked again for a
    resync interval (only if the node still waits on that task)."""
    await conn.execute(
        text(
            "UPDATE dag.nodes SET updated_at = now() WHERE task_id = ANY(:ids)"
            " AND state IN ('released', 'running', 'cancelling')"
        ),
        {"ids": list(task_ids)},
    )


_SET_NODES = text(
    "UPDATE dag.nodes n SET state = c.state, error = COALESCE(c.error, n.error),"
    " updated_at = now(), started_at = CASE WHEN n.state = 'pending'"
    "   AND c.state IN ('ready', 'waiting', 'mapped') THEN now() ELSE n.started_at END"
    " FROM unnest(CAST(:names AS text[]), CAST(:states AS text[]),"
    "   CAST(:errors AS text[])) AS c(name, state, error)"
    " WHERE n.run_id = :run AND n.name = c.name"
)


async def set_nodes(
    conn: AsyncConnection, run_id: int, changes: Mapping[str, tuple[NodeState, str | None]]
) -> None:
    """Write node states the caller computed under the run's lock."""
    if not changes:
        return
    names = list(changes)
    await conn.execute(
        _SET_NODES,
        {
            "run": run_id,
            "names": names,
            "states": [str(changes[n][0]) for n in names],
            "errors": [changes[n][1] for n in names],
        },
    )


async def start_waiting(conn: AsyncConnection, run_id: int, gates: Mapping[str, int]) -> None:
    """Approval gates the caller just set waiting: each waits ``timeout_s`` from now."""
    if not gates:
        return
    await conn.execute(
        text(
            "UPDATE dag.nodes n SET wait_until = now() + make_interval(secs => g.timeout_s)"
            " FROM unnest(CAST(:names AS text[]), CAST(:timeouts AS int[]))"
            "   AS g(name, timeout_s)"
            " WHERE n.run_id = :run AND n.name = g.name AND n.state = 'waiting'"
        ),
        {"run": run_id, "names": list(gates), "timeouts": list(gates.values())},
    )


async def decide(
    conn: AsyncConnection,
    run_id: int,
    name: str,
    decision: str,
    by: str | None,
    comment: str | None,
    role: str | None = None,
) -> Row[Any] | None:
    """Record a decision on a waiting approval gate, once: None if the node is not
    waiting or was decided already (the conditional update is what makes it once, under
    any number of callers and leaders)."""
    return (
        await conn.execute(
            text(
                "UPDATE dag.nodes SET decision = :decision, decided_by = :by,"
                " decided_role = :role, audit_pending = true,"
                " decided_at = now(), comment = :comment, updated_at = now()"
                " WHERE run_id = :run AND name = :name AND state = 'waiting'"
                " AND decision IS NULL RETURNING name, decision, decided_by, decided_at"
            ),
            {
                "run": run_id,
                "name": name,
                "decision": decision,
                "by": by,
                "comment": comment,
                "role": role,
            },
        )
    ).first()


async def due_gates(conn: AsyncConnection, limit: int = 1000) -> list[int]:
    """Runs with an approval gate decided, an event node whose event came, or either past
    its wait, that the loop moves on."""
    rows = await conn.execute(
        text(
            "SELECT DISTINCT run_id FROM (SELECT run_id FROM dag.nodes n"
            f" WHERE {_GATE_DUE} LIMIT :limit) d"
        ),
        {"limit": limit},
    )
    return sorted(r.run_id for r in rows)


async def time_out_gates(
    conn: AsyncConnection, run_id: int, defaults: Mapping[str, tuple[str, int]]
) -> None:
    """Decide the run's gates past their wait by their ``on_timeout`` (no one decided):
    ``defaults`` holds each gate's (on_timeout, timeout_s)."""
    if not defaults:
        return
    names = list(defaults)
    await conn.execute(
        text(
            "UPDATE dag.nodes n SET decision = g.decision, decided_at = now(),"
            " audit_pending = true,"
            " comment = 'no decision within ' || g.timeout_s || ' s: on_timeout applied'"
            " FROM unnest(CAST(:names AS text[]), CAST(:decisions AS text[]),"
            "   CAST(:timeouts AS int[])) AS g(name, decision, timeout_s)"
            " WHERE n.run_id = :run AND n.name = g.name AND n.state = 'waiting'"
            " AND n.decision IS NULL AND n.wait_until <= now()"
        ),
        {
            "run": run_id,
            "names": names,
            "decisions": [defaults[n][0] for n in names],
            "timeouts": [defaults[n][1] for n in names],
        },
    )


async def apply_decisions(conn: AsyncConnection, run_id: int) -> int:
    """The run's decided gates end: approved ones succeed, rejected ones fail."""
    result = await conn.execute(
        text(
            "UPDATE dag.nodes SET updated_at = now(), wait_until = NULL,"
            " state = CASE decision WHEN 'approve' THEN 'succeeded' ELSE 'failed' END,"
            " error = CASE WHEN decision = 'reject' THEN 'rejected by '"
            "   || COALESCE(decided_by, 'its timeout') END"
            " WHERE run_id = :run AND state = 'waiting' AND decision IS NOT NULL"
        ),
        {"run": run_id},
    )
    return int(result.rowcount)


async def finish_run(conn: AsyncConnection, run_id: int, state: RunState) -> None:
    await conn.execute(
        text(
            "UPDATE dag.runs SET state = :state, finished_at = now(), updated_at = now()"
            " WHERE id = :id AND state = 'running'"
        ),
        {"id": run_id, "state": state},
    )


def _ready(runs: str) -> TextClause:
    return text(
        "WITH ready AS (SELECT n.*, row_number() OVER (PARTITION BY n.run_id"
        "   ORDER BY n.map_index NULLS FIRST, n.name) AS rank"
        f"   FROM dag.nodes n WHERE n.state = 'ready' AND {runs})"
        " SELECT n.run_id, n.name, n.try_number, n.map_of, n.map_index, n.map_item,"
        " r.owner, r.workflow, r.workflow_id, r.params, r.task_timeout_s,"
        " r.created_at AS run_created_at,"
        " GREATEST(0, EXTRACT(EPOCH FROM clock_timestamp() - n.updated_at)) AS ready_s"
        " FROM ready n JOIN dag.runs r ON r.id = n.run_id"
        " WHERE r.max_active_nodes IS NULL OR n.rank <= r.max_active_nodes - ("
        "   SELECT count(*) FROM dag.nodes l WHERE l.run_id = n.run_id"
        "   AND l.state IN ('released', 'running', 'cancelling'))"
        " ORDER BY n.run_id, n.rank LIMIT :limit"
    )


_READY = _ready("NOT (n.run_id = ANY(:skip))")
_READY_OF = _ready("n.run_id = ANY(CAST(:runs AS bigint[]))")


async def ready_nodes(
    conn: AsyncConnection, limit: int, skip_runs: Sequence[int] = ()
) -> list[Row[Any]]:
    """Ready nodes to release, within each run's ``max_active_nodes`` (counting the
    tasks it has live in core)."""
    return list(await conn.execute(_READY, {"limit": limit, "skip": list(skip_runs)}))


async def set_nodes_reading_ready(
    conn: AsyncConnection,
    run_id: int,
    changes: Mapping[str, tuple[NodeState, str | None]],
    limit: int,
    commit: bool = False,
) -> list[Any]:
    """``set_nodes``, and then the run's ready nodes as ``ready_nodes`` reads them, in
    one round trip: the nodes these changes readied, for the release that follows the
    transaction's commit. ``commit``: nothing follows in the transaction, whose COMMIT
    goes in the same round trip (``pipeline.COMMIT``)."""
    names = list(changes)
    chain: list[pipeline.Statement] = [
        (
            _SET_NODES,
            {
                "run": run_id,
                "names": names,
                "states": [str(changes[n][0]) for n in names],
                "errors": [changes[n][1] for n in names],
            },
        ),
        (_READY_OF, {"runs": [run_id], "limit": limit}),
    ]
    found = await pipeline.run(conn, [*chain, pipeline.COMMIT] if commit else chain)
    return found[1]


# Written only under the leader's epoch (``:leader``, ``:epoch``): the fence before it in
# the same round trip holds the leader's row, so the epoch it reads is the fence's.
_RECORD_RELEASED = text(
    "UPDATE dag.nodes n SET state = 'released', task_id = r.task, updated_at = now()"
    " FROM unnest(CAST(:runs AS bigint[]), CAST(:names AS text[]),"
    "   CAST(:tries AS integer[]), CAST(:tasks AS bigint[])) AS r(run, name, try, task)"
    " WHERE n.run_id = r.run AND n.name = r.name AND n.try_number = r.try"
    " AND n.state = 'ready'"
    " AND EXISTS (SELECT 1 FROM dag.leader l WHERE l.name = :leader AND l.epoch = :epoch)"
    " RETURNING n.task_id"
)


async def record_released(
    conn: AsyncConnection,
    released: Sequence[tuple[int, str, int, int]],
    first: pipeline.Statement,
    epoch: int,
) -> tuple[list[Any], set[int]]:
    """``first``'s rows (the leader's fence, ``Lease.fencing``), then (run, node, try,
    task) marked released where the node is still ready for that try and the leader's
    epoch is still ``epoch``, and the COMMIT, in one round trip with the transaction's
    BEGIN: nothing follows in the transaction, and a fence that fails (its rows are
    another epoch or none: the caller raises) let it write nothing. The task ids
    recorded (the others' runs were cancelled meanwhile)."""
    params = {
        "runs": [r[0] for r in released],
        "names": [r[1] for r in released],
        "tries": [r[2] for r in released],
        "tasks": [r[3] for r in released],
        "leader": first[1]["name"],
        "epoch": epoch,
    }
    fenced, rows, _ = await pipeline.run(conn, [first, (_RECORD_RELEASED, params), pipeline.COMMIT])
    return fenced, {r.task_id for r in rows}


async def fail_ready(conn: AsyncConnection, run_id: int, name: str, error: str) -> None:
    await conn.execute(
        text(
            "UPDATE dag.nodes SET state = 'failed', error = :error, updated_at = now()"
            " WHERE run_id = :run AND name = :name AND state = 'ready'"
        ),
        {"run": run_id, "name": name, "error": error[:4096]},
    )


async def cancelling_nodes(conn: AsyncConnection, limit: int) -> list[Row[Any]]:
    return list(
        await conn.execute(
            text(
                "SELECT n.run_id, n.name, n.task_id, n.try_number, n.child_run_id, r.owner"
                " FROM dag.nodes n"
                " JOIN dag.runs r ON r.id = n.run_id WHERE n.state = 'cancelling'"
                " ORDER BY n.run_id LIMIT :limit"
            ),
            {"limit": limit},
        )
    )


async def cancelled(conn: AsyncConnection, task_id: int) -> None:
    await conn.execute(
        text(
            "UPDATE dag.nodes SET state = 'cancelled', updated_at = now()"
            " WHERE task_id = :task AND state = 'cancelling'"
        ),
        {"task": task_id},
    )


async def cancelled_untracked(conn: AsyncConnection, nodes: Sequence[tuple[int, str]]) -> None:
    """Close cancelling nodes that have no recorded task (what they may have submitted
    has been cancelled by its key)."""
    await conn.execute(
        text(
            "UPDATE dag.nodes n SET state = 'cancelled', updated_at = now()"
            " FROM unnest(CAST(:runs AS bigint[]), CAST(:names AS text[])) AS c(run, name)"
            " WHERE n.run_id = c.run AND n.name = c.name AND n.state = 'cancelling'"
            " AND n.task_id IS NULL"
        ),
        {"runs": [r for r, _ in nodes], "names": [n for _, n in nodes]},
    )


async def pending_audits(conn: AsyncConnection, limit: int = 100) -> list[Row[Any]]:
    """Decisions not yet reported to core's audit trail, oldest first."""
    return list(
        await conn.execute(
            text(
                "SELECT n.run_id, n.name, n.try_number, n.decision, n.decided_by,"
                " n.decided_role, n.decided_at, n.comment, r.workflow, r.owner"
                " FROM dag.nodes n JOIN dag.runs r ON r.id = n.run_id"
                f" WHERE {_AUDIT_PENDING} ORDER BY n.decided_at LIMIT :limit"
            ),
            {"limit": limit},
        )
    )


async def audited(conn: AsyncConnection, run_id: int, name: str, decided_at: Any) -> None:
    """The decision made at ``decided_at`` was reported (a newer one stays pending)."""
    await conn.execute(
        text(
            "UPDATE dag.nodes SET audit_pending = false"
            " WHERE run_id = :run AND name = :name AND decided_at = :at"
        ),
        {"run": run_id, "name": name, "at": decided_at},
    )


# --- sub-workflows ---------------------------------------------------------------------------


async def lock_references(conn: AsyncConnection, owner: str) -> None:
    """Serialise, per owner, the storing of definitions that run sub-workflows: two that
    reference each other, stored at once, would each pass the cycle check alone."""
    await _lock(conn, owner, "*subflows")


async def workflow_as_of(
    conn: AsyncConnection, owner: str, name: str, version: int | None, at: Any
) -> Row[Any] | None:
    """``owner``'s workflow ``name`` at ``version``, or (None) its newest version stored
    at or before ``at`` (when the parent run started); None if there is none."""
    return (
        await conn.execute(
            text(
                "SELECT * FROM dag.workflows WHERE owner = :owner AND name = :name"
                " AND (CAST(:version AS integer) IS NULL OR version = :version)"
                " AND (CAST(:version AS integer) IS NOT NULL OR created_at <= :at)"
                " ORDER BY version DESC LIMIT 1"
            ),
            {"owner": owner, "name": name, "version": version, "at": at},
        )
    ).first()


async def references_of(
    conn: AsyncConnection, owner: str, name: str, version: int | None
) -> tuple[int, list[tuple[str, str, int | None]]] | None:
    """``owner``'s workflow ``name`` at ``version`` (None: the newest): its version and,
    for each of its sub-workflow nodes, (node, workflow, version or None); None if there
    is no such workflow. Read from the stored JSON, not parsed."""
    row = (
        await conn.execute(
            text(
                "SELECT version, jsonb_path_query_array(definition,"
                " '$.nodes[*] ? (exists(@.workflow))') AS refs"
                " FROM dag.workflows WHERE owner = :owner AND name = :name"
                " AND (CAST(:version AS integer) IS NULL OR version = :version)"
                " ORDER BY version DESC LIMIT 1"
            ),
            {"owner": owner, "name": name, "version": version},
        )
    ).first()
    if row is None:
        return None
    refs = [(n["name"], n["workflow"]["name"], n["workflow"].get("version")) for n in row.refs]
    return int(row.version), refs


async def start_child(
    conn: AsyncConnection,
    parent: Any,
    node: str,
    try_number: int,
    workflow: Row[Any],
    params: Mapping[str, Any],
    node_names: Sequence[str],
    timeout_s: int | None,
    max_active_nodes: int | None,
    task_timeout_s: int | None,
) -> int:
    """The child run of ``parent``'s ``node`` try: made queued, with every node pending,
    unless that try already has one (the unique parent index: at most one, whatever
    crash or leader change came between); its id, also recorded on the node, which
    runs while the child does."""
    child = await conn.scalar(
        text(
            "INSERT INTO dag.runs (workflow_id, owner, team, workflow, workflow_version,"
            " params, timeout_s, max_active_nodes, task_timeout_s, parent_run_id,"
            " parent_node, parent_try, depth)"
            " VALUES (:wid, :owner, :team, :name, :version, CAST(:params AS jsonb),"
            " :timeout, :max_nodes, :task_timeout, :parent, :node, :try, :depth)"
            " ON CONFLICT (parent_run_id, parent_node, parent_try)"
            " WHERE parent_run_id IS NOT NULL DO NOTHING RETURNING id"
        ),
        {
            "wid": workflow.id,
            "owner": parent.owner,
            "team": workflow.team,
            "name": workflow.name,
            "version": workflow.version,
            "params": orjson.dumps(params).decode(),
            "timeout": timeout_s,
            "max_nodes": max_active_nodes,
            "task_timeout": task_timeout_s,
            "parent": parent.id,
            "node": node,
            "try": try_number,
            "depth": parent.depth + 1,
        },
    )
    if child is None:
        child = await conn.scalar(
            text(
                "SELECT id FROM dag.runs WHERE parent_run_id = :parent AND parent_node = :node"
                " AND parent_try = :try"
            ),
            {"parent": parent.id, "node": node, "try": try_number},
        )
    else:
        await conn.execute(
            text(
                "INSERT INTO dag.nodes (run_id, name) SELECT :run, unnest(CAST(:names AS text[]))"
            ),
            {"run": child, "names": list(node_names)},
        )
    await conn.execute(
        text(
            "UPDATE dag.nodes SET state = 'running', child_run_id = :child, updated_at = now()"
            " WHERE run_id = :run AND name = :name AND state = 'ready'"
        ),
        {"child": child, "run": parent.id, "name": node},
    )
    return int(child)


async def children_ended(conn: AsyncConnection, limit: int = 1000) -> list[int]:
    """Runs with a sub-workflow node running whose child run has ended."""
    rows = await conn.execute(
        text(f"SELECT DISTINCT n.run_id {_CHILD_ENDED} LIMIT :limit"),
        {"limit": limit},
    )
    return sorted(r.run_id for r in rows)


async def child_runs(conn: AsyncConnection, run_ids: Iterable[int]) -> dict[int, Row[Any]]:
    """The runs (by id) of these ids."""
    rows = await conn.execute(
        text(f"SELECT {RUN_COLUMNS} FROM dag.runs WHERE id = ANY(:ids)"), {"ids": list(run_ids)}
    )
    return {r.id: r for r in rows}


async def cancel_child(conn: AsyncConnection, child_run_id: int, why: str) -> bool:
    """Cancel a child run still queued or running (its live nodes then cancel in turn);
    False if it had ended."""
    row = await conn.scalar(
        text(
            "UPDATE dag.runs SET state = 'cancelled', finished_at = now(), updated_at = now(),"
            " started_at = COALESCE(started_at, now()), reason = :why"
            " WHERE id = :id AND state IN ('queued', 'running') RETURNING id"
        ),
        {"id": child_run_id, "why": why},
    )
    if row is None:
        return False
    await _cancel_nodes(conn, child_run_id)
    return True


async def close_cancelled_child(conn: AsyncConnection, run_id: int, name: str) -> None:
    """A cancelling sub-workflow node whose child was cancelled (or had ended) is done."""
    await conn.execute(
        text(
            "UPDATE dag.nodes SET state = 'cancelled', updated_at = now()"
            " WHERE run_id = :run AND name = :name AND state = 'cancelling'"
            " AND child_run_id IS NOT NULL"
        ),
        {"run": run_id, "name": name},
    )


async def purge_runs(conn: AsyncConnection, age_s: float, limit: int) -> int:
    """Delete up to ``limit`` runs finished more than ``age_s`` ago (their nodes go with
    them), none with a node still waiting for core; return how many went."""
    result = await conn.execute(
        text(
            "WITH doomed AS (SELECT r.id FROM dag.runs r"
            " WHERE r.finished_at < now() - make_interval(secs => :age_s)"
            " AND NOT EXISTS (SELECT 1 FROM dag.nodes n WHERE n.run_id = r.id"
            " AND n.state = 'cancelling')"
            " ORDER BY r.finished_at LIMIT :limit FOR UPDATE SKIP LOCKED)"
            " DELETE FROM dag.runs r USING doomed WHERE r.id = doomed.id"
        ),
        {"age_s": age_s, "limit": limit},
    )
    return int(result.rowcount)


async def read_cursor(conn: AsyncConnection) -> str:
    value = await conn.scalar(text("SELECT cursor FROM dag.feed_cursor WHERE id = 1"))
    return str(value)


_STORE_CURSOR = text("UPDATE dag.feed_cursor SET cursor = :cursor, updated_at = now() WHERE id = 1")


def cursor_stored(cursor: str) -> pipeline.Statement:
    """``store_cursor``'s statement, to send with others (``pipeline.run``)."""
    return _STORE_CURSOR, {"cursor": cursor}


async def store_cursor(conn: AsyncConnection, cursor: str) -> None:
    await conn.execute(*cursor_stored(cursor))


def run_model(row: Row[Any], nodes: list[Any] | None = None) -> Run:
    return Run.model_validate({**row._mapping, "nodes": nodes or []})


# Live runs only (the partial index of active runs); finished ones are counted as they end.
_LIVE_RUNS = text("""
SELECT state, count(*) AS n FROM dag.runs WHERE state IN ('queued', 'running') GROUP BY state
""")

_LIVE_NODES = text("""
SELECT n.state, count(*) AS n FROM dag.nodes n JOIN dag.runs r ON r.id = n.run_id
WHERE r.finished_at IS NULL GROUP BY n.state
""")


async def live_counts(
    conn: AsyncConnection,
) -> tuple[dict[RunState, float], dict[NodeState, float]]:
    """Unfinished runs by state, and their nodes by state, for ``/metrics``."""
    runs = {RunState(r.state): float(r.n) for r in await conn.execute(_LIVE_RUNS)}
    nodes = {NodeState(r.state): float(r.n) for r in await conn.execute(_LIVE_NODES)}
    return runs, nodes
