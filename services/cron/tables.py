"""The cron service's schema as SQLAlchemy Core tables. The migrations build it; a test
diffs the two."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    Integer,
    PrimaryKeyConstraint,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

from libs.common.leader import leader_table
from libs.common.schema import metadata_for

SCHEMA = "cron"

metadata = metadata_for(SCHEMA)


def _time(name: str, nullable: bool = True, default: bool = False) -> Column[object]:
    return Column(
        name,
        DateTime(timezone=True),
        nullable=nullable,
        server_default=func.now() if default else None,
    )


schedules = Table(
    "schedules",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("owner", Text, nullable=False),
    # A team that owns the schedule with its owner: its members see and act on it.
    Column("team", Text),
    Column("name", Text, nullable=False),
    # Who last changed it (its owner, or an admin for what it runs): its fires say so.
    Column("changed_by", Text, nullable=False),
    Column("expression", Text, nullable=False),
    Column("timezone", Text, nullable=False),
    Column("target", JSONB, nullable=False),
    Column("misfire_policy", Text, nullable=False),
    Column("catch_up_limit", Integer, nullable=False),
    Column("misfire_grace_s", Integer, nullable=False),
    Column("overlap_policy", Text, nullable=False),
    _time("starts_at"),
    _time("ends_at"),
    Column("paused", Boolean, nullable=False, server_default=text("false")),
    # Each fire's task runs this schedule's fixed offset (0 .. jitter_s s) after its slot.
    Column("jitter_s", Integer, nullable=False, server_default=text("0")),
    # Bumped by every change, so the engine drops heap entries of an older version.
    Column("version", BigInteger, nullable=False, server_default=text("1")),
    # Every slot at or before this instant has been dealt with (fired, or missed by policy).
    _time("fired_through", nullable=False),
    # The slot the engine waits for; NULL when paused, ended, or it never fires again.
    _time("next_fire_at"),
    _time("created_at", nullable=False, default=True),
    _time("updated_at", nullable=False, default=True),
    UniqueConstraint("owner", "name"),
    CheckConstraint("misfire_policy IN ('catch_up', 'fire_once', 'skip')", name="misfire_policy"),
    CheckConstraint("overlap_policy IN ('allow', 'forbid', 'replace')", name="overlap_policy"),
    CheckConstraint("catch_up_limit BETWEEN 1 AND 1000", name="catch_up_limit"),
    CheckConstraint("misfire_grace_s >= 1", name="misfire_grace_positive"),
    CheckConstraint("NOT paused OR next_fire_at IS NULL", name="paused_waits_for_nothing"),
    CheckConstraint("jitter_s BETWEEN 0 AND 3600", name="jitter_range"),
)

Index(
    "ix_schedules_next_fire_at",
    schedules.c.next_fire_at,
    postgresql_where=schedules.c.next_fire_at.isnot(None),
)

fires = Table(
    "fires",
    metadata,
    Column(
        "schedule_id",
        BigInteger,
        ForeignKey("cron.schedules.id", ondelete="CASCADE"),
        nullable=False,
    ),
    _time("fire_time", nullable=False),
    Column("manual", Boolean, nullable=False, server_default=text("false")),
    Column("outcome", Text, nullable=False),
    Column("task_id", BigInteger),
    Column("run_id", BigInteger),
    _time("recorded_at", nullable=False, default=True),
    _time("submitted_at"),
    Column("tries", Integer, nullable=False, server_default=text("0")),
    Column("detail", Text),
    # The schedule's version the fire was planned from (a later change withdraws it).
    Column("version", BigInteger),
    # Times a change in the lead window withdrew the fire; part of its idempotency key.
    Column("withdrawn", Integer, nullable=False, server_default=text("0")),
    Column("backfill", Boolean, nullable=False, server_default=text("false")),
    PrimaryKeyConstraint("schedule_id", "fire_time"),
    CheckConstraint(
        "outcome IN ('failed', 'missed', 'pending', 'skipped_overlap', 'submitted', 'withdrawn')",
        name="outcome",
    ),
    CheckConstraint(
        "(outcome = 'submitted') = (submitted_at IS NOT NULL)", name="submitted_has_time"
    ),
)

Index(
    "ix_schedules_team_id",
    schedules.c.team,
    schedules.c.id,
    postgresql_where=schedules.c.team.isnot(None),
)

Index("ix_fires_pending", fires.c.schedule_id, postgresql_where=fires.c.outcome == "pending")
Index("ix_fires_recorded_at", fires.c.recorded_at)

leader = leader_table(metadata)
