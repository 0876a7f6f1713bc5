"""Tokens over the API: create, list, revoke. A user manages its own tokens, which never
carry more than it has (its own role, an expiry no later than its credential's); an admin
manages anyone's."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request, Response, status

from libs.common.errors import Forbidden, InvalidInput
from libs.common.models import MAX_PAGE, PrincipalName, TokenCreate, TokenCreated, TokenList
from libs.common.problems import PROBLEMS
from services.core.api.deps import Audit, Engine, TokenCache, require
from services.core.db import tokens
from services.core.domain.principals import Principal
from services.core.ops import tokens as tokens_ops

router = APIRouter(prefix="/v1/tokens", tags=["tokens"])

# Workers hold a token but may not mint more.
Holder = Annotated[Principal, Depends(require("user", "admin", "service"))]
TokenId = Annotated[int, Path(ge=1, le=2**63 - 1)]


def _check_rights(principal: Principal, body: TokenCreate) -> None:
    if body.expires_at is not None and body.expires_at <= datetime.now(UTC):
        raise InvalidInput("expires_at: must be in the future")
    if principal.role == "admin":
        return
    if body.principal not in (None, principal.name):
        raise Forbidden("principal: only admins create tokens for others")
    if body.role not in (None, principal.role):
        raise Forbidden(f"role: a {principal.role} may not create a {body.role} token")
    if principal.expires_at is not None and (
        body.expires_at is None or body.expires_at > principal.expires_at
    ):
        raise Forbidden(
            "expires_at: a token made with a credential that expires must expire no later "
            f"than it ({principal.expires_at.isoformat()})"
        )


@router.post(
    "", status_code=status.HTTP_201_CREATED, response_model=TokenCreated, responses=PROBLEMS
)
async def create_token(
    body: TokenCreate, principal: Holder, engine: Engine, record: Audit, request: Request
) -> TokenCreated:
    """A new token; its value is in this answer only."""
    _check_rights(principal, body)
    who = body.principal or principal.name
    role = body.role if principal.role == "admin" else principal.role
    token, info = await tokens_ops.create(
        engine,
        record,
        principal=who,
        role=role,
        name=body.name,
        created_by=principal.name,
        expires_at=body.expires_at,
        most=request.app.state.settings.tokens_per_principal,
        kid=principal.key_id,
    )
    return TokenCreated(token=token, info=info)


@router.get("", response_model=TokenList, responses=PROBLEMS)
async def list_tokens(
    principal: Holder,
    engine: Engine,
    owner: Annotated[PrincipalName | None, Query(alias="principal")] = None,
    include_revoked: bool = False,
    before: Annotated[int | None, Query(ge=1, le=2**63 - 1)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
) -> TokenList:
    """Tokens newest first (never their values): the caller's own; an admin's, anyone's."""
    if principal.role != "admin":
        if owner not in (None, principal.name):
            return TokenList(items=[])
        owner = principal.name
    async with engine.connect() as conn:
        return TokenList(items=await tokens.list_(conn, owner, include_revoked, before, limit))


@router.delete("/{token_id}", status_code=status.HTTP_204_NO_CONTENT, responses=PROBLEMS)
async def revoke_token(
    token_id: TokenId, principal: Holder, engine: Engine, record: Audit, request: Request
) -> Response:
    """Revoke a token: at once through this replica, within the token cache time
    (``CAIRN_TOKEN_CACHE_S``) through every other. Someone else's token is a 404."""
    mine = None if principal.role == "admin" else principal.name
    await tokens_ops.revoke(engine, record, token_id, mine)
    cache: TokenCache = request.app.state.tokens
    cache.evict(token_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
