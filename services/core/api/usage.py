"""Right-sizing (per owner and task name, what is requested against what is used) and
usage accounting (what a month's attempts used, per owner, team or queue)."""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Query

from libs.common.models import (
    MAX_PAGE,
    Month,
    Name,
    TeamName,
    UsageAccount,
    UsageAccounts,
    UsageReport,
)
from libs.common.problems import PROBLEMS
from services.core.api.deps import Engine, Reader
from services.core.db import accounting, placement

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
    request (the p95 with 20% headroom), and the devices it asked for per attempt (held
    whole, not measured). ``team`` takes the tasks that team owns. Users
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


@router.get("/accounts", response_model=UsageAccounts, responses=PROBLEMS)
async def accounts(
    principal: Reader,
    engine: Engine,
    month: Annotated[Month | None, Query(description="As 2026-12; the current month")] = None,
    by: Literal["owner", "team", "queue"] = "owner",
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
) -> UsageAccounts:
    """What the attempts that ended in ``month`` (UTC) used, summed ``by`` owner, team
    (the tasks each team owns) or queue, the largest reservations first: attempts, wall
    seconds, CPU seconds used, core-seconds and MB-seconds reserved, the largest peak
    memory, device-seconds held by device name. Rolled up from the event feed by the leader every ``CAIRN_USAGE_INTERVAL_S``
    (60 s), and kept after the tasks' retention. Users see their own use (by owner or by
    queue) and their teams' (by team); admins and services everyone's."""
    month = month or datetime.now(UTC).strftime("%Y-%m")
    first = date(int(month[:4]), int(month[5:]), 1)
    owner = teams = None
    if principal.owner_filter is not None:
        if by == "team":
            teams = sorted(principal.teams)
        else:
            owner = principal.name
    async with engine.connect() as conn:
        rows = await accounting.accounts(conn, first, by, limit, owner=owner, teams=teams)
        keys = [r.key for r in rows]
        devices = await accounting.device_seconds(conn, first, by, keys, owner, teams)
    items = [
        UsageAccount(
            key=r.key,
            attempts=int(r.attempts),
            wall_s=round(r.wall_s, 3),
            cpu_s=round(r.cpu_s, 3),
            cpu_reserved_s=round(r.cpu_reserved_s, 3),
            memory_mb_s=round(r.memory_mb_s, 3),
            peak_memory_mb=round(r.peak_memory_mb, 3),
            device_s={k: round(v, 3) for k, v in sorted(devices.get(r.key, {}).items())},
        )
        for r in rows
    ]
    return UsageAccounts(month=month, by=by, items=items)
