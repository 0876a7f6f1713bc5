"""The cron service's HTTP API: schedules, their previews and their fire history."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response, status
from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common.auth import Person
from libs.common.cron_models import (
    MAX_SCHEDULE_PAGE,
    Backfill,
    BackfillCreate,
    CronStatus,
    Fire,
    FirePage,
    NextFire,
    NextFires,
    Schedule,
    ScheduleCreate,
    SchedulePage,
    ScheduleUpdate,
)
from libs.common.errors import Conflict, InvalidInput, Unavailable
from libs.common.problems import PROBLEMS
from libs.common.teams import check_member
from services.cron import store
from services.cron.engine import CronEngine
from services.cron.fire import Outgoing, Sender
from services.cron.settings import CronSettings

router = APIRouter(prefix="/v1", tags=["schedules"])

ScheduleId = Annotated[int, Path(ge=1, le=2**63 - 1, description="The schedule's id.")]
MAX_PREVIEW = 1000


def _now(request: Request) -> datetime:
    """The engine's clock: the API and the engine agree on what "now" is."""
    cron: CronEngine = request.app.state.cron
    return cron.clock.now()


def _db(request: Request) -> AsyncEngine:
    engine: AsyncEngine = request.app.state.engine
    return engine


@router.post(
    "/schedules", status_code=status.HTTP_201_CREATED, response_model=Schedule, responses=PROBLEMS
)
async def create_schedule(body: ScheduleCreate, caller: Person, request: Request) -> Schedule:
    """Register a schedule owned by the caller (and with ``team``, by a team the caller
    belongs to: its members see and act on it, its fires' tasks are the team's). Its
    first fire is the first slot after now (or after ``starts_at``)."""
    settings: CronSettings = request.app.state.settings
    team = store.team_of(body)
    check_member(caller, team, "body.team" if body.team else "body.target.task.team")
    async with _db(request).begin() as conn:
        now = _now(request)
        return await store.create(
            conn, caller.name, body, now, settings.cron_max_schedules_per_owner
        )


@router.get("/schedules", response_model=SchedulePage, responses=PROBLEMS)
async def list_schedules(
    caller: Person,
    request: Request,
    after: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_SCHEDULE_PAGE)] = 100,
) -> SchedulePage:
    """The caller's schedules and its teams' (every owner's for admins and services), by id."""
    async with _db(request).connect() as conn:
        items, next_after = await store.list_page(conn, caller.visibility, after, limit)
    return SchedulePage(items=items, next_after=next_after)


@router.get("/schedules/{schedule_id}", response_model=Schedule, responses=PROBLEMS)
async def get_schedule(schedule_id: ScheduleId, caller: Person, request: Request) -> Schedule:
    async with _db(request).connect() as conn:
        return await store.get(conn, schedule_id, caller.visibility)


@router.patch("/schedules/{schedule_id}", response_model=Schedule, responses=PROBLEMS)
async def update_schedule(
    schedule_id: ScheduleId, body: ScheduleUpdate, caller: Person, request: Request
) -> Schedule:
    """Change the fields given. New timing applies from now: the next fire is the first
    slot of the new timing after now. ``team`` (null: none) is its owner's to change, to a
    team the owner belongs to; the target is then bound to the new team and its secrets.
    ``target`` (what its fires run, as its owner) is its owner's or an admin's to change:
    a teammate's change is a 403 naming it. The caller becomes ``changed_by``."""
    async with _db(request).begin() as conn:
        return await store.update(conn, schedule_id, caller, body, _now(request))


@router.delete(
    "/schedules/{schedule_id}", status_code=status.HTTP_204_NO_CONTENT, responses=PROBLEMS
)
async def delete_schedule(schedule_id: ScheduleId, caller: Person, request: Request) -> Response:
    """Delete the schedule and its fire history; tasks it submitted stay in core."""
    async with _db(request).begin() as conn:
        await store.delete(conn, schedule_id, caller.visibility)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/schedules/{schedule_id}/pause", response_model=Schedule, responses=PROBLEMS)
async def pause_schedule(schedule_id: ScheduleId, caller: Person, request: Request) -> Schedule:
    async with _db(request).begin() as conn:
        return await store.set_paused(conn, schedule_id, caller.visibility, True, _now(request))


@router.post("/schedules/{schedule_id}/resume", response_model=Schedule, responses=PROBLEMS)
async def resume_schedule(schedule_id: ScheduleId, caller: Person, request: Request) -> Schedule:
    """Resume from now: slots that passed while paused are not fired."""
    async with _db(request).begin() as conn:
        return await store.set_paused(conn, schedule_id, caller.visibility, False, _now(request))


@router.post(
    "/schedules/{schedule_id}/trigger",
    status_code=status.HTTP_201_CREATED,
    response_model=Fire,
    responses=PROBLEMS,
)
async def trigger_schedule(schedule_id: ScheduleId, caller: Person, request: Request) -> Fire:
    """Fire now, once, outside the schedule (the overlap policy does not apply). Works on
    a paused schedule too. While core cannot take it (unreachable, or the owner at a quota)
    the fire stays ``pending`` (a 503) and the leading engine sends it when core can."""
    sender: Sender = request.app.state.sender
    db = _db(request)
    async with db.begin() as conn:
        schedule = await store.get(conn, schedule_id, caller.visibility)
        now = _now(request)
        claimed = (
            await conn.execute(
                store.CLAIM,
                {
                    "ids": [schedule_id],
                    "times": [now],
                    "outcomes": ["pending"],
                    "details": ["triggered by " + caller.name],
                    "manual": [True],
                },
            )
        ).all()
        if not claimed:
            raise Conflict("a fire of this schedule was recorded at this very instant; try again")
    target = schedule.target.model_dump(mode="json")
    fire = Outgoing(schedule_id, now, True, schedule.owner, target, changed_by=schedule.changed_by)
    [result] = await sender.send([fire])
    async with db.begin() as conn:
        await store.record(conn, [result])
        if result.outcome == "pending":
            await store.notify(conn, schedule_id)  # the leader picks the fire up
        fired = await store.list_fires(conn, schedule_id, None, 1)
    if result.outcome == "pending":
        raise Unavailable(
            f"core did not take the fire now; it is kept and retried: {result.detail}"
        )
    return fired[0]


@router.post(
    "/schedules/{schedule_id}/backfill",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=Backfill,
    responses=PROBLEMS,
)
async def backfill_schedule(
    schedule_id: ScheduleId, body: BackfillCreate, caller: Person, request: Request
) -> Backfill:
    """Fire every slot of the schedule from ``from`` to ``to`` (both included, up to now)
    once: slots fired before are left as they were, so a repeat is a no-op. The leader
    sends them paced (``CAIRN_CRON_BACKFILL_RATE`` a second), one after the other when
    the overlap policy is not ``allow``; their fires and tasks are marked backfill, and
    each task gets its slot in ``CAIRN_CRON_SLOT``. Works on a paused schedule too."""
    settings: CronSettings = request.app.state.settings
    async with _db(request).begin() as conn:
        return await store.backfill(
            conn, schedule_id, caller.visibility, body, _now(request), settings.cron_backfill_max
        )


@router.get("/schedules/{schedule_id}/next", response_model=NextFires, responses=PROBLEMS)
async def next_fires(
    schedule_id: ScheduleId,
    caller: Person,
    request: Request,
    n: Annotated[int, Query(ge=1, le=MAX_PREVIEW)] = 10,
    after: Annotated[
        datetime | None, Query(description="Preview from this instant (default: now).")
    ] = None,
) -> NextFires:
    """The next ``n`` fires after ``after``, in UTC and on the schedule's wall clock: see
    what a schedule does across a DST change before it happens."""
    async with _db(request).connect() as conn:
        schedule = await store.get(conn, schedule_id, caller.visibility)
    start = _now(request) if after is None else _preview_start(after)
    plan = store.check_timing(
        schedule.expression,
        schedule.timezone,
        schedule.starts_at,
        schedule.ends_at,
        zone_given=False,
    )
    items: list[NextFire] = []
    at: datetime | None = start
    while len(items) < n and at is not None:
        at = plan.next_after(at)
        if at is not None:
            local = at.astimezone(plan.zone)
            items.append(NextFire(utc=at, local=local.isoformat()))
    return NextFires(schedule_id=schedule_id, timezone=schedule.timezone, after=start, items=items)


def _preview_start(after: datetime) -> datetime:
    """``after`` in UTC (naive: UTC), or a 422 naming it: before 1970 or after 9000,
    also where the conversion to UTC would pass the calendar's first or last day."""
    try:
        start = (after if after.tzinfo else after.replace(tzinfo=UTC)).astimezone(UTC)
    except OverflowError:
        start = None
    if start is None or not 1970 <= start.year <= 9000:
        raise InvalidInput(
            "query.after: must be between 1970 and 9000",
            errors=[{"field": "query.after", "reason": "must be between 1970 and 9000"}],
        )
    return start


@router.get("/schedules/{schedule_id}/fires", response_model=FirePage, responses=PROBLEMS)
async def fire_history(
    schedule_id: ScheduleId,
    caller: Person,
    request: Request,
    before: datetime | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_SCHEDULE_PAGE)] = 100,
) -> FirePage:
    """Fires, newest first: slot, outcome, task id, lag."""
    async with _db(request).connect() as conn:
        await store.get(conn, schedule_id, caller.visibility)
        return FirePage(items=await store.list_fires(conn, schedule_id, before, limit))


@router.get("/cron/status", response_model=CronStatus, tags=["status"], responses=PROBLEMS)
async def cron_status(caller: Person, request: Request) -> CronStatus:
    """Whether this replica leads, and what its engine holds."""
    engine: CronEngine = request.app.state.cron
    return CronStatus(**engine.status())
