"""Who a token stands for: how the cron and DAG services learn their callers."""

from __future__ import annotations

from fastapi import APIRouter

from libs.common.models import WhoAmI
from libs.common.problems import PROBLEMS
from services.core.api.deps import CurrentPrincipal

router = APIRouter(prefix="/v1", tags=["principals"])


@router.get("/whoami", response_model=WhoAmI, responses=PROBLEMS)
async def whoami(principal: CurrentPrincipal) -> WhoAmI:
    """The name, role and teams of the caller's credential, and when it expires."""
    return WhoAmI(
        name=principal.name,
        role=principal.role,
        teams=sorted(principal.teams),
        expires_at=principal.expires_at,
    )
