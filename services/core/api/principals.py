"""Who a token stands for: how the cron and DAG services learn their callers, and what
``cairn whoami`` shows (each team with where it comes from); and an admin disabling a
principal (someone who left) and enabling it again."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Request

from libs.common.models import PrincipalInfo, PrincipalName, TeamSource, WhoAmI
from libs.common.problems import PROBLEMS
from services.core.api.deps import AdminOnly, Audit, CurrentPrincipal, Engine, TokenCache
from services.core.db import principals as principals_db
from services.core.db import teams as teams_db
from services.core.ops import principals as principals_ops

router = APIRouter(prefix="/v1", tags=["principals"])

NamePath = Annotated[PrincipalName, Path(description="The principal's name.")]


@router.get("/whoami", response_model=WhoAmI, responses=PROBLEMS)
async def whoami(request: Request, principal: CurrentPrincipal, engine: Engine) -> WhoAmI:
    """The name, role and teams of the caller's credential (each with where it comes
    from: a recorded membership, the provider's claim), and when it expires."""
    async with engine.connect() as conn:
        recorded = await teams_db.recorded_teams(conn, principal.name)
        standing = await teams_db.claims_of(conn, principal.name)
    sources = []
    for team in sorted(principal.teams):
        found: list[Literal["membership", "claim"]] = []
        if team in recorded:
            found.append("membership")
        if team in principal.claimed or team in standing:
            found.append("claim")
        sources.append(TeamSource(team=team, sources=found, standing_until=standing.get(team)))
    return WhoAmI(
        name=principal.name,
        role=principal.role,
        teams=sorted(principal.teams),
        expires_at=principal.expires_at,
        team_sources=sources,
        via="session" if getattr(request.state, "via_session", False) else "token",
    )


@router.get("/principals/{name}", response_model=PrincipalInfo, responses=PROBLEMS)
async def get_principal(name: NamePath, principal: AdminOnly, engine: Engine) -> PrincipalInfo:
    """The principal's role and whether it is disabled (admins); 404 for a name core has
    no row for (one the identity provider vouches for, who never made a token)."""
    async with engine.connect() as conn:
        return await principals_db.get(conn, name)


@router.post("/principals/{name}/disable", response_model=PrincipalInfo, responses=PROBLEMS)
async def disable_principal(
    name: NamePath, principal: AdminOnly, engine: Engine, record: Audit, request: Request
) -> PrincipalInfo:
    """Disable the principal (someone who left; admins, idempotent, audited as
    ``principal.disable``): its tokens, JWTs and dashboard sessions are refused (401) at
    once through this replica and within the token cache time through the others; what a
    service submits on its behalf (cron's fires, a workflow's nodes) is a 403 naming the
    owner; its subscriptions' webhooks are not delivered; its services' replicas are not
    started again. Its tasks already waiting or running are left as they are (an admin
    may cancel them). A name core has no row for is recorded, as a user, and disabled.
    An admin may not disable itself (409)."""
    done = await principals_ops.set_disabled(engine, record, name, True, principal.name)
    cache: TokenCache = request.app.state.tokens
    cache.evict_principal(name)
    owners: principals_db.DisabledOwners = request.app.state.disabled_owners
    owners.forget(name)
    return done


@router.post("/principals/{name}/enable", response_model=PrincipalInfo, responses=PROBLEMS)
async def enable_principal(
    name: NamePath, principal: AdminOnly, engine: Engine, record: Audit, request: Request
) -> PrincipalInfo:
    """Enable a disabled principal again (admins, idempotent, audited as
    ``principal.enable``): its tokens that were not revoked work again, and so does what
    services do on its behalf. 404 for a name core has no row for."""
    done = await principals_ops.set_disabled(engine, record, name, False, principal.name)
    owners: principals_db.DisabledOwners = request.app.state.disabled_owners
    owners.forget(name)
    return done
