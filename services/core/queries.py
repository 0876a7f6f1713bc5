"""The named SQL of core's hot paths: submit, transitions, the feed, promotion, purge.
Plain reads are written with SQLAlchemy Core in ``store.py``."""

from __future__ import annotations

import functools

from sqlalchemy import TextClause, text

from libs.common.states import TaskState
from services.core.tables import LABELLED

TASK_COLUMNS = """
    id, owner, name, queue, priority, kind, artifact_uri, artifact_sha256, args, env,
    input_path, output_path, cpu, memory_mb, preemptible, max_attempts, backoff_base_s,
    backoff_cap_s, backoff_jitter, poison_after, timeout_s, run_at, idempotency_key,
    spec_hash, labels, state, attempts, last_error, current_attempt_id, created_at,
    updated_at, finished_at, defer_ok, deadline, team, concurrency_key, concurrency_limit
"""

# What a submission reads back: what the database decided. The rest is the spec.
SUBMITTED_COLUMNS = "id, owner, state, idempotency_key, spec_hash, run_at, created_at, updated_at"

# Rows arrive as one jsonb array; ORDER BY ord makes identities follow the given order.
SUBMIT: TextClause = text(f"""
WITH input AS (
    SELECT r.*, e.ord
    FROM jsonb_array_elements(CAST(:rows AS jsonb)) WITH ORDINALITY AS e(doc, ord),
    jsonb_to_record(e.doc) AS r(
        name text, queue text, priority smallint, kind text, artifact_uri text,
        artifact_sha256 text, args jsonb, env jsonb, input_path text, output_path text,
        cpu double precision, memory_mb integer, preemptible boolean, max_attempts integer,
        backoff_base_s double precision, backoff_cap_s double precision,
        backoff_jitter boolean, poison_after integer, timeout_s integer,
        run_at timestamptz, idempotency_key text, spec_hash text, labels jsonb, owner text,
        defer_ok boolean, deadline timestamptz, team text, concurrency_key text,
        concurrency_limit integer
    )
), clock AS (
    -- Fair share (docs/sharing.md): a flow's work in a queue is stamped one step (the
    -- quantum over its weight) after its last waiting stamp; a flow with nothing
    -- waiting starts at the queue's head stamp (or now, if that is later), so it
    -- interleaves with a backlog instead of queueing behind it. A flow is an owner's
    -- own work, or a team's work (whoever of its members submitted it). "waiting" is
    -- spelled as a range, as in the flow's index (ix_tasks_owner_last, ix_tasks_team_last;
    -- migration 0014_flow_last says why), so that no other index can serve the read.
    SELECT o.flow_owner, o.team, o.queue,
           CASE WHEN o.team IS NULL THEN
               (SELECT max(w.vtime) FROM core.tasks w
                WHERE w.owner = o.flow_owner AND w.queue = o.queue
                  AND w.state >= 'waiting' AND w.state <= 'waiting' AND w.team IS NULL)
           ELSE
               (SELECT max(w.vtime) FROM core.tasks w
                WHERE w.team = o.team AND w.queue = o.queue
                  AND w.state >= 'waiting' AND w.state <= 'waiting' AND w.team IS NOT NULL)
           END AS last,
           LEAST(EXTRACT(EPOCH FROM now()),
                 (SELECT min(h.vtime) FROM core.tasks h
                  WHERE h.queue = o.queue AND h.state = 'waiting')) AS head,
           CAST(:quantum AS double precision) / COALESCE(
               CASE WHEN o.team IS NULL
                    THEN (SELECT s.weight FROM core.shares s WHERE s.name = o.flow_owner)
                    ELSE (SELECT s.weight FROM core.team_shares s WHERE s.team = o.team) END,
               1) AS step
    FROM (SELECT DISTINCT CASE WHEN team IS NULL THEN owner END AS flow_owner, team, queue
          FROM input) o
), stamped AS (
    SELECT input.*,
           GREATEST(
               EXTRACT(EPOCH FROM COALESCE(input.run_at, now())),
               COALESCE(clock.last + clock.step, clock.head, EXTRACT(EPOCH FROM now()))
                   + clock.step * (row_number() OVER (
                       PARTITION BY clock.flow_owner, clock.team, input.queue
                       ORDER BY input.ord) - 1)
           ) AS vtime
    FROM input JOIN clock ON clock.queue = input.queue
        AND clock.team IS NOT DISTINCT FROM input.team
        AND (input.team IS NOT NULL OR clock.flow_owner = input.owner)
), new AS (
    INSERT INTO core.tasks (
        owner, name, queue, priority, kind, artifact_uri, artifact_sha256, args, env,
        input_path, output_path, cpu, memory_mb, preemptible, max_attempts, backoff_base_s,
        backoff_cap_s, backoff_jitter, poison_after, timeout_s, run_at, idempotency_key,
        spec_hash, labels, defer_ok, deadline, team, concurrency_key, concurrency_limit, vtime,
        state
    )
    SELECT
        owner, name, queue, priority, kind, artifact_uri, artifact_sha256, args, env,
        input_path, output_path, cpu, memory_mb, preemptible, max_attempts, backoff_base_s,
        backoff_cap_s, backoff_jitter, poison_after, timeout_s, COALESCE(run_at, now()),
        idempotency_key, spec_hash, labels, defer_ok, deadline, team, concurrency_key,
        concurrency_limit, vtime,
        CASE WHEN run_at > now()
              OR EXISTS (SELECT 1 FROM core.queues q WHERE q.name = stamped.queue AND q.paused)
             THEN 'ready' ELSE 'waiting' END
    FROM stamped
    ORDER BY ord
    ON CONFLICT (owner, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING {SUBMITTED_COLUMNS}
), events AS (
    INSERT INTO core.task_events (task_id, seq, owner, op, from_state, to_state)
    SELECT id, 1, owner, 'submit', NULL, state FROM new
)
SELECT {SUBMITTED_COLUMNS} FROM new ORDER BY id
""")


BY_IDEMPOTENCY_KEYS: TextClause = text(f"""
SELECT {SUBMITTED_COLUMNS} FROM core.tasks
WHERE (owner, idempotency_key) IN (
    SELECT * FROM unnest(CAST(:owners AS text[]), CAST(:keys AS text[])))
""")

# The guarded move of one task: the sub-select locks the row and reads the state it
# leaves; the UPDATE applies only if that state is one the op may start from.
TRANSITION: TextClause = text("""
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

# Written as IN over the (few) paused queues, so that with none paused the park queries
# cost nothing, and with some they walk the waiting index of those queues only.
_PAUSED_QUEUES = "(SELECT q.name FROM core.queues q WHERE q.paused)"
_QUEUE_PAUSED = f"t.queue IN {_PAUSED_QUEUES}"
_QUEUE_RUNS = f"t.queue NOT IN {_PAUSED_QUEUES}"


def _bulk(op: str, source: str, target: str, condition: str, order: str, reason: str) -> TextClause:
    return text(
        _BULK.format(
            op=op, source=source, target=target, condition=condition, order=order, reason=reason
        )
    )


# A claim takes due ready work itself (db.dispatch), so the promoter leaves it to claims
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
        changes=f"""state = CASE WHEN t.queue IN {_PAUSED_QUEUES} THEN 'ready' ELSE 'waiting' END,
        finished_at = NULL, run_at = now(), attempts = 0, crashes = 0""",
        closing="",
    )
)

# As a cancel of one task: a running attempt is closed here too, and its worker told to
# stop it at its next heartbeat.
BULK_CANCEL: TextClause = text(
    _BULK_PERSON.format(
        selected=_SELECTED,
        changes="state = 'cancelled', finished_at = now()",
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
     WHERE t.state IN ('failed', 'ready') AND t.run_at > now() AND {_QUEUE_RUNS}),
    (SELECT min(t.run_at) + make_interval(secs => :after_s) FROM core.tasks t
     WHERE t.state = 'ready' AND t.run_at <= now() AND NOT t.deferred
       AND t.run_at > now() - make_interval(secs => :after_s) AND {_QUEUE_RUNS})
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
PURGE_WORKERS: TextClause = text("""
WITH doomed AS (
    SELECT id FROM core.workers
    WHERE state IN ('dead', 'left') AND gone_at < now() - make_interval(secs => :age_s)
    ORDER BY gone_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
)
DELETE FROM core.workers w USING doomed WHERE w.id = doomed.id
""")

# The feed: only events of transactions older than every running one are served, so an
# event that commits later can never land behind a cursor already handed out. A user
# reads its own tasks' events and those of tasks its teams own (``teams``; NULL: none).
_FEED = """
SELECT e.xid, e.id, e.task_id, e.seq, e.owner, e.op, e.from_state, e.to_state, e.reason,
       e.attempt_id, e.at, h.horizon
FROM (SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS horizon) h
LEFT JOIN LATERAL (
    SELECT * FROM core.task_events e
    WHERE (e.xid, e.id) > (:xid, :id) AND e.xid < h.horizon {to_state}
      AND (CAST(:owner AS text) IS NULL OR e.owner = :owner
           OR (CAST(:teams AS text[]) IS NOT NULL AND EXISTS (
               SELECT 1 FROM core.tasks t
               WHERE t.id = e.task_id AND t.team = ANY(CAST(:teams AS text[])))))
    ORDER BY e.xid, e.id
    LIMIT :limit
) e ON true
"""

FEED: TextClause = text(_FEED.format(to_state=""))


@functools.cache
def feed_to(state: TaskState) -> TextClause:
    """The feed of events that moved a task to ``state`` only. The state is written into
    the text, not bound, so a partial index on it (``ix_task_events_dead``) serves even a
    prepared statement's generic plan."""
    return text(_FEED.format(to_state=f"AND e.to_state = '{state.value}'"))


QUEUE_DEPTHS: TextClause = text("""
SELECT queue, state, count(*) AS n,
       EXTRACT(EPOCH FROM now() - min(updated_at) FILTER (WHERE state = 'waiting')) AS oldest
FROM core.tasks
WHERE state IN ('dead', 'failed', 'ready', 'running', 'waiting')
GROUP BY queue, state
""")


# The last hour of each queue, by minutes ago (0: this minute). Both halves use a partial
# index: finished rows by ``ix_tasks_finished_at``, unfinished ones by the live index.
QUEUE_HISTORY: TextClause = text("""
WITH recent AS (
    SELECT queue, created_at, finished_at FROM core.tasks
    WHERE finished_at > now() - make_interval(mins => :minutes)
    UNION ALL
    SELECT queue, created_at, NULL FROM core.tasks
    WHERE state IN ('failed', 'ready', 'running', 'waiting')
)
SELECT queue, 'submitted' AS kind,
       floor(EXTRACT(EPOCH FROM now() - created_at) / 60)::int AS ago, count(*) AS n
FROM recent WHERE created_at > now() - make_interval(mins => :minutes) GROUP BY 1, 2, 3
UNION ALL
SELECT queue, 'finished', floor(EXTRACT(EPOCH FROM now() - finished_at) / 60)::int, count(*)
FROM recent WHERE finished_at IS NOT NULL GROUP BY 1, 2, 3
UNION ALL
SELECT queue, 'live', 0, count(*) FROM recent WHERE finished_at IS NULL GROUP BY 1, 2, 3
""")
