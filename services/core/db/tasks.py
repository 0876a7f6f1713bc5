"""Tasks in the database: submission, reads, the feed, promotion, purge and queues' depth.
Every state change goes through ``transition`` (one task) or one of the bulk statements
below (many), both guarded by the rules of ``domain.transitions``. The named SQL of the
hot paths is written as text; plain reads with SQLAlchemy Core."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import namedtuple_row
from sqlalchemy import (
    Boolean,
    Row,
    TextClause,
    and_,
    bindparam,
    func,
    literal_column,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common import pipeline
from libs.common.auth import Visibility
from libs.common.errors import IdempotencyMismatch, IllegalTransition, InvalidInput, NotFound
from libs.common.models import (
    Attempt,
    Egress,
    Event,
    QueueHistory,
    QueueInfo,
    QueueSeries,
    Task,
    TaskCreate,
    TaskSelector,
)
from libs.common.states import FINAL, TaskState, Workers, sql_in
from libs.common.stored import as_stored
from services.core.db import accounting, readings
from services.core.db.params import jsonb
from services.core.db.tables import (
    LABELLED,
    attempts,
    queues,
    task_events,
    tasks,
)
from services.core.domain import selectors
from services.core.domain.limits import Defaults, Filled
from services.core.domain.sharing import FairShare
from services.core.domain.transitions import Op, check, sources

S = TaskState

# --- the named SQL of the hot paths ------------------------------------------------------

TASK_COLUMNS = """
    id, owner, name, queue, priority, kind, artifact_uri, artifact_sha256, args, env,
    input_path, output_path, cpu, memory_mb, preemptible, max_attempts, backoff_base_s,
    backoff_cap_s, backoff_jitter, poison_after, timeout_s, run_at, idempotency_key,
    spec_hash, labels, state, attempts, last_error, current_attempt_id, created_at,
    updated_at, finished_at, defer_ok, deadline, team, concurrency_key, concurrency_limit,
    start_by, poison_window_s, retry_causes, progress_timeout_s, placement,
    artifact_credentials, devices, disk_mb, service
"""

# What a submission reads back: what the database decided (its time limits too: the
# queue's and core's defaults, domain.limits). The rest is the spec.
SUBMITTED_COLUMNS = (
    "id, owner, state, idempotency_key, spec_hash, run_at, created_at, updated_at,"
    " timeout_s, start_by, poison_window_s, disk_mb"
)

# A task's crashes within its window (towards poison_after: domain.outcomes), and its
# crash times with one more now, the last poison_after of them kept.
RECENT_CRASHES = """(SELECT count(*) FROM unnest(t.crashed_at) c
    WHERE c > now() - make_interval(secs => t.poison_window_s))::int"""
CRASHED_NOW = """(array_append(t.crashed_at, now()))[
    greatest(1, cardinality(t.crashed_at) + 2 - t.poison_after):]"""

# Fair share (docs/sharing.md): a flow's work in a queue is stamped one step (the quantum
# over its weight) after its last waiting stamp; a flow with nothing waiting starts at the
# queue's head stamp (or now, if that is later), so it interleaves with a backlog instead
# of queueing behind it. A flow is an owner's own work, or a team's work (whoever of its
# members submitted it). "waiting" is spelled as a range, as in the flow's index
# (ix_tasks_owner_last, ix_tasks_team_last; migration 0014_flow_last says why), so that
# no other index can serve the read. The rule is written once, here, and read by both
# forms of the submit below: per flow (many rows) and for one row.


def _flow_reads(owner: str, team: str, queue: str) -> str:
    """A flow's reads as select items: its last waiting stamp (``last``), its weight, and
    its queue's (joined as ``q``) rule and pause."""
    waiting = f"w.state >= '{S.WAITING}' AND w.state <= '{S.WAITING}'"
    return f"""CASE WHEN {team} IS NULL THEN
        (SELECT max(w.vtime) FROM core.tasks w WHERE w.owner = {owner} AND w.queue = {queue}
           AND {waiting} AND w.team IS NULL)
    ELSE (SELECT max(w.vtime) FROM core.tasks w WHERE w.team = {team} AND w.queue = {queue}
           AND {waiting} AND w.team IS NOT NULL) END AS last,
    COALESCE(CASE WHEN {team} IS NULL
        THEN (SELECT s.weight FROM core.shares s WHERE s.name = {owner})
        ELSE (SELECT s.weight FROM core.team_shares s WHERE s.team = {team}) END, 1) AS weight,
    COALESCE(q.policy->>'fair_share', CAST(:fair_share AS text)) = 'usage' AS by_usage,
    COALESCE(q.paused, false) AS paused"""


# A flow's step, and how far its usage pushes it (a queue that weighs usage: its decayed
# reserved core-seconds over its weight, in steps of the quantum: its new work is stamped
# no earlier than that far after now), over ``_flow_reads`` fenced as ``c`` (OFFSET 0
# keeps the planner from copying a read into every place its column is used).
_FLOW_CLOCK = f"""c.*, CAST(:quantum AS double precision) / c.weight AS step,
    CASE WHEN c.by_usage THEN COALESCE((
        SELECT u.cpu_s * {accounting.decay("u.at", "now()", ":fair_half_life")}
        FROM core.fair_usage u
        WHERE u.kind = CASE WHEN c.team IS NULL THEN 'owner' ELSE 'team' END
          AND u.name = COALESCE(c.team, c.owner)), 0)
        * CAST(:quantum AS double precision) / (:fair_unit * c.weight)
    ELSE 0 END AS pushed"""


def _stamp(k: str, nth: str) -> str:
    """The stamp of a row of flow clock ``k``, the ``nth`` (from 0) of its flow here."""
    now = "EXTRACT(EPOCH FROM now())"
    return f"""GREATEST(EXTRACT(EPOCH FROM COALESCE(run_at, now())),
    CASE WHEN {k}.pushed > 0 THEN GREATEST({k}.last + {k}.step, {now} + {k}.pushed)
         ELSE COALESCE({k}.last + {k}.step, LEAST({now},
             (SELECT min(h.vtime) FROM core.tasks h
              WHERE h.queue = {k}.queue AND h.state = '{S.WAITING}'))) END
    + {k}.step * ({nth}))"""


# The rows, as stamped (``stamped``: core.tasks columns, ``stamp``, ``paused``, ``ord``,
# ``max_wait_s``), stored with their events.
_STORE = f"""new AS (
    INSERT INTO core.tasks (
        owner, name, queue, priority, kind, artifact_uri, artifact_sha256, args, env,
        input_path, output_path, cpu, memory_mb, preemptible, max_attempts, backoff_base_s,
        backoff_cap_s, backoff_jitter, poison_after, timeout_s, run_at, idempotency_key,
        spec_hash, labels, defer_ok, deadline, team, concurrency_key, concurrency_limit, vtime,
        start_by, poison_window_s, retry_causes, progress_timeout_s, placement, required,
        artifact_credentials, devices, disk_mb, service, state
    )
    SELECT
        owner, name, queue, priority, kind, artifact_uri, artifact_sha256, args, env,
        input_path, output_path, cpu, memory_mb, preemptible, max_attempts, backoff_base_s,
        backoff_cap_s, backoff_jitter, poison_after, timeout_s, COALESCE(run_at, now()),
        idempotency_key, spec_hash, labels, defer_ok, deadline, team, concurrency_key,
        concurrency_limit, stamp,
        -- the earlier of its own start_by and its wait bound, counted from when it is due
        LEAST(start_by, COALESCE(run_at, now()) + make_interval(secs => max_wait_s)),
        poison_window_s, retry_causes, progress_timeout_s, placement, required,
        artifact_credentials, devices, disk_mb, service,
        CASE WHEN run_at > now() OR paused THEN '{S.READY}' ELSE '{S.WAITING}' END
    FROM stamped
    ORDER BY ord
    ON CONFLICT (owner, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING {SUBMITTED_COLUMNS}
), events AS (
    INSERT INTO core.task_events (task_id, seq, owner, op, from_state, to_state)
    SELECT id, 1, owner, 'submit', NULL, state FROM new
)"""

_NTH_OF_FLOW = """row_number() OVER (
    PARTITION BY clock.owner, clock.team, input.queue ORDER BY input.ord) - 1"""

# Rows arrive as one JSON array, each read as a core.tasks row (the keys it lacks NULL,
# the keys that are no column ignored; ``vtime`` and ``state`` are set below), and the
# wait bounds, which are no column, as a second array in the same order (``:waits``);
# ORDER BY ord makes identities follow the given order. No list of columns and types here
# keeps the statement under psycopg's 4,096-byte parse cache
# (tests/integration/core/test_pipeline.py). ``json``, not ``jsonb``: read straight into
# the records, not built into a document first, about 3 µs of PostgreSQL's CPU a row less
# (docs/benchmarks.md, "Submit"). A flow's reads are made once for its rows.
_SUBMIT = f"""
WITH input AS (
    SELECT r.*, CAST(w.wait AS integer) AS max_wait_s, r.ordinality AS ord
    FROM json_populate_recordset(CAST(NULL AS core.tasks), CAST(:rows AS json))
        WITH ORDINALITY AS r
    JOIN json_array_elements_text(CAST(:waits AS json)) WITH ORDINALITY AS w(wait, n)
        ON w.n = r.ordinality
), clock AS (
    SELECT {_FLOW_CLOCK}
    FROM (SELECT f.flow_owner AS owner, f.team, f.queue,
                 {_flow_reads("f.flow_owner", "f.team", "f.queue")}
          FROM (SELECT DISTINCT CASE WHEN team IS NULL THEN owner END AS flow_owner, team,
                       queue
                FROM input) f
          LEFT JOIN core.queues q ON q.name = f.queue
          OFFSET 0) c
    OFFSET 0
), stamped AS (
    SELECT input.*, clock.paused, {_stamp("clock", _NTH_OF_FLOW)} AS stamp
    FROM input JOIN clock ON clock.queue = input.queue
        AND clock.team IS NOT DISTINCT FROM input.team
        AND (input.team IS NOT NULL OR clock.owner = input.owner)
), {_STORE}"""

# The same for one row (most single submissions, each written alone when no other waits
# with it): no flows to gather and join back, no numbering within them. About 0.1 ms of
# PostgreSQL's CPU less a statement than the form for many (0.44 against 0.53 ms in a
# loop of lone submissions). Its row is read as jsonb, its wait bound from the row (no
# ``:waits``): read as json by ``json_populate_recordset`` it cost 20-30 µs more a
# statement (250-270 against 230-250 µs, alternating, 2026-12-07). Unfenced, ``pushed``'s
# read is copied into the stamp's two uses of it, and read only in a queue that weighs
# usage: cheaper than the fence here.
_SUBMIT_ONE = f"""
WITH stamped AS (
    SELECT k.*, {_stamp("k", "0")} AS stamp
    FROM (SELECT {_FLOW_CLOCK}
          FROM (SELECT r.*, CAST(e.doc->>'max_wait_s' AS integer) AS max_wait_s, 1 AS ord,
                       {_flow_reads("r.owner", "r.team", "r.queue")}
                FROM (SELECT CAST(:rows AS jsonb)->0 AS doc) e
                CROSS JOIN jsonb_populate_record(CAST(NULL AS core.tasks), e.doc) AS r
                LEFT JOIN core.queues q ON q.name = r.queue
                OFFSET 0) c) k
), {_STORE}"""

# (``new.*``: what RETURNING gave, ``SUBMITTED_COLUMNS``, not written out a second time)
SUBMIT: TextClause = text(f"{_SUBMIT}\nSELECT new.* FROM new ORDER BY id")
SUBMIT_ONE: TextClause = text(f"{_SUBMIT_ONE}\nSELECT new.* FROM new")

# The same, telling the other replicas' listeners of what it stored (``feed.notes_of``)
# in its own transaction: once, if it stored anything (the CTE calls a volatile
# function, so it is computed once, and only if read). The notes come as one JSON array
# of [channel, payload] pairs: psycopg dumps a list as an array in Python, about 30 µs
# of a lone submission's CPU for two text arrays.
_TELLING = """, told AS (
    SELECT count(pg_notify(n->>0, n->>1)) AS notes
    FROM jsonb_array_elements(CAST(:notes AS jsonb)) AS n
)
SELECT new.* FROM new CROSS JOIN told ORDER BY id"""
SUBMIT_TELLING: TextClause = text(_SUBMIT + _TELLING)
SUBMIT_ONE_TELLING: TextClause = text(_SUBMIT_ONE + _TELLING)


BY_IDEMPOTENCY_KEYS: TextClause = text(f"""
SELECT {SUBMITTED_COLUMNS} FROM core.tasks
WHERE (owner, idempotency_key) IN (
    SELECT * FROM unnest(CAST(:owners AS text[]), CAST(:keys AS text[])))
""")

# The guarded move of one task: the sub-select locks the row and reads the state it
# leaves; the UPDATE applies only if that state is one the op may start from.
TRANSITION: TextClause = text(f"""
WITH old AS (
    SELECT id, state, current_attempt_id FROM core.tasks
    WHERE id = :id AND (CAST(:owner AS text) IS NULL OR owner = :owner)
    FOR UPDATE
), moved AS (
    UPDATE core.tasks t SET
        state = :target,
        version = t.version + 1,
        updated_at = now(),
        finished_at = CASE WHEN :final THEN now() END,
        run_at = CASE
            WHEN :reset_run_at THEN now()
            WHEN CAST(:delay_s AS double precision) IS NOT NULL
                THEN now() + make_interval(secs => CAST(:delay_s AS double precision))
            ELSE t.run_at END,
        attempts = CASE WHEN :reset_counts THEN 0 ELSE t.attempts - :refund END,
        crashes = CASE WHEN :reset_counts THEN 0 ELSE t.crashes + :crashed END,
        source_handbacks = CASE WHEN :reset_counts THEN 0 ELSE t.source_handbacks END,
        crashed_at = CASE WHEN :reset_counts THEN '{{}}'
                          WHEN :crashed > 0 THEN {CRASHED_NOW} ELSE t.crashed_at END,
        start_by = CASE WHEN :reset_counts THEN NULL ELSE t.start_by END,
        current_attempt_id = COALESCE(
            CAST(:attempt_id AS bigint), CASE WHEN :keep_attempt THEN t.current_attempt_id END
        ),
        last_error = COALESCE(CAST(:error AS text), t.last_error),
        deferred = false
    FROM old
    WHERE t.id = old.id AND old.state = ANY(CAST(:sources AS text[]))
    RETURNING t.id, t.owner, t.version, t.state, old.state AS from_state,
              COALESCE(CAST(:attempt_id AS bigint), old.current_attempt_id) AS attempt_id
), events AS (
    INSERT INTO core.task_events (
        task_id, seq, owner, op, from_state, to_state, reason, attempt_id
    )
    SELECT id, version, owner, :op, from_state, state, :reason, attempt_id FROM moved
)
SELECT (SELECT state FROM old) AS found_state, (SELECT from_state FROM moved) AS from_state
""")

# Moves of many tasks at once by one op from one state, in batches that skip locked rows
# so they never wait on a submit, a claim or each other.
_BULK = """
WITH picked AS (
    SELECT id, deferred FROM core.tasks t
    WHERE t.state = '{source}' AND {condition}
    ORDER BY {order}
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), moved AS (
    -- A deferral ends when its task moves on, whichever way (else a later failure would
    -- be taken for a deferral and skip its backoff).
    UPDATE core.tasks t SET state = '{target}', version = t.version + 1, updated_at = now(),
        deferred = false
    FROM picked WHERE t.id = picked.id
    RETURNING t.id, t.owner, t.version, picked.deferred
), events AS (
    INSERT INTO core.task_events (task_id, seq, owner, op, from_state, to_state, reason)
    SELECT id, version, owner, '{op}', '{source}', '{target}', {reason} FROM moved
)
SELECT count(*) FROM moved
"""

# Tasks that never started by their start_by end dead (Op.EXPIRE): never leased (no
# attempt row: one leased and given back has started, and its wait is over), found by
# their start_by through ix_tasks_start_by, whose condition the sources spell out.
_EXPIRING = sql_in("t.state", sources(Op.EXPIRE, S.DEAD))
EXPIRE_UNSTARTED: TextClause = text(f"""
WITH picked AS (
    SELECT t.id, t.state AS from_state,
           'not started by its start_by, '
               || to_char(t.start_by AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')
               AS reason
    FROM core.tasks t
    WHERE t.start_by <= now() AND t.start_by IS NOT NULL AND {_EXPIRING}
      AND NOT EXISTS (SELECT 1 FROM core.attempts a WHERE a.task_id = t.id)
    ORDER BY t.start_by
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), moved AS (
    UPDATE core.tasks t SET state = '{S.DEAD}', version = t.version + 1, updated_at = now(),
        finished_at = now(), deferred = false, last_error = picked.reason
    FROM picked WHERE t.id = picked.id
    RETURNING t.id, t.owner, t.version, picked.from_state, picked.reason
), events AS (
    INSERT INTO core.task_events (task_id, seq, owner, op, from_state, to_state, reason)
    SELECT id, version, owner, '{Op.EXPIRE}', from_state, '{S.DEAD}', reason FROM moved
)
SELECT count(*) FROM moved
""")

# The (few) paused queues. The park queries run only when a queue is paused: the EXISTS
# is evaluated once, before any task is read, whatever the plan (with every task in one
# queue, the plan walked the primary key in id order testing each task against the
# paused queues: 354 ms a pass at 1,100,000 tasks, none paused). They take their tasks
# by queue from the array of paused queues, an index condition (as ``IN (SELECT ...)``,
# on statistics that predated the backlog, the park walked every waiting task's entry:
# 37-162 ms a pass at 100,000 waiting behind 1,000,000 finished).
_PAUSED_QUEUES = "(SELECT q.name FROM core.queues q WHERE q.paused)"
_QUEUE_PAUSED = f"EXISTS {_PAUSED_QUEUES} AND t.queue = ANY(ARRAY{_PAUSED_QUEUES})"
_QUEUE_RUNS = f"t.queue NOT IN {_PAUSED_QUEUES}"


def _bulk(op: str, source: str, target: str, condition: str, order: str, reason: str) -> TextClause:
    return text(
        _BULK.format(
            op=op, source=source, target=target, condition=condition, order=order, reason=reason
        )
    )


# A claim takes due ready work itself (db.attempts), so the promoter leaves it to claims
# for ``:after_s`` past its run_at (the burst at a due instant is then leased, not
# promoted and leased); a deferral's end is the promoter's alone.
PROMOTE_READY = _bulk(
    "promote",
    "ready",
    "waiting",
    f"""t.run_at <= now() AND {_QUEUE_RUNS}
        AND (t.deferred OR t.run_at <= now() - make_interval(secs => :after_s))""",
    "t.run_at",
    "CASE WHEN deferred THEN 'latest start reached: runs although its pool is busy' END",
)
PROMOTE_FAILED = _bulk(
    "promote",
    "failed",
    "waiting",
    f"t.run_at <= now() AND {_QUEUE_RUNS}",
    "t.run_at",
    "'backoff over'",
)
PARK_WAITING = _bulk("park", "waiting", "ready", _QUEUE_PAUSED, "t.id", "'queue paused'")
PARK_FAILED = _bulk(
    "park",
    "failed",
    "ready",
    f"t.run_at <= now() AND {_QUEUE_PAUSED}",
    "t.run_at",
    "'queue paused'",
)

# A person's bulk retry or cancel: the tasks a filter selects, oldest first from a keyset
# cursor, a page at a time, skipping rows others hold. Unset conditions are NULL.
_SELECTED = f"""
    t.state = ANY(CAST(:sources AS text[])) AND t.id > :after
    AND (CAST(:queue AS text) IS NULL OR t.queue = :queue)
    AND (CAST(:owner AS text) IS NULL OR t.owner = :owner)
    AND (CAST(:team AS text) IS NULL OR t.team = :team)
    AND (CAST(:labels AS jsonb) IS NULL OR (t.labels @> CAST(:labels AS jsonb) AND t.{LABELLED}))
    AND (CAST(:created_after AS timestamptz) IS NULL OR t.created_at >= :created_after)
    AND (CAST(:created_before AS timestamptz) IS NULL OR t.created_at < :created_before)
    AND (CAST(:finished_after AS timestamptz) IS NULL OR t.finished_at >= :finished_after)
    AND (CAST(:finished_before AS timestamptz) IS NULL OR t.finished_at < :finished_before)
"""

COUNT_SELECTED: TextClause = text(f"""
SELECT count(*) FROM (SELECT 1 FROM core.tasks t WHERE {_SELECTED} LIMIT :cap) s
""")

# One page of a bulk retry's selection, read before it moves: core checks each task's
# owner may still run it (membership, queue policy) as a submission would be checked.
SELECTED_PAGE: TextClause = text(f"""
SELECT t.* FROM core.tasks t WHERE {_SELECTED} ORDER BY t.id LIMIT :limit
""")

_BULK_PERSON = """
WITH picked AS (
    SELECT t.id, t.state AS from_state, t.current_attempt_id FROM core.tasks t
    WHERE {selected}
      AND (CAST(:ids AS bigint[]) IS NULL OR t.id = ANY(CAST(:ids AS bigint[])))
    ORDER BY t.id
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), moved AS (
    UPDATE core.tasks t SET {changes}, version = t.version + 1, updated_at = now(),
        current_attempt_id = NULL
    FROM picked WHERE t.id = picked.id
    RETURNING t.id, t.owner, t.version, t.state, picked.from_state, picked.current_attempt_id
), events AS (
    INSERT INTO core.task_events (task_id, seq, owner, op, from_state, to_state, reason,
                                  attempt_id)
    SELECT id, version, owner, :op, from_state, state, :reason, current_attempt_id FROM moved
){closing}
SELECT count(*) AS changed, COALESCE(max(id), 0) AS last_id FROM moved
"""

# As a person's retry of one task: a fresh budget, eligible now (ready if paused).
BULK_RETRY: TextClause = text(
    _BULK_PERSON.format(
        selected=_SELECTED,
        changes=f"""state = CASE WHEN t.queue IN {_PAUSED_QUEUES} THEN '{S.READY}' ELSE '{S.WAITING}' END,
        finished_at = NULL, run_at = now(), attempts = 0, crashes = 0, crashed_at = '{{}}',
        source_handbacks = 0, start_by = NULL""",
        closing="",
    )
)

# As a cancel of one task: a running attempt is closed here too, and its worker told to
# stop it at its next heartbeat.
BULK_CANCEL: TextClause = text(
    _BULK_PERSON.format(
        selected=_SELECTED,
        changes=f"state = '{S.CANCELLED}', finished_at = now()",
        closing=""", closed AS (
    UPDATE core.attempts a SET outcome = 'cancelled', ended_at = now(), error = :reason
    FROM moved WHERE a.task_id = moved.id AND a.outcome IS NULL
)""",
    )
)

# How long until the next delayed task is due (seconds, by the database's clock), or due
# ready work left to claims is to be promoted, for the promoter's timer; NULL when none
# waits. Read in the promoting transaction: rows due by
# its now() were promoted by it, or are another replica's (locked by its promotion), or
# wait for a paused queue; none is a reason to wake.
NEXT_DUE: TextClause = text(f"""
SELECT EXTRACT(EPOCH FROM LEAST(
    (SELECT min(t.run_at) FROM core.tasks t
     WHERE t.state IN ('{S.FAILED}', '{S.READY}') AND t.run_at > now() AND {_QUEUE_RUNS}),
    (SELECT min(t.run_at) + make_interval(secs => :after_s) FROM core.tasks t
     WHERE t.state = '{S.READY}' AND t.run_at <= now() AND NOT t.deferred
       AND t.run_at > now() - make_interval(secs => :after_s) AND {_QUEUE_RUNS}),
    (SELECT min(t.start_by) FROM core.tasks t
     WHERE t.start_by > now() AND t.start_by IS NOT NULL AND {_EXPIRING})
) - now())::float AS due_in_s
""")

PURGE_FINISHED: TextClause = text("""
WITH doomed AS (
    SELECT id FROM core.tasks
    WHERE finished_at < now() - make_interval(secs => :age_s)
    ORDER BY finished_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), gone_events AS (
    DELETE FROM core.task_events e USING doomed WHERE e.task_id = doomed.id
)
DELETE FROM core.tasks t USING doomed WHERE t.id = doomed.id
""")

# Workers dead or departed longer than the retention; their attempts keep a NULL worker.
PURGE_WORKERS: TextClause = text(f"""
WITH doomed AS (
    SELECT id FROM core.workers
    WHERE {sql_in("state", Workers.GONE)} AND gone_at < now() - make_interval(secs => :age_s)
    ORDER BY gone_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
)
DELETE FROM core.workers w USING doomed WHERE w.id = doomed.id
""")

# The feed: only events of transactions older than every running one are served, so an
# event that commits later can never land behind a cursor already handed out. An admin or
# a service reads every event (``FEED``); a user its own tasks' events and those of tasks
# its teams own (``FEED_OWN``; ``teams`` NULL: none).
_FEED = """
SELECT e.xid, e.id, e.task_id, e.seq, e.owner, e.op, e.from_state, e.to_state, e.reason,
       e.attempt_id, e.at, h.horizon
FROM (SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS horizon) h
LEFT JOIN LATERAL ({events}
    ORDER BY xid, id
    LIMIT :limit
) e ON true
"""

_AFTER = "(e.xid, e.id) > (:xid, :id) AND e.xid < h.horizon {to_state}"
_ALL_EVENTS = f"SELECT * FROM core.task_events e WHERE {_AFTER}"
_IN_TEAMS = "t.team = ANY(CAST(:teams AS text[]))"
# A user's events are its own, read by owner in feed order (``ix_task_events_owner``), and
# those of its teams' tasks that are not its own, read one of three ways chosen when the
# statement runs. Fewer than ``near`` events after the cursor: walk them, each one's task
# looked up by key (a long poll at the head pays for the new events only). Else, if the
# teams own fewer than ``team_tasks`` tasks, from those tasks (``ix_tasks_team_id``)
# through each one's events (their key). Else walk the events after the cursor against a
# hash of the teams' tasks, built once a read (``IS TRUE`` keeps the ``IN`` a hashed
# subplan, not a join; teams this large fill a page soon). Each way a page is the first
# ``limit`` events after the cursor that the user sees, as one walk would find them. Each
# way's choice gates it from above its LIMIT, so a way not chosen never starts: gated
# under it, a parallel walk's Gather started its workers (two processes, 5-15 ms a read,
# long polls included) only for them to find the gate shut. The probes' walk is capped
# at ``near`` events (all there are after the cursor when it runs), so it is never
# planned parallel either.
NEAR = 1000
TEAM_TASKS = 2000
_OWN_EVENTS = """
    WITH counts AS MATERIALIZED (
        SELECT (SELECT count(*) FROM (SELECT FROM core.task_events e
                                      WHERE (e.xid, e.id) > (:xid, :id)
                                      ORDER BY e.xid, e.id LIMIT {near}) ahead) < {near} AS near,
               (SELECT count(*) FROM (SELECT FROM core.tasks t WHERE {in_teams}
                                      LIMIT {team_tasks}) few) < {team_tasks} AS few
        WHERE CAST(:teams AS text[]) IS NOT NULL
    ), way AS MATERIALIZED (
        SELECT COALESCE(bool_or(NOT near AND few), false) AS by_tasks,
               COALESCE(bool_or(near), false) AS near,
               COALESCE(bool_or(NOT near AND NOT few), false) AS many
        FROM counts
    )
    SELECT * FROM (SELECT * FROM core.task_events e WHERE e.owner = :owner AND {after}
                   ORDER BY e.xid, e.id LIMIT :limit) own
    UNION ALL
    SELECT * FROM (
        SELECT e.* FROM core.tasks t CROSS JOIN LATERAL (
            SELECT * FROM core.task_events e WHERE e.task_id = t.id AND e.owner <> :owner
              AND {after}
            ORDER BY e.xid, e.id LIMIT :limit) e
        WHERE {in_teams}
        ORDER BY e.xid, e.id LIMIT :limit) by_tasks
    WHERE (SELECT by_tasks FROM way)
    UNION ALL
    SELECT * FROM (
        SELECT * FROM (SELECT * FROM core.task_events e WHERE {after}
                       ORDER BY e.xid, e.id LIMIT {near}) e
        WHERE e.owner <> :owner
          AND EXISTS (SELECT 1 FROM core.tasks t WHERE t.id = e.task_id AND {in_teams})
        ORDER BY e.xid, e.id LIMIT :limit) by_probes
    WHERE (SELECT near FROM way)
    UNION ALL
    SELECT * FROM (
        SELECT * FROM core.task_events e
        WHERE e.owner <> :owner AND {after}
          AND (e.task_id IN (SELECT t.id FROM core.tasks t WHERE {in_teams})) IS TRUE
        ORDER BY e.xid, e.id LIMIT :limit) by_hash
    WHERE (SELECT many FROM way)"""


@functools.cache
def feed_statement(
    to_state: TaskState | None = None,
    *,
    own: bool = False,
    near: int = NEAR,
    team_tasks: int = TEAM_TASKS,
) -> TextClause:
    """The feed: every event (``own``: a user's), ``to_state``: only the events that moved
    a task there. The state is written into the text, not bound, so a partial index on it
    (``ix_task_events_dead``) serves even a prepared statement's generic plan."""
    only = "" if to_state is None else f"AND e.to_state = '{to_state.value}'"
    after = _AFTER.format(to_state=only)
    events = (
        _OWN_EVENTS.format(after=after, in_teams=_IN_TEAMS, near=near, team_tasks=team_tasks)
        if own
        else _ALL_EVENTS.format(to_state=only)
    )
    return text(_FEED.format(events=events))


FEED = feed_statement()
FEED_OWN = feed_statement(own=True)


QUEUE_DEPTHS: TextClause = text(f"""
SELECT queue, state, count(*) AS n,
       EXTRACT(EPOCH FROM now() - min(updated_at) FILTER (WHERE state = '{S.WAITING}')) AS oldest
FROM core.tasks
WHERE state IN ('{S.DEAD}', '{S.FAILED}', '{S.READY}', '{S.RUNNING}', '{S.WAITING}')
GROUP BY queue, state
""")


# The last hour of each queue, by minutes ago (0: this minute). Both halves use a partial
# index: finished rows by ``ix_tasks_finished_at``, unfinished ones by the live index. One
# pass over them counts each (queue, minute made, minute ended) at once, a few thousand
# groups at most, which the three sums then read: reading the rows themselves three times
# (a CTE of every row, spilled to disk at 100,000 live) took twice as long.
QUEUE_HISTORY: TextClause = text(f"""
WITH recent AS (
    SELECT queue,
           CASE WHEN created_at > now() - make_interval(mins => :minutes)
                THEN floor(EXTRACT(EPOCH FROM now() - created_at) / 60)::int END AS made,
           floor(EXTRACT(EPOCH FROM now() - finished_at) / 60)::int AS ended,
           count(*) AS n
    FROM (
        SELECT queue, created_at, finished_at FROM core.tasks
        WHERE finished_at > now() - make_interval(mins => :minutes)
        UNION ALL
        SELECT queue, created_at, NULL FROM core.tasks
        WHERE state IN ('{S.FAILED}', '{S.READY}', '{S.RUNNING}', '{S.WAITING}')
    ) t
    GROUP BY 1, 2, 3
)
SELECT queue, 'submitted' AS kind, made AS ago, sum(n)::bigint AS n, now() AS until
FROM recent WHERE made IS NOT NULL GROUP BY 1, 3
UNION ALL
SELECT queue, 'finished', ended, sum(n)::bigint, now() FROM recent WHERE ended IS NOT NULL
GROUP BY 1, 3
UNION ALL
SELECT queue, 'live', 0, sum(n)::bigint, now() FROM recent WHERE ended IS NULL GROUP BY 1
""")


# --- the driver's fast path ------------------------------------------------------------


async def _fetch(conn: AsyncConnection, query: TextClause, params: dict[str, Any]) -> list[Any]:
    """Run a named query on the psycopg connection under ``conn``, rows as named tuples.
    For the submit path, where SQLAlchemy's result processing cost more than the query."""
    raw = await conn.get_raw_connection()
    driver: psycopg.AsyncConnection[Any] = raw.driver_connection  # type: ignore[assignment]
    sql = pipeline.driver_sql(query, conn.dialect)
    try:
        async with driver.cursor(row_factory=namedtuple_row) as cursor:
            await cursor.execute(sql, params)
            return await cursor.fetchall()
    except psycopg.Error as exc:
        # Raise what SQLAlchemy would have: the same error handlers apply, and a lost
        # connection leaves the pool instead of failing the next request too.
        lost = conn.dialect.is_disconnect(exc, raw.dbapi_connection, None)  # type: ignore[arg-type]
        if lost:
            await conn.invalidate(exc)
        raise DBAPIError.instance(
            sql, params, exc, psycopg.Error, connection_invalidated=lost, dialect=conn.dialect
        ) from exc


_PSYCOPG = psycopg_dialect.dialect()  # type: ignore[no-untyped-call]


async def _fetch_plain(
    driver: psycopg.AsyncConnection[Any], query: TextClause, params: dict[str, Any]
) -> list[Any]:
    """``_fetch`` on a plain psycopg connection (no SQLAlchemy engine under it): a
    refusal raises as SQLAlchemy's error would, ``connection_invalidated`` when the
    connection is lost, so the same handlers answer it."""
    sql = pipeline.driver_sql(query, _PSYCOPG)
    try:
        async with driver.cursor(row_factory=namedtuple_row) as cursor:
            await cursor.execute(sql, params)
            return await cursor.fetchall()
    except psycopg.Error as exc:
        lost = driver.broken or driver.closed or isinstance(exc, psycopg.OperationalError)
        raise DBAPIError.instance(
            sql, params, exc, psycopg.Error, connection_invalidated=lost, dialect=_PSYCOPG
        ) from exc


# --- submissions --------------------------------------------------------------------------


_LATER_FIELDS: dict[str, object] = {
    "defer_ok": False,
    "deadline": None,
    "team": None,
    "concurrency": None,
    "start_by": None,
    "max_wait_s": None,
    "progress_timeout_s": None,
    "placement": None,
    "service": None,
}
_LATER_RETRY_FIELDS: dict[str, object] = {
    "poison_window_s": None,
    "never": {"exit_codes": [], "signals": []},
    "always": {"exit_codes": [], "signals": []},
}


def spec_hash(spec: TaskCreate) -> str:
    """A digest of a submission, to tell a retried request from a different one: the
    submission as sent, before defaults fill it (a queue's default timeout may change
    between two sends of one request)."""
    doc = spec.model_dump(mode="json")
    # Fields added later count only when set, so a key reused across an upgrade matches.
    for fields, part in ((_LATER_FIELDS, doc), (_LATER_RETRY_FIELDS, doc["retry"])):
        for name, default in fields.items():
            if part.get(name) == default:
                del part[name]
    if not doc["resources"].get("devices"):
        doc["resources"].pop("devices", None)
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def retry_causes(spec: TaskCreate) -> dict[str, Any] | None:
    """The retry policy's never/always lists as stored (None when it lists none)."""
    policy = spec.retry
    if not policy.never and not policy.always:
        return None
    return {"never": policy.never.model_dump(), "always": policy.always.model_dump()}


def _row_doc(spec: TaskCreate, filled: Filled | None = None) -> dict[str, Any]:
    """A submission's row for SUBMIT, without the keys whose value is None: the statement
    reads a key a row lacks as NULL, and a common task's document is half as long without
    them (about 400 bytes, not 800). PostgreSQL parses it in about 60 % of the time, and
    core dumps and sends less: a batched task 48-51 -> 40-41 µs of PostgreSQL's CPU and
    25-29 -> 24 of core's (docs/benchmarks.md, "Submit")."""
    filled = filled or _as_set(spec)
    row = {
        "name": spec.name,
        "queue": spec.queue,
        "priority": spec.priority,
        "kind": spec.kind,
        "artifact_uri": spec.artifact.uri,
        "artifact_sha256": spec.artifact.sha256,
        "artifact_credentials": (
            spec.artifact.credentials.model_dump() if spec.artifact.credentials else None
        ),
        "args": spec.args,
        "env": {k: v if isinstance(v, str) else v.model_dump() for k, v in spec.env.items()},
        "input_path": spec.input_path,
        "output_path": spec.output_path,
        "cpu": spec.resources.cpu,
        "memory_mb": spec.resources.memory_mb,
        "devices": spec.resources.devices or None,
        "disk_mb": filled.disk_mb,
        "preemptible": spec.preemptible,
        "max_attempts": spec.retry.max_attempts,
        "backoff_base_s": spec.retry.base_s,
        "backoff_cap_s": spec.retry.cap_s,
        "backoff_jitter": spec.retry.jitter,
        "poison_after": spec.retry.poison_after,
        "timeout_s": filled.timeout_s,
        "max_wait_s": filled.max_wait_s,
        "poison_window_s": filled.poison_window_s,
        "start_by": spec.start_by.isoformat() if spec.start_by else None,
        "retry_causes": retry_causes(spec),
        "run_at": spec.run_at.isoformat() if spec.run_at else None,
        "idempotency_key": spec.idempotency_key,
        "spec_hash": spec_hash(spec) if spec.idempotency_key else None,
        "labels": spec.labels,
        "defer_ok": spec.defer_ok,
        "deadline": spec.deadline.isoformat() if spec.deadline else None,
        "team": spec.team,
        "concurrency_key": spec.concurrency.key if spec.concurrency else None,
        "concurrency_limit": spec.concurrency.limit if spec.concurrency else None,
        "progress_timeout_s": spec.progress_timeout_s,
        "service": (
            spec.service.model_dump(mode="json", exclude_defaults=True) if spec.service else None
        ),
        **_placement_doc(spec),
    }
    return {key: value for key, value in row.items() if value is not None}


def _placement_doc(spec: TaskCreate) -> dict[str, Any]:
    """The placement as submitted and its required selectors compiled for the claim
    (checked before: ``ops.tasks.fill_limits``)."""
    if spec.placement is None:
        return {"placement": None, "required": None}
    doc = spec.placement.model_dump(mode="json", exclude_defaults=True)
    return {"placement": doc, "required": selectors.rules_of(doc).compiled}


def required_of(spec: TaskCreate) -> dict[str, Any] | None:
    """A submission's required selectors as stored and tested by the claim (None for
    the common task): what its announcement carries (``feed.Work.placed``)."""
    return _placement_doc(spec)["required"] if spec.placement is not None else None


def submission_docs(
    owner: str | Sequence[str],
    specs: Sequence[TaskCreate],
    filled: Sequence[Filled] | None = None,
) -> list[dict[str, Any]]:
    """The rows SUBMIT takes, one per submission: ``owner`` is one owner for all, or one
    per submission; ``filled`` each one's time limits (``domain.limits``; none: as the
    spec sets them, with core's default crash window)."""
    owners = [owner] * len(specs) if isinstance(owner, str) else list(owner)
    limits = filled or [_as_set(spec) for spec in specs]
    return [
        {**_row_doc(spec, fill), "owner": who}
        for spec, fill, who in zip(specs, limits, owners, strict=True)
    ]


async def submit(
    conn: AsyncConnection,
    owner: str | Sequence[str],
    specs: Sequence[TaskCreate],
    quantum_s: float = 1.0,
    filled: Sequence[Filled] | None = None,
    fair: FairShare | None = None,
) -> list[tuple[Any, bool]]:
    """Store the submissions in one statement; return each one's task row, in the order
    given, and whether it was created (False: its idempotency key matched a task).
    ``IdempotencyMismatch`` if a key matched a different request. Rows hold
    ``SUBMITTED_COLUMNS``. ``quantum_s`` is the fair-share step of an owner of weight 1
    (docs/sharing.md); ``owner`` and ``filled``: ``submission_docs``; ``fair``: whether
    queues weigh usage by default, and how (none: they do not)."""
    docs = submission_docs(owner, specs, filled)
    out = await _store(functools.partial(_fetch, conn), docs, quantum_s, fair)
    for item in out:
        if isinstance(item, IdempotencyMismatch):
            raise item
    return out  # type: ignore[return-value]


# One submission's outcome: its row and whether it was created, or its refusal.
Stored = tuple[Any, bool] | IdempotencyMismatch


async def submit_docs(
    driver: psycopg.AsyncConnection[Any],
    docs: Sequence[dict[str, Any]],
    quantum_s: float,
    notes: Sequence[tuple[str, str]] = (),
    fair: FairShare | None = None,
) -> list[Stored]:
    """Store ``docs`` (``submission_docs``) in one statement on a plain psycopg connection
    in autocommit, ``notes`` (``feed.notes_of``) sent by it: one commit for all. Each
    one's outcome, in the order given: a key that matched a different request is that
    submission's ``IdempotencyMismatch``, the others stand. A statement the database
    refuses raises, as ``_fetch`` does."""
    fetch = functools.partial(_fetch_plain, driver)
    if not notes:
        return await _store(fetch, docs, quantum_s, fair)
    return await _store(fetch, docs, quantum_s, fair, {"notes": jsonb(notes)})


Fetch = Callable[[TextClause, dict[str, Any]], Awaitable[list[Any]]]


async def _store(
    fetch: Fetch,
    docs: Sequence[dict[str, Any]],
    quantum_s: float,
    fair: FairShare | None = None,
    told: dict[str, Any] | None = None,
) -> list[Stored]:
    """Run SUBMIT (SUBMIT_ONE for one doc; their TELLING forms with ``told``, the notes)
    and match each doc to its row, reading the rows of keys that matched tasks stored
    before."""
    one = len(docs) == 1
    if told is None:
        query = SUBMIT_ONE if one else SUBMIT
    else:
        query = SUBMIT_ONE_TELLING if one else SUBMIT_TELLING
    fair = fair or FairShare()
    params = {
        "rows": jsonb(docs),
        "quantum": quantum_s,
        "fair_share": fair.by,
        "fair_half_life": fair.half_life_s,
        "fair_unit": fair.unit_cpu_s,
        **(told or {}),
    }
    if not one:
        params["waits"] = jsonb([doc.get("max_wait_s") for doc in docs])
    created = await fetch(query, params)

    def key_of(row: Any) -> tuple[str, str] | None:
        return (row["owner"], row["idempotency_key"]) if row.get("idempotency_key") else None

    created_keys = {(row.owner, row.idempotency_key) for row in created if row.idempotency_key}
    wanted = {k for k in map(key_of, docs) if k is not None}
    missing = sorted(wanted - created_keys)
    by_key: dict[tuple[str, str], Any] = {}
    if missing:
        found = await fetch(
            BY_IDEMPOTENCY_KEYS,
            {"owners": [o for o, _ in missing], "keys": [k for _, k in missing]},
        )
        by_key = {(row.owner, row.idempotency_key): row for row in found}
    out: list[Stored] = []
    fresh = iter(created)
    for doc in docs:
        key = key_of(doc)
        if key is None or (key in created_keys and key not in by_key):
            row = next(fresh)
            if key:
                by_key[key] = row  # a second of the same key in this statement matches it
            out.append((row, True))
        elif by_key[key].spec_hash != doc["spec_hash"]:
            out.append(
                IdempotencyMismatch(
                    f"idempotency_key {key[1]!r} was used for task {by_key[key].id}"
                    " with a different request"
                )
            )
        else:
            out.append((by_key[key], False))
    return out


def _as_set(spec: TaskCreate) -> Filled:
    window = spec.retry.poison_window_s or Defaults().poison_window_s
    return Filled(spec.timeout_s, spec.max_wait_s, window, spec.resources.disk_mb)


_FILLED_IN = ("run_at", "timeout_s", "start_by", "retry", "max_wait_s", "resources")


def new_task(spec: TaskCreate, row: Any) -> Task:
    """The task a submission just created, from the spec and its submitted row: what the
    database added is only ids, state, times and the limits defaults filled in, so
    nothing needs reading back."""
    return Task.model_construct(
        **{name: getattr(spec, name) for name in TaskCreate.model_fields if name not in _FILLED_IN},
        timeout_s=row.timeout_s,
        start_by=row.start_by,
        retry=spec.retry.model_copy(update={"poison_window_s": row.poison_window_s}),
        resources=spec.resources.model_copy(update={"disk_mb": row.disk_mb}),
        id=row.id,
        owner=row.owner,
        state=TaskState(row.state),
        run_at=row.run_at,
        attempts=0,
        last_error=None,
        current_attempt_id=None,
        created_at=row.created_at,
        updated_at=row.updated_at,
        finished_at=None,
    )


def task_from_row(m: Any) -> Task:
    """A task from a row of ``TASK_COLUMNS`` (SQLAlchemy's or psycopg's named tuple)."""
    return Task(
        id=m.id,
        owner=m.owner,
        name=m.name,
        queue=m.queue,
        priority=m.priority,
        kind=m.kind,
        artifact={
            "uri": m.artifact_uri,
            "sha256": m.artifact_sha256,
            "credentials": m.artifact_credentials,
        },
        args=m.args,
        env=m.env,
        input_path=m.input_path,
        output_path=m.output_path,
        resources={
            "cpu": m.cpu,
            "memory_mb": m.memory_mb,
            "devices": m.devices or {},
            "disk_mb": m.disk_mb,
        },
        preemptible=m.preemptible,
        retry={
            "max_attempts": m.max_attempts,
            "base_s": m.backoff_base_s,
            "cap_s": m.backoff_cap_s,
            "jitter": m.backoff_jitter,
            "poison_after": m.poison_after,
            "poison_window_s": m.poison_window_s,
            **(m.retry_causes or {}),
        },
        timeout_s=m.timeout_s,
        start_by=m.start_by,
        run_at=m.run_at,
        idempotency_key=m.idempotency_key,
        labels=m.labels,
        state=m.state,
        attempts=m.attempts,
        last_error=m.last_error,
        current_attempt_id=m.current_attempt_id,
        created_at=m.created_at,
        updated_at=m.updated_at,
        finished_at=m.finished_at,
        defer_ok=m.defer_ok,
        deadline=m.deadline,
        team=m.team,
        concurrency=(
            {"key": m.concurrency_key, "limit": m.concurrency_limit} if m.concurrency_key else None
        ),
        progress_timeout_s=m.progress_timeout_s,
        placement=m.placement,
        service=m.service,
    )


# --- reads --------------------------------------------------------------------------------


def _visible(who: Visibility) -> Any:
    if not who.teams:
        return tasks.c.owner == who.owner
    return or_(tasks.c.owner == who.owner, tasks.c.team.in_(sorted(who.teams)))


async def get_task(conn: AsyncConnection, task_id: int, who: Visibility | None) -> Task:
    """The task, if it exists and ``who`` (when given) may see it: its owner, or a member
    of the team that owns it; else ``NotFound``."""
    query = select(tasks).where(tasks.c.id == task_id)
    if who is not None:
        query = query.where(_visible(who))
    row = (await conn.execute(query)).first()
    if row is None:
        raise NotFound(f"task {task_id} not found")
    return task_from_row(row)


@dataclass(frozen=True)
class TaskFilter:
    state: TaskState | None = None
    queue: str | None = None
    owner: str | None = None
    labels: tuple[tuple[str, str], ...] = ()
    team: str | None = None
    visible_to: Visibility | None = None
    keys: tuple[str, ...] = ()


async def list_tasks(
    conn: AsyncConnection, where: TaskFilter, before_id: int | None, limit: int
) -> list[Task]:
    """Newest first; ``before_id`` is the keyset cursor."""
    query = select(tasks).order_by(tasks.c.id.desc()).limit(limit)
    conditions = []
    if where.state is not None:
        conditions.append(tasks.c.state == where.state.value)
    if where.queue is not None:
        conditions.append(tasks.c.queue == where.queue)
    if where.owner is not None:
        conditions.append(tasks.c.owner == where.owner)
    if where.labels:
        conditions.append(tasks.c.labels.contains(dict(where.labels)))
        conditions.append(literal_column(f"core.tasks.{LABELLED}", Boolean))
    if where.team is not None:
        conditions.append(tasks.c.team == where.team)
    if where.visible_to is not None:
        conditions.append(_visible(where.visible_to))
    if where.keys:
        conditions.append(tasks.c.idempotency_key.in_(where.keys))
    if before_id is not None:
        conditions.append(tasks.c.id < before_id)
    if conditions:
        query = query.where(and_(*conditions))
    return [task_from_row(row) for row in await conn.execute(query)]


async def list_attempts(conn: AsyncConnection, task_id: int) -> list[Attempt]:
    query = select(attempts).where(attempts.c.task_id == task_id).order_by(attempts.c.id)
    return [Attempt.model_validate(row._mapping) for row in await conn.execute(query)]


def _event(row: Any) -> Event:
    """An event from its row: SQLAlchemy's or a pipeline's (``pipeline.run``), by name."""
    return Event(
        cursor=f"{row.xid}.{row.id}",
        task_id=row.task_id,
        seq=row.seq,
        owner=row.owner,
        op=row.op,
        from_state=row.from_state,
        to_state=row.to_state,
        reason=row.reason,
        attempt_id=row.attempt_id,
        at=row.at,
    )


# A task's history, by the events' key (task_id, seq).
EVENTS_OF = (
    select(task_events)
    .where(task_events.c.task_id == bindparam("task_id"))
    .order_by(task_events.c.seq)
)


async def task_events_of(conn: AsyncConnection, task_id: int) -> list[Event]:
    return [_event(row) for row in await conn.execute(EVENTS_OF, {"task_id": task_id})]


def feed_query(
    after: tuple[int, int], limit: int, who: Visibility | None, to_state: TaskState | None
) -> tuple[TextClause, dict[str, Any]]:
    """The feed's statement for ``who`` (None: every event) and its parameters."""
    params: dict[str, Any] = {"xid": after[0], "id": after[1], "limit": limit}
    if who is None:
        return feed_statement(to_state), params
    params |= {"owner": who.owner, "teams": sorted(who.teams) if who.teams else None}
    return feed_statement(to_state, own=True), params


async def read_feed(
    conn: AsyncConnection,
    after: tuple[int, int],
    limit: int,
    who: Visibility | None,
    to_state: TaskState | None = None,
) -> tuple[list[Event], tuple[int, int]]:
    """Events after the cursor, oldest first, and the cursor to read on from; with
    ``who``, only those of its own tasks and its teams'; with ``to_state``, only those
    that moved a task there (the cursor still moves past the others)."""
    query, params = feed_query(after, limit, who, to_state)
    # Sent as the hot path's statements are (``pipeline.run``): prepared at its first
    # run, its rows named tuples, without SQLAlchemy's result machinery (the DAG's long
    # poll reads it twice a workflow hop).
    [rows] = await pipeline.run(conn, [(query, params)])
    events = [_event(row) for row in rows if row.id is not None]
    if events:
        last = rows[-1]
        return events, (last.xid, last.id)
    horizon = rows[0].horizon if rows else after[0]
    # Nothing visible: every event of a transaction below the horizon is already behind
    # the cursor, so it may jump to the horizon without skipping anything.
    return [], max(after, (horizon - 1, 2**63 - 1))


# --- state changes ------------------------------------------------------------------------


async def transition(
    conn: AsyncConnection,
    task_id: int,
    op: Op,
    target: TaskState,
    *,
    owner: str | None = None,
    reason: str | None = None,
    error: str | None = None,
    reset_run_at: bool = False,
    reset_counts: bool = False,
    keep_attempt: bool = False,
    attempt_id: int | None = None,
    delay_s: float | None = None,
    crashed: bool = False,
    refund: bool = False,
) -> TaskState:
    """Move one task by ``op`` to ``target`` if its current state allows it, and append the
    event; return the state it left. ``NotFound`` if it is missing (or not ``owner``'s),
    ``IllegalTransition`` if its state refuses the move. Nothing is changed on refusal.
    ``attempt_id`` becomes the task's current attempt (a claim must name one); otherwise
    ``keep_attempt`` keeps the current one and any other move clears it. ``delay_s`` sets
    ``run_at`` that far ahead (a retry's backoff); ``crashed`` counts a lost attempt
    towards the poison-pill limit; ``refund`` gives back the attempt (handed back)."""
    allowed_from = sources(op, target)
    if target is TaskState.RUNNING and attempt_id is None and not keep_attempt:
        raise ValueError("a move to running must name its attempt")
    params = {
        "id": task_id,
        "owner": owner,
        "target": target.value,
        "sources": allowed_from,
        "final": target in FINAL,
        "reset_run_at": reset_run_at,
        "reset_counts": reset_counts,
        "keep_attempt": keep_attempt,
        "attempt_id": attempt_id,
        "delay_s": delay_s,
        "crashed": int(crashed),
        "refund": int(refund),
        "error": error,
        "op": op.value,
        "reason": reason,
    }
    row = (await conn.execute(TRANSITION, params)).one()
    if row.found_state is None:
        raise NotFound(f"task {task_id} not found")
    if row.from_state is None:
        check(op, TaskState(row.found_state), target)
        raise IllegalTransition(f"cannot {op.value} a task that is {row.found_state}")
    return TaskState(row.from_state)


async def cancel(conn: AsyncConnection, task_id: int, owner: str | None, reason: str) -> None:
    """Cancel the task; a running attempt is closed here, and its worker told to stop it
    at its next heartbeat."""
    await transition(conn, task_id, Op.CANCEL, TaskState.CANCELLED, owner=owner, reason=reason)
    await conn.execute(
        update(attempts)
        .where(attempts.c.task_id == task_id, attempts.c.outcome.is_(None))
        .values(outcome="cancelled", ended_at=func.now(), error=reason)
    )


async def retry(conn: AsyncConnection, task_id: int, who: Visibility | None) -> None:
    """A person's retry: a fresh budget of attempts, eligible now (or ready if paused)."""
    task = await get_task(conn, task_id, who)
    target = TaskState.READY if await queue_paused(conn, task.queue) else TaskState.WAITING
    await transition(
        conn,
        task_id,
        Op.RETRY,
        target,
        reason="retried by a person",
        reset_run_at=True,
        reset_counts=True,
    )
    # A fresh turn in fair share: an old stamp would age it straight to the top.
    await conn.execute(
        update(tasks)
        .where(tasks.c.id == task_id)
        .values(vtime=func.greatest(tasks.c.vtime, func.extract("epoch", func.now())))
    )


_BULK_OPS = {
    Op.RETRY: (BULK_RETRY, TaskState.WAITING),
    Op.CANCEL: (BULK_CANCEL, TaskState.CANCELLED),
}


def bulk_sources(op: Op, selector: TaskSelector) -> list[str]:
    """The states a bulk ``op`` takes tasks from (those of the transitions table, or the
    one the filter names); ``InvalidInput`` naming ``filter.state`` if it never can."""
    allowed = sources(op, _BULK_OPS[op][1])
    if selector.state is None:
        return allowed
    if selector.state.value not in allowed:
        reason = f"{op.value} takes tasks that are {', '.join(allowed)}, not {selector.state.value}"
        raise InvalidInput(
            f"filter.state: {reason}", errors=[{"field": "body.filter.state", "reason": reason}]
        )
    return [selector.state.value]


def _selector_params(op: Op, selector: TaskSelector, owner: str | None) -> dict[str, Any]:
    return {
        "sources": bulk_sources(op, selector),
        "queue": selector.queue,
        "owner": owner,
        "team": selector.team,
        "labels": jsonb(selector.labels) if selector.labels else None,
        "created_after": selector.created_after,
        "created_before": selector.created_before,
        "finished_after": selector.finished_after,
        "finished_before": selector.finished_before,
    }


async def count_selected(
    conn: AsyncConnection, op: Op, selector: TaskSelector, owner: str | None, cap: int
) -> int:
    """How many tasks a bulk ``op`` would take (up to ``cap``)."""
    params = {**_selector_params(op, selector, owner), "after": 0, "cap": cap}
    return int((await conn.execute(COUNT_SELECTED, params)).scalar_one())


async def selected_page(
    conn: AsyncConnection, op: Op, selector: TaskSelector, owner: str | None, after: int, limit: int
) -> list[Task]:
    """The next page of the tasks a bulk ``op`` selects (ids above ``after``), unlocked."""
    params = {**_selector_params(op, selector, owner), "after": after, "limit": limit}
    return [task_from_row(row) for row in await conn.execute(SELECTED_PAGE, params)]


async def bulk_move(
    conn: AsyncConnection,
    op: Op,
    selector: TaskSelector,
    owner: str | None,
    *,
    after: int,
    limit: int,
    reason: str,
    ids: Sequence[int] | None = None,
) -> tuple[int, int]:
    """Move one page of the selected tasks (ids above ``after``; with ``ids``, of those
    only) as ``op`` does one task; return how many moved and the last id taken (0: none)."""
    query, _ = _BULK_OPS[op]
    params = {
        **_selector_params(op, selector, owner),
        "after": after,
        "limit": limit,
        "op": op.value,
        "reason": reason,
        "ids": list(ids) if ids is not None else None,
    }
    row = (await conn.execute(query, params)).one()
    return int(row.changed), int(row.last_id)


async def promote_and_park(conn: AsyncConnection, limit: int, after_s: float = 0.0) -> int:
    """One pass of the promoter: due work becomes eligible (ready work ``after_s`` past its
    run_at: claims take it before), paused queues' work steps back."""
    moved = 0
    for query in (PARK_WAITING, PARK_FAILED, PROMOTE_FAILED):
        moved += (await conn.execute(query, {"limit": limit})).scalar_one()
    promote = {"limit": limit, "after_s": after_s}
    moved += int((await conn.execute(PROMOTE_READY, promote)).scalar_one())
    return moved


async def expire_unstarted(conn: AsyncConnection, limit: int) -> int:
    """Up to ``limit`` tasks never started by their start_by end dead (``Op.EXPIRE``)."""
    return int((await conn.execute(EXPIRE_UNSTARTED, {"limit": limit})).scalar_one())


async def next_due_in(conn: AsyncConnection, after_s: float = 0.0) -> float | None:
    """Seconds until the next delayed task (in a running queue) is due, or due ready work
    is to be promoted (``after_s`` past its run_at); None if none waits."""
    due: float | None = (await conn.execute(NEXT_DUE, {"after_s": after_s})).scalar_one()
    return due


async def purge_finished(conn: AsyncConnection, age_s: float, limit: int) -> int:
    """Delete up to ``limit`` tasks finished more than ``age_s`` ago, with their attempts
    and events; return how many went."""
    result = await conn.execute(PURGE_FINISHED, {"age_s": age_s, "limit": limit})
    return int(result.rowcount)


async def purge_workers(conn: AsyncConnection, age_s: float, limit: int) -> int:
    """Delete up to ``limit`` workers gone (dead or left) more than ``age_s`` ago."""
    result = await conn.execute(PURGE_WORKERS, {"age_s": age_s, "limit": limit})
    return int(result.rowcount)


# --- queues -------------------------------------------------------------------------------


async def queue_paused(conn: AsyncConnection, name: str) -> bool:
    row = (await conn.execute(select(queues.c.paused).where(queues.c.name == name))).first()
    return bool(row and row.paused)


async def set_paused(conn: AsyncConnection, name: str, paused: bool) -> None:
    stmt = pg_insert(queues).values(name=name, paused=paused)
    stmt = stmt.on_conflict_do_update(
        index_elements=[queues.c.name], set_={"paused": paused, "updated_at": func.now()}
    )
    await conn.execute(stmt)


async def queue_depths(count: readings.Count) -> Sequence[Row[Any]]:
    """``QUEUE_DEPTHS``, read by ``count`` (``readings``): what ``list_queues`` takes."""
    return await count(QUEUE_DEPTHS)


async def list_queues(
    conn: AsyncConnection, depths: Sequence[Row[Any]] | None = None
) -> list[QueueInfo]:
    """Every queue with live work or settings; its depths as ``queue_depths`` read them
    (here on ``conn`` if not given)."""
    infos: dict[str, QueueInfo] = {}

    def info(name: str) -> QueueInfo:
        return infos.setdefault(
            name, QueueInfo(name=name, paused=False, depth={}, oldest_waiting_age_s=None)
        )

    if depths is None:
        depths = await queue_depths(readings.on(conn))
    for row in depths:
        entry = info(row.queue)
        entry.depth[TaskState(row.state)] = row.n
        if row.oldest is not None:
            entry.oldest_waiting_age_s = float(row.oldest)
    for row in await conn.execute(select(queues)):
        entry = info(row.name)
        entry.paused = row.paused
        entry.default_timeout_s = row.default_timeout_s
        entry.max_timeout_s = row.max_timeout_s
        entry.max_wait_s = row.max_wait_s
        entry.default_disk_mb = row.default_disk_mb
        entry.max_disk_mb = row.max_disk_mb
        if row.egress is not None:
            entry.egress = as_stored(Egress, row.egress)
    for entry in infos.values():
        for state in TaskState:
            if state not in FINAL or state is TaskState.DEAD:
                entry.depth.setdefault(state, 0)
    return sorted(infos.values(), key=lambda q: q.name)


async def queue_history(count: readings.Count, minutes: int) -> QueueHistory:
    """Per queue and minute: tasks submitted, finished, and the backlog (unfinished tasks)
    worked back from the backlog then; read by ``count`` (``readings``): ``until`` is the
    time of the reading it gave."""
    counts: dict[str, dict[str, list[int]]] = {}
    rows = await count(QUEUE_HISTORY, {"minutes": minutes})
    # with nothing to chart, the reading's time by this host's clock
    until = rows[0].until if rows else datetime.now(UTC) - timedelta(seconds=count.age_s)
    for row in rows:
        series = counts.setdefault(
            row.queue, {k: [0] * minutes for k in ("submitted", "finished", "live")}
        )
        if 0 <= row.ago < minutes:
            series[row.kind][row.ago] += row.n
    items = []
    for name, series in sorted(counts.items()):
        backlog, level = [], series["live"][0]
        for ago in range(minutes):
            backlog.append(level)
            level = max(0, level - series["submitted"][ago] + series["finished"][ago])
        items.append(
            QueueSeries(
                name=name,
                submitted=series["submitted"][::-1],
                finished=series["finished"][::-1],
                backlog=backlog[::-1],
            )
        )
    return QueueHistory(minutes=minutes, until=until, items=items)
