"""The DAG service's schema as SQLAlchemy Core tables. The migrations build it; a test
diffs the two."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

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
    SmallInteger,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

from libs.common.dag_models import RUN_FINAL, NodeState, RunState
from libs.common.leader import leader_table
from libs.common.schema import metadata_for

SCHEMA = "dag"

metadata = metadata_for(SCHEMA)


def _in(column: str, values: Iterable[StrEnum]) -> str:
    return f"{column} IN ({', '.join(repr(str(v)) for v in sorted(values))})"


def _at(name: str, nullable: bool = False) -> Column[object]:
    default = None if nullable else func.now()
    return Column(name, DateTime(timezone=True), nullable=nullable, server_default=default)


workflows = Table(
    "workflows",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("owner", Text, nullable=False),
    # The team that owns this version with its owner (its members see and run it).
    Column("team", Text),
    Column("name", Text, nullable=False),
    Column("version", Integer, nullable=False),
    Column("definition", JSONB, nullable=False),
    Column("definition_hash", Text, nullable=False),
    Column("node_count", Integer, nullable=False),
    _at("created_at"),
    UniqueConstraint("owner", "name", "version"),
    Index("ix_workflows_team", "team", postgresql_where=text("team IS NOT NULL")),
    CheckConstraint("version > 0", name="version_positive"),
    CheckConstraint("node_count > 0", name="has_nodes"),
)

runs = Table(
    "runs",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column(
        "workflow_id",
        BigInteger,
        ForeignKey("workflows.id", ondelete="RESTRICT"),
        nullable=False,
        index=True,
    ),
    Column("owner", Text, nullable=False),
    # The workflow version's team: its members see and act on the run.
    Column("team", Text),
    Column("workflow", Text, nullable=False),
    Column("workflow_version", Integer, nullable=False),
    Column("params", JSONB, nullable=False),
    Column("state", Text, nullable=False, server_default=text("'queued'")),
    Column("idempotency_key", Text),
    _at("created_at"),
    _at("updated_at"),
    _at("started_at", nullable=True),
    _at("finished_at", nullable=True),
    Column("timeout_s", Integer),
    _at("deadline", nullable=True),
    Column("reason", Text),
    Column("max_active_nodes", Integer),
    Column("task_timeout_s", Integer),
    # A sub-workflow's run: the parent run, node and try that started it (at most one
    # child each), and how deep it nests (0: started by a person, cron or a trigger).
    Column("parent_run_id", BigInteger),
    Column("parent_node", Text),
    Column("parent_try", Integer),
    Column("depth", SmallInteger, nullable=False, server_default=text("0")),
    CheckConstraint(_in("state", RunState), name="state"),
    CheckConstraint(
        "(parent_run_id IS NULL) = (parent_node IS NULL)"
        " AND (parent_run_id IS NULL) = (parent_try IS NULL)"
        " AND (parent_run_id IS NULL) = (depth = 0)",
        name="parent_whole",
    ),
    CheckConstraint("timeout_s IS NULL OR timeout_s > 0", name="timeout_positive"),
    CheckConstraint(
        "max_active_nodes IS NULL OR max_active_nodes > 0", name="max_active_nodes_positive"
    ),
    CheckConstraint("task_timeout_s IS NULL OR task_timeout_s > 0", name="task_timeout_positive"),
    CheckConstraint(
        f"({_in('state', RUN_FINAL)}) = (finished_at IS NOT NULL)", name="final_has_time"
    ),
    CheckConstraint("state = 'queued' OR started_at IS NOT NULL", name="started_has_time"),
    Index(
        "ix_runs_idempotency",
        "owner",
        "idempotency_key",
        unique=True,
        postgresql_where=text("idempotency_key IS NOT NULL"),
    ),
    Index("ix_runs_team_id", "team", "id", postgresql_where=text("team IS NOT NULL")),
    Index(
        "ix_runs_parent",
        "parent_run_id",
        "parent_node",
        "parent_try",
        unique=True,
        postgresql_where=text("parent_run_id IS NOT NULL"),
    ),
    # Retention deletes the oldest finished runs first.
    Index("ix_runs_finished_at", "finished_at", postgresql_where=text("finished_at IS NOT NULL")),
    # Admission counts the active runs of one workflow.
    Index(
        "ix_runs_active",
        "owner",
        "workflow",
        "state",
        "id",
        postgresql_where=text("state IN ('queued', 'running')"),
    ),
    # A workflow's recent runs (the history grid).
    Index("ix_runs_workflow", "owner", "workflow", "id"),
    # The loop fails running runs past their deadline.
    Index(
        "ix_runs_deadline",
        "deadline",
        postgresql_where=text("state = 'running' AND deadline IS NOT NULL"),
    ),
)

nodes = Table(
    "nodes",
    metadata,
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("name", Text, primary_key=True),
    Column("state", Text, nullable=False, server_default=text("'pending'")),
    Column("try_number", Integer, nullable=False, server_default=text("1")),
    Column("task_id", BigInteger),
    Column("error", Text),
    _at("updated_at"),
    Column("outputs", JSONB),
    # An instance of a mapped node (named NODE[INDEX]): its node, index and item.
    Column("map_of", Text),
    Column("map_index", Integer),
    Column("map_item", JSONB),
    # An approval gate: when it stops waiting, and its decision (decided_by NULL: its
    # timeout decided). A decision is written once, while the node waits; the loop then
    # moves the node on.
    _at("wait_until", nullable=True),
    Column("decision", Text),
    Column("decided_by", Text),
    _at("decided_at", nullable=True),
    Column("comment", Text),
    # The decider's role, and whether the decision still waits to be reported to core's
    # audit trail (the loop reports it, then clears this).
    Column("decided_role", Text),
    Column("audit_pending", Boolean, nullable=False, server_default=text("false")),
    # A sub-workflow node: the child run it started (in place of a task).
    Column("child_run_id", BigInteger),
    # An event node: the event it waits for (set when it starts waiting).
    Column("event", Text),
    # When its rule was met this try (the history grid's durations run from it).
    _at("started_at", nullable=True),
    CheckConstraint(_in("state", NodeState), name="state"),
    CheckConstraint("decision IS NULL OR decision IN ('approve', 'reject')", name="decision"),
    CheckConstraint("(decision IS NULL) = (decided_at IS NULL)", name="decision_has_time"),
    CheckConstraint("(map_of IS NULL) = (map_index IS NULL)", name="instance_has_index"),
    CheckConstraint("try_number > 0", name="try_positive"),
    # A cancelling node without a task: its release may have reached core unrecorded.
    CheckConstraint(
        "task_id IS NOT NULL OR child_run_id IS NOT NULL OR state NOT IN ('released', 'running')",
        name="live_has_task",
    ),
    # Feed events find their node through the task; a task belongs to one node's try.
    Index("ix_nodes_task_id", "task_id", unique=True, postgresql_where=text("task_id IS NOT NULL")),
    # The releaser's and the canceller's work lists.
    Index("ix_nodes_to_do", "state", postgresql_where=text("state IN ('ready', 'cancelling')")),
    # The loop's sub-workflow nodes waiting on (or cancelling) their child run.
    Index(
        "ix_nodes_children",
        "child_run_id",
        postgresql_where=text("child_run_id IS NOT NULL AND state IN ('running', 'cancelling')"),
    ),
    Index("ix_nodes_audit_pending", "decided_at", postgresql_where=text("audit_pending")),
    # The loop's approval gates: decided ones to move on, and the next timeout.
    Index("ix_nodes_waiting", "wait_until", postgresql_where=text("state = 'waiting'")),
    # The resync's work list: nodes waiting on a live task, oldest change first.
    Index(
        "ix_nodes_live",
        "updated_at",
        postgresql_where=text("state IN ('released', 'running', 'cancelling')"),
    ),
)

feed_cursor = Table(
    "feed_cursor",
    metadata,
    Column("id", SmallInteger, primary_key=True, autoincrement=False),
    Column("cursor", Text, nullable=False),
    _at("updated_at"),
    CheckConstraint("id = 1", name="one_row"),
)

# Events delivered to runs: once per run and name, kept until a node waits for them.
run_events = Table(
    "run_events",
    metadata,
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("name", Text, primary_key=True),
    Column("data", JSONB, nullable=False),
    Column("sent_by", Text, nullable=False),
    _at("created_at"),
)

# Signed HTTP triggers: each delivery starts a run of the owner's workflow; a delivery's
# idempotency key is the run's (``trigger:ID:KEY``, unique per owner in dag.runs).
triggers = Table(
    "triggers",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("owner", Text, nullable=False),
    Column("workflow", Text, nullable=False),
    # The HMAC key: verifying a signature needs it as is.
    Column("secret", Text, nullable=False),
    Column("params", JSONB),
    Column("key_path", Text),
    _at("created_at"),
    Index("ix_triggers_owner", "owner", "workflow"),
)

leader = leader_table(metadata)
