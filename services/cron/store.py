"""Every read and write of the cron schema.

A schedule row carries ``fired_through`` (every slot at or before it is dealt with) and
``next_fire_at`` (the slot the engine waits for). Every change bumps ``version`` and sends
``NOTIFY cron_schedules`` in the same transaction, so the leading engine (on whichever
replica) drops what it held for that schedule and reads it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import psycopg
from pydantic import TypeAdapter, ValidationError
from sqlalchemy import Row, func, or_, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common.auth import Caller, Visibility
from libs.common.cron_models import (
    MAX_SCHEDULE_PAGE,
    Backfill,
    BackfillCreate,
    Fire,
    Schedule,
    ScheduleCreate,
    ScheduleUpdate,
    Target,
    TaskTarget,
)
from libs.common.errors import Conflict, InvalidInput, NotFound
from libs.common.models import first_error
from libs.common.teams import bound_to_team, check_team_change, check_what_runs
from services.cron.domain import timing
from services.cron.domain.fires import Result
from services.cron.domain.timing import InvalidSchedule
from services.cron.tables import fires, schedules

CHANNEL = "cron_schedules"
_TARGET = TypeAdapter[Target](Target)


def _invalid(field: str, exc: Exception) -> InvalidInput:
    return InvalidInput(f"{field}: {exc}", errors=[{"field": field, "reason": str(exc)}])


@dataclass(frozen=True)
class Timing:
    """What decides when a schedule fires, checked."""

    expression: str
    zone: ZoneInfo
    starts_at: datetime | None
    ends_at: datetime | None

    def next_after(self, after: datetime) -> datetime | None:
        return timing.next_fire(self.expression, self.zone, after, self.starts_at, self.ends_at)

    def first_after(self, after: datetime) -> datetime | None:
        """The next fire after ``after`` of a timing being set (created or changed): a
        422 naming the expression when there is none and no ``ends_at`` says why."""
        first = self.next_after(after)
        if first is None and self.ends_at is None:
            raise _invalid("body.expression", ValueError(f"{self.expression!r} never fires"))
        return first


def check_timing(
    expression: str,
    zone_name: str,
    starts_at: datetime | None,
    ends_at: datetime | None,
    *,
    zone_given: bool = True,
) -> Timing:
    """The schedule's timing, or a 422 naming the field at fault. A zone given (not the
    one stored) must also be a place's (``timing.check_new_zone``)."""
    try:
        expression = timing.parse_expression(expression)
    except InvalidSchedule as exc:
        raise _invalid("body.expression", exc) from None
    try:
        if zone_given:
            timing.check_new_zone(zone_name)
        zone = timing.parse_zone(zone_name)
    except InvalidSchedule as exc:
        raise _invalid("body.timezone", exc) from None
    if starts_at and ends_at and ends_at <= starts_at:
        raise _invalid("body.ends_at", ValueError("must be after starts_at"))
    return Timing(expression, zone, starts_at, ends_at)


def check_jitter(plan: Timing, jitter_s: int) -> None:
    """A 422 naming ``jitter_s`` when a fire's offset could reach the next slot: jitter
    must stay under the schedule's shortest interval between fires
    (``timing.shortest_gap_s``), or a jittered task would start at or after the next
    slot's."""
    if jitter_s == 0:
        return
    gap = timing.shortest_gap_s(plan.expression, jitter_s)
    if gap is not None and gap <= jitter_s:
        why = f"must be less than the schedule's shortest interval between fires ({gap} s)"
        raise _invalid("body.jitter_s", ValueError(why))


def timing_of(row: Any) -> Timing:
    return Timing(row.expression, timing.parse_zone(row.timezone), row.starts_at, row.ends_at)


def schedule_from_row(row: Any) -> Schedule:
    return Schedule(
        id=row.id,
        owner=row.owner,
        team=row.team,
        name=row.name,
        expression=row.expression,
        timezone=row.timezone,
        target=row.target,
        misfire_policy=row.misfire_policy,
        catch_up_limit=row.catch_up_limit,
        misfire_grace_s=row.misfire_grace_s,
        overlap_policy=row.overlap_policy,
        jitter_s=row.jitter_s,
        starts_at=row.starts_at,
        ends_at=row.ends_at,
        paused=row.paused,
        version=row.version,
        changed_by=row.changed_by,
        next_fire_at=row.next_fire_at,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


async def listen(conn: psycopg.AsyncConnection[Any]) -> None:
    """Subscribe a leader's own connection (psycopg) to schedule changes."""
    await conn.execute(f"LISTEN {CHANNEL}")


async def notify(conn: AsyncConnection, schedule_id: int) -> None:
    await conn.execute(text("SELECT pg_notify(:c, :id)"), {"c": CHANNEL, "id": str(schedule_id)})


def team_of(body: ScheduleCreate) -> str | None:
    """The team that owns a new schedule: ``team``, or its task target's."""
    if body.team is None and isinstance(body.target, TaskTarget):
        return body.target.task.team
    return body.team


def for_team(target: Target, team: str | None) -> Target:
    """The target as a team's schedule fires it: its task owned by the team, with no
    secret but the team's (422 naming the field otherwise)."""
    if not isinstance(target, TaskTarget):
        return target
    if team is None:
        if target.task.team is not None:
            reason = "the schedule is no team's: give the schedule a team instead"
            raise _invalid("body.target.task.team", ValueError(reason))
        return target
    task = bound_to_team(target.task, team, "body.target.task")
    return target.model_copy(update={"task": task})


async def create(
    conn: AsyncConnection, owner: str, body: ScheduleCreate, now: datetime, max_per_owner: int
) -> Schedule:
    """Store the schedule (its membership in ``team_of(body)`` checked by the caller)."""
    team = team_of(body)
    target = for_team(body.target, team)
    plan = check_timing(body.expression, body.timezone, body.starts_at, body.ends_at)
    first = plan.first_after(now)
    check_jitter(plan, body.jitter_s)
    count = (
        await conn.execute(select(func.count()).where(schedules.c.owner == owner))
    ).scalar_one()
    if count >= max_per_owner:
        raise Conflict(f"{owner} already has {count} schedules, the most one owner may have")
    values = {
        "owner": owner,
        "team": team,
        "changed_by": owner,
        "name": body.name,
        "expression": plan.expression,
        "timezone": body.timezone,
        "target": target.model_dump(mode="json"),
        "misfire_policy": body.misfire_policy,
        "catch_up_limit": body.catch_up_limit,
        "misfire_grace_s": body.misfire_grace_s,
        "overlap_policy": body.overlap_policy,
        "jitter_s": body.jitter_s,
        "starts_at": body.starts_at,
        "ends_at": body.ends_at,
        "paused": body.paused,
        "fired_through": now,
        "next_fire_at": None if body.paused else first,
    }
    try:
        async with conn.begin_nested():
            row = (
                await conn.execute(schedules.insert().values(**values).returning(schedules))
            ).one()
    except IntegrityError:
        raise Conflict(f"{owner} already has a schedule named {body.name!r}") from None
    await notify(conn, row.id)
    return schedule_from_row(row)


def _visible(who: Visibility) -> Any:
    if not who.teams:
        return schedules.c.owner == who.owner
    return or_(schedules.c.owner == who.owner, schedules.c.team.in_(sorted(who.teams)))


async def _row(
    conn: AsyncConnection, schedule_id: int, who: Visibility | None, lock: bool = False
) -> Row[Any]:
    """The schedule, if ``who`` (when given) may see it: its owner, or a member of the
    team that owns it; else ``NotFound``, as for one that does not exist."""
    query = select(schedules).where(schedules.c.id == schedule_id)
    if who is not None:
        query = query.where(_visible(who))
    if lock:
        query = query.with_for_update()
    row = (await conn.execute(query)).one_or_none()
    if row is None:
        raise NotFound(f"no schedule {schedule_id}")
    return row


async def get(conn: AsyncConnection, schedule_id: int, who: Visibility | None) -> Schedule:
    return schedule_from_row(await _row(conn, schedule_id, who))


async def list_page(
    conn: AsyncConnection, who: Visibility | None, after: int, limit: int
) -> tuple[list[Schedule], int | None]:
    limit = min(limit, MAX_SCHEDULE_PAGE)
    query = select(schedules).where(schedules.c.id > after).order_by(schedules.c.id).limit(limit)
    if who is not None:
        query = query.where(_visible(who))
    rows = (await conn.execute(query)).all()
    items = [schedule_from_row(r) for r in rows]
    return items, (items[-1].id if len(items) == limit else None)


async def _save(conn: AsyncConnection, schedule_id: int, values: dict[str, Any]) -> Schedule:
    try:
        async with conn.begin_nested():
            row = (
                await conn.execute(
                    schedules.update()
                    .where(schedules.c.id == schedule_id)
                    .values(**values, version=schedules.c.version + 1, updated_at=func.now())
                    .returning(schedules)
                )
            ).one()
    except IntegrityError:
        raise Conflict(f"a schedule named {values.get('name')!r} exists already") from None
    await notify(conn, schedule_id)
    return schedule_from_row(row)


def _kept_target(stored: Any) -> Target:
    """The stored target a move to a team keeps, as today's rules read it: a 422 naming
    ``body.target`` when they refuse it (stored under older ones), so that a new target
    goes with the move."""
    try:
        return _TARGET.validate_python(stored)
    except ValidationError as exc:
        why = f"the stored target no longer holds ({first_error(exc)}): give a new one"
        raise _invalid("body.target", ValueError(why)) from None


def _untied(target: Target) -> Target:
    """The stored target without the team it was bound to, to be bound to a new one."""
    if not isinstance(target, TaskTarget) or target.task.team is None:
        return target
    return target.model_copy(update={"task": target.task.model_copy(update={"team": None})})


async def update(
    conn: AsyncConnection,
    schedule_id: int,
    caller: Caller,
    patch: ScheduleUpdate,
    now: datetime,
) -> Schedule:
    """Change the fields ``caller`` gave; a new ``team`` is the owner's to give."""
    who = caller.visibility
    row = await _row(conn, schedule_id, who, lock=True)
    given = patch.model_dump(exclude_unset=True)
    if None in (given.get(k, 0) for k in ("name", "expression", "timezone", "target")):
        field = next(
            k for k in ("name", "expression", "timezone", "target") if given.get(k, 0) is None
        )
        raise _invalid(f"body.{field}", ValueError("may not be null"))
    if "target" in given:
        check_what_runs(caller, row.owner, "body.target")
    values: dict[str, Any] = {k: v for k, v in given.items() if k not in ("target", "team")}
    values["changed_by"] = caller.name
    team = given.get("team", row.team)
    if team != row.team:
        check_team_change(caller, row.owner, team, "body.team")
        values["team"] = team
        moved = patch.target or _untied(_kept_target(row.target))
        values["target"] = for_team(moved, team).model_dump(mode="json")
    elif patch.target is not None:
        values["target"] = for_team(patch.target, row.team).model_dump(mode="json")
    plan = check_timing(
        given.get("expression", row.expression),
        given.get("timezone", row.timezone),
        given.get("starts_at", row.starts_at),
        given.get("ends_at", row.ends_at),
        zone_given="timezone" in given,
    )
    values["expression"] = plan.expression
    if {"expression", "timezone", "jitter_s"} & given.keys():
        check_jitter(plan, given.get("jitter_s", row.jitter_s))
    if {"expression", "timezone", "starts_at", "ends_at"} & given.keys():
        # New timing applies from now on: slots of the old timing not yet fired are gone.
        after = max(row.fired_through, now)
        values["fired_through"] = after
        first = plan.first_after(after)
        values["next_fire_at"] = None if row.paused else first
    return await _save(conn, schedule_id, values)


async def delete(conn: AsyncConnection, schedule_id: int, who: Visibility | None) -> None:
    await _row(conn, schedule_id, who, lock=True)
    await conn.execute(schedules.delete().where(schedules.c.id == schedule_id))
    await notify(conn, schedule_id)


async def set_paused(
    conn: AsyncConnection, schedule_id: int, who: Visibility | None, paused: bool, now: datetime
) -> Schedule:
    row = await _row(conn, schedule_id, who, lock=True)
    if paused:
        return await _save(conn, schedule_id, {"paused": True, "next_fire_at": None})
    # Slots that passed while paused are not fired: a resumed schedule starts from now.
    after = max(row.fired_through, now)
    return await _save(
        conn,
        schedule_id,
        {"paused": False, "fired_through": after, "next_fire_at": timing_of(row).next_after(after)},
    )


async def backfill(
    conn: AsyncConnection,
    schedule_id: int,
    who: Visibility | None,
    body: BackfillCreate,
    now: datetime,
    most: int,
) -> Backfill:
    """Queue every slot of the schedule in ``[from, to]`` (up to now) that has no fire
    yet, as pending fires marked ``backfill``: the leader sends them, paced. A slot
    fired before is left as it was, so a repeated backfill is a no-op."""
    row = await _row(conn, schedule_id, who)
    plan = timing_of(row)
    until = min(body.to, now)
    slots: list[datetime] = []
    at = plan.next_after(body.from_ - timedelta(microseconds=1))
    while at is not None and at <= until:
        if len(slots) == most:
            raise _invalid(
                "body.to", ValueError(f"the range holds more than {most} slots; backfill less")
            )
        slots.append(at)
        at = plan.next_after(at)
    queued: Sequence[Any] = []
    if slots:
        queued = (
            await conn.execute(
                BACKFILL,
                {"id": schedule_id, "times": slots, "version": row.version},
            )
        ).all()
        await notify(conn, schedule_id)
    return Backfill(
        schedule_id=schedule_id,
        slots=len(slots),
        queued=len(queued),
        already=len(slots) - len(queued),
        first=slots[0] if slots else None,
        last=slots[-1] if slots else None,
    )


def fire_from_row(row: Any) -> Fire:
    lag = (row.submitted_at - row.fire_time).total_seconds() * 1000 if row.submitted_at else None
    return Fire(
        schedule_id=row.schedule_id,
        fire_time=row.fire_time,
        manual=row.manual,
        outcome=row.outcome,
        task_id=row.task_id,
        run_id=row.run_id,
        recorded_at=row.recorded_at,
        submitted_at=row.submitted_at,
        lag_ms=lag,
        tries=row.tries,
        detail=row.detail,
        backfill=row.backfill,
        withdrawn=row.withdrawn,
    )


async def list_fires(
    conn: AsyncConnection, schedule_id: int, before: datetime | None, limit: int
) -> list[Fire]:
    query = (
        select(fires)
        .where(fires.c.schedule_id == schedule_id)
        .order_by(fires.c.fire_time.desc())
        .limit(min(limit, MAX_SCHEDULE_PAGE))
    )
    if before is not None:
        query = query.where(fires.c.fire_time < before)
    return [fire_from_row(r) for r in (await conn.execute(query)).all()]


# --- the engine's statements --------------------------------------------------------------

HEAP_ROWS = text(
    "SELECT id, version, next_fire_at, fired_through, overlap_policy, jitter_s,"
    " target->>'kind' AS kind FROM cron.schedules WHERE next_fire_at IS NOT NULL"
)

SCHEDULES_BY_ID = text("SELECT * FROM cron.schedules WHERE id = ANY(:ids)")

# Claims slots: a slot another leader (or an earlier life of this one) claimed is skipped.
CLAIM = text(
    """
    INSERT INTO cron.fires (schedule_id, fire_time, outcome, detail, manual)
    SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:times AS timestamptz[]),
                         CAST(:outcomes AS text[]), CAST(:details AS text[]),
                         CAST(:manual AS boolean[]))
    ON CONFLICT DO NOTHING
    RETURNING schedule_id, fire_time
    """
)

# Fires as they were sent (or missed, or skipped). A slot an earlier life left pending is
# completed; one already settled stays as it was.
FIRED = text(
    """
    INSERT INTO cron.fires (schedule_id, fire_time, outcome, task_id, run_id, submitted_at,
                            detail, tries, version)
    SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:times AS timestamptz[]),
                         CAST(:outcomes AS text[]), CAST(:task_ids AS bigint[]),
                         CAST(:run_ids AS bigint[]), CAST(:submitted_ats AS timestamptz[]),
                         CAST(:details AS text[]), CAST(:tries AS integer[]),
                         CAST(:versions AS bigint[]))
    ON CONFLICT (schedule_id, fire_time) DO UPDATE
       SET outcome = EXCLUDED.outcome, task_id = EXCLUDED.task_id, run_id = EXCLUDED.run_id,
           submitted_at = EXCLUDED.submitted_at, detail = EXCLUDED.detail,
           tries = cron.fires.tries + EXCLUDED.tries, version = EXCLUDED.version
     WHERE cron.fires.outcome IN ('pending', 'withdrawn') AND EXCLUDED.outcome <> 'pending'
    """
)
FIRED_COLS = (
    "ids", "times", "outcomes", "task_ids", "run_ids", "submitted_ats", "details", "tries",
    "versions",
)  # fmt: skip

# Fires sent ahead whose slot has not come, and fires withdrawn before their slot: what
# a new leader must know to withdraw (or send again) after a change in the lead window.
AHEAD = text(
    """
    SELECT schedule_id, fire_time, outcome, task_id, version, withdrawn FROM cron.fires
     WHERE NOT manual AND fire_time > :now AND outcome IN ('submitted', 'withdrawn')
    """
)

# A fire sent ahead, withdrawn because its schedule changed before the slot: its task is
# cancelled, and the schedule is wound back so the slot is planned again from the change.
WITHDRAW = text(
    """
    UPDATE cron.fires f
       SET outcome = 'withdrawn', withdrawn = f.withdrawn + 1, submitted_at = NULL,
           detail = 'withdrawn: the schedule changed before the slot; task '
                    || f.task_id || ' cancelled'
      FROM unnest(CAST(:ids AS bigint[]), CAST(:times AS timestamptz[])) AS v(id, fire_time)
     WHERE f.schedule_id = v.id AND f.fire_time = v.fire_time AND f.outcome = 'submitted'
    RETURNING f.schedule_id, f.fire_time, f.withdrawn
    """
)

REWIND = text(
    """
    UPDATE cron.schedules s
       SET fired_through = LEAST(s.fired_through, v.through), next_fire_at = v.next
      FROM unnest(CAST(:ids AS bigint[]), CAST(:versions AS bigint[]),
                  CAST(:throughs AS timestamptz[]), CAST(:nexts AS timestamptz[]))
           AS v(id, version, through, next)
     WHERE s.id = v.id AND s.version = v.version AND NOT s.paused
    """
)
REWIND_PAUSED = text(
    """
    UPDATE cron.schedules s SET fired_through = LEAST(s.fired_through, :through)
     WHERE s.id = ANY(:ids) AND s.paused
    """
)

ADVANCE = text(
    """
    UPDATE cron.schedules s
       SET fired_through = GREATEST(s.fired_through, v.through), next_fire_at = v.next
      FROM unnest(CAST(:ids AS bigint[]), CAST(:versions AS bigint[]),
                  CAST(:throughs AS timestamptz[]), CAST(:nexts AS timestamptz[]))
           AS v(id, version, through, next)
     WHERE s.id = v.id AND s.version = v.version
    """
)

RECORD = text(
    """
    UPDATE cron.fires f
       SET outcome = v.outcome, task_id = v.task_id, run_id = v.run_id,
           submitted_at = CASE WHEN v.outcome = 'submitted'
                               THEN COALESCE(v.submitted_at, clock_timestamp()) END,
           detail = COALESCE(v.detail, f.detail), tries = f.tries + 1
      FROM unnest(CAST(:ids AS bigint[]), CAST(:times AS timestamptz[]),
                  CAST(:outcomes AS text[]), CAST(:task_ids AS bigint[]),
                  CAST(:run_ids AS bigint[]), CAST(:details AS text[]),
                  CAST(:submitted_ats AS timestamptz[]))
           AS v(id, fire_time, outcome, task_id, run_id, detail, submitted_at)
     WHERE f.schedule_id = v.id AND f.fire_time = v.fire_time AND f.outcome = 'pending'
    """
)

# A try that core did not take: counted, with why, and the fire stays pending.
RETRIED = text(
    """
    UPDATE cron.fires f SET tries = f.tries + 1, detail = v.detail
      FROM unnest(CAST(:ids AS bigint[]), CAST(:times AS timestamptz[]),
                  CAST(:details AS text[])) AS v(id, fire_time, detail)
     WHERE f.schedule_id = v.id AND f.fire_time = v.fire_time AND f.outcome = 'pending'
    """
)

BACKFILL = text(
    """
    INSERT INTO cron.fires (schedule_id, fire_time, outcome, detail, backfill, version)
    SELECT :id, t, 'pending', 'queued by a backfill', true, :version
      FROM unnest(CAST(:times AS timestamptz[])) AS t
    ON CONFLICT DO NOTHING
    RETURNING fire_time
    """
)

PENDING = text(
    "SELECT schedule_id, fire_time, manual, tries, backfill, withdrawn FROM cron.fires"
    " WHERE outcome = 'pending' ORDER BY fire_time"
)

# What each schedule's fire before ``slot`` made, for the overlap policies: never the
# slot's own task (a slot fired again after a crash finds its own task, not a previous).
LAST_TARGETS = text(
    """
    SELECT DISTINCT ON (f.schedule_id) f.schedule_id, f.task_id, f.run_id
      FROM cron.fires f
      JOIN unnest(CAST(:ids AS bigint[]), CAST(:slots AS timestamptz[])) AS v(id, slot)
        ON f.schedule_id = v.id AND f.fire_time < v.slot
     WHERE f.outcome = 'submitted' AND (f.task_id IS NOT NULL OR f.run_id IS NOT NULL)
     ORDER BY f.schedule_id, f.fire_time DESC
    """
)

PURGE_FIRES = text(
    """
    DELETE FROM cron.fires WHERE ctid IN (
        SELECT ctid FROM cron.fires
         WHERE recorded_at < now() - make_interval(secs => :age_s) AND outcome <> 'pending'
         LIMIT :limit)
    """
)


_RECORD_COLS = ("ids", "times", "outcomes", "task_ids", "run_ids", "details", "submitted_ats")


async def record(conn: AsyncConnection, results: Sequence[Result]) -> None:
    """Store what became of fires that are no longer pending."""
    rows = [
        (r.schedule_id, r.fire_time, r.outcome, r.task_id, r.run_id, r.detail, r.submitted_at)
        for r in results
        if r.outcome != "pending"
    ]
    if rows:
        await conn.execute(RECORD, dict(zip(_RECORD_COLS, columns(rows, 7), strict=True)))
    waiting = [(r.schedule_id, r.fire_time, r.detail) for r in results if r.outcome == "pending"]
    if waiting:
        await conn.execute(
            RETRIED, dict(zip(("ids", "times", "details"), columns(waiting, 3), strict=True))
        )


def columns(values: Sequence[tuple[Any, ...]], width: int) -> list[list[Any]]:
    """Rows as columns, for the ``unnest`` statements above."""
    return [list(col) for col in zip(*values, strict=True)] if values else [[]] * width


_SCHEDULE_COUNTS = text("""
SELECT CASE WHEN paused THEN 'paused' ELSE 'active' END AS state, count(*) AS n
FROM cron.schedules GROUP BY 1
""")


async def schedule_counts(conn: AsyncConnection) -> dict[str, int]:
    """Schedules by state (``active``, ``paused``), for ``/metrics``."""
    return {r.state: int(r.n) for r in await conn.execute(_SCHEDULE_COUNTS)}
