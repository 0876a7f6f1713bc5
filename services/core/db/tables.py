"""Core's schema as SQLAlchemy Core tables. The migrations build it; a test diffs the two."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Date,
    DateTime,
    Double,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    PrimaryKeyConstraint,
    SmallInteger,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID
from sqlalchemy.schema import SchemaItem
from sqlalchemy.types import TypeEngine

from libs.common.leader import leader_table
from libs.common.schema import Domain, metadata_for
from libs.common.states import ATTEMPT_OUTCOMES, FINAL, WORKER_STATES, TaskState, Workers, sql_in

S = TaskState

SCHEMA = "core"

metadata = metadata_for(SCHEMA)


_FINAL_SQL = sql_in("state", FINAL)
_LIVE = [s for s in TaskState if s not in FINAL] + [TaskState.DEAD]


_NULL_OR_POSITIVE = "VALUE IS NULL OR VALUE > 0"


def _ruled(column: str, base: type[TypeEngine[Any]], rule: str, check: str) -> Domain:
    """The type of a ``core.tasks`` column whose rule is on its value alone: a domain,
    ``core.tasks_<column>``, whose check is named as the rule (``ck_tasks_<rule>``).
    PostgreSQL checks a domain where a value is made one (an INSERT, an UPDATE that sets
    the column), its check planned once and kept by each connection; a table's CHECK
    constraints, all of them at every UPDATE of a row, read and planned afresh at each
    statement (migration 0039)."""
    return Domain(
        f"tasks_{column}", base, constraint_name=f"ck_tasks_{rule}", check=check, schema=SCHEMA
    )


def _now() -> Column[object]:
    return Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now())


principals = Table(
    "principals",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("name", Text, nullable=False, unique=True),
    Column("role", Text, nullable=False),
    _now(),
    # set while an admin has it disabled (someone who left): db/principals.py
    Column("disabled_at", DateTime(timezone=True)),
    Column("disabled_by", Text),
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
    Column("name", Text, nullable=False, server_default=text("''")),
    Column("expires_at", DateTime(timezone=True)),
    Column("last_used_at", DateTime(timezone=True)),
    Column("created_by", Text),
    # the id of the identity provider's key the credential that made it rests on (a JWT,
    # a session, a token made by one): the provider withdrawing it revokes the token
    Column("kid", Text),
    CheckConstraint("length(name) <= 100", name="name_length"),
    Index(
        "ix_tokens_kid",
        "kid",
        postgresql_where=text("kid IS NOT NULL AND revoked_at IS NULL"),
    ),
)

teams = Table(
    "teams",
    metadata,
    Column("name", Text, primary_key=True),
    _now(),
    Column("created_by", Text, nullable=False),
    CheckConstraint("length(name) BETWEEN 1 AND 64", name="name_length"),
)

# The names of deleted teams: their tasks, schedules and workflows still name them, so a
# team made with one later would hand its members the old team's work; taken again only
# when asked for (``reuse_name``, db/teams.py).
retired_teams = Table(
    "retired_teams",
    metadata,
    Column("name", Text, primary_key=True),
    Column("deleted_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("deleted_by", Text, nullable=False),
)

team_members = Table(
    "team_members",
    metadata,
    Column("team", Text, ForeignKey("teams.name", ondelete="CASCADE"), primary_key=True),
    Column("member", Text, primary_key=True, index=True),
    _now(),
    Column("added_by", Text, nullable=False),
)

# A membership an identity provider's claim vouched for at a submission, until the token
# that carried it expires: what a lease checks a team secret's use against besides
# ``team_members`` (db/teams.py).
team_claims = Table(
    "team_claims",
    metadata,
    Column("team", Text, ForeignKey("teams.name", ondelete="CASCADE"), primary_key=True),
    Column("member", Text, primary_key=True, index=True),
    Column("until", DateTime(timezone=True), nullable=False),
    # the id of the provider's key that signed the token (None: not known)
    Column("kid", Text),
    # when a verified token last carried the claim, and until when it stands for what a
    # service does in the member's name (cron fires, DAG nodes: db/teams.py)
    Column("seen_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("standing_until", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# The dashboard's sign-ins under way (authorization code + PKCE): kept from the redirect
# to the provider until its answer comes back (ten minutes at most, db/login.py).
login_flows = Table(
    "login_flows",
    metadata,
    Column("state_hash", Text, primary_key=True),
    Column("verifier", Text, nullable=False),
    Column("nonce", Text, nullable=False),
    Column("next", Text, nullable=False),
    Column(
        "created_at", DateTime(timezone=True), nullable=False, server_default=func.now(), index=True
    ),
)

# The dashboard's sessions, by the SHA-256 of their cookie: who signed in, the teams
# their ID token claimed, and when the session ends (db/login.py).
sessions = Table(
    "sessions",
    metadata,
    Column("id_hash", Text, primary_key=True),
    Column("csrf_hash", Text, nullable=False),
    Column("principal", Text, nullable=False, index=True),
    Column("role", Text, nullable=False),
    Column("teams", ARRAY(Text), nullable=False),
    Column("kid", Text),
    _now(),
    Column("expires_at", DateTime(timezone=True), nullable=False, index=True),
    CheckConstraint("role IN ('admin', 'user')", name="role"),
    CheckConstraint("expires_at > created_at", name="lifetime"),
)

# Bearer tokens core mints for a live session (db/login.py), by their SHA-256: they
# end with it, and stand for whom it does.
session_tokens = Table(
    "session_tokens",
    metadata,
    Column("token_hash", Text, primary_key=True),
    Column(
        "session_hash",
        Text,
        ForeignKey("sessions.id_hash", ondelete="CASCADE"),
        nullable=False,
        index=True,
    ),
    _now(),
    Column("expires_at", DateTime(timezone=True), nullable=False, index=True),
)

# Services kept at N replicas with rolling updates (docs/services.md): the template of
# the current revision and of the one before (a rollback's target), the rollout policy
# and where the rollout stands; the controller's steps, newest last.
services = Table(
    "services",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("owner", Text, nullable=False),
    Column("name", Text, nullable=False),
    Column("replicas", Integer, nullable=False),
    Column("template", JSONB, nullable=False),
    Column("revision", Integer, nullable=False),
    Column("previous", JSONB),
    Column("previous_revision", Integer),
    Column("revisions", Integer, nullable=False),
    Column("max_surge", Integer, nullable=False),
    Column("max_unavailable", Integer, nullable=False),
    Column("deadline_s", Integer, nullable=False),
    # failures of the new revision's replicas that roll a rollout back before its deadline
    Column("max_failures", Integer, nullable=False, server_default=text("3")),
    Column("rollout", Text, nullable=False),
    Column("rollout_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("message", Text),
    _now(),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    UniqueConstraint("owner", "name"),
    CheckConstraint("replicas >= 0", name="replicas"),
    CheckConstraint("rollout IN ('progressing', 'complete', 'rolled_back')", name="rollout"),
    CheckConstraint(
        "max_surge >= 0 AND max_unavailable >= 0 AND max_surge + max_unavailable > 0",
        name="moves",
    ),
    CheckConstraint("max_failures >= 1", name="max_failures"),
)

service_steps = Table(
    "service_steps",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("service_id", BigInteger, ForeignKey("services.id", ondelete="CASCADE"), nullable=False),
    Column("at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("step", Text, nullable=False),
    Column("detail", Text),
    Index("ix_service_steps_service_id", "service_id", "id"),
)

secrets = Table(
    "secrets",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("owner", Text),
    Column("team", Text),
    Column("name", Text, nullable=False),
    Column("key_id", Text, nullable=False),
    Column("nonce", LargeBinary, nullable=False),
    Column("ciphertext", LargeBinary, nullable=False),
    _now(),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("created_by", Text, nullable=False),
    Column("updated_by", Text, nullable=False),
    CheckConstraint("(owner IS NULL) <> (team IS NULL)", name="one_scope"),
    CheckConstraint("length(name) BETWEEN 1 AND 128", name="name_length"),
    Index(
        "uq_secrets_owner_name",
        "owner",
        "name",
        unique=True,
        postgresql_where=text("owner IS NOT NULL"),
    ),
    Index(
        "uq_secrets_team_name",
        "team",
        "name",
        unique=True,
        postgresql_where=text("team IS NOT NULL"),
    ),
)

# Append-only (a trigger refuses UPDATE, TRUNCATE, and DELETE outside the retention purge).
audit = Table(
    "audit",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("actor", Text, nullable=False),
    Column("actor_role", Text, nullable=False),
    Column("action", Text, nullable=False),
    Column("target", Text, nullable=False),
    Column("source", Text),
    Column("before", JSONB),
    Column("after", JSONB),
    # The hash chain (domain/auditchain.py): set once, by the writer, in the insert's
    # transaction (NULL only inside it).
    Column("prev_hash", Text),
    Column("hash", Text),
    # A reported action's key, the reporter's name first: a report sent again is recorded
    # once (not hashed: the content is).
    Column("idempotency_key", Text),
    Index("ix_audit_at", "at"),
    Index("ix_audit_actor_id", "actor", "id"),
    Index("ix_audit_action_id", "action", "id"),
    Index(
        "ix_audit_idempotency",
        "idempotency_key",
        unique=True,
        postgresql_where=text("idempotency_key IS NOT NULL"),
    ),
)

# The audit chain's head: one row, locked by every audit insert, so that the rows of all
# replicas form one chain in id order.
audit_chain = Table(
    "audit_chain",
    metadata,
    Column("one", Boolean, primary_key=True, server_default=text("true")),
    Column("head_id", BigInteger, nullable=False, server_default=text("0")),
    Column("head_hash", Text, nullable=False),
    CheckConstraint("one", name="one"),
)

# The last audit id the scheduled export wrote (one row).
audit_export = Table(
    "audit_export",
    metadata,
    Column("one", Boolean, primary_key=True, server_default=text("true")),
    Column("last_id", BigInteger, nullable=False, server_default=text("0")),
    Column("exported_at", DateTime(timezone=True)),
    CheckConstraint("one", name="one"),
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
    # Its tasks' time limits (docs/architecture.md, "Time limits").
    Column("default_timeout_s", Integer),
    Column("max_timeout_s", Integer),
    Column("max_wait_s", Integer),
    CheckConstraint(
        "(default_timeout_s IS NULL OR default_timeout_s > 0)"
        " AND (max_timeout_s IS NULL OR max_timeout_s > 0)"
        " AND (max_wait_s IS NULL OR max_wait_s > 0)",
        name="time_limits_positive",
    ),
    CheckConstraint("default_timeout_s <= max_timeout_s", name="default_timeout_within_max"),
    # Its tasks' disk quota (MiB): when they ask none, and the most they may ask.
    Column("default_disk_mb", Integer),
    Column("max_disk_mb", Integer),
    CheckConstraint(
        "(default_disk_mb IS NULL OR default_disk_mb > 0)"
        " AND (max_disk_mb IS NULL OR max_disk_mb > 0)",
        name="disk_limits_positive",
    ),
    CheckConstraint("default_disk_mb <= max_disk_mb", name="default_disk_within_max"),
    # Its attempts' egress policy (``models.Egress``; NULL: ``host``, the default).
    Column("egress", JSONB),
    CheckConstraint("egress->>'mode' IN ('none', 'allow')", name="egress_mode"),
)

#: the condition of the labels' index, which every label filter adds (a non-empty
#: filter never matches an unlabelled task)
LABELLED = "labels <> '{}'::jsonb"


def found_by_id(state: TaskState, alias: str = "t") -> str:
    """``alias``'s state is ``state``, for a statement that finds its tasks by ids (or
    by their attempts): spelled as a range, which implies no partial index's predicate
    on the state, so the tasks are read by the primary key. With the equality, a table
    whose statistics predate its backlog (analysed when nearly all its tasks were
    finished, as after a quiet night: autoanalyze waits for a tenth of the table to
    change) had its plans walk the index of every waiting task
    (``ix_tasks_owner_waiting``) or every live one (``ix_tasks_live_queue_state``) to
    test each against the ids: a claim's reserved work read 5,000 rows a pick at 5,000
    waiting (7.5 ms at 20,000 behind 1,000,000 finished), a resend every live task for
    each open attempt (``tests/integration/core/test_claim_plan.py``)."""
    return f"{alias}.state >= '{state.value}' AND {alias}.state <= '{state.value}'"


tasks = Table(
    "tasks",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("owner", Text, nullable=False),
    Column("name", Text, nullable=False),
    Column("queue", Text, nullable=False),
    Column(
        "priority",
        _ruled("priority", SmallInteger, "priority_range", "VALUE BETWEEN -100 AND 100"),
        nullable=False,
        server_default=text("0"),
    ),
    Column("kind", _ruled("kind", Text, "kind", "VALUE IN ('service', 'task')"), nullable=False),
    Column("artifact_uri", Text, nullable=False),
    Column("artifact_sha256", Text, nullable=False),
    Column("args", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    Column("env", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("input_path", Text),
    Column("output_path", Text),
    Column("cpu", _ruled("cpu", Double, "resources_positive", "VALUE > 0"), nullable=False),
    Column(
        "memory_mb", _ruled("memory_mb", Integer, "resources_positive", "VALUE > 0"), nullable=False
    ),
    # its disk quota (MiB; NULL: the worker's default)
    Column("disk_mb", _ruled("disk_mb", Integer, "disk_positive", _NULL_OR_POSITIVE)),
    Column("preemptible", Boolean, nullable=False, server_default=text("false")),
    Column(
        "max_attempts",
        _ruled("max_attempts", Integer, "max_attempts_positive", "VALUE > 0"),
        nullable=False,
    ),
    Column("backoff_base_s", Double),
    Column("backoff_cap_s", Double, nullable=False),
    Column("backoff_jitter", Boolean, nullable=False),
    Column(
        "poison_after",
        _ruled("poison_after", Integer, "poison_after_positive", "VALUE > 0"),
        nullable=False,
    ),
    Column("timeout_s", _ruled("timeout_s", Integer, "timeout_positive", _NULL_OR_POSITIVE)),
    Column("run_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("idempotency_key", Text),
    Column("spec_hash", Text),
    Column("labels", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("state", _ruled("state", Text, "state", sql_in("VALUE", TaskState)), nullable=False),
    Column(
        "attempts",
        _ruled("attempts", Integer, "counts_non_negative", "VALUE >= 0"),
        nullable=False,
        server_default=text("0"),
    ),
    Column(
        "crashes",
        _ruled("crashes", Integer, "counts_non_negative", "VALUE >= 0"),
        nullable=False,
        server_default=text("0"),
    ),
    # Attempts handed back in a row because its file:// source did not answer
    # (domain.outcomes.source_unanswered); reset by any other end a worker reports
    # (but a hand-back without that cause) and by a person's retry.
    Column(
        "source_handbacks",
        _ruled("source_handbacks", Integer, "source_handbacks_non_negative", "VALUE >= 0"),
        nullable=False,
        server_default=text("0"),
    ),
    Column("last_error", Text),
    Column("current_attempt_id", BigInteger),
    Column("version", Integer, nullable=False, server_default=text("1")),
    _now(),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("finished_at", DateTime(timezone=True)),
    Column("defer_ok", Boolean, nullable=False, server_default=text("false")),
    Column("deadline", DateTime(timezone=True)),
    Column("deferred", Boolean, nullable=False, server_default=text("false")),
    Column("team", Text),
    Column("vtime", Double, nullable=False, server_default=text("EXTRACT(EPOCH FROM now())")),
    Column("concurrency_key", Text),
    Column(
        "concurrency_limit",
        _ruled("concurrency_limit", Integer, "concurrency_limit_positive", _NULL_OR_POSITIVE),
    ),
    # Ends dead if it has not started by then (Op.EXPIRE).
    Column("start_by", DateTime(timezone=True)),
    # Crashes count towards poison_after only within this window: their times, the last
    # poison_after of them (domain.outcomes).
    Column(
        "poison_window_s",
        _ruled("poison_window_s", Double, "poison_window_positive", "VALUE > 0"),
        nullable=False,
        server_default=text("259200"),
    ),
    Column(
        "crashed_at", ARRAY(DateTime(timezone=True)), nullable=False, server_default=text("'{}'")
    ),
    # The retry policy's never/always causes (RetryPolicy), NULL when it lists none.
    Column("retry_causes", JSONB),
    # No new progress for this long ends the attempt as timed out (docs/progress.md).
    Column(
        "progress_timeout_s",
        _ruled("progress_timeout_s", Integer, "progress_timeout_positive", _NULL_OR_POSITIVE),
    ),
    # Placement by label (docs/placement.md): as submitted, and the required selectors
    # compiled for the claim (domain.selectors); NULL for the common task.
    Column("placement", JSONB),
    Column("required", JSONB),
    # The artifact's credentials, a secret reference ({"secret", "team"}; docs/security.md).
    Column(
        "artifact_credentials",
        _ruled(
            "artifact_credentials", JSONB, "artifact_credentials", "jsonb_typeof(VALUE) = 'object'"
        ),
    ),
    # Countable devices it asks for ({"gpu": 1}; docs/placement.md), NULL for none.
    Column("devices", JSONB),
    # A service's declared ports and probes (docs/services.md); NULL for everything else.
    Column("service", JSONB),
    CheckConstraint(f"({_FINAL_SQL}) = (finished_at IS NOT NULL)", name="final_has_finished_at"),
    CheckConstraint(
        f"state <> '{S.RUNNING}' OR current_attempt_id IS NOT NULL", name="running_has_attempt"
    ),
    CheckConstraint("required IS NULL OR placement IS NOT NULL", name="required_placed"),
    CheckConstraint("service IS NULL OR kind = 'service'", name="service_kind"),
    # A service's live tasks, read by its controller (db.services.live_replicas).
    Index(
        "ix_tasks_service_replicas",
        "owner",
        "name",
        postgresql_where=text(
            "labels ? 'cairn.service' AND state IN ('ready', 'waiting', 'running', 'failed')"
        ),
    ),
    # The running tasks placed by label or that are services, by name and owner: where a
    # spread group runs (db.placement.by_labels), where a service's replicas run
    # (db.services.endpoints). One index for both (migration 0040_task_indexes).
    Index(
        "ix_tasks_running_named",
        "name",
        "owner",
        postgresql_where=text(
            f"state = '{S.RUNNING}' AND (placement IS NOT NULL OR kind = 'service')"
        ),
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
        postgresql_where=text(f"state = '{S.WAITING}'"),
    ),
    Index(
        "ix_tasks_waiting_vtime",
        "queue",
        "vtime",
        "id",
        postgresql_where=text(f"state = '{S.WAITING}'"),
    ),
    Index(
        "ix_tasks_owner_waiting",
        "owner",
        "queue",
        "vtime",
        postgresql_where=text(f"state IN ('{S.READY}', '{S.WAITING}')"),
    ),
    Index(
        "ix_tasks_due",
        "run_at",
        postgresql_where=text(f"state IN ('{S.FAILED}', '{S.READY}')"),
    ),
    Index("ix_tasks_ready_due", "queue", "run_at", postgresql_where=text(f"state = '{S.READY}'")),
    Index(
        "ix_tasks_start_by",
        "start_by",
        postgresql_where=text(f"start_by IS NOT NULL AND state IN ('{S.READY}', '{S.WAITING}')"),
    ),
    Index(
        "ix_tasks_live_queue_state",
        "queue",
        "state",
        postgresql_where=text(sql_in("state", _LIVE)),
    ),
    Index("ix_tasks_owner_id", "owner", "id"),
    Index("ix_tasks_team_id", "team", "id", postgresql_where=text("team IS NOT NULL")),
    Index(
        "ix_tasks_team_waiting",
        "team",
        "queue",
        "vtime",
        postgresql_where=text(f"state IN ('{S.READY}', '{S.WAITING}') AND team IS NOT NULL"),
    ),
    # A flow's last waiting stamp (queries.SUBMIT's clock; migration 0014_flow_last says
    # why "waiting" is spelled as a range).
    Index(
        "ix_tasks_owner_last",
        "owner",
        "queue",
        "vtime",
        postgresql_where=text(
            f"state >= '{S.WAITING}' AND state <= '{S.WAITING}' AND team IS NULL"
        ),
    ),
    Index(
        "ix_tasks_team_last",
        "team",
        "queue",
        "vtime",
        postgresql_where=text(
            f"state >= '{S.WAITING}' AND state <= '{S.WAITING}' AND team IS NOT NULL"
        ),
    ),
    Index("ix_tasks_finished_at", "finished_at", postgresql_where=text("finished_at IS NOT NULL")),
    # The placement pass's deferral (``db.placement._DEFER``, ``_UNDEFER``): the deferrable
    # waiting work, and the work a deferral parked (migration 0046_deferral_indexes).
    Index(
        "ix_tasks_deferrable",
        "id",
        postgresql_where=text(f"state = '{S.WAITING}' AND (defer_ok OR deadline IS NOT NULL)"),
    ),
    Index("ix_tasks_deferred", "id", postgresql_where=text(f"state = '{S.READY}' AND deferred")),
    Index(
        "ix_tasks_labels",
        "labels",
        postgresql_using="gin",
        postgresql_ops={"labels": "jsonb_path_ops"},
        postgresql_where=text(LABELLED),
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
    Column("state", Text, nullable=False, server_default=text(f"'{Workers.LIVE}'")),
    Column("registered_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("last_heartbeat_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # the agent's own last turn (the sidecar's beat does not move it): a hung agent's mark;
    # NULL for an agent registered without ``hang_watch`` (only its heartbeats count)
    Column("last_turn_at", DateTime(timezone=True)),
    Column("gone_at", DateTime(timezone=True)),
    # sha-256 of the worker's lease secret: only the agent that registered it may act for it
    Column("lease_sha256", Text),
    Column("reserved_for", BigInteger),
    # the countable devices it offers ({"gpu": 2}; docs/placement.md)
    Column("devices", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    # what of its agent hangs on file:// sources that did not answer, at its last beat:
    # threads left to an open or read, spawn helpers' checkers (cairn_workers_hung_sources)
    Column("hung_source_threads", Integer, nullable=False, server_default=text("0")),
    Column("hung_source_checkers", Integer, nullable=False, server_default=text("0")),
    CheckConstraint(sql_in("state", WORKER_STATES), name="state"),
    CheckConstraint(
        "hung_source_threads >= 0 AND hung_source_checkers >= 0", name="hung_non_negative"
    ),
    CheckConstraint("cpu > 0 AND memory_mb > 0", name="capacity_positive"),
    CheckConstraint(
        f"({sql_in('state', Workers.GONE)}) = (gone_at IS NOT NULL)", name="gone_has_time"
    ),
    Index(
        "ix_workers_heartbeat",
        "last_heartbeat_at",
        postgresql_where=text(sql_in("state", Workers.PRESENT)),
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
    # What the attempt wrote to its CAIRN_OUTPUTS file (a JSON object of at most 64 KiB).
    Column("outputs", JSONB),
    # The signal that killed it, when its worker did not send it (a ``crashed`` report).
    Column("signal", SmallInteger),
    # sha-256 of the attempt's fencing secret (its token: docs/progress.md)
    Column("fence_sha256", LargeBinary),
    # the devices it holds ({"gpu": 1}), NULL for none
    Column("charge_devices", JSONB),
    # A service's replica, as its agent reports it (docs/services.md): its readiness
    # probe passes, since when, its host's address and the port of each declared name.
    Column("ready", Boolean),
    Column("ready_at", DateTime(timezone=True)),
    Column("address", Text),
    Column("ports", JSONB),
    # The output's length its worker reported, when the end of its log was still on its
    # way to core then (docs/logs.md: late chunks); NULL: core had it all, or no report.
    Column("log_bytes", BigInteger),
    CheckConstraint("log_bytes >= 0", name="log_bytes"),
    CheckConstraint("(outcome IS NULL) = (ended_at IS NULL)", name="ended_has_outcome"),
    CheckConstraint(
        sql_in("outcome", ATTEMPT_OUTCOMES),
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
    # Room in each page for the updates that change no indexed column (``seen_at``: a
    # start's acknowledgement, a heartbeat), so that they are HOT (migration 0033).
    postgresql_with={"fillfactor": 80},
)

# A task's latest progress and checkpoint (docs/progress.md): one row per task that
# reported any, written by its current attempt's worker, kept across its attempts.
task_progress = Table(
    "task_progress",
    metadata,
    Column(
        "task_id",
        BigInteger,
        ForeignKey("tasks.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("attempt_id", BigInteger, nullable=False),
    Column("fraction", Double),
    Column("message", Text),
    Column("progress_at", DateTime(timezone=True)),
    Column("checkpoint", LargeBinary),
    Column("checkpoint_attempt_id", BigInteger),
    Column("checkpoint_at", DateTime(timezone=True)),
    CheckConstraint("fraction IS NULL OR fraction BETWEEN 0 AND 1", name="fraction"),
    CheckConstraint("char_length(message) <= 200", name="message_size"),
    CheckConstraint("octet_length(checkpoint) <= 65536", name="checkpoint_size"),
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


def _share_columns() -> list[SchemaItem]:
    """A share's weight, quotas and submit-rate window, and their checks: an owner's
    (``shares``) and a team's (``team_shares``) are the same (fresh objects a table)."""
    return [
        Column("weight", Double, nullable=False, server_default=text("1")),
        Column("max_cpu", Double),
        Column("max_memory_mb", Double),
        Column("max_running", Integer),
        Column("max_waiting", Integer),
        Column("max_submits_per_min", Integer),
        Column("rate_window_at", DateTime(timezone=True)),
        Column("rate_count", Integer, nullable=False, server_default=text("0")),
        Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
        # running quota of countable devices, by name ({"gpu": 4})
        Column("max_devices", JSONB),
        CheckConstraint("weight > 0 AND weight <= 1000", name="weight_range"),
        CheckConstraint(
            "(max_cpu IS NULL OR max_cpu > 0) AND (max_memory_mb IS NULL OR max_memory_mb > 0)"
            " AND (max_running IS NULL OR max_running > 0)"
            " AND (max_waiting IS NULL OR max_waiting > 0)"
            " AND (max_submits_per_min IS NULL OR max_submits_per_min > 0)",
            name="limits_positive",
        ),
    ]


# Share and quotas of a principal by name: an owner today; a team slots in by its name.
shares = Table(
    "shares",
    metadata,
    Column("name", Text, primary_key=True),
    *_share_columns(),
)

# A team's share and quotas, as ``shares`` holds an owner's (docs/sharing.md, "Teams").
team_shares = Table(
    "team_shares",
    metadata,
    Column("team", Text, ForeignKey("teams.name", ondelete="CASCADE"), primary_key=True),
    *_share_columns(),
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
    Column("truncated", Boolean, nullable=False, server_default=text("false")),
    Column("size", BigInteger, nullable=False, server_default=text("0")),
    Column("length", BigInteger, nullable=False, server_default=text("0")),
    Column("start_pos", BigInteger, nullable=False, server_default=text("0")),
    Column("archived_at", DateTime(timezone=True)),
    CheckConstraint("size >= 0 AND start_pos >= 0 AND length >= start_pos", name="positions"),
    Index("ix_attempt_logs_unarchived", "attempt_id", postgresql_where=text("archived_at IS NULL")),
)

# Live logs (docs/logs.md): the chunks of each attempt's log, by stored position.
log_chunks = Table(
    "log_chunks",
    metadata,
    Column(
        "attempt_id",
        BigInteger,
        ForeignKey("attempts.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("pos", BigInteger, primary_key=True),
    Column("bytes", Integer, nullable=False),
    Column("content", Text, nullable=False),
    CheckConstraint("pos >= 0 AND bytes > 0", name="sizes"),
)

# Logs moved to the object store; kept past their task until the object is deleted.
log_objects = Table(
    "log_objects",
    metadata,
    Column("key", Text, primary_key=True),
    Column("task_id", BigInteger, nullable=False),
    Column("attempt_id", BigInteger, nullable=False),
    Column(
        "archived_at",
        DateTime(timezone=True),
        nullable=False,
        server_default=func.now(),
        index=True,
    ),
)

task_events = Table(
    "task_events",
    metadata,
    Column("id", BigInteger, Identity(always=True), nullable=False),
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
    # Its natural key: nothing reads an event by its id alone (the feed walks ``(xid,
    # id)``), so ``id`` has no index of its own (migration 0040_task_indexes).
    PrimaryKeyConstraint("task_id", "seq"),
    Index("ix_task_events_xid_id", "xid", "id"),
    # A user's feed reads its own events by owner, in feed order (``queries.FEED_OWN``).
    Index("ix_task_events_owner", "owner", "xid", "id"),
    # The notification matcher's feed (``queries.feed_statement``): deaths only.
    Index("ix_task_events_dead", "xid", "id", postgresql_where=text(f"to_state = '{S.DEAD}'")),
)


# --- notifications (docs/notifications.md) ------------------------------------------------

Index(
    "ix_tasks_deadline_id",
    tasks.c.deadline,
    tasks.c.id,
    postgresql_where=text("deadline IS NOT NULL"),
)

subscriptions = Table(
    "subscriptions",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("owner", Text, nullable=False),
    Column("name", Text, nullable=False),
    Column("events", ARRAY(Text), nullable=False),
    Column("queue", Text),
    Column("labels", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("url", Text, nullable=False),
    # The HMAC key, sealed as secrets are (identity/crypto.py), bound to owner and name.
    Column("secret_key_id", Text, nullable=False),
    Column("secret_nonce", LargeBinary, nullable=False),
    Column("secret_sealed", LargeBinary, nullable=False),
    # When its last ``test`` delivery was queued: the next waits CAIRN_NOTIFY_TEST_INTERVAL_S.
    Column("tested_at", DateTime(timezone=True)),
    Column("enabled", Boolean, nullable=False, server_default=text("true")),
    Column("disabled_reason", Text),
    Column("failures", Integer, nullable=False, server_default=text("0")),
    _now(),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    UniqueConstraint("owner", "name"),
    CheckConstraint("enabled = (disabled_reason IS NULL)", name="disabled_has_reason"),
    CheckConstraint("failures >= 0", name="failures_non_negative"),
    CheckConstraint("cardinality(events) > 0", name="has_events"),
)

notifications = Table(
    "notifications",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column(
        "subscription_id",
        BigInteger,
        ForeignKey("subscriptions.id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("event", Text, nullable=False),
    Column("dedupe_key", Text, nullable=False),
    Column(
        "delivery_id",
        UUID(as_uuid=True),
        nullable=False,
        unique=True,
        server_default=text("gen_random_uuid()"),
    ),
    Column("payload", JSONB, nullable=False),
    Column("state", Text, nullable=False, server_default=text("'pending'")),
    Column("tries", Integer, nullable=False, server_default=text("0")),
    Column("next_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    _now(),
    Column("finished_at", DateTime(timezone=True)),
    Column("last_status", Integer),
    Column("last_error", Text),
    Column("last_at", DateTime(timezone=True)),
    UniqueConstraint("subscription_id", "dedupe_key"),
    CheckConstraint("state IN ('delivered', 'failed', 'pending')", name="state"),
    CheckConstraint("(state = 'pending') = (finished_at IS NULL)", name="final_has_finished_at"),
    CheckConstraint("tries >= 0", name="tries_non_negative"),
    Index("ix_notifications_next_at", "next_at", postgresql_where=text("state = 'pending'")),
    Index(
        "ix_notifications_finished_at",
        "finished_at",
        postgresql_where=text("finished_at IS NOT NULL"),
    ),
)

notification_answers = Table(
    "notification_answers",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column(
        "notification_id",
        BigInteger,
        ForeignKey("notifications.id", ondelete="CASCADE"),
        nullable=False,
        index=True,
    ),
    Column("subscription_id", BigInteger, nullable=False),
    Column("try", Integer, nullable=False),
    Column("at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("status", Integer),
    Column("error", Text),
    Column("duration_ms", Double, nullable=False),
    Index("ix_notification_answers_subscription_id_id", "subscription_id", "id"),
)

#: what ended attempts used, per month (its first day), owner, team ('' for none) and
#: queue, rolled up from the feed (``db/accounting.py``; docs/sharing.md "Usage")
usage_monthly = Table(
    "usage_monthly",
    metadata,
    Column("month", Date, primary_key=True),
    Column("owner", Text, primary_key=True),
    Column("team", Text, primary_key=True, server_default=text("''")),
    Column("queue", Text, primary_key=True),
    Column("attempts", BigInteger, nullable=False, server_default=text("0")),
    Column("wall_s", Double, nullable=False, server_default=text("0")),
    Column("cpu_s", Double, nullable=False, server_default=text("0")),
    Column("cpu_reserved_s", Double, nullable=False, server_default=text("0")),
    Column("memory_mb_s", Double, nullable=False, server_default=text("0")),
    Column("peak_memory_mb", Double, nullable=False, server_default=text("0")),
    CheckConstraint("EXTRACT(DAY FROM month) = 1", name="first_day"),
    Index("ix_usage_monthly_month_team", "month", "team"),
)

#: each fair-share flow's reserved core-seconds (an owner's own work: kind ``owner``; a
#: team's: ``team``), decayed with ``CAIRN_FAIR_SHARE_HALF_LIFE_S``, as of ``at`` (a reader
#: decays it to its now): kept by the usage roll-up, read by the claim in queues with
#: ``fair_share: usage`` (``db/accounting.py``; docs/sharing.md "Fair share by usage")
fair_usage = Table(
    "fair_usage",
    metadata,
    Column("kind", Text, primary_key=True),
    Column("name", Text, primary_key=True),
    Column("cpu_s", Double, nullable=False, server_default=text("0")),
    Column("at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    CheckConstraint("kind IN ('owner', 'team')", name="kind"),
)

#: the device-seconds of the same attempts, per device name (``db/accounting.py``)
usage_monthly_devices = Table(
    "usage_monthly_devices",
    metadata,
    Column("month", Date, primary_key=True),
    Column("owner", Text, primary_key=True),
    Column("team", Text, primary_key=True, server_default=text("''")),
    Column("queue", Text, primary_key=True),
    Column("device", Text, primary_key=True),
    Column("device_s", Double, nullable=False, server_default=text("0")),
    CheckConstraint("EXTRACT(DAY FROM month) = 1", name="first_day"),
)

notify_cursors = Table(
    "notify_cursors",
    metadata,
    Column("name", Text, primary_key=True),
    Column("feed_xid", BigInteger, nullable=False, server_default=text("0")),
    Column("feed_id", BigInteger, nullable=False, server_default=text("0")),
    Column("deadline_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("deadline_id", BigInteger, nullable=False, server_default=text("0")),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

#: core's leader epoch (libs/common/leader.py): the replica running the singleton loops
leader = leader_table(metadata)
