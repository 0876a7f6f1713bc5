"""Runs: read them with their nodes, draw their graph, cancel and retry them, decide
their approval gates, deliver events to them."""

from __future__ import annotations

import graphlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Response
from fastapi.responses import PlainTextResponse
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from libs.common.auth import Caller, Person
from libs.common.dag_models import (
    ApprovalDecision,
    ApprovalSpec,
    EventDelivery,
    EventName,
    Graph,
    GraphEdge,
    GraphNode,
    Node,
    NodeName,
    NodeSpec,
    Run,
    RunClear,
    RunEvent,
    RunList,
    RunRetry,
    RunState,
    TriggerRule,
    WorkflowCreate,
    WorkflowName,
)
from libs.common.errors import Conflict, Forbidden, InvalidInput, NotFound
from libs.common.models import MAX_PAGE
from libs.common.problems import PROBLEMS
from libs.common.stored import as_stored
from libs.common.teams import check_what_runs
from services.dag import store
from services.dag.deps import Db, GraphCache, Loop, RunIdPath
from services.dag.domain import data
from services.dag.domain.graph import Dag
from services.dag.engine import (
    Engine,
    Graphs,
    Unreadable,
    clear_set,
    failed_instances,
    reset_for_retry,
)
from services.dag.mermaid import mermaid

router = APIRouter(prefix="/v1/runs", tags=["runs"])
_RETRIED = (RunState.FAILED, RunState.CANCELLED)
_CLEARED = (RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED)


@dataclass(frozen=True)
class _Shape:
    """What a run's answer reads of its workflow version: its nodes in order, and each
    one's spec (its rule, upstream nodes, event, declared outputs)."""

    order: tuple[str, ...]
    specs: Mapping[str, NodeSpec]


async def _shape(conn: AsyncConnection, graphs: Graphs, workflow_id: int) -> _Shape:
    """The version's shape; of a definition the service can no longer parse (stored
    under older bounds, or changed by hand) as far as it reads as stored (``Stored``):
    its runs are still shown (the loop fails them, saying why), never a 500."""
    try:
        dag = await graphs.get(conn, workflow_id)
    except Unreadable:
        row = await store.workflow_by_id(conn, workflow_id)
        return _stored_shape(row.definition)
    return _Shape(dag.order, dag.specs)


def _stored_shape(definition: Any) -> _Shape:
    try:
        body = as_stored(WorkflowCreate, definition)
    except ValidationError:
        return _Shape((), {})
    specs = {node.name: node for node in body.nodes}
    sorter = graphlib.TopologicalSorter(
        {name: [up for up in spec.depends_on if up in specs] for name, spec in specs.items()}
    )
    try:
        return _Shape(tuple(sorter.static_order()), specs)
    except graphlib.CycleError:
        return _Shape(tuple(specs), specs)


async def _dag(conn: AsyncConnection, graphs: Graphs, workflow_id: int) -> Dag:
    """The version's graph, for a change of its run: 409 saying why when its definition
    can no longer be read."""
    try:
        return await graphs.get(conn, workflow_id)
    except Unreadable as exc:
        raise Conflict(f"the run cannot be changed: {exc.why}") from None


async def _with_nodes(conn: AsyncConnection, graphs: Graphs, row: Any) -> Run:
    """The run with its nodes in topological order, each mapped node followed by its
    instances, and the outputs each kept. A node its version's definition does not name
    (one it can no longer read) follows, with the default rule and no upstream."""
    shape = await _shape(conn, graphs, row.workflow_id)
    rows = await store.nodes_of(conn, [row.id])
    nodes = {n.name: n for n in rows}
    details = await store.node_details(conn, row.id)
    outputs = data.collect(
        (
            data.Kept(n.name, n.map_of, n.map_index, n.outputs)
            for n in rows
            if n.map_of is None or n.map_of in shape.specs
        ),
        shape.specs,
    )
    instances: dict[str, list[store.NodeRow]] = {}
    for n in rows:
        if n.map_of is not None:
            instances.setdefault(n.map_of, []).append(n)

    def listed(n: store.NodeRow, spec_name: str) -> Node:
        spec = shape.specs.get(spec_name)
        return Node(
            name=n.name,
            state=n.state,
            trigger_rule=TriggerRule.ALL_SUCCESS if spec is None else spec.trigger_rule,
            depends_on=[] if spec is None else list(spec.depends_on),
            try_number=n.try_number,
            task_id=n.task_id,
            error=n.error,
            updated_at=details[n.name].updated_at,
            outputs=n.outputs if n.map_of else outputs.get(n.name),
            map_of=n.map_of,
            map_index=n.map_index,
            map_item=details[n.name].map_item,
            decision=details[n.name].decision,
            decided_by=details[n.name].decided_by,
            decided_at=details[n.name].decided_at,
            comment=details[n.name].comment,
            wait_until=details[n.name].wait_until,
            child_run_id=n.child_run_id,
            event=None if spec is None or spec.event is None else spec.event.name,
        )

    order = [name for name in shape.order if name in nodes]
    order += sorted(n.name for n in rows if n.map_of is None and n.name not in shape.specs)
    found = []
    for name in order:
        found.append(listed(nodes[name], name))
        mine = sorted(instances.get(name, []), key=lambda n: n.map_index or 0)
        found += [listed(n, name) for n in mine]
    return store.run_model(row, found)


@router.get("", response_model=RunList, responses=PROBLEMS)
async def list_runs(
    caller: Person,
    db: Db,
    workflow: WorkflowName | None = None,
    state: RunState | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    cursor: Annotated[str | None, Query(max_length=20, pattern=r"^[0-9]{1,19}$")] = None,
) -> RunList:
    """Runs you may see, newest first, without their nodes."""
    before = int(cursor) if cursor else None
    if before is not None and before > 2**63 - 1:
        raise InvalidInput("cursor: not a cursor this API gave out")
    async with db.connect() as conn:
        rows = await store.list_runs(conn, caller.visibility, workflow, state, limit, before)
    items = [store.run_model(r) for r in rows]
    next_cursor = str(items[-1].id) if len(items) == limit else None
    return RunList(items=items, next_cursor=next_cursor)


@router.get("/{run_id}", response_model=Run, responses=PROBLEMS)
async def get_run(run_id: RunIdPath, caller: Person, db: Db, graphs: GraphCache) -> Run:
    """The run with every node's state, in topological order."""
    async with db.connect() as conn:
        row = await store.get_run(conn, run_id, caller.visibility)
        return await _with_nodes(conn, graphs, row)


@router.get(
    "/{run_id}/graph",
    response_model=Graph,
    responses={**PROBLEMS, 200: {"content": {"text/plain": {}}}},
)
async def get_graph(
    run_id: RunIdPath,
    caller: Person,
    db: Db,
    graphs: GraphCache,
    format: Literal["json", "mermaid"] = "json",
) -> Graph | PlainTextResponse:
    """The run's nodes and edges (upstream to downstream) as JSON, or with
    ``format=mermaid`` as a Mermaid flowchart."""
    async with db.connect() as conn:
        row = await store.get_run(conn, run_id, caller.visibility)
        run = await _with_nodes(conn, graphs, row)
    run.nodes = [n for n in run.nodes if n.map_of is None]
    edges = [GraphEdge(source=up, target=n.name) for n in run.nodes for up in n.depends_on]
    text = mermaid(run.nodes, edges)
    if format == "mermaid":
        return PlainTextResponse(text)
    nodes = [
        GraphNode(name=n.name, state=n.state, trigger_rule=n.trigger_rule, task_id=n.task_id)
        for n in run.nodes
    ]
    return Graph(run_id=run.id, nodes=nodes, edges=edges, mermaid=text)


@router.post("/{run_id}/cancel", response_model=Run, responses=PROBLEMS)
async def cancel_run(
    run_id: RunIdPath, caller: Person, db: Db, graphs: GraphCache, loop: Loop
) -> Run:
    """Cancel a queued or running run; its nodes' live tasks are cancelled in core."""
    async with db.begin() as conn:
        row = await store.cancel_run(conn, run_id, caller.visibility)
        run = await _with_nodes(conn, graphs, row)
    loop.wake()
    return run


@router.post("/{run_id}/retry", response_model=Run, responses=PROBLEMS)
async def retry_run(
    run_id: RunIdPath,
    caller: Person,
    db: Db,
    graphs: GraphCache,
    loop: Loop,
    body: RunRetry | None = None,
) -> Run:
    """Run a failed or cancelled run again from the nodes that failed, could not run or
    were cancelled (each with its try counted up); the run queues like a new one. With
    ``instances: failed`` a mapped node that failed keeps the instances that succeeded
    and runs only its failed ones again."""
    async with db.begin() as conn:
        row = await store.get_run(conn, run_id, caller.visibility)
        dag = await _dag(conn, graphs, row.workflow_id)
        nodes = await store.nodes_of(conn, [run_id], lock=True)
        again = reset_for_retry(dag, {n.name: n.state for n in nodes})
        mapped: list[str] = []
        instances: list[str] = []
        if body is not None and body.instances == "failed":
            mapped, instances = failed_instances(again, nodes)
        whole = [name for name in again if name not in mapped]
        row = await store.requeue(
            conn, run_id, caller.visibility, whole, sources=_RETRIED, action="retried"
        )
        await store.retry_instances(conn, run_id, mapped, instances)
        run = await _with_nodes(conn, graphs, row)
    loop.wake()
    return run


@router.post("/{run_id}/clear", response_model=Run, responses=PROBLEMS)
async def clear_run(
    run_id: RunIdPath, body: RunClear, caller: Person, db: Db, graphs: GraphCache, loop: Loop
) -> Run:
    """Run a finished run again from ``node``: it and (unless ``downstream`` is false)
    every node below it go back to pending with their next try, whatever they ended as;
    the rest keep their outcomes and outputs. The run queues like a new one."""
    async with db.begin() as conn:
        row = await store.get_run(conn, run_id, caller.visibility)
        dag = await _dag(conn, graphs, row.workflow_id)
        if body.node not in dag.specs:
            raise InvalidInput(
                f"body.node: run {run_id} has no node '{body.node}'",
                errors=[{"field": "body.node", "reason": f"no node '{body.node}'"}],
            )
        await store.nodes_of(conn, [run_id], lock=True)
        cleared = clear_set(dag, body.node, body.downstream)
        row = await store.requeue(
            conn, run_id, caller.visibility, cleared, sources=_CLEARED, action="cleared"
        )
        run = await _with_nodes(conn, graphs, row)
    loop.wake()
    return run


NodeNamePath = Annotated[NodeName, Path(description="The approval gate's node name.")]


def may_decide(caller: Caller, run: Any, approval: ApprovalSpec) -> bool:
    """Who may decide a gate: the people and team it names; without ``approvers``, the
    run's owner and the members of its team (and admins)."""
    named = approval.approvers
    if named is None:
        return caller.sees_all or caller.name == run.owner or run.team in caller.teams
    return caller.name in named.people or (named.team is not None and named.team in caller.teams)


async def _decide(
    run_id: int,
    name: str,
    decision: Literal["approve", "reject"],
    body: ApprovalDecision | None,
    caller: Caller,
    db: AsyncEngine,
    graphs: Graphs,
    loop: Engine,
) -> Run:
    async with db.begin() as conn:
        row = await store.get_run(conn, run_id, None)
        dag = await _dag(conn, graphs, row.workflow_id)
        spec = dag.specs.get(name)
        sees = caller.sees_all or caller.name == row.owner or row.team in caller.teams
        gate = spec.approval if spec is not None else None
        if gate is None or not may_decide(caller, row, gate):
            if not sees:
                raise NotFound(f"no run {run_id}")  # another owner's run is as a missing one
            if gate is None:
                raise NotFound(f"run {run_id} has no approval gate '{name}'")
            raise Forbidden(f"you are not an approver of node '{name}' of run {run_id}")
        comment = body.comment if body is not None and body.comment else None
        decided = await store.decide(
            conn, run_id, name, decision, caller.name, comment, caller.role
        )
        if decided is None:
            state = next(n.state for n in await store.nodes_of(conn, [run_id]) if n.name == name)
            raise Conflict(f"node '{name}' of run {run_id} is {state}, or decided: not waiting")
        run = await _with_nodes(conn, graphs, row)
    loop.wake()
    return run if sees else _gate_only(run, name)


def _gate_only(run: Run, name: str) -> Run:
    """What a named approver who does not otherwise see the run gets of it: the run's
    identity and state and the gate's node; not its params, nor its other nodes (their
    tasks, errors and outputs), which the whole run carried to anyone a gate names."""
    gate = [n for n in run.nodes if n.name == name]
    return run.model_copy(update={"params": {}, "nodes": gate})


@router.post("/{run_id}/nodes/{name}/approve", response_model=Run, responses=PROBLEMS)
async def approve_node(
    run_id: RunIdPath,
    name: NodeNamePath,
    caller: Person,
    db: Db,
    graphs: GraphCache,
    loop: Loop,
    body: ApprovalDecision | None = None,
) -> Run:
    """Approve a waiting approval gate (its decision is recorded at once; the loop then
    moves the node to succeeded). 403 if you are not an approver, 409 if it is not
    waiting or was decided already."""
    return await _decide(run_id, name, "approve", body, caller, db, graphs, loop)


@router.post("/{run_id}/nodes/{name}/reject", response_model=Run, responses=PROBLEMS)
async def reject_node(
    run_id: RunIdPath,
    name: NodeNamePath,
    caller: Person,
    db: Db,
    graphs: GraphCache,
    loop: Loop,
    body: ApprovalDecision | None = None,
) -> Run:
    """Reject a waiting approval gate: the node fails and its downstream follows the
    trigger rules. 403 if you are not an approver, 409 if it is not waiting."""
    return await _decide(run_id, name, "reject", body, caller, db, graphs, loop)


EventNamePath = Annotated[EventName, Path(description="The event's name.")]


@router.post(
    "/{run_id}/events/{name}", response_model=RunEvent, status_code=201, responses=PROBLEMS
)
async def deliver_event(
    run_id: RunIdPath,
    name: EventNamePath,
    caller: Person,
    db: Db,
    graphs: GraphCache,
    loop: Loop,
    response: Response,
    body: EventDelivery | None = None,
) -> RunEvent:
    """Deliver event ``name`` to a queued or running run whose workflow has a node that
    waits for it (404 otherwise; 409 once the run ended). The run keeps it once (201):
    the node waiting for it succeeds with ``data`` as its outputs, and one that starts
    waiting later finds it. The same event again answers the one kept (200), or 409 if
    its data differ."""
    given = body.data if body is not None else {}
    async with db.begin() as conn:
        row = await store.get_run(conn, run_id, caller.visibility)
        if given and caller.role != "service":
            # The data become the node's outputs, which the nodes after it read into
            # their tasks, run as the owner: a teammate's would be a teammate's
            # arguments run as someone else (as a run's params would be).
            check_what_runs(caller, row.owner, "body.data")
        dag = await _dag(conn, graphs, row.workflow_id)
        if not any(s.event is not None and s.event.name == name for s in dag.specs.values()):
            raise NotFound(f"run {run_id} has no node that waits for event '{name}'")
        if row.state not in (RunState.QUEUED, RunState.RUNNING):
            raise Conflict(f"run {run_id} is {row.state}: events go to a queued or running run")
        kept, delivered = await store.deliver_event(conn, run_id, name, given, caller.name)
        if not delivered and kept.data != given:
            raise Conflict(f"event '{name}' was delivered to run {run_id} already, other data")
        node = await store.node_waiting_for(conn, run_id, name)
    if delivered:
        loop.wake()
    else:
        response.status_code = 200
    return RunEvent.model_validate({**kept._mapping, "node": node})
