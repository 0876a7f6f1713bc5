"""Worker agents: register, heartbeat, claim attempts, report how they ended; drain."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response, status
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common.errors import NotFound
from libs.common.models import (
    MAX_PAGE,
    WORKER_LEASE_HEADER,
    ClaimAnswer,
    ClaimRequest,
    Heartbeat,
    HeartbeatAnswer,
    LogBatch,
    LogBatchAnswer,
    ReplicaStatusAnswer,
    ReplicaStatuses,
    Report,
    ReportAnswer,
    Starts,
    StartsAnswer,
    Turn,
    TurnAnswer,
    Worker,
    WorkerList,
    WorkerRegister,
    WorkerRegistered,
)
from libs.common.problems import PROBLEMS
from libs.common.states import TaskState, WorkerState
from services.core.api.deps import (
    JSON,
    AdminOnly,
    Announcer,
    Audit,
    Bearer,
    Engine,
    LeaseCache,
    PlainRoute,
    allow,
    auditor_of,
    authenticate,
    engine_of,
    on_liveness_pool,
    plain_caller,
    require,
)
from services.core.api.tasks import decode_cursor, encode_cursor
from services.core.db import attempts as attempts_db
from services.core.db import placement
from services.core.db import workers as workers_db
from services.core.domain.principals import Principal
from services.core.domain.workers import missing_grace_s, turn_fresh_s
from services.core.ops import dispatch as ops
from services.core.ops import services as services_ops
from services.core.ops import tasklogs
from services.core.settings import CoreSettings

router = APIRouter(prefix="/v1/workers", tags=["workers"])

WorkerId = Annotated[int, Path(ge=1, le=2**63 - 1)]
AttemptId = Annotated[int, Path(ge=1, le=2**63 - 1)]
AGENTS = ("worker", "admin")


async def _agent(request: Request, credentials: Bearer) -> Principal:
    """A worker agent (or an admin), in one dependency (``require`` solves four)."""
    return allow(await authenticate(request, engine_of(request), credentials), AGENTS)


AgentPrincipal = Annotated[Principal, Depends(_agent)]
Overseer = Annotated[Principal, Depends(require("admin", "service"))]


def _settings(request: Request) -> CoreSettings:
    settings: CoreSettings = request.app.state.settings
    return settings


LEASE_MAX = 200
LeaseHeader = Annotated[str | None, Header(alias=WORKER_LEASE_HEADER, max_length=LEASE_MAX)]


async def _hold(
    worker_id: int, principal: Principal, engine: AsyncEngine, request: Request, lease: str | None
) -> workers_db.Holder:
    """The worker, if the caller registered it (admins: any) and holds its lease secret;
    else 404, as for a missing worker. A lease checked lately is not read again."""
    owner = None if principal.role == "admin" else principal.name
    leases: LeaseCache = request.app.state.leases
    registrar = leases.principal_of(worker_id, lease)
    if registrar is not None:
        return workers_db.held_by(workers_db.Holder(worker_id, registrar), owner)
    async with engine.connect() as conn:
        holder = await workers_db.leased_worker(conn, worker_id, lease)
    leases.put(worker_id, lease, holder.principal)
    return workers_db.held_by(holder, owner)


async def _own_worker(
    worker_id: WorkerId,
    principal: AgentPrincipal,
    engine: Engine,
    request: Request,
    lease: LeaseHeader = None,
) -> workers_db.Holder:
    return await _hold(worker_id, principal, engine, request, lease)


OwnWorker = Annotated[workers_db.Holder, Depends(_own_worker)]


@router.post(
    "", status_code=status.HTTP_201_CREATED, response_model=WorkerRegistered, responses=PROBLEMS
)
async def register_worker(
    offer: WorkerRegister, principal: AgentPrincipal, engine: Engine, request: Request
) -> WorkerRegistered:
    """A worker agent starts: it offers capacity for some queues. The answer holds the
    worker's lease secret, which every later call for this worker must send."""
    settings = _settings(request)
    worker, lease = await ops.register(engine, principal.name, offer)
    return WorkerRegistered(
        worker=worker,
        lease=lease,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        heartbeat_timeout_s=settings.heartbeat_timeout_s,
        agent_hang_timeout_s=settings.agent_hang_timeout_s,
        turn_fresh_s=_fresh_s(settings),
    )


@router.get("", response_model=WorkerList, responses=PROBLEMS)
async def list_workers(
    principal: Overseer,
    engine: Engine,
    state: WorkerState | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    cursor: Annotated[str | None, Query(max_length=40)] = None,
) -> WorkerList:
    """Workers newest first, a page at a time, with their capacity, what is placed on
    them, and their last heartbeat. Dead and departed ones are kept for the retention."""
    before = decode_cursor(cursor) if cursor else None
    async with engine.connect() as conn:
        items = await workers_db.list_workers(conn, state, before, limit)
    next_cursor = encode_cursor(items[-1].id) if len(items) == limit else None
    return WorkerList(items=items, next_cursor=next_cursor)


def _dispatcher_on(request: Request, engine: AsyncEngine) -> ops.Dispatcher:
    state = request.app.state
    settings: CoreSettings = state.settings
    defaults = placement.Defaults.of(settings)
    return ops.Dispatcher(
        engine,
        state.notifier,
        state.core_metrics,
        state.secret_box,
        defaults,
        settings.claim_ahead_max_s,
        fresh_s=_fresh_s(settings),
        source_cap=settings.source_unanswered_max,
        holds=state.claim_holds,
        known=state.known_workers,
    )


def _fresh_s(settings: CoreSettings) -> float:
    return turn_fresh_s(settings.heartbeat_timeout_s, settings.agent_hang_timeout_s)


def _dispatcher(engine: Engine, request: Request) -> ops.Dispatcher:
    return _dispatcher_on(request, engine)


Dispatch = Annotated[ops.Dispatcher, Depends(_dispatcher)]


@dataclass(frozen=True)
class AgentCall:
    """What an agent's hot calls need, solved as one dependency (FastAPI spends tens of
    microseconds on each one it solves; these calls solved twelve): the worker held by
    the caller (``OwnWorker``) and a dispatcher (``Dispatch``)."""

    worker: workers_db.Holder
    dispatcher: ops.Dispatcher
    #: who calls: the actor of what the call audits (an agent's own drain)
    principal: Principal


async def _agent_call(
    worker_id: WorkerId, request: Request, principal: AgentPrincipal, lease: LeaseHeader = None
) -> AgentCall:
    # The caller is a dependency of its own, solved before the path and the header are
    # validated: a request without a valid token is a 401, whatever else is wrong.
    engine = engine_of(request)
    worker = await _hold(worker_id, principal, engine, request, lease)
    return AgentCall(worker, _dispatcher_on(request, engine), principal)


Agent = Annotated[AgentCall, Depends(_agent_call)]


@router.post(
    "/{worker_id}/heartbeat",
    response_model=HeartbeatAnswer,
    responses=PROBLEMS,
    dependencies=[Depends(on_liveness_pool)],
)
async def heartbeat(beat: Heartbeat, call: Agent, request: Request) -> HeartbeatAnswer:
    """The sidecar's beat: the worker lives, and these attempts' processes run. With
    ``hung_s``, the sidecar says its agent hung and it killed the attempts: the worker
    is dead at once, its attempts lost."""
    worker, dispatcher = call.worker, call.dispatcher
    grace = missing_grace_s(_settings(request).heartbeat_interval_s)
    hung = (beat.hung_source_threads, beat.hung_source_checkers)
    found, state = await ops.heartbeat(
        dispatcher, worker, beat.attempts, grace, beat.hung_s, hung, beat.seen
    )
    return HeartbeatAnswer(
        state=state,
        stop=found.stop,
        squeeze=found.squeeze,
        preempt=found.preempt,
        preempt_grace_s=_settings(request).preempt_grace_s,
    )


async def turn(body: Turn, call: Agent, request: Request) -> Response:
    """One round trip of a worker agent, in one transaction: the reports of attempts that
    ended (each fenced by its attempt and this worker: a stale one is refused alone, with
    409 in its verdict), the attempts it started, and the room it wants filled (``claim``;
    with ``wait``, an empty answer is held until work arrives or ``wait`` seconds pass)."""
    worker, dispatcher = call.worker, call.dispatcher
    # An agent's own drain is audited as an admin's is, the agent the actor.
    record = auditor_of(request, call.principal) if body.draining else None
    done = await ops.turn(
        dispatcher, worker.id, body, request.headers, request.is_disconnected, record
    )
    answer = TurnAnswer(
        state=done.state, reports=done.reports, attempts=done.attempts, waited=done.waited
    )
    return Response(answer.model_dump_json(), media_type=JSON)


MAX_ID = 2**63 - 1


class TurnRoute(PlainRoute):
    """``POST /v1/workers/{worker_id}/turn`` as ``turn`` declares it, with an agent's turn
    served without FastAPI's dependency solving and body handling, as
    ``tasks.SubmitRoute`` serves a submission: the caller authenticated first (401, 403
    as there), then the worker held (404), then the JSON body parsed by pydantic
    straight from the bytes; an id or a lease header the dependencies would refuse, or
    a body that does not validate, goes to FastAPI's own handler."""

    async def plain(self, request: Request) -> Response | None:
        principal = await plain_caller(request, AGENTS)
        worker_id = _plain_id(request.path_params.get("worker_id"))
        lease = request.headers.get(WORKER_LEASE_HEADER)
        if worker_id is None or (lease is not None and len(lease) > LEASE_MAX):
            return None
        engine = engine_of(request)
        worker = await _hold(worker_id, principal, engine, request, lease)
        try:
            body = Turn.model_validate_json(await request.body())
        except ValidationError:
            return None
        call = AgentCall(worker, _dispatcher_on(request, engine), principal)
        return await turn(body, call, request)


def _plain_id(value: str | None) -> int | None:
    """A path's id as the path parameter takes it, if it is plain digits in range."""
    if value is None or not (value.isascii() and value.isdigit()) or len(value) > 19:
        return None
    number = int(value)
    return number if 1 <= number <= MAX_ID else None


router.add_api_route(
    "/{worker_id}/turn",
    turn,
    methods=["POST"],
    response_model=TurnAnswer,
    responses=PROBLEMS,
    route_class_override=TurnRoute,
)


@router.post("/{worker_id}/claim", response_model=ClaimAnswer, responses=PROBLEMS)
async def claim(room: ClaimRequest, call: Agent, request: Request) -> ClaimAnswer:
    """Lease attempts that fit the room given; with ``wait``, hold an empty answer until
    work arrives or ``wait`` seconds pass. (A turn without reports.)"""
    worker, dispatcher = call.worker, call.dispatcher
    leased = await ops.claim(dispatcher, worker.id, room, request.is_disconnected)
    return ClaimAnswer(attempts=leased)


@router.post(
    "/{worker_id}/attempts/{attempt_id}/start", response_model=ReportAnswer, responses=PROBLEMS
)
async def start(attempt_id: AttemptId, worker: OwnWorker, engine: Engine) -> ReportAnswer:
    """The agent asks before it starts an attempt when its last turn is too old to vouch
    for its lease: 409 when core no longer holds it for this worker (lost to the reaper,
    cancelled), so the agent must not run it."""
    task_id = await ops.confirm_start(engine, attempt_id, worker.id)
    return ReportAnswer(task_id=task_id, state=TaskState.RUNNING)


@router.post("/{worker_id}/starts", response_model=StartsAnswer, responses=PROBLEMS)
async def starts(body: Starts, worker: OwnWorker, engine: Engine) -> StartsAnswer:
    """The agent asks before it starts attempts leased ahead, at their ``start_at``, all
    that are due at once in one request: those core no longer holds for this worker
    (cancelled while held, lost) are ``gone`` and must not run."""
    async with engine.connect() as conn:
        held = await attempts_db.held_starts(conn, body.attempts, worker.id)
    asked = sorted(set(body.attempts))
    return StartsAnswer(
        held=[a for a in asked if a in held], gone=[a for a in asked if a not in held]
    )


@router.post(
    "/{worker_id}/attempts/{attempt_id}/report", response_model=ReportAnswer, responses=PROBLEMS
)
async def report(
    attempt_id: AttemptId, outcome: Report, call: Agent, request: Request
) -> ReportAnswer:
    """How an attempt ended. A report from an attempt that is no longer the task's current
    one (its lease was lost) is refused with 409 and changes nothing. (A turn of one
    report.)"""
    worker, dispatcher = call.worker, call.dispatcher
    verdict = await ops.report(dispatcher, worker.id, attempt_id, outcome, request.headers)
    assert verdict.task_id is not None and verdict.state is not None
    return ReportAnswer(task_id=verdict.task_id, state=verdict.state)


@router.post("/{worker_id}/logs", response_model=LogBatchAnswer, responses=PROBLEMS)
async def ship_logs(
    batch: LogBatch, worker: OwnWorker, engine: Engine, notifier: Announcer, request: Request
) -> LogBatchAnswer:
    """Chunks of the logs of attempts this worker runs, any number of attempts in one
    batch. Each chunk is answered on its own: 200 stored (or already held: a retried
    batch is not doubled), 409 when its attempt is not open on this worker (nor ended by
    its report less than ``CAIRN_LOG_LATE_S`` ago with the rest of its log on its way),
    422 when it goes past the output's end that report gave; the secrets' values are
    masked before anything is stored (docs/logs.md)."""
    limits = tasklogs.Limits.of(_settings(request))
    acks = await tasklogs.append(engine, request.app.state.log_maskers, worker.id, batch, limits)
    notifier.announce_log(a.attempt_id for a in acks if a.status == 200)
    return LogBatchAnswer(items=acks)


@router.post("/{worker_id}/replicas", response_model=ReplicaStatusAnswer, responses=PROBLEMS)
async def replicas(body: ReplicaStatuses, worker: OwnWorker, engine: Engine) -> ReplicaStatusAnswer:
    """What the agent's probes say of the services' replicas it runs: ready or not, the
    host's address and the port of each declared name (docs/services.md). An attempt no
    longer open on this worker is left out of ``kept``."""
    kept = await services_ops.report_replicas(engine, worker.id, body.items)
    return ReplicaStatusAnswer(kept=kept)


@router.post("/{worker_id}/drain", response_model=Worker, responses=PROBLEMS)
async def drain(
    worker_id: WorkerId,
    principal: AdminOnly,
    engine: Engine,
    record: Audit,
    notifier: Announcer,
) -> Worker:
    """Stop giving the worker new work; what runs finishes (the agent hands back the rest
    after its grace period)."""
    await ops.drain(engine, notifier, record, worker_id)
    return await _get(engine, worker_id)


@router.post("/{worker_id}/leave", response_model=Worker, responses=PROBLEMS)
async def leave(worker: OwnWorker, dispatcher: Dispatch, engine: Engine) -> Worker:
    """The agent stops cleanly; attempts it still holds are lost at once."""
    await ops.leave(dispatcher, worker.id)
    return await _get(engine, worker.id)


async def _get(engine: Engine, worker_id: int) -> Worker:
    async with engine.connect() as conn:
        found = await workers_db.list_workers(conn, None, worker_id + 1, 1)
    if not found or found[0].id != worker_id:
        raise NotFound(f"worker {worker_id} not found")  # purged since its lease was checked
    return found[0]
