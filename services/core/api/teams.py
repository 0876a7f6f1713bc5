"""Teams: admins create them, manage their members and set their share and quotas; a
member sees its team and its usage."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response, status

from libs.common.models import (
    OwnerUsage,
    PrincipalName,
    ShareSettings,
    Team,
    TeamCreate,
    TeamList,
    TeamName,
)
from libs.common.problems import PROBLEMS
from services.core.api.deps import AdminOnly, Audit, Engine, Reader
from services.core.db import sharing, teams
from services.core.ops import teams as teams_ops

router = APIRouter(prefix="/v1/teams", tags=["teams"])

TeamPath = Annotated[TeamName, Path(description="The team's name.")]
MemberPath = Annotated[PrincipalName, Path(description="A principal's name.")]


@router.post("", status_code=status.HTTP_201_CREATED, response_model=Team, responses=PROBLEMS)
async def create_team(
    body: TeamCreate, principal: AdminOnly, engine: Engine, record: Audit
) -> Team:
    """Create a team. The name of a team deleted before is a 409 unless ``reuse_name``:
    that team's tasks, schedules and workflows still name it."""
    return await teams_ops.create(engine, record, body.name, principal.name, body.reuse_name)


@router.get("", response_model=TeamList, responses=PROBLEMS)
async def list_teams(principal: Reader, engine: Engine) -> TeamList:
    """Every team for admins and services; the caller's own teams for everyone else."""
    async with engine.connect() as conn:
        return TeamList(items=await teams.list_(conn, principal.owner_filter))


@router.get("/{name}", response_model=Team, responses=PROBLEMS)
async def get_team(name: TeamPath, principal: Reader, engine: Engine) -> Team:
    """The team with its members; a team the caller is not in is a 404."""
    async with engine.connect() as conn:
        return await teams.get(conn, name, principal.owner_filter)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, responses=PROBLEMS)
async def delete_team(
    name: TeamPath, principal: AdminOnly, engine: Engine, record: Audit
) -> Response:
    """Delete the team, its memberships and its secrets; work it owned stays with its
    submitters, naming the team, so its name is not taken again unless asked for."""
    await teams_ops.delete(engine, record, name, principal.name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.put("/{name}/members/{member}", response_model=Team, responses=PROBLEMS)
async def add_member(
    name: TeamPath, member: MemberPath, principal: AdminOnly, engine: Engine, record: Audit
) -> Team:
    """Add a member (idempotent). It takes effect within the token cache time."""
    return await teams_ops.add_member(engine, record, name, member, principal.name)


@router.delete("/{name}/members/{member}", response_model=Team, responses=PROBLEMS)
async def remove_member(
    name: TeamPath, member: MemberPath, principal: AdminOnly, engine: Engine, record: Audit
) -> Team:
    return await teams_ops.remove_member(engine, record, name, member)


@router.get("/{name}/usage", response_model=OwnerUsage, responses=PROBLEMS)
async def team_usage(
    request: Request, name: TeamPath, principal: Reader, engine: Engine
) -> OwnerUsage:
    """The team's weight and share of the pool (its tasks are one fair-share flow), what
    the tasks it owns run and have waiting, its quotas and which it is at, and its
    decayed usage. Members and admins; anyone else gets a 404."""
    half_life = float(request.app.state.settings.fair_share_half_life_s)
    async with engine.connect() as conn:
        await teams.get(conn, name, principal.owner_filter)
        [usage] = await sharing.team_usage_of(conn, [name], half_life)
    return usage


@router.patch("/{name}/share", response_model=OwnerUsage, responses=PROBLEMS)
async def set_team_share(
    name: TeamPath,
    change: ShareSettings,
    principal: AdminOnly,
    engine: Engine,
    request: Request,
    record: Audit,
) -> OwnerUsage:
    """Set the team's fair-share weight and quotas, which bound the sum over the tasks it
    owns (null: no limit; weight null: 1). A field left out keeps its value."""
    book: sharing.Book = request.app.state.sharing
    return await teams_ops.set_share(engine, record, book, name, change)
