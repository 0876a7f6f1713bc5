"""core.tasks' one-column rules become domains (issue 35, "cheaper moves in PostgreSQL").

PostgreSQL checks every CHECK constraint of a table on each UPDATE of one of its rows,
and reads and plans each one afresh for each statement: a task's every move paid for
eighteen. A domain's check runs only where a value is made into the column's type (an
INSERT, an UPDATE that sets that column), planned once and kept in the type cache. So
each one-column rule becomes the check of a domain of its own, ``core.tasks_<column>``,
under the constraint's old name (an error still names the rule); the four rules that tie
columns together stay CHECK constraints of the table.

No row is rewritten: a column takes its domain while the domain has no check yet (a
change of type PostgreSQL knows needs no new row), then each domain gets its check,
which reads the rows once to validate them. PostgreSQL builds again the partial indexes
whose predicate names ``state`` (and those on ``kind``, ``priority``) and checks the four
CHECKs left, a read of the table each: 2.2 to 3 s for 300,000 tasks (98 MB of rows),
under the ALTER TABLE's lock; the downgrade, 1.8 s. Half of the upgrade's is the domains'
checks, a read of the table each (1.07 s of 2.2). Both ways it then analyses the changed
columns again if they had statistics (``_analyse``: the change of type loses them), 0.4 s
more under the lock at 300,000 tasks.

Revision ID: 0033_task_domains
Revises: 0032_source_handbacks
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

revision = "0033_task_domains"
down_revision = "0032_source_handbacks"
branch_labels = None
depends_on = None

_STATES = "'cancelled', 'dead', 'failed', 'ready', 'running', 'succeeded', 'waiting'"

# (column, its type, the rule's name, the rule on VALUE: on the column, VALUE is its name)
RULES = [
    ("state", "TEXT", "state", f"VALUE IN ({_STATES})"),
    ("kind", "TEXT", "kind", "VALUE IN ('service', 'task')"),
    ("priority", "SMALLINT", "priority_range", "VALUE BETWEEN -100 AND 100"),
    ("max_attempts", "INTEGER", "max_attempts_positive", "VALUE > 0"),
    ("poison_after", "INTEGER", "poison_after_positive", "VALUE > 0"),
    ("poison_window_s", "DOUBLE PRECISION", "poison_window_positive", "VALUE > 0"),
    ("attempts", "INTEGER", "counts_non_negative", "VALUE >= 0"),
    ("crashes", "INTEGER", "counts_non_negative", "VALUE >= 0"),
    ("source_handbacks", "INTEGER", "source_handbacks_non_negative", "VALUE >= 0"),
    ("cpu", "DOUBLE PRECISION", "resources_positive", "VALUE > 0"),
    ("memory_mb", "INTEGER", "resources_positive", "VALUE > 0"),
    ("disk_mb", "INTEGER", "disk_positive", "VALUE IS NULL OR VALUE > 0"),
    ("timeout_s", "INTEGER", "timeout_positive", "VALUE IS NULL OR VALUE > 0"),
    ("progress_timeout_s", "INTEGER", "progress_timeout_positive", "VALUE IS NULL OR VALUE > 0"),
    ("concurrency_limit", "INTEGER", "concurrency_limit_positive", "VALUE IS NULL OR VALUE > 0"),
    ("artifact_credentials", "JSONB", "artifact_credentials", "jsonb_typeof(VALUE) = 'object'"),
]

# The table's rules that two columns made one (counts, resources), as they stood.
_PAIRS = {
    "counts_non_negative": "attempts >= 0 AND crashes >= 0",
    "resources_positive": "cpu > 0 AND memory_mb > 0",
}


def _table_rules() -> dict[str, str]:
    rules = {name: on_value.replace("VALUE", column) for column, _, name, on_value in RULES}
    return {**rules, **_PAIRS}


def _analysed() -> bool:
    """Whether the planner has statistics of the columns changed here (ANALYZE or
    autovacuum read the table since it was made)."""
    found = op.get_bind().execute(
        text(
            "SELECT EXISTS (SELECT FROM pg_stats WHERE schemaname = 'core'"
            " AND tablename = 'tasks' AND attname = ANY(:columns))"
        ),
        {"columns": [c for c, *_ in RULES]},
    )
    return bool(found.scalar())


def _analyse(analysed: bool) -> None:
    """What the planner knew of the changed columns, read again: ALTER COLUMN ... TYPE
    drops their statistics even where no row is rewritten, and autovacuum analyses the
    table again only once a tenth of it has changed. Meanwhile the planner guesses
    (``state = 'waiting'``: 0.5 % of the rows) and a connection keeps the generic plans
    of a turn's statements made then. A sample of the table (30,000 rows at most). Not
    on a table never analysed (a new install's): analysed empty, the planner would take
    it at its size as it grows instead of at ten pages at least."""
    if analysed:
        op.execute(f"ANALYZE core.tasks ({', '.join(c for c, *_ in RULES)})")


def upgrade() -> None:
    analysed = _analysed()
    for column, base, _, _ in RULES:
        op.execute(f"CREATE DOMAIN core.tasks_{column} AS {base}")
    changes = [f"DROP CONSTRAINT ck_tasks_{name}" for name in _table_rules()]
    changes += [f"ALTER COLUMN {c} TYPE core.tasks_{c}" for c, *_ in RULES]
    op.execute("ALTER TABLE core.tasks " + ", ".join(changes))
    for column, _, name, on_value in RULES:
        op.execute(
            f"ALTER DOMAIN core.tasks_{column} ADD CONSTRAINT ck_tasks_{name} CHECK ({on_value})"
        )
    _analyse(analysed)


def downgrade() -> None:
    analysed = _analysed()
    changes = [f"ALTER COLUMN {c} TYPE {base}" for c, base, *_ in RULES]
    changes += [f"ADD CONSTRAINT ck_tasks_{n} CHECK ({rule})" for n, rule in _table_rules().items()]
    op.execute("ALTER TABLE core.tasks " + ", ".join(changes))
    for column, *_ in RULES:
        op.execute(f"DROP DOMAIN core.tasks_{column}")
    _analyse(analysed)
