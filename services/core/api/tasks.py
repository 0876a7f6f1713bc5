"""Tasks: submit, read, list, cancel, retry, and each task's attempts and events."""

from __future__ import annotations

import base64
import binascii
import re
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

import orjson
from fastapi import APIRouter, Header, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import BaseModel, TypeAdapter, ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common import tracing
from libs.common.errors import Forbidden, InvalidInput, NotFound, Unauthorized
from libs.common.models import (
    MAX_BATCH,
    MAX_PAGE,
    AttemptList,
    BatchResult,
    BulkAction,
    BulkResult,
    EventList,
    IdempotencyKey,
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
from services.core.api import deps
from services.core.api.deps import (
    JSON,
    Announcer,
    Audit,
    Engine,
    Meter,
    OwnedTask,
    Reader,
    Submission,
    Submitting,
    TaskIdPath,
)
from services.core.db import placement, progress, sharing
from services.core.db import tasks as tasks_db
from services.core.domain import limits
from services.core.ops import tasklogs
from services.core.ops import tasks as tasks_ops
from services.core.settings import CoreSettings

router = APIRouter(prefix="/v1/tasks", tags=["tasks"])


def _json(model: Task | BatchResult | TaskPage, status_code: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status_code, media_type=JSON)


async def submit_task(
    spec: TaskCreate,
    call: Submitting,
    request: Request,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            description="The body's ``idempotency_key``, given as a header instead (both"
            " given, they must be the same).",
        ),
    ] = None,
) -> Response:
    """Submit one task. 201 with the new task; 200 with the existing one when the same
    owner already submitted this ``idempotency_key`` (in the body, or the
    ``Idempotency-Key`` header). ``team`` shares it with a team the owner belongs to;
    ``env`` values may name secrets. 403 when the queue's policy does not allow what it
    asks for; 429 (with ``Retry-After``) when the owner is at a quota."""
    return await _submit_one(spec, call, request, tracing.now_ns())


_KEY = TypeAdapter(IdempotencyKey)


def _keyed(spec: TaskCreate, request: Request) -> TaskCreate:
    """``spec`` with the ``Idempotency-Key`` header's key, if one is given: a client that
    sent the header (the common convention) and not the body's field got a task for
    every retry of its request."""
    key = request.headers.get("idempotency-key")
    if key is None or key == spec.idempotency_key:
        return spec
    where = ("header", "Idempotency-Key")
    try:
        key = _KEY.validate_python(key)
    except ValidationError as exc:
        raise RequestValidationError([{**exc.errors()[0], "loc": where}]) from None
    if spec.idempotency_key is not None:
        why = "differs from the body's idempotency_key: give one, or the same in both"
        raise RequestValidationError([{"loc": where, "msg": why, "type": "value_error"}])
    return spec.model_copy(update={"idempotency_key": key})


async def _submit_one(spec: TaskCreate, call: Submission, request: Request, start: int) -> Response:
    spec = _keyed(spec, request)
    _check_sources(request, [spec], batch=False)
    by = await _submitter(request, call)
    by.book.check_policy(
        tasks_ops.policy_role(call.principal, call.owner), call.owner, spec, "body"
    )
    [(row, created)] = await tasks_ops.submit(
        by, call.owner, [spec], lambda _: "", request.headers, start
    )
    if created:
        task = tasks_db.new_task(spec, row)
    else:
        async with call.engine.connect() as conn:
            task = await tasks_db.get_task(conn, row.id, None)
    return Response(
        task.model_dump_json(),
        status_code=201 if created else 200,
        headers={"Location": f"/v1/tasks/{row.id}"},
        media_type=JSON,
    )


class SubmitRoute(deps.PlainRoute):
    """``POST /v1/tasks`` as ``submit_task`` declares it, with the common request served
    without FastAPI's dependency solving and body handling (about 0.13 ms of the 1.1-1.2
    ms a lone submission cost core, docs/benchmarks.md): the caller authenticated first
    (``deps.plain_submission``), then the JSON body parsed by pydantic straight from the
    bytes; a body that does not validate or a header ``OnBehalfOf`` refuses goes to
    FastAPI's own handler."""

    async def plain(self, request: Request) -> Response | None:
        start = tracing.now_ns()
        call = await deps.plain_submission(request)
        if call is None:
            return None
        try:
            spec = TaskCreate.model_validate_json(await request.body())
        except ValidationError:
            return None
        return await _submit_one(spec, call, request, start)


router.add_api_route(
    "",
    submit_task,
    methods=["POST"],
    status_code=status.HTTP_201_CREATED,
    response_model=Task,
    responses={
        200: {"model": Task, "description": "The idempotency key matched a task"},
        **PROBLEMS,
    },
    route_class_override=SubmitRoute,
)


async def _submitter(request: Request, call: Submission) -> tasks_ops.Submitter:
    return tasks_ops.Submitter(
        principal=call.principal,
        engine=call.engine,
        notifier=call.notifier,
        meter=call.meter,
        book=await _book(request, call.engine),
        quantum=float(request.app.state.settings.fair_quantum_s),
        defaults=_task_defaults(request.app.state.settings),
        fair=request.app.state.settings.fair_share_rule,
        group=request.app.state.group_commit,
    )


def _task_defaults(settings: CoreSettings) -> limits.Defaults:
    return limits.Defaults(settings.default_timeout_s, settings.poison_window_s)


async def _book(request: Request, engine: AsyncEngine) -> sharing.Book:
    book: sharing.Book = request.app.state.sharing
    return await book.fresh(engine)


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
Gone = Callable[[], Awaitable[bool]]


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
    principal = call.principal
    batch = _parse(TaskBatchCreate, await request.body())
    _check_sources(request, batch.tasks, batch=True)
    owners: str | list[str] = call.owner
    if batch.owners is not None:
        if principal.role != "service" and set(batch.owners) != {principal.name}:
            raise Forbidden("only the service role may name other owners in owners")
        owners = batch.owners
    each = [owners] * len(batch.tasks) if isinstance(owners, str) else owners
    by = await _submitter(request, call)
    if by.book.policies:
        for i, (who, spec) in enumerate(zip(each, batch.tasks, strict=True)):
            role = tasks_ops.policy_role(principal, who)
            by.book.check_policy(role, who, spec, f"body.tasks.{i}")
    rows = await tasks_ops.submit(
        by, owners, batch.tasks, lambda i: f"tasks.{i}.", request.headers, start
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
    owner = _bulk_owner(principal, action.filter)
    return await tasks_ops.retry_many(engine, notifier, book, principal, owner, action, record)


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
    owner = _bulk_owner(principal, action.filter)
    return await tasks_ops.cancel_many(engine, notifier, meter, principal, owner, action, record)


@router.get("/{task_id}", response_model=Task, responses=PROBLEMS)
async def get_task(task: OwnedTask, engine: Engine, request: Request) -> Response:
    """The task; one that is not running says why in ``pending_reason``; one that
    reported progress says what in ``progress``."""
    async with engine.connect() as conn:
        [task] = await placement.with_pending_reasons(conn, [task], _defaults(request))
        [task] = await progress.with_progress(conn, [task])
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
        items = await progress.with_progress(conn, items)
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
    return _json(await tasks_ops.cancel(engine, notifier, meter, principal, record, task_id))


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
    return _json(await tasks_ops.retry(engine, notifier, book, principal, record, task_id))


@router.get("/{task_id}/attempts", response_model=AttemptList, responses=PROBLEMS)
async def list_attempts(task: OwnedTask, engine: Engine) -> AttemptList:
    async with engine.connect() as conn:
        return AttemptList(items=await tasks_db.list_attempts(conn, task.id))


_LOG_HEADERS = {
    "X-Cairn-Attempt": "the attempt whose log this is",
    "X-Cairn-Log-Offset": "where this answer ends in the stored log: the next `offset`",
    "X-Cairn-Log-Truncated": "whether some of the log was dropped (over the cap, skipped)",
    "X-Cairn-Log-Complete": "whether the attempt has ended and its log is whole (a late end came, or the wait for it is over), so it will not grow",
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
        gone = _reader_gone(request, engine, task.id)
        stream = tasklogs.Follow(engine, notifier, objects, tasklogs.Limits.of(settings), gone)
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
        tasklogs.Limits.of(settings),
    )
    headers = {
        "X-Cairn-Attempt": str(attempt),
        "X-Cairn-Log-Offset": str(got.next_offset),
        "X-Cairn-Log-Truncated": str(got.view.truncated).lower(),
        "X-Cairn-Log-Complete": str(got.view.complete).lower(),
    }
    return PlainTextResponse("".join(p.text for p in got.pieces), headers=headers)


def _reader_gone(request: Request, engine: AsyncEngine, task_id: int) -> Gone:
    """Whether a log's follower is gone: the client left, or its credential, looked at
    again once a token cache time (``CAIRN_TOKEN_CACHE_S``, at least a second), no
    longer reads the task (revoked, expired, its session ended, its member removed from
    the task's team). A stream is authorised when it begins and may last as long as its
    attempt runs, days for a service's replica; it then ends without its ``end``, and the
    client that follows again gets the 401 or 404."""
    every_s = max(1.0, request.app.state.tokens.ttl_s)
    checked = time.monotonic()

    async def gone() -> bool:
        nonlocal checked
        if await request.is_disconnected():
            return True
        if time.monotonic() - checked < every_s:
            return False
        checked = time.monotonic()
        try:
            principal = await deps.plain_caller(request, deps.READERS)
            async with engine.connect() as conn:
                await tasks_db.get_task(conn, task_id, principal.visibility)
        except (Unauthorized, Forbidden, NotFound):
            return True
        return False

    return gone


def _resume(last_event_id: str) -> tuple[int, int]:
    found = re.fullmatch(r"([0-9]{1,19}):([0-9]{1,40})", last_event_id)  # isdigit takes "²"
    if found is None or not 1 <= int(found[1]) < 2**63:
        raise InvalidInput("Last-Event-ID: not an id this stream gave out")
    return int(found[1]), min(int(found[2]), 2**62)


@router.get("/{task_id}/events", response_model=EventList, responses=PROBLEMS)
async def list_task_events(task: OwnedTask, engine: Engine) -> EventList:
    """Every state change of the task, oldest first."""
    async with engine.connect() as conn:
        return EventList(items=await tasks_db.task_events_of(conn, task.id))
