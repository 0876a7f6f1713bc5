"""The cron service's wire models (schedules, fires, previews). The expression and zone
are checked by the service itself (services/cron/domain/timing.py), which names them in
its 422 answers."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)

from libs.common.dag_models import RunParams
from libs.common.models import (
    CRON_ENV,
    MAX_PAGE,
    Input,
    Name,
    Output,
    TaskCreate,
    TeamName,
    _storable_time,
)
from libs.common.stored import Stored

MisfirePolicy = Literal["skip", "fire_once", "catch_up"]
OverlapPolicy = Literal["allow", "forbid", "replace"]
FireOutcome = Literal["pending", "submitted", "skipped_overlap", "missed", "failed", "withdrawn"]
Expression = Annotated[str, StringConstraints(min_length=1, max_length=200)]
ZoneName = Annotated[str, StringConstraints(min_length=1, max_length=64)]
Instant = Annotated[AwareDatetime, AfterValidator(_storable_time)]
MAX_JITTER_S = 3600
MAX_BACKFILL = 1000


class TaskTarget(Input):
    """Each fire submits this task to core, owned by the schedule's owner (and team)."""

    kind: Literal["task"] = "task"
    task: TaskCreate

    @model_validator(mode="after")
    def _no_per_fire_fields(self) -> TaskTarget:
        if self.task.idempotency_key is not None:
            raise ValueError("task.idempotency_key is set by each fire; leave it out")
        if self.task.run_at is not None:
            raise ValueError("task.run_at is the fire time; leave it out")
        if self.task.start_by is not None:
            raise ValueError("task.start_by: a fire's wait is bounded by task.max_wait_s")
        if CRON_ENV & self.task.env.keys():
            raise ValueError(f"task.env: {', '.join(sorted(CRON_ENV))} are set by each fire")
        return self


class DagTarget(Input):
    """Each fire starts a run of this workflow in the DAG service."""

    kind: Literal["dag"]
    workflow: Name
    #: checked as the DAG service checks a run's: what it would refuse at every fire is
    #: refused here, when the schedule is defined
    params: RunParams = Field(default_factory=dict)


Target = Annotated[TaskTarget | DagTarget, Field(discriminator="kind")]
#: a target as a schedule's answer shows it (``Stored``)
StoredTarget = Annotated[Stored[TaskTarget] | Stored[DagTarget], Field(discriminator="kind")]


class ScheduleCreate(Input):
    """A new schedule. Its name is unique per owner. With ``team`` (one the caller
    belongs to), the team's members see and act on it, and its fires' tasks are owned by
    the team; a task target may then use only the team's secrets."""

    name: Name
    team: TeamName | None = None
    expression: Expression = Field(
        description="Five fields (minute hour day-of-month month day-of-week) or a macro "
        "such as @daily, read in `timezone`'s wall clock."
    )
    timezone: ZoneName = "UTC"
    target: Target
    misfire_policy: MisfirePolicy = "fire_once"
    catch_up_limit: int = Field(default=10, ge=1, le=1000)
    misfire_grace_s: int = Field(default=60, ge=1, le=7 * 86400)
    overlap_policy: OverlapPolicy = "allow"
    jitter_s: int = Field(
        default=0,
        ge=0,
        le=MAX_JITTER_S,
        description="Each fire's task starts this schedule's fixed offset, 0 to jitter_s "
        "seconds (derived from its id), after the slot: spreads a crowded minute.",
    )
    starts_at: Instant | None = None
    ends_at: Instant | None = None
    paused: bool = False

    @model_validator(mode="after")
    def _window(self) -> ScheduleCreate:
        if self.starts_at and self.ends_at and self.ends_at <= self.starts_at:
            raise ValueError("ends_at must be after starts_at")
        return self


class ScheduleUpdate(Input):
    """A change to a schedule: only the fields given change. ``team`` moves it to a team
    of its owner's, or with null back to the owner alone (the owner's call only)."""

    name: Name | None = None
    team: TeamName | None = None
    expression: Expression | None = None
    timezone: ZoneName | None = None
    target: Target | None = None
    misfire_policy: MisfirePolicy | None = None
    catch_up_limit: int | None = Field(default=None, ge=1, le=1000)
    misfire_grace_s: int | None = Field(default=None, ge=1, le=7 * 86400)
    overlap_policy: OverlapPolicy | None = None
    jitter_s: int | None = Field(default=None, ge=0, le=MAX_JITTER_S)
    starts_at: Instant | None = None
    ends_at: Instant | None = None


class Schedule(Output):
    id: int
    owner: str
    team: str | None = None
    name: str
    expression: str
    timezone: str
    target: StoredTarget
    misfire_policy: MisfirePolicy
    catch_up_limit: int
    misfire_grace_s: int
    overlap_policy: OverlapPolicy
    jitter_s: int = 0
    starts_at: datetime | None
    ends_at: datetime | None
    paused: bool
    version: int
    #: who last created or changed it; its fires' tasks carry it (``cairn.cron/changed-by``)
    changed_by: str | None = None
    next_fire_at: datetime | None = Field(description="None: paused, ended, or never fires.")
    created_at: datetime
    updated_at: datetime


class SchedulePage(Output):
    items: list[Schedule]
    next_after: int | None = Field(description="Pass as `after` for the next page.")


class Fire(Output):
    """One fire of a schedule: its slot, and what became of it."""

    schedule_id: int
    fire_time: datetime
    manual: bool
    outcome: FireOutcome
    task_id: int | None
    run_id: int | None
    recorded_at: datetime
    submitted_at: datetime | None
    lag_ms: float | None = Field(description="submitted_at minus fire_time.")
    tries: int
    detail: str | None
    backfill: bool = False
    withdrawn: int = Field(
        default=0, description="Times a change before the slot withdrew what was sent ahead."
    )


class FirePage(Output):
    items: list[Fire]


class NextFire(Output):
    utc: datetime
    local: str = Field(description="The same instant on the schedule's wall clock, with offset.")


class NextFires(Output):
    schedule_id: int
    timezone: str
    after: datetime
    items: list[NextFire]


class BackfillCreate(Input):
    """Fire every slot of the schedule in ``[from, to]`` once (at most
    ``MAX_BACKFILL`` slots), paced, under the schedule's overlap policy."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    from_: Instant = Field(alias="from")
    to: Instant

    @model_validator(mode="after")
    def _ordered(self) -> BackfillCreate:
        if self.to < self.from_:
            raise ValueError("to must not be before from")
        return self


class Backfill(Output):
    schedule_id: int
    slots: int = Field(description="Slots of the schedule in the range.")
    queued: int = Field(description="Slots not fired before, now queued to fire.")
    already: int = Field(description="Slots fired (or queued) before: left as they were.")
    first: datetime | None
    last: datetime | None


class CronStatus(Output):
    """This replica: whether it leads, and what its engine holds."""

    instance: str
    leader: bool
    schedules: int = Field(description="Schedules in the leader's heap (0 on a standby).")
    pending_fires: int
    next_fire_at: datetime | None


MAX_SCHEDULE_PAGE = MAX_PAGE
