"""Secrets: a name and a value, of the caller or of a team it belongs to. No answer ever
holds a value: tasks refer to secrets by name, and only the worker leasing an attempt
receives them."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response, status

from libs.common.errors import NotFound
from libs.common.models import (
    KeyStatus,
    RekeyRequest,
    RekeyResult,
    SecretCreate,
    SecretInfo,
    SecretList,
    SecretName,
    SecretUpdate,
    TeamName,
)
from libs.common.problems import PROBLEMS
from services.core.api.deps import AdminOnly, Audit, Box, Engine, Reader
from services.core.db import secrets
from services.core.db.secrets import Scope
from services.core.domain.principals import Principal
from services.core.ops import rekey
from services.core.ops import secrets as secrets_ops

router = APIRouter(prefix="/v1/secrets", tags=["secrets"])

NamePath = Annotated[SecretName, Path(description="The secret's name.")]
TeamQuery = Annotated[TeamName | None, Query(description="A team's secret, not the caller's.")]


def _scope(principal: Principal, team: str | None) -> Scope:
    """Where the caller's request lands; a team it is not in is a 404 like a missing one."""
    if team is None:
        return Scope(principal.name, None)
    if principal.role != "admin" and team not in principal.teams:
        raise NotFound(f"team {team!r} not found")
    return Scope(None, team)


@router.post("", status_code=status.HTTP_201_CREATED, response_model=SecretInfo, responses=PROBLEMS)
async def create_secret(
    body: SecretCreate, principal: Reader, engine: Engine, box: Box, record: Audit
) -> SecretInfo:
    """Store a secret, encrypted; 409 if the name is taken in that scope (PUT replaces)."""
    scope = _scope(principal, body.team)
    return await secrets_ops.create(
        engine, box, record, scope, body.name, body.value, principal.name
    )


@router.get("", response_model=SecretList, responses=PROBLEMS)
async def list_secrets(principal: Reader, engine: Engine) -> SecretList:
    """Names and metadata of the caller's and its teams' secrets (admins: all)."""
    async with engine.connect() as conn:
        if principal.role == "admin":
            return SecretList(items=await secrets.list_(conn, None, None))
        return SecretList(items=await secrets.list_(conn, principal.name, principal.teams))


@router.put("/{name}", response_model=SecretInfo, responses=PROBLEMS)
async def replace_secret(
    name: NamePath,
    body: SecretUpdate,
    principal: Reader,
    engine: Engine,
    box: Box,
    record: Audit,
    team: TeamQuery = None,
) -> SecretInfo:
    """Give a secret a new value; tasks not yet leased get the new one."""
    scope = _scope(principal, team)
    return await secrets_ops.replace(engine, box, record, scope, name, body.value, principal.name)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, responses=PROBLEMS)
async def delete_secret(
    name: NamePath, principal: Reader, engine: Engine, record: Audit, team: TeamQuery = None
) -> Response:
    """Delete a secret; an attempt of a task that still refers to it fails, saying so."""
    scope = _scope(principal, team)
    await secrets_ops.remove(engine, record, scope, name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/keys", response_model=KeyStatus, responses=PROBLEMS)
async def key_status(_: AdminOnly, engine: Engine, box: Box) -> KeyStatus:
    """The secrets keys core holds, and how many sealed values each key seals (admins);
    ``remaining`` counts those under a key other than the current one."""
    return await rekey.status(engine, box)


@router.post("/rekey", response_model=RekeyResult, responses=PROBLEMS)
async def rekey_secrets(
    _: AdminOnly, engine: Engine, box: Box, record: Audit, body: RekeyRequest | None = None
) -> RekeyResult:
    """Seal anew under the current key up to ``limit`` values that an older configured
    key seals (admins), in batches, while core serves; call again with ``after`` set to
    the answer's ``next`` until it is null; once ``remaining`` is 0 the older keys may be
    removed. Each batch is audited (``secret.rekey``)."""
    asked = body or RekeyRequest()
    return await rekey.rekey(engine, box, record, asked.limit, asked.after)
