"""Who a token stands for: how the cron and DAG services learn their callers, and what
``cairn whoami`` shows (each team with where it comes from)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request

from libs.common.models import TeamSource, WhoAmI
from libs.common.problems import PROBLEMS
from services.core.api.deps import CurrentPrincipal, Engine
from services.core.db import teams as teams_db

router = APIRouter(prefix="/v1", tags=["principals"])


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
