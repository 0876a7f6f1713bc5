"""Every PostgreSQL advisory lock key Cairn takes, in one place, so that no two uses share
one. The services may share a database: a key is either one bigint or a pair of
integers (class, object), and PostgreSQL keeps both in one space (a bigint ``k`` is the
pair ``(k >> 32, k & 0xffffffff)``), so the classes below are chosen apart from the
bigints' high halves (0 for every bigint key here)."""

from __future__ import annotations

# --- one bigint each ---------------------------------------------------------------------
#: a service's Alembic migrations, one migrator at a time (libs/common/migrations.py)
MIGRATIONS = 0x0CA1_C0DE
#: the cron service's leader (services/cron/engine.py)
CRON_LEADER = 0x0CA1_C709
#: the dag service's leader (services/dag/engine.py)
DAG_LEADER = 0x0CA1_0DA6
#: core's leader, the replica that runs core's singleton loops (services/core/loops.py)
CORE_LEADER = 0x0CA1_C0E0

# --- core: (class, object) pairs -----------------------------------------------------------
#: core's singletons, one replica at a time each: object 1 the placement pass, 2 the
#: notification matcher, 3 the deadline scan
CORE = 4707
PLACEMENT_PASS = (CORE, 1)
MATCHER = (CORE, 2)
DEADLINE_SCAN = (CORE, 3)
# Classes whose object is a name's hashtext. A claim takes owners' running quotas, then
# teams', then concurrency keys; a submission owners' submission quotas, then teams':
# each sorted, in that order, so that no two transactions deadlock.
OWNER_RUNNING = 4708
CONCURRENCY_KEY = 4709
OWNER_SUBMITS = 4710
TEAM_RUNNING = 4711
TEAM_SUBMITS = 4712
#: an owner's test deliveries of webhooks (one at a time, so that the limit holds)
WEBHOOK_TESTS = 4713
#: the running tasks of one owner and name spread across a label (a service's replicas):
#: one claim at a time decides where the next goes; a claim takes these (sorted) before
#: the quota classes above
SPREAD_GROUP = 4714

#: dag's per-(owner, workflow) writer locks are ``hashtextextended`` (64 bits) of a
#: ``dag/...`` name: spread over the whole space, a clash with the keys above has odds
#: of about 2**-60.
ALL_BIGINTS = (MIGRATIONS, CRON_LEADER, DAG_LEADER, CORE_LEADER)
ALL_CLASSES = (
    CORE, OWNER_RUNNING, CONCURRENCY_KEY, OWNER_SUBMITS, TEAM_RUNNING, TEAM_SUBMITS, WEBHOOK_TESTS,
    SPREAD_GROUP,
)  # fmt: skip
