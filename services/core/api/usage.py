"""Right-sizing: per owner and task name, what is requested against what is used."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from libs.common.models import MAX_PAGE, Name, TeamName, UsageReport
from libs.common.problems import PROBLEMS
from services.core.api.deps import Engine, Reader
from services.core.db import placement

router = APIRouter(prefix="/v1/usage", tags=["usage"])


@router.get("", response_model=UsageReport, responses=PROBLEMS)
async def rightsizing(
    principal: Reader,
    engine: Engine,
    owner: Annotated[str | None, Query(max_length=100, pattern=r"^[^\x00]*$")] = None,
    team: TeamName | None = None,
    name: Annotated[Name | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
) -> UsageReport:
    """Each kind of task (owner, name) with ended attempts: its mean request, the p95 of
    its measured peak memory and CPU (cores: CPU seconds over wall time), and a suggested
    request (the p95 with 20% headroom). ``team`` takes the tasks that team owns. Users
    see their own, and with ``team`` their teams' (of every member); admins and services
    every owner's."""
    if principal.owner_filter is not None:
        if team is not None:
            if team not in principal.teams:
                return UsageReport(items=[])
        elif owner not in (None, principal.name):
            return UsageReport(items=[])
        else:
            owner = principal.name
    async with engine.connect() as conn:
        items = await placement.rightsizing(conn, owner, name, limit, team=team)
    return UsageReport(items=items)
