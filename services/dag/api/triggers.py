"""Signed HTTP triggers: a workflow's owner creates them (the secret is shown once);
anyone holding the secret starts runs by POSTing a JSON payload signed with it.

A delivery carries ``X-Cairn-Timestamp`` (Unix seconds) and ``X-Cairn-Signature:
sha256=HEX``, the HMAC-SHA256 with the trigger's secret of ``TIMESTAMP.BODY``. A missing,
malformed or stale timestamp is a 401; a signature that does not match (or a trigger that
does not exist: the two are not told apart) a 403. The run's idempotency key is
``trigger:ID:KEY``, KEY the ``Idempotency-Key`` header, else the payload's value at the
trigger's ``key_path``, else the signature itself (so a replay within the tolerance finds
the same run); the runs table's unique index makes the same key the same run.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
import time
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Header, Path, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from libs.common.auth import ActingOwner, Person
from libs.common.dag_models import (
    MAX_EVENT_BYTES,
    MAX_TRIGGERS,
    Run,
    RunCreate,
    Trigger,
    TriggerCreate,
    TriggerCreated,
    TriggerList,
    WorkflowName,
)
from libs.common.errors import Forbidden, InvalidInput, PayloadTooLarge, Unauthorized
from libs.common.problems import PROBLEMS
from services.dag import store, traces
from services.dag.api.workflows import begin_run
from services.dag.deps import Db, GraphCache, Loop

router = APIRouter(tags=["triggers"])

TriggerIdPath = Annotated[int, Path(ge=1, le=2**63 - 1, description="The trigger's id.")]
_SIGNATURE = re.compile(r"^sha256=([0-9a-f]{64})$")
_MISSING = object()


def _trigger(row: Any) -> Trigger:
    return Trigger.model_validate({**row._mapping, "path": f"/v1/triggers/{row.id}"})


@router.post(
    "/v1/workflows/{name}/triggers",
    response_model=TriggerCreated,
    status_code=201,
    responses=PROBLEMS,
)
async def create_trigger(
    name: WorkflowName, body: TriggerCreate, caller: Person, owner: ActingOwner, db: Db
) -> TriggerCreated:
    """A new signed trigger of your workflow, with its secret: shown in this answer only.
    At most 20 per workflow (409)."""
    secret = secrets.token_urlsafe(32)
    async with db.begin() as conn:
        await store.get_workflow(conn, owner, name)
        row = await store.create_trigger(
            conn, owner, name, secret, body.params, body.key_path, MAX_TRIGGERS
        )
    return TriggerCreated.model_validate({**_trigger(row).model_dump(), "secret": secret})


@router.get("/v1/workflows/{name}/triggers", response_model=TriggerList, responses=PROBLEMS)
async def list_triggers(
    name: WorkflowName, caller: Person, owner: ActingOwner, db: Db
) -> TriggerList:
    """Your workflow's triggers (never their secrets)."""
    async with db.connect() as conn:
        await store.get_workflow(conn, owner, name)
        rows = await store.list_triggers(conn, owner, name)
    return TriggerList(items=[_trigger(r) for r in rows])


@router.delete("/v1/workflows/{name}/triggers/{trigger_id}", status_code=204, responses=PROBLEMS)
async def delete_trigger(
    name: WorkflowName, trigger_id: TriggerIdPath, caller: Person, owner: ActingOwner, db: Db
) -> Response:
    """Delete one of your workflow's triggers: its deliveries are refused from now on
    (the runs it started stay)."""
    async with db.begin() as conn:
        await store.delete_trigger(conn, owner, name, trigger_id)
    return Response(status_code=204)


async def _bounded_body(request: Request) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_EVENT_BYTES:
            raise PayloadTooLarge(f"a trigger's body is at most {MAX_EVENT_BYTES} bytes")
    return bytes(body)


def _check_time(timestamp: str | None, tolerance_s: int) -> str:
    if timestamp is None or not re.fullmatch(r"[0-9]{1,12}", timestamp):  # isdigit takes "²"
        raise Unauthorized("X-Cairn-Timestamp: Unix seconds required (the signed request's)")
    if math.fabs(time.time() - int(timestamp)) > tolerance_s:
        raise Unauthorized(f"X-Cairn-Timestamp: more than {tolerance_s} s from now")
    return timestamp


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The signature of a delivery: HMAC-SHA256 of ``TIMESTAMP.BODY``, as hex."""
    signed = timestamp.encode() + b"." + body
    return hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()


def _verified(trigger: Any, timestamp: str, body: bytes, given: str | None) -> tuple[Any, str]:
    """The trigger and the signature's hex digest, if it is its secret's over
    ``TIMESTAMP.BODY`` (an unknown trigger is refused as a wrong signature)."""
    found = _SIGNATURE.match(given or "")
    if found is None:
        raise Unauthorized("X-Cairn-Signature: sha256=HEX required")
    expected = "-" if trigger is None else sign(trigger.secret, timestamp, body)
    if trigger is None or not hmac.compare_digest(expected, found.group(1)):
        raise Forbidden("X-Cairn-Signature: does not match this trigger's secret")
    return trigger, found.group(1)


def _at(payload: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(payload, dict) or part not in payload:
            return _MISSING
        payload = payload[part]
    return payload


def _run_body(trigger: Any, payload: Any, key: str) -> RunCreate:
    """The run a payload asks for: its params (mapped, or the payload's ``params``)."""
    if not isinstance(payload, dict):
        raise InvalidInput("body: a JSON object required")
    if trigger.params is not None:
        params = {
            name: value
            for name, path in trigger.params.items()
            if (value := _at(payload, path)) is not _MISSING
        }
    else:
        params = payload.get("params", {})
    try:
        return RunCreate.model_validate({"params": params, "idempotency_key": key})
    except ValidationError as exc:
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in exc.errors()]
        ) from None


def _key(trigger: Any, payload: Any, header: str | None, signature: str) -> str:
    if header:
        found: Any = header
    elif trigger.key_path is not None:
        found = _at(payload, trigger.key_path)
        if isinstance(found, bool) or not isinstance(found, str | int):
            field = f"body.{trigger.key_path}"
            raise InvalidInput(
                f"{field}: the trigger's idempotency key (a string or an integer) is missing",
                errors=[{"field": field, "reason": "a string or an integer required"}],
            )
    else:
        found = f"sig-{signature[:40]}"
    key = f"trigger:{trigger.id}:{found}"
    if len(key) > 200 or not key.isprintable():
        raise InvalidInput(
            "idempotency key: at most 200 printable characters",
            errors=[{"field": "Idempotency-Key", "reason": "at most 200 printable characters"}],
        )
    return key


@router.post("/v1/triggers/{trigger_id}", response_model=Run, status_code=201, responses=PROBLEMS)
async def fire_trigger(
    trigger_id: TriggerIdPath,
    request: Request,
    response: Response,
    db: Db,
    graphs: GraphCache,
    loop: Loop,
    x_cairn_timestamp: Annotated[str | None, Header(max_length=20)] = None,
    x_cairn_signature: Annotated[str | None, Header(max_length=80)] = None,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> Run:
    """Start a run of the trigger's workflow (201), or answer the run the delivery's
    idempotency key already started (200). Signed with the trigger's secret, not a
    bearer token (see the module's description): 401 unsigned or stale, 403 a wrong
    signature, 413 over 64 KiB, 422 params the workflow does not take."""
    body = await _bounded_body(request)
    timestamp = _check_time(x_cairn_timestamp, request.app.state.settings.trigger_tolerance_s)
    async with db.connect() as conn:
        found = await store.get_trigger(conn, trigger_id)
    trigger, signature = _verified(found, timestamp, body, x_cairn_signature)
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise InvalidInput("body: not JSON") from None
    run_body = _run_body(trigger, payload, _key(trigger, payload, idempotency_key, signature))
    async with db.begin() as conn:
        row, created = await begin_run(
            conn, graphs, trigger.owner, trigger.workflow, run_body, None
        )
    if created:
        traces.started(row)
        loop.wake()
    else:
        response.status_code = 200
    return store.run_model(row)
