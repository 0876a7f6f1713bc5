"""Core's schema as SQLAlchemy Core tables. The migrations build it; a test diffs the two."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Double,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    SmallInteger,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from libs.common.schema import metadata_for
from libs.common.states import FINAL, TaskState

SCHEMA = "core"

metadata = metadata_for(SCHEMA)


def _in(column: str, values: Iterable[TaskState]) -> str:
    return f"{column} IN ({', '.join(repr(str(v)) for v in sorted(values))})"


_FINAL_SQL = _in("state", FINAL)
_ALL_STATES_SQL = _in("state", TaskState)
_LIVE = [s for s in TaskState if s not in FINAL] + [TaskState.DEAD]


def _now() -> Column[object]:
    return Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now())


principals = Table(
    "principals",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("name", Text, nullable=False, unique=True),
    Column("role", Text, nullable=False),
    _now(),
    CheckConstraint("role IN ('admin', 'service', 'user', 'worker')", name="role"),
    CheckConstraint("length(name) BETWEEN 1 AND 100", name="name_length"),
)

tokens = Table(
    "tokens",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column(
        "principal_id",
        BigInteger,
        ForeignKey("principals.id", ondelete="CASCADE"),
        nullable=False,
        index=True,
    ),
    Column("token_hash", LargeBinary, nullable=False, unique=True),
    _now(),
    Column("revoked_at", DateTime(timezone=True)),
)

queues = Table(
    "queues",
    metadata,
    Column("name", Text, primary_key=True),
    Column("paused", Boolean, nullable=False, server_default=text("false")),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("overcommit", Double),
    Column("defer_above", Double),
    Column("utilisation", Double),
    Column("policy", JSONB),
    CheckConstraint(
        "overcommit IS NULL OR (overcommit >= 1 AND overcommit <= 10)", name="overcommit_range"
    ),
    CheckConstraint(
        "defer_above IS NULL OR (defer_above > 0 AND defer_above <= 1)", name="defer_above_range"
    ),
)

tasks = Table(
    "tasks",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("owner", Text, nullable=False),
    Column("name", Text, nullable=False),
    Column("queue", Text, nullable=False),
    Column("priority", SmallInteger, nullable=False, server_default=text("0")),
    Column("kind", Text, nullable=False),
    Column("artifact_uri", Text, nullable=False),
    Column("artifact_sha256", Text, nullable=False),
    Column("args", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    Column("env", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("input_path", Text),
    Column("output_path", Text),
    Column("cpu", Double, nullable=False),
    Column("memory_mb", Integer, nullable=False),
    Column("preemptible", Boolean, nullable=False, server_default=text("false")),
    Column("max_attempts", Integer, nullable=False),
    Column("backoff_base_s", Double),
    Column("backoff_cap_s", Double, nullable=False),
    Column("backoff_jitter", Boolean, nullable=False),
    Column("poison_after", Integer, nullable=False),
    Column("timeout_s", Integer),
    Column("run_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("idempotency_key", Text),
    Column("spec_hash", Text),
    Column("labels", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("state", Text, nullable=False),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("crashes", Integer, nullable=False, server_default=text("0")),
    Column("last_error", Text),
    Column("current_attempt_id", BigInteger),
    Column("version", Integer, nullable=False, server_default=text("1")),
    _now(),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("finished_at", DateTime(timezone=True)),
    Column("defer_ok", Boolean, nullable=False, server_default=text("false")),
    Column("deadline", DateTime(timezone=True)),
    Column("deferred", Boolean, nullable=False, server_default=text("false")),
    Column("vtime", Double, nullable=False, server_default=text("EXTRACT(EPOCH FROM now())")),
    Column("concurrency_key", Text),
    Column("concurrency_limit", Integer),
    CheckConstraint(_ALL_STATES_SQL, name="state"),
    CheckConstraint("kind IN ('service', 'task')", name="kind"),
    CheckConstraint(f"({_FINAL_SQL}) = (finished_at IS NOT NULL)", name="final_has_finished_at"),
    CheckConstraint("max_attempts > 0", name="max_attempts_positive"),
    CheckConstraint("poison_after > 0", name="poison_after_positive"),
    CheckConstraint("attempts >= 0 AND crashes >= 0", name="counts_non_negative"),
    CheckConstraint("cpu > 0 AND memory_mb > 0", name="resources_positive"),
    CheckConstraint("timeout_s IS NULL OR timeout_s > 0", name="timeout_positive"),
    CheckConstraint("priority BETWEEN -100 AND 100", name="priority_range"),
    CheckConstraint(
        "state <> 'running' OR current_attempt_id IS NOT NULL", name="running_has_attempt"
    ),
    CheckConstraint(
        "concurrency_limit IS NULL OR concurrency_limit > 0", name="concurrency_limit_positive"
    ),
    Index(
        "uq_tasks_owner_idempotency_key",
        "owner",
        "idempotency_key",
        unique=True,
        postgresql_where=text("idempotency_key IS NOT NULL"),
    ),
    Index(
        "ix_tasks_waiting",
        "queue",
        text("priority DESC"),
        "vtime",
        "id",
        postgresql_where=text("state = 'waiting'"),
    ),
    Index(
        "ix_tasks_waiting_vtime",
        "queue",
        "vtime",
        "id",
        postgresql_where=text("state = 'waiting'"),
    ),
    Index(
        "ix_tasks_owner_waiting",
        "owner",
        "queue",
        "vtime",
        postgresql_where=text("state IN ('ready', 'waiting')"),
    ),
    Index(
        "ix_tasks_due",
        "run_at",
        postgresql_where=text("state IN ('failed', 'ready')"),
    ),
    Index(
        "ix_tasks_live_queue_state",
        "queue",
        "state",
        postgresql_where=text(_in("state", _LIVE)),
    ),
    Index("ix_tasks_owner_id", "owner", "id"),
    Index("ix_tasks_finished_at", "finished_at", postgresql_where=text("finished_at IS NOT NULL")),
    Index(
        "ix_tasks_labels",
        "labels",
        postgresql_using="gin",
        postgresql_ops={"labels": "jsonb_path_ops"},
    ),
)

workers = Table(
    "workers",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("principal", Text, nullable=False),
    Column("hostname", Text, nullable=False),
    Column("queues", ARRAY(Text), nullable=False),
    Column("labels", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("cpu", Double, nullable=False),
    Column("memory_mb", Integer, nullable=False),
    Column("state", Text, nullable=False, server_default=text("'live'")),
    Column("registered_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("last_heartbeat_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("gone_at", DateTime(timezone=True)),
    Column("reserved_for", BigInteger),
    CheckConstraint("state IN ('dead', 'draining', 'left', 'live')", name="state"),
    CheckConstraint("cpu > 0 AND memory_mb > 0", name="capacity_positive"),
    CheckConstraint("(state IN ('dead', 'left')) = (gone_at IS NOT NULL)", name="gone_has_time"),
    Index(
        "ix_workers_heartbeat",
        "last_heartbeat_at",
        postgresql_where=text("state IN ('draining', 'live')"),
    ),
)

attempts = Table(
    "attempts",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column(
        "task_id",
        BigInteger,
        ForeignKey("tasks.id", ondelete="CASCADE"),
        nullable=False,
        index=True,
    ),
    Column("number", Integer, nullable=False),
    Column("worker_id", BigInteger, ForeignKey("workers.id", ondelete="SET NULL")),
    Column("outcome", Text),
    Column("started_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("seen_at", DateTime(timezone=True)),
    Column("ended_at", DateTime(timezone=True)),
    Column("exit_code", Integer),
    Column("peak_memory_mb", Double),
    Column("cpu_seconds", Double),
    Column("error", Text),
    Column("log_tail", Text),
    Column("charge_cpu", Double),
    Column("charge_memory_mb", Double),
    Column("squeezed_at", DateTime(timezone=True)),
    Column("squeezed_for", BigInteger),
    Column("preempted_by", BigInteger),
    Column("concurrency_key", Text),
    CheckConstraint("(outcome IS NULL) = (ended_at IS NULL)", name="ended_has_outcome"),
    CheckConstraint(
        "outcome IN ('cancelled', 'crashed', 'failed', 'handed_back', 'lost', 'preempted',"
        " 'succeeded', 'timeout')",
        name="outcome",
    ),
    Index("ix_attempts_open_by_worker", "worker_id", postgresql_where=text("outcome IS NULL")),
    Index(
        "ix_attempts_room_made",
        "worker_id",
        postgresql_where=text("preempted_by IS NOT NULL OR squeezed_for IS NOT NULL"),
    ),
    Index(
        "ix_attempts_key_open",
        "concurrency_key",
        postgresql_where=text("outcome IS NULL AND concurrency_key IS NOT NULL"),
    ),
    Index(
        "ix_attempts_key_started",
        "concurrency_key",
        "started_at",
        postgresql_where=text("concurrency_key IS NOT NULL"),
    ),
)

usage = Table(
    "usage",
    metadata,
    Column("owner", Text, primary_key=True),
    Column("name", Text, primary_key=True),
    Column("peak_cpu", Double, nullable=False),
    Column("peak_memory_mb", Double, nullable=False),
    Column("samples", Integer, nullable=False, server_default=text("0")),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# Share and quotas of a principal by name: an owner today; a team slots in by its name.
shares = Table(
    "shares",
    metadata,
    Column("name", Text, primary_key=True),
    Column("weight", Double, nullable=False, server_default=text("1")),
    Column("max_cpu", Double),
    Column("max_memory_mb", Double),
    Column("max_running", Integer),
    Column("max_waiting", Integer),
    Column("max_submits_per_min", Integer),
    Column("rate_window_at", DateTime(timezone=True)),
    Column("rate_count", Integer, nullable=False, server_default=text("0")),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    CheckConstraint("weight > 0 AND weight <= 1000", name="weight_range"),
    CheckConstraint(
        "(max_cpu IS NULL OR max_cpu > 0) AND (max_memory_mb IS NULL OR max_memory_mb > 0)"
        " AND (max_running IS NULL OR max_running > 0) AND (max_waiting IS NULL OR max_waiting > 0)"
        " AND (max_submits_per_min IS NULL OR max_submits_per_min > 0)",
        name="limits_positive",
    ),
)

concurrency_limits = Table(
    "concurrency_limits",
    metadata,
    Column("key", Text, primary_key=True),
    Column("max_running", Integer),
    Column("max_starts", Integer),
    Column("window_s", Double),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    CheckConstraint(
        "(max_running IS NULL OR max_running > 0) AND (max_starts IS NULL OR max_starts > 0)"
        " AND (window_s IS NULL OR window_s > 0)",
        name="positive",
    ),
    CheckConstraint("(max_starts IS NULL) = (window_s IS NULL)", name="rate_has_window"),
)

attempt_logs = Table(
    "attempt_logs",
    metadata,
    Column(
        "attempt_id",
        BigInteger,
        ForeignKey("attempts.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("content", Text, nullable=False),
    Column("truncated", Boolean, nullable=False, server_default=text("false")),
)

task_events = Table(
    "task_events",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column(
        "xid",
        BigInteger,
        nullable=False,
        server_default=text("(pg_current_xact_id())::text::bigint"),
    ),
    Column("task_id", BigInteger, nullable=False),
    Column("seq", Integer, nullable=False),
    Column("owner", Text, nullable=False),
    Column("op", Text, nullable=False),
    Column("from_state", Text),
    Column("to_state", Text, nullable=False),
    Column("reason", Text),
    Column("attempt_id", BigInteger),
    Column("at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    UniqueConstraint("task_id", "seq"),
    Index("ix_task_events_xid_id", "xid", "id"),
)
