"""Tasks: submit, read, list, cancel, retry, and each task's attempts and events."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import orjson
from fastapi import APIRouter, Header, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from libs.common import tracing
from libs.common.errors import Forbidden, InvalidInput, NotFound, QuotaExceeded
from libs.common.models import (
    MAX_BATCH,
    MAX_BULK_COUNT,
    MAX_PAGE,
    AttemptList,
    BatchResult,
    BulkAction,
    BulkResult,
    EventList,
    LabelKey,
    QueueName,
    Task,
    TaskBatchCreate,
    TaskCreate,
    TaskPage,
    TaskSelector,
    TeamName,
)
from libs.common.problems import PROBLEMS
from libs.common.sources import source_allowed
from libs.common.states import TaskState
from services.core import traces
from services.core.api.deps import (
    Announcer,
    Audit,
    Engine,
    Meter,
    OwnedTask,
    Reader,
    Submitting,
    TaskIdPath,
)
from services.core.db import placement, secrets, sharing, teams
from services.core.db import tasks as tasks_db
from services.core.domain.principals import Principal
from services.core.domain.transitions import Op
from services.core.ops import tasklogs
from services.core.ops.metrics import CoreMetrics

router = APIRouter(prefix="/v1/tasks", tags=["tasks"])


JSON = "application/json"


def _json(model: Task | BatchResult | TaskPage, status_code: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status_code, media_type=JSON)


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=Task,
    responses={
        200: {"model": Task, "description": "The idempotency key matched a task"},
        **PROBLEMS,
    },
)
async def submit_task(spec: TaskCreate, call: Submitting, request: Request) -> Response:
    """Submit one task. 201 with the new task; 200 with the existing one when the same
    owner already submitted this ``idempotency_key``. ``team`` shares it with a team the
    owner belongs to; ``env`` values may name secrets. 403 when the queue's policy does
    not allow what it asks for; 429 (with ``Retry-After``) when the owner is at a quota."""
    start = tracing.now_ns()
    principal, owner, engine, notifier, meter = (
        call.principal, call.owner, call.engine, call.notifier, call.meter
    )  # fmt: skip
    _check_sources(request, [spec], batch=False)
    book = await _book(request, engine)
    book.check_policy(_policy_role(principal, owner), owner, spec, "body")
    quantum = _quantum(request)
    if book.limits_submissions([owner], [spec.team]):
        async with engine.begin() as conn:
            if secrets.needs_check(spec):
                await _check(conn, principal, owner, spec)
            await _admit(conn, book, [owner], meter, [spec.team])
            [(row, created)] = await tasks_db.submit(conn, owner, [spec], quantum)
            task = await _submitted(conn, spec, row, created)
    else:
        # One statement, so no transaction around it: autocommit saves two round trips.
        async with engine.connect() as conn:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            if secrets.needs_check(spec):
                await _check(conn, principal, owner, spec)
            [(row, created)] = await tasks_db.submit(conn, owner, [spec], quantum)
            task = await _submitted(conn, spec, row, created)
    if created:
        notifier.announce()
        if row.state == TaskState.READY:
            notifier.announce_due(row.run_at)
        meter.submitted_to([spec.queue])
        traces.submitted(request.headers, [(row, spec)], start)
    response = _json(task, 201 if created else 200)
    response.headers["Location"] = f"/v1/tasks/{row.id}"
    return response


async def _submitted(conn: AsyncConnection, spec: TaskCreate, row: Any, created: bool) -> Task:
    return tasks_db.new_task(spec, row) if created else await tasks_db.get_task(conn, row.id, None)


async def _book(request: Request, engine: AsyncEngine) -> sharing.Book:
    book: sharing.Book = request.app.state.sharing
    return await book.fresh(engine)


def _quantum(request: Request) -> float:
    return float(request.app.state.settings.fair_quantum_s)


def _policy_role(principal: Principal, owner: str) -> str:
    """The role a queue's policy sees: a service submitting for someone else is held to
    what that person (a user) may ask for."""
    return "user" if principal.role == "service" and owner != principal.name else principal.role


async def _admit(
    conn: AsyncConnection,
    book: sharing.Book,
    owners: Sequence[str],
    meter: CoreMetrics,
    teams: Sequence[str | None] = (),
) -> None:
    try:
        await sharing.admit_submissions(conn, book, owners, teams)
    except QuotaExceeded as refused:
        meter.quota_refusals.labels(refused.extra["quota"]).inc()
        raise


# The request body of /batch as OpenAPI shows it (the model is parsed by hand, below).
_BATCH = {
    "type": "object",
    "required": ["tasks"],
    "additionalProperties": False,
    "properties": {
        "tasks": {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_BATCH,
            "items": {"$ref": "#/components/schemas/TaskCreate"},
        },
        "owners": {
            "type": "array",
            "maxItems": MAX_BATCH,
            "items": {
                "type": "string",
                "minLength": 1,
                "maxLength": 200,
                "pattern": "^[^\\x00-\\x1f\\x7f]+$",
            },
            "description": "One owner per task; service role only.",
        },
    },
}

M = TypeVar("M", bound=BaseModel)


def _check_sources(request: Request, specs: list[TaskCreate], batch: bool) -> None:
    """Refuse an artifact from outside ``CAIRN_ARTIFACT_SOURCES`` (422 naming its field)."""
    prefixes = request.app.state.settings.sources
    errors = [
        {
            "loc": ("body", "tasks", i, "artifact", "uri")
            if batch
            else ("body", "artifact", "uri"),
            "msg": "not an allowed artifact source (CAIRN_ARTIFACT_SOURCES)",
            "type": "value_error",
        }
        for i, spec in enumerate(specs)
        if not source_allowed(spec.artifact.uri, prefixes)
    ]
    if errors:
        raise RequestValidationError(errors)


def _parse(model: type[M], body: bytes) -> M:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in exc.errors()]
        raise RequestValidationError(errors) from None


@router.post(
    "/batch",
    status_code=status.HTTP_201_CREATED,
    response_model=BatchResult,
    responses={
        200: {"model": BatchResult, "description": "Every idempotency key matched a task"},
        **PROBLEMS,
    },
    openapi_extra={"requestBody": {"required": True, "content": {JSON: {"schema": _BATCH}}}},
)
async def submit_batch(request: Request, call: Submitting) -> Response:
    """Submit up to 1,000 tasks in one transaction: all are stored, or none. A service
    token may name each task's owner in ``owners``."""
    # Parsed by pydantic straight from the bytes: a third cheaper than FastAPI's
    # json.loads then validate, which matters at a thousand tasks a request.
    start = tracing.now_ns()
    principal, owner, engine, notifier, meter = (
        call.principal, call.owner, call.engine, call.notifier, call.meter
    )  # fmt: skip
    batch = _parse(TaskBatchCreate, await request.body())
    _check_sources(request, batch.tasks, batch=True)
    owners: str | list[str] = owner
    if batch.owners is not None:
        if principal.role != "service" and set(batch.owners) != {principal.name}:
            raise Forbidden("only the service role may name other owners in owners")
        owners = batch.owners
    each = [owners] * len(batch.tasks) if isinstance(owners, str) else owners
    book = await _book(request, engine)
    if book.policies:
        for i, (who, spec) in enumerate(zip(each, batch.tasks, strict=True)):
            book.check_policy(_policy_role(principal, who), who, spec, f"body.tasks.{i}")
    async with engine.begin() as conn:
        for i, spec in enumerate(batch.tasks):
            if secrets.needs_check(spec):
                who = owners if isinstance(owners, str) else owners[i]
                await _check(conn, principal, who, spec, f"tasks.{i}.")
        teams = [spec.team for spec in batch.tasks]
        if book.limits_submissions(each, teams):
            await _admit(conn, book, each, meter, teams)
        rows = await tasks_db.submit(conn, owners, batch.tasks, _quantum(request))
    notifier.announce()
    delayed = [row.run_at for row, created in rows if created and row.state == TaskState.READY]
    if delayed:
        notifier.announce_due(min(delayed))
    meter.submitted_to(
        spec.queue for spec, (_, created) in zip(batch.tasks, rows, strict=True) if created
    )
    traces.submitted(
        request.headers,
        ((row, spec) for spec, (row, created) in zip(batch.tasks, rows, strict=True) if created),
        start,
    )
    items = [
        {"id": row.id, "state": row.state, "created": created, "created_at": row.created_at}
        for row, created in rows
    ]
    return Response(
        orjson.dumps({"tasks": items}),
        status_code=201 if any(created for _, created in rows) else 200,
        media_type=JSON,
    )


async def _check(
    conn: AsyncConnection, principal: Principal, owner: str, spec: secrets.Asks, field: str = ""
) -> None:
    """The owner's right to its team and secrets: the caller's teams when it submits for
    itself, the teams the owner holds without a token (``teams.teams_of``) when a service
    submits for it."""
    if owner != principal.name:
        owner_teams = await teams.teams_of(conn, owner)
    else:
        owner_teams = principal.teams
        if principal.id is None and principal.claims_until is not None:
            # An identity provider vouches for these teams (for a bounded time): kept, so
            # that the lease, which has no token at hand, checks the same membership.
            used = secrets.teams_used(spec) & owner_teams
            await teams.vouch(
                conn, owner, used, owner_teams, principal.claims_until, principal.key_id
            )
    await secrets.check_submission(conn, owner, owner_teams, spec, field)


def _defaults(request: Request) -> placement.Defaults:
    return placement.Defaults.of(request.app.state.settings)


_BULK_PAGE = 500


def _bulk_owner(principal: Reader, selector: TaskSelector) -> str | None:
    """Whose tasks a bulk action may take: an admin's, anyone's (or the one named); a
    member's, the tasks its team owns (``filter.team``, of any member or the one named);
    anyone else's, its own."""
    if principal.role == "admin":
        return selector.owner
    if selector.team is not None:
        if selector.team not in principal.teams:
            reason = f"you are not a member of team {selector.team}"
            raise Forbidden(
                f"filter.team: {reason}", errors=[{"field": "body.filter.team", "reason": reason}]
            )
        return selector.owner
    if selector.owner not in (None, principal.name):
        reason = "only an admin acts on other owners' tasks in bulk (or a member, with team)"
        raise Forbidden(
            f"filter.owner: {reason}", errors=[{"field": "body.filter.owner", "reason": reason}]
        )
    return principal.name


@dataclass
class _Walk:
    """How far a bulk action got: moved, the last id passed, and what it refused."""

    changed: int = 0
    after: int = 0
    refused: int = 0
    refusal: str | None = None


Vet = Callable[[AsyncConnection, Task], Awaitable[str | None]]


async def _bulk_page(
    conn: AsyncConnection,
    op: Op,
    action: BulkAction,
    owner: str | None,
    walk: _Walk,
    limit: int,
    reason: str,
    vet: Vet | None,
) -> bool:
    """Move one page of the selection, leaving out what ``vet`` refuses; False at its end."""
    ids: list[int] | None = None
    if vet is not None:
        page = await tasks_db.selected_page(conn, op, action.filter, owner, walk.after, limit)
        if not page:
            return False
        ids = []
        for task in page:
            why = await vet(conn, task)
            if why is None:
                ids.append(task.id)
            else:
                walk.refused += 1
                walk.refusal = walk.refusal or f"task {task.id}: {why}"
    moved, last = await tasks_db.bulk_move(
        conn, op, action.filter, owner, after=walk.after, limit=limit, reason=reason, ids=ids
    )
    walk.changed += moved
    if ids is None:
        walk.after = last
        return moved > 0
    walk.after = page[-1].id
    return True


async def _bulk(
    op: Op,
    action: BulkAction,
    principal: Reader,
    engine: Engine,
    reason: str,
    record: Audit,
    vet: Vet | None = None,
) -> BulkResult:
    owner = _bulk_owner(principal, action.filter)
    async with engine.connect() as conn:
        matched = await tasks_db.count_selected(conn, op, action.filter, owner, MAX_BULK_COUNT)
    if action.dry_run:
        return BulkResult(matched=matched, changed=0, dry_run=True, more=matched > 0)
    walk = _Walk()
    # Refused tasks are passed over, not moved: the walk stops after as many as a count.
    while walk.changed < action.limit and walk.refused < MAX_BULK_COUNT:
        # Each page its own short transaction: locks are held for a page, never a call.
        async with engine.begin() as conn:
            size = min(_BULK_PAGE, action.limit - walk.changed)
            if not await _bulk_page(conn, op, action, owner, walk, size, reason, vet):
                break
    if walk.refusal is not None and not walk.changed:
        raise Forbidden(walk.refusal)
    async with engine.begin() as conn:
        left = await tasks_db.count_selected(conn, op, action.filter, owner, walk.refused + 1)
        if walk.changed and owner != principal.name and principal.role != "service":
            # Beyond the caller's own tasks (an admin's, a team's): one row per call.
            await record(
                conn,
                f"task.bulk.{op.value}",
                f"team:{action.filter.team}" if action.filter.team else f"owner:{owner or '*'}",
                before={"filter": action.filter.model_dump(mode="json", exclude_defaults=True)},
                after={"changed": walk.changed},
            )
    return BulkResult(
        matched=matched,
        changed=walk.changed,
        dry_run=False,
        more=left > walk.refused,
        refused=walk.refused,
        refusal=walk.refusal,
    )


@router.post("/retry", response_model=BulkResult, responses=PROBLEMS)
async def retry_tasks(
    action: BulkAction,
    principal: Reader,
    engine: Engine,
    notifier: Announcer,
    record: Audit,
    request: Request,
) -> BulkResult:
    """Retry every dead, failed or cancelled task the filter selects (your own; with
    ``filter.team``, that team's, if you are a member; an admin's reach every owner), up
    to ``limit`` in one call, oldest first, as ``/{id}/retry`` does one. ``dry_run``
    counts them first; ``more`` says whether to call again. A task ``/{id}/retry`` would
    refuse is left as it is and counted in ``refused``; 403 when every one was."""
    book = await _book(request, engine)

    async def vet(conn: AsyncConnection, task: Task) -> str | None:
        try:
            await _may_retry(conn, book, principal, task)
        except (Forbidden, InvalidInput) as refused:
            return str(refused)
        return None

    reason = f"retried in bulk by {principal.name}"
    result = await _bulk(Op.RETRY, action, principal, engine, reason, record, vet)
    if result.changed:
        notifier.announce()
    return result


@router.post("/cancel", response_model=BulkResult, responses=PROBLEMS)
async def cancel_tasks(
    action: BulkAction,
    principal: Reader,
    engine: Engine,
    notifier: Announcer,
    meter: Meter,
    record: Audit,
) -> BulkResult:
    """Cancel every unfinished task the filter selects, as ``/{id}/cancel`` does one
    (running attempts are stopped at their worker's next heartbeat)."""
    reason = f"cancelled in bulk by {principal.name}"
    result = await _bulk(Op.CANCEL, action, principal, engine, reason, record)
    if result.changed:
        notifier.announce()
        meter.ended(TaskState.CANCELLED, result.changed)
    return result


@router.get("/{task_id}", response_model=Task, responses=PROBLEMS)
async def get_task(task: OwnedTask, engine: Engine, request: Request) -> Response:
    """The task; one that is not running says why in ``pending_reason``."""
    async with engine.connect() as conn:
        [task] = await placement.with_pending_reasons(conn, [task], _defaults(request))
    return _json(task)


def decode_cursor(cursor: str) -> int:
    try:
        value = int(base64.urlsafe_b64decode(cursor.encode() + b"==").decode())
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise InvalidInput("cursor: not a cursor this API gave out") from None
    if not 1 <= value <= 2**63 - 1:
        raise InvalidInput("cursor: not a cursor this API gave out")
    return value


def encode_cursor(task_id: int) -> str:
    return base64.urlsafe_b64encode(str(task_id).encode()).decode().rstrip("=")


def _parse_labels(labels: list[str]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in labels:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidInput(f"label: {item!r} is not KEY=VALUE")
        pairs.append((key, value))
    return tuple(pairs)


@router.get("", response_model=TaskPage, responses=PROBLEMS)
async def list_tasks(
    principal: Reader,
    engine: Engine,
    request: Request,
    state: TaskState | None = None,
    queue: QueueName | None = None,
    owner: Annotated[str | None, Query(max_length=100, pattern=r"^[^\x00]*$")] = None,
    team: TeamName | None = None,
    label: Annotated[
        list[Annotated[str, Query(max_length=400, pattern=r"^[^\x00]*$")]],
        Query(max_length=16, description="KEY=VALUE; repeat to require several"),
    ] = [],  # noqa: B006 - FastAPI copies query defaults
    idempotency_key: Annotated[
        list[Annotated[str, Query(max_length=200, pattern=r"^[^\x00]*$")]],
        Query(max_length=100, description="only tasks submitted with one of these keys"),
    ] = [],  # noqa: B006 - FastAPI copies query defaults
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    cursor: Annotated[str | None, Query(max_length=40)] = None,
) -> Response:
    """Tasks newest first. Users see their own and their teams'; admins and services see
    every owner's. ``idempotency_key`` (repeatable) finds what a client may have
    submitted, e.g. a workflow's releases whose answers it never recorded."""
    labels = _parse_labels(label)
    for key, _ in labels:
        _check_label_key(key)
    where = tasks_db.TaskFilter(
        state=state,
        queue=queue,
        owner=owner,
        labels=labels,
        team=team,
        visible_to=principal.visibility,
        keys=tuple(idempotency_key),
    )
    before = decode_cursor(cursor) if cursor else None
    async with engine.connect() as conn:
        items = await tasks_db.list_tasks(conn, where, before, limit)
        items = await placement.with_pending_reasons(conn, items, _defaults(request))
    next_cursor = encode_cursor(items[-1].id) if len(items) == limit else None
    return _json(TaskPage(items=items, next_cursor=next_cursor))


def _check_label_key(key: str) -> None:
    from pydantic import TypeAdapter, ValidationError

    try:
        TypeAdapter(LabelKey).validate_python(key)
    except ValidationError:
        raise InvalidInput(f"label: {key!r} is not a valid label key") from None


@router.post("/{task_id}/cancel", response_model=Task, responses=PROBLEMS)
async def cancel_task(
    task_id: TaskIdPath,
    principal: Reader,
    engine: Engine,
    notifier: Announcer,
    meter: Meter,
    record: Audit,
) -> Response:
    """Cancel a task that has not finished. A final task answers 409."""
    async with engine.begin() as conn:
        before = await tasks_db.get_task(conn, task_id, principal.visibility)
        await tasks_db.cancel(conn, task_id, None, f"cancelled by {principal.name}")
        task = await tasks_db.get_task(conn, task_id, None)
        await _audit_others(record, conn, principal, "task.cancel", before, task)
    notifier.announce()
    meter.ended(TaskState.CANCELLED)
    return _json(task)


@router.post("/{task_id}/retry", response_model=Task, responses=PROBLEMS)
async def retry_task(
    task_id: TaskIdPath,
    principal: Reader,
    engine: Engine,
    notifier: Announcer,
    record: Audit,
    request: Request,
) -> Response:
    """Put a dead, failed or cancelled task back in line, with a fresh budget of attempts.
    Refused (403 naming the field, 422 for a secret gone) as submitting it would be now:
    its owner must still belong to its team and to the teams of the secrets it names,
    and the queue's policy must still admit it."""
    book = await _book(request, engine)
    async with engine.begin() as conn:
        before = await tasks_db.get_task(conn, task_id, principal.visibility)
        await _may_retry(conn, book, principal, before)
        await tasks_db.retry(conn, task_id, None)
        task = await tasks_db.get_task(conn, task_id, None)
        await _audit_others(record, conn, principal, "task.retry", before, task)
    notifier.announce()
    return _json(task)


async def _may_retry(
    conn: AsyncConnection, book: sharing.Book, principal: Principal, task: Task
) -> None:
    """A retry puts the task to work again as its owner, so it is checked as submitting
    it would be now: the owner's teams and secrets (``_check``) and the queue's policy,
    for the owner and, when a user retries a teammate's task, for that user too."""
    book.check_policy(_policy_role(principal, task.owner), task.owner, task, "task")
    if principal.role == "user" and principal.name != task.owner:
        book.check_policy("user", principal.name, task, "task")
    if secrets.needs_check(task):
        await _check(conn, principal, task.owner, task)


async def _audit_others(
    record: Audit,
    conn: AsyncConnection,
    principal: Principal,
    action: str,
    before: Task,
    after: Task,
) -> None:
    """Acting on another owner's work (as an admin or a teammate) is audited; services
    act for the owner (cron, DAG) and are not."""
    if before.owner != principal.name and principal.role != "service":
        await record(
            conn,
            action,
            f"task:{before.id}",
            before={"owner": before.owner, "team": before.team, "state": before.state},
            after={"state": after.state},
        )


@router.get("/{task_id}/attempts", response_model=AttemptList, responses=PROBLEMS)
async def list_attempts(task: OwnedTask, engine: Engine) -> AttemptList:
    async with engine.connect() as conn:
        return AttemptList(items=await tasks_db.list_attempts(conn, task.id))


_LOG_HEADERS = {
    "X-Cairn-Attempt": "the attempt whose log this is",
    "X-Cairn-Log-Offset": "where this answer ends in the stored log: the next `offset`",
    "X-Cairn-Log-Truncated": "whether some of the log was dropped (over the cap, skipped)",
    "X-Cairn-Log-Complete": "whether the attempt has ended, so the log will not grow",
}


@router.get(
    "/{task_id}/logs",
    response_class=PlainTextResponse,
    responses={
        200: {
            "content": {"text/plain": {}, "text/event-stream": {}},
            "headers": {
                k: {"description": v, "schema": {"type": "string"}} for k, v in _LOG_HEADERS.items()
            },
        },
        **PROBLEMS,
    },
)
async def read_log(
    task: OwnedTask,
    engine: Engine,
    notifier: Announcer,
    request: Request,
    attempt_id: Annotated[int | None, Query(ge=1, le=2**63 - 1)] = None,
    offset: Annotated[int, Query(ge=0, le=2**62, description="a stored position")] = 0,
    follow: Annotated[bool, Query(description="stream it (SSE) until the attempt ends")] = False,
    last_event_id: Annotated[str | None, Header(max_length=60)] = None,
) -> Response:
    """The log (stdout and stderr) of the task's latest attempt, or of ``attempt_id``,
    from ``offset`` on: what is stored so far, also while the attempt runs. With
    ``follow``, a ``text/event-stream``: ``log`` events (``LogPiece``) as the log grows,
    then one ``end`` (``LogEnd``) once the attempt has ended and all of it was sent; an
    ``id`` on each event resumes the stream (``Last-Event-ID``) where it stopped."""
    settings = request.app.state.settings
    objects = request.app.state.log_objects
    if follow:
        if last_event_id is not None and attempt_id is None:
            attempt_id, offset = _resume(last_event_id)
        if attempt_id is not None:  # refused before the stream starts, as a 404
            await tasklogs.attempt_of(engine, task.id, attempt_id)
        stream = tasklogs.Follow(
            engine, notifier, objects, settings.log_max_bytes, request.is_disconnected
        )
        return StreamingResponse(
            tasklogs.follow(stream, task.id, attempt_id, offset),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )
    attempt = await tasklogs.attempt_of(engine, task.id, attempt_id)
    if attempt is None:
        raise NotFound(f"task {task.id} has no attempt yet, so no log")
    got = await tasklogs.read(
        engine,
        objects,
        task.id,
        attempt,
        offset,
        2 * settings.log_max_bytes,
        settings.log_max_bytes,
    )
    headers = {
        "X-Cairn-Attempt": str(attempt),
        "X-Cairn-Log-Offset": str(got.next_offset),
        "X-Cairn-Log-Truncated": str(got.view.truncated).lower(),
        "X-Cairn-Log-Complete": str(got.view.ended).lower(),
    }
    return PlainTextResponse("".join(p.text for p in got.pieces), headers=headers)


def _resume(last_event_id: str) -> tuple[int, int]:
    attempt, sep, offset = last_event_id.partition(":")
    if not (sep and attempt.isdigit() and offset.isdigit()) or not 1 <= int(attempt) < 2**63:
        raise InvalidInput("Last-Event-ID: not an id this stream gave out")
    return int(attempt), min(int(offset), 2**62)


@router.get("/{task_id}/events", response_model=EventList, responses=PROBLEMS)
async def list_task_events(task: OwnedTask, engine: Engine) -> EventList:
    """Every state change of the task, oldest first."""
    async with engine.connect() as conn:
        return EventList(items=await tasks_db.task_events_of(conn, task.id))
