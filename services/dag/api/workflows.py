"""Workflow definitions: store a version, read them, start runs."""

from __future__ import annotations

import asyncio
from datetime import UTC
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from sqlalchemy import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common.auth import ActingOwner, Caller, Person, Visibility
from libs.common.dag_models import (
    MAX_HISTORY_RUNS,
    MAX_SUBFLOW_DEPTH,
    HistoryCell,
    HistoryRun,
    Run,
    RunCreate,
    Workflow,
    WorkflowCreate,
    WorkflowHistory,
    WorkflowList,
    WorkflowName,
)
from libs.common.errors import Conflict, InvalidInput
from libs.common.problems import PROBLEMS
from libs.common.teams import bound_to_team, check_member, check_what_runs
from services.dag import store, traces
from services.dag.deps import Db, GraphCache, Loop
from services.dag.domain import subflows
from services.dag.domain.data import Instance, map_items
from services.dag.domain.templates import Renderer, RunContext, merged_params
from services.dag.engine import Graphs, build_sized

router = APIRouter(prefix="/v1/workflows", tags=["workflows"])
#: the most workflow versions one definition's sub-workflow references reach
MAX_REFERENCED = 500


def _workflow(row: object) -> Workflow:
    return Workflow.model_validate(row, from_attributes=True)


def _for_team(body: WorkflowCreate) -> WorkflowCreate:
    """A team's definition: every node's task owned by the team, with no secret but the
    team's (422 naming the node's field otherwise)."""
    team = body.team
    if team is None:
        return body
    nodes = [
        node
        if node.task is None
        else node.model_copy(
            update={"task": bound_to_team(node.task, team, f"body.nodes.{i}.task")}
        )
        for i, node in enumerate(body.nodes)
    ]
    return body.model_copy(update={"nodes": nodes})


# Whose workflow: a teammate's, shared with a team of the caller (default: the caller's).
WorkflowOwner = Annotated[
    str | None,
    Query(
        alias="owner",
        min_length=1,
        max_length=200,
        pattern=r"^[^\x00-\x1f\x7f]+$",
        description="The workflow's owner, when it is a teammate's workflow shared with "
        "a team of yours (the run is then the owner's and the team's).",
    ),
]


@router.post("", response_model=Workflow, status_code=201, responses=PROBLEMS)
async def put_workflow(
    body: WorkflowCreate,
    caller: Person,
    owner: ActingOwner,
    db: Db,
    graphs: GraphCache,
    response: Response,
) -> Workflow:
    """Store a definition as the workflow's next version (201), or answer its newest
    version (200) when that is the same definition. A cycle, an unknown or duplicate node
    is refused with their names. ``team`` must be one the caller belongs to (403)."""
    check_member(caller, body.team, "body.team")
    body = _for_team(body)
    dag, weight = await asyncio.to_thread(build_sized, body)  # a large one takes seconds
    async with db.begin() as conn:
        await _check_subflows(conn, owner, body)
        row, created = await store.put_workflow(conn, owner, body)
    graphs.put(row.id, dag, weight)
    if not created:
        response.status_code = 200
    return _workflow(row)


def _refused(field: str, reason: str, **extra: object) -> InvalidInput:
    return InvalidInput(f"{field}: {reason}", errors=[{"field": field, "reason": reason}], **extra)


class _References:
    """The workflow versions one definition's sub-workflow references reach, read from
    the store: each version's references (``subflows.Edges``)."""

    def __init__(self, conn: AsyncConnection, owner: str, body: WorkflowCreate) -> None:
        self.conn = conn
        self.owner = owner
        self.body = body
        self.root: subflows.Key = (body.name, 0)
        self.edges: dict[subflows.Key, list[tuple[str, subflows.Key]]] = {}
        self._loaded: dict[subflows.Key, list[tuple[str, str, int | None]]] = {}

    async def resolve(self, name: str, version: int | None) -> subflows.Key | None:
        """The version a reference runs (None: there is none)."""
        if name == self.body.name and version is None:
            return self.root  # its newest version is the one being stored
        found = await store.references_of(self.conn, self.owner, name, version)
        if found is None:
            return None
        key = (name, found[0])
        self._loaded[key] = found[1]
        return key

    async def follow(self, todo: list[subflows.Key]) -> None:
        """Read every version reachable from ``todo``."""
        while todo:
            key = todo.pop()
            if key in self.edges:
                continue
            if len(self.edges) > MAX_REFERENCED:
                raise _refused("body.nodes", f"sub-workflows reach over {MAX_REFERENCED} versions")
            self.edges[key] = []
            for node, name, version in self._loaded.get(key, []):
                target = await self.resolve(name, version)
                if target is not None:  # a stored version's reference was checked then
                    self.edges[key].append((node, target))
                    todo.append(target)


async def _check_subflows(conn: AsyncConnection, owner: str, body: WorkflowCreate) -> None:
    """Every sub-workflow a node runs is one of ``owner``'s (the version it pins exists),
    and the references reach no cycle and nest no deeper than ``MAX_SUBFLOW_DEPTH``
    (422 naming the node's ``workflow.name`` and the path)."""
    own = [(i, n.name, n.workflow) for i, n in enumerate(body.nodes) if n.workflow is not None]
    if not own:
        return
    await store.lock_references(conn, owner)  # held to the commit of what is stored
    refs = _References(conn, owner, body)
    first: list[tuple[str, subflows.Key]] = []
    for i, node, ref in own:
        target = await refs.resolve(ref.name, ref.version)
        if target is None:
            which = f"version {ref.version} of " if ref.version else ""
            field = f"body.nodes.{i}.workflow." + ("version" if ref.version else "name")
            raise _refused(field, f"no {which}workflow '{ref.name}' of yours")
        first.append((node, target))
    refs.edges[refs.root] = first
    await refs.follow([target for _, target in first])
    problem = subflows.check(body.name, refs.edges, MAX_SUBFLOW_DEPTH)
    if problem is not None:
        index = next(i for i, node, _ in own if node == problem.node)
        raise _refused(
            f"body.nodes.{index}.workflow.name", problem.reason, subflow_path=list(problem.path)
        )


@router.get("", response_model=WorkflowList, responses=PROBLEMS)
async def list_workflows(caller: Person, db: Db) -> WorkflowList:
    """The newest version of each workflow you may see."""
    async with db.connect() as conn:
        rows = await store.list_workflows(conn, caller.visibility)
    return WorkflowList.model_validate(
        {"items": [{**r._mapping, "nodes": r.node_count} for r in rows]}
    )


@router.get("/{name}", response_model=Workflow, responses=PROBLEMS)
async def get_workflow(
    name: WorkflowName,
    caller: Person,
    owner: ActingOwner,
    db: Db,
    version: Annotated[int | None, Query(ge=1, le=2**31 - 1)] = None,
    of: WorkflowOwner = None,
) -> Workflow:
    """Your workflow's newest version, or ``version``; with ``owner``, a teammate's
    workflow shared with your team (anyone else's is a 404)."""
    async with db.connect() as conn:
        whose, who = _whose(caller, owner, of)
        return _workflow(await store.get_workflow(conn, whose, name, version, who))


def _whose(caller: Caller, owner: str, of: str | None) -> tuple[str, Visibility | None]:
    """The workflow's owner, and who must be able to see it (None: the caller's own)."""
    if of is None or of == owner:
        return owner, None
    return of, caller.visibility


def _check_choices(caller: Caller, owner: str, body: RunCreate) -> None:
    """A run of someone else's workflow takes its own params: the values the templates
    read (``params``, ``fire``) are the owner's or an admin's to choose (403 naming one)."""
    for field in ("params", "fire"):
        if getattr(body, field):
            check_what_runs(caller, owner, f"body.{field}")


def run_key(key: str | None, owner: str, acting: str) -> str | None:
    """The idempotency key a run is kept under. Keys are unique per owner, so a run
    someone else starts of the owner's workflow (a teammate's, an admin's with
    ``owner``) keeps its key apart, as ``by NAME: KEY``: it finds none of the owner's
    own runs (another workflow's, its params), and takes none of the keys the owner's
    runs will come with (cron's ``cron:SCHEDULE:SLOT`` are predictable)."""
    if key is None or acting == owner:
        return key
    return f"by {acting}: {key}"


async def begin_run(
    conn: AsyncConnection,
    graphs: Graphs,
    owner: str,
    name: str,
    body: RunCreate,
    who: Visibility | None,
) -> tuple[Row[Any], bool]:
    """Queue a run of ``owner``'s workflow ``name`` (its params checked against the
    definition, every node rendered once), or find the run its idempotency key names:
    one of this workflow that ``who`` may see, else a 409 naming the key."""
    workflow = await store.get_workflow(conn, owner, name, body.version, who)
    dag = await graphs.get(conn, workflow.id)
    params = merged_params(dag, body.params)
    for node in dag.order:  # a list parameter a node maps over is checked now
        spec = dag.specs[node]
        if spec.map is not None and spec.map.over.strip("{} ").startswith("params."):
            _, why = map_items(spec, params, {})
            if why is not None:
                name = spec.map.over.strip("{} ").removeprefix("params.")
                raise InvalidInput(
                    f"body.params.{name}: {why}",
                    errors=[{"field": f"body.params.{name}", "reason": why}],
                )
    if body.fire is not None:  # {{ fire.slot }}: kept with the run's params
        fire = body.fire.model_dump(mode="json")
        fire["slot"] = body.fire.slot.astimezone(UTC).isoformat()  # as CAIRN_CRON_SLOT
        params = {**params, "fire": fire}
    definition = dag.definition
    row, created = await store.create_run(
        conn,
        owner,
        workflow,
        params,
        body.idempotency_key,
        dag.order,
        timeout_s=body.timeout_s or definition.timeout_s,
        max_active_nodes=definition.max_active_nodes,
        task_timeout_s=body.task_timeout_s or definition.task_timeout_s,
    )
    if not created and (row.workflow != workflow.name or not store.visible(row, who)):
        reason = "names a run of another workflow: use a key of this run's own"
        raise Conflict(
            f"body.idempotency_key: {reason}",
            errors=[{"field": "body.idempotency_key", "reason": reason}],
        )
    if created:
        # Every node must render into a valid task now, not halfway through the run
        # (what upstream nodes hand on renders empty here).
        context = RunContext(
            row.id, workflow.name, owner, params, task_timeout_s=row.task_timeout_s
        )
        renderer = Renderer(dag, context)
        for node in dag.order:
            if dag.specs[node].task is None:
                continue  # a gate, a sub-workflow or an event node has no task
            item = Instance(0, "") if dag.specs[node].map is not None else None
            renderer.task(node, 1, item)
    return row, created


@router.post("/{name}/runs", response_model=Run, status_code=201, responses=PROBLEMS)
async def start_run(
    name: WorkflowName,
    body: RunCreate,
    caller: Person,
    owner: ActingOwner,
    db: Db,
    graphs: GraphCache,
    loop: Loop,
    response: Response,
    of: WorkflowOwner = None,
) -> Run:
    """Start a run (201), or answer the run your ``idempotency_key`` already started (200).
    It is queued until the workflow has fewer than ``max_active_runs`` running. With
    ``owner``, a run of a teammate's workflow shared with your team: the run, like the
    workflow, is its owner's and the team's, and its tasks run as the owner, so only the
    owner (or an admin) chooses its ``params`` (and ``fire``, which the templates read
    too): a teammate's are a 403 naming them."""
    acting = owner
    owner, who = _whose(caller, owner, of)
    if owner != acting:
        _check_choices(caller, owner, body)
        body = body.model_copy(
            update={"idempotency_key": run_key(body.idempotency_key, owner, acting)}
        )
    async with db.begin() as conn:
        row, created = await begin_run(conn, graphs, owner, name, body, who)
    if created:
        traces.started(row)
        loop.wake()
    else:
        response.status_code = 200
    return store.run_model(row)


@router.get("/{name}/history", response_model=WorkflowHistory, responses=PROBLEMS)
async def history(
    name: WorkflowName,
    caller: Person,
    owner: ActingOwner,
    db: Db,
    graphs: GraphCache,
    limit: Annotated[int, Query(ge=1, le=MAX_HISTORY_RUNS)] = 25,
    of: WorkflowOwner = None,
) -> WorkflowHistory:
    """The workflow's newest ``limit`` runs (at most 100), oldest first, each with every
    node's state, try and duration: the dashboard's grid of runs by node."""
    async with db.connect() as conn:
        whose, who = _whose(caller, owner, of)
        newest = await store.get_workflow(conn, whose, name, None, who)
        order = list((await graphs.get(conn, newest.id)).order)
        runs, nodes = await store.history(conn, whose, name, limit, who)
    cells: dict[int, dict[str, HistoryCell]] = {r.id: {} for r in runs}
    for n in nodes:
        duration = None if n.duration_s is None else round(float(n.duration_s), 3)
        cells[n.run_id][n.name] = HistoryCell(
            state=n.state, try_number=n.try_number, duration_s=duration
        )
    older = sorted({n.name for n in nodes} - set(order))
    return WorkflowHistory(
        workflow=name,
        nodes=order + older,
        runs=[
            HistoryRun.model_validate({**r._mapping, "nodes": cells[r.id]}) for r in reversed(runs)
        ],
    )
