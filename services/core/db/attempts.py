"""Attempts: what a claim picks and leases, how attempts start and end, and reports many
at once. The workers themselves (registration, heartbeats, the reaper) are in
``db.workers``.

Every task state change here is guarded by the transitions table: ``tasks_db.transition``
(one task), a claim, or a batch of reports (``report_many``), whose SQL guards carry the
sources of each op.
"""

from __future__ import annotations

import math
import time
from base64 import b64encode
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError
from sqlalchemy import TextClause, func, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common import pipeline
from libs.common.errors import NotFound, StaleAttempt
from libs.common.models import (
    Artifact,
    Assignment,
    AttemptReport,
    Charge,
    Egress,
    ReportVerdict,
    Resources,
    ServiceSpec,
)
from libs.common.states import FINAL, TaskState, Workers, sql_in
from libs.common.stored import as_stored
from services.core import traces
from services.core.db import placement, sharing
from services.core.db import tasks as tasks_db
from services.core.db.params import floats, ints, jsonb, words
from services.core.db.secrets import mask_json, refers_to_secrets
from services.core.db.tables import attempts, found_by_id, tasks
from services.core.domain import outcomes, selectors
from services.core.domain.outcomes import Move
from services.core.domain.placement import DECAY, ZERO, Amount, choose, claim_depth
from services.core.domain.retry import SERVICE_RESTARTS
from services.core.domain.sharing import Gate
from services.core.domain.transitions import Op, sources

S = TaskState


# Waiting work of the worker's queues, best first (priority, then the fair-share stamp:
# docs/sharing.md), with what placement needs (its kind's measured peak, its pool's
# overcommit ratio) and what sharing needs (its owner's running quotas, its concurrency
# key, its aging boost). A preemptible task may be charged less than its request, so
# only guaranteed work is filtered by the room here. Time-insensitive work in a pool
# above its deferral threshold is left for the placement pass to defer. The second scan
# adds the work longest past its fair turn, which aging may lift above the first's.
#
# The claim's state guards, written into the SQL (from the transitions table) so that the
# planner can use the partial indexes even with a generic plan: waiting work, and ready
# work whose run_at has come in a running queue, the promoter's own condition
# (tasks_db.PROMOTE_READY), so that a burst of delayed work is claimable at its instant,
# not after a promotion row by row. A deferral's end is left to the promoter, whose event
# says why it runs. A claim that asks ``ahead_s`` also takes ready work due within that
# many seconds (its attempt starts at the task's run_at), but only after all the work due
# now: ``ahead`` sorts last, so work leased ahead only fills room left over.
_FROM_WAITING, _FROM_READY = S.WAITING.value, S.READY.value


if sorted((_FROM_WAITING, _FROM_READY)) != sources(Op.CLAIM, S.RUNNING):
    # The scans below are written per source state; the transitions table stays the rule.
    raise RuntimeError("the claim's scans and the transitions table disagree")


# A task leased ahead and given back before its run_at (its worker died, drained, or
# preempted it while it was held) waits again with its run_at kept: not taken before then.
# Past its start_by a task is the promoter's to expire, not a claim's to lease.
_STARTABLE = "(t.start_by IS NULL OR t.start_by > now())"


_WAITING = f"t.state = '{_FROM_WAITING}' AND t.run_at <= now() AND {_STARTABLE}"


# The same, for work found by its ids (the reserved: ``found_by_id``).
_WAITING_BY_ID = f"{found_by_id(S.WAITING)} AND t.run_at <= now() AND {_STARTABLE}"


_READY = f"""t.state = '{_FROM_READY}' AND NOT t.deferred AND {_STARTABLE}
  AND t.queue NOT IN (SELECT q.name FROM core.queues q WHERE q.paused)"""


_DUE_READY = f"{_READY} AND t.run_at <= now()"


# Work a claim ahead may take: a scan of its own, in due order, so that it stops at its
# limit (the ready index is by queue and run_at) however much is due within ``ahead_s``;
# sorting that window by priority cost every claim a pass over it (10,000s of rows when
# 100,000 schedules fire in a minute).
_AHEAD_READY = f"""{_READY} AND t.run_at > now()
  AND t.run_at <= now() + make_interval(secs => :ahead_s)"""


# A task's required selectors against the worker's labels (``domain.selectors``: its
# facts, as a jsonb array and as text[]): facts all present, none of some present, one of
# each group present. A task without selectors (the common one) is one NULL test.
_LABELLED = """(t.required IS NULL OR (
    t.required->'all' <@ CAST(:facts AS jsonb)
    AND NOT (t.required->'none' ?| CAST(:fact_names AS text[]))
    AND NOT EXISTS (SELECT FROM jsonb_array_elements(t.required->'any') g
                    WHERE NOT (g ?| CAST(:fact_names AS text[])))))"""


# The devices a task asks for against those the worker has free (``:devices``, a jsonb
# object of counts): devices are never overcommitted, so every task is filtered by them.
# A task without devices (the common one) is one NULL test.
_DEVICES_FIT = """(t.devices IS NULL OR NOT EXISTS (
    SELECT FROM jsonb_each_text(t.devices) d
    WHERE d.value::int > COALESCE((CAST(:devices AS jsonb)->>d.key)::int, 0)))"""


_PICK = f"""
SELECT t.id FROM core.tasks t
WHERE {{which}}
  AND (t.preemptible OR (t.cpu <= :cpu AND t.memory_mb <= :memory_mb))
  AND {_DEVICES_FIT}
  AND {_LABELLED}
  AND NOT ({placement.DEFERRABLE} AND t.queue IN {placement.HOT_QUEUES}
           AND {placement.LATEST_START} > now())
ORDER BY {{order}}
LIMIT {{limit}}
FOR UPDATE OF t SKIP LOCKED
"""


_AGING = """LEAST(CAST(:aging_max AS integer), GREATEST(0, floor(
    (EXTRACT(EPOCH FROM now()) - t.vtime) / :aging_s)))"""


# What placement and sharing need of the rows picked, joined once they are few, by the
# primary key (``ANY``: planned without the claim's limit, as a turn plans it, the join
# was a scan of the whole table, hashed).
_DETAILS = f"""
SELECT t.id, p.reserved, t.state = '{_FROM_READY}' AND t.run_at > now() AS ahead,
       t.state, t.owner, t.cpu, t.memory_mb, t.devices, t.preemptible, t.priority,
       t.vtime, t.concurrency_key, t.concurrency_limit,
       {_AGING}::int AS boost,
       u.peak_cpu, u.peak_memory_mb, q.overcommit, s.max_cpu, s.max_memory_mb, s.max_running,
       s.max_devices, t.team, ts.max_cpu AS team_max_cpu,
       ts.max_memory_mb AS team_max_memory_mb, ts.max_running AS team_max_running,
       ts.max_devices AS team_max_devices, {refers_to_secrets("t.env")} AS secret_refs,
       t.name, t.queue, t.placement
FROM picked p JOIN core.tasks t ON t.id = p.id AND t.id = ANY(ARRAY(SELECT id FROM picked))
LEFT JOIN core.usage u ON u.owner = t.owner AND u.name = t.name
LEFT JOIN core.queues q ON q.name = t.queue
LEFT JOIN core.shares s ON s.name = t.owner
LEFT JOIN core.team_shares ts ON ts.team = t.team
"""


def _pick(which: str, order: str, limit: str = ":limit") -> str:
    return _PICK.format(which=which, order=order, limit=limit)


_BEST = "t.priority DESC, t.vtime, t.id"


# Due ready work is found by its due time and sorted (it is few, but at a burst) by
# effective priority, so aging needs no second scan of it; what a claim ahead may take is
# taken in due order (``_AHEAD_READY``), and sorts after all the work due now.
_BEST_DUE = f"t.priority + {_AGING} DESC, t.vtime, t.id"


_FIRST_DUE = "t.run_at, t.id"


# Guaranteed tasks this worker squeezed or preempted attempts for, lately, and the task it
# is reserved for: they go first, whatever their queue.
_RESERVED = """
SELECT COALESCE(a.preempted_by, a.squeezed_for) FROM core.attempts a
WHERE a.worker_id = :worker AND (a.preempted_by IS NOT NULL OR a.squeezed_for IS NOT NULL)
  AND (a.outcome IS NULL OR a.ended_at > now() - interval '60 seconds')
UNION
SELECT w.reserved_for FROM core.workers w WHERE w.id = :worker AND w.reserved_for IS NOT NULL
"""


def _waiting_in(in_queues: str) -> TextClause:
    waiting = f"{_WAITING} AND {in_queues}"
    aged = f"{waiting} AND t.vtime < EXTRACT(EPOCH FROM now()) - :aging_s"
    reserved = f"{_WAITING_BY_ID} AND t.id = ANY(ARRAY({_RESERVED}))"
    return text(f"""
WITH reserved AS ({_pick(reserved, _BEST)}),
best AS ({_pick(waiting, _BEST)}),
aged AS ({_pick(aged, "t.vtime, t.id", ":aged_limit")}),
due AS ({_pick(f"{_DUE_READY} AND {in_queues}", _BEST_DUE)}),
ahead AS ({_pick(f"{_AHEAD_READY} AND {in_queues}", _FIRST_DUE)}),
picked AS (
    SELECT id, bool_or(reserved) AS reserved FROM (
        SELECT id, true AS reserved FROM reserved
        UNION ALL SELECT id, false FROM best
        UNION ALL SELECT id, false FROM aged
        UNION ALL SELECT id, false FROM due
        UNION ALL SELECT id, false FROM ahead) p
    GROUP BY id
)
{_DETAILS}
""")


# One queue (the common worker) is an equality, so the scan walks the waiting index in
# its order and stops at the limit; several are an ANY, sorted. One statement: the
# reserved work, the best, the longest past its fair turn, the due.
_WAITING_IN_QUEUE = _waiting_in("t.queue = :queue")


_WAITING_IN_QUEUES = _waiting_in("t.queue = ANY(CAST(:queues AS text[]))")


# The columns of a leased task's row (``moved``: the task's, and its attempt's id, number,
# charge and fencing secret) that its assignment is built from (``_assignment``).
_ASSIGNED = """
    id, kind, artifact_uri, artifact_sha256, args, env, input_path, output_path, cpu,
    memory_mb, devices, disk_mb, timeout_s, preemptible, created_at, attempt_id,
    attempt_number, charge_cpu, charge_memory_mb, charge_devices, progress_timeout_s, fence,
    service,
    -- the task's latest checkpoint, for this attempt's CAIRN_CHECKPOINT
    (SELECT p.checkpoint FROM core.task_progress p WHERE p.task_id = moved.id) AS checkpoint,
    -- its queue's egress policy (NULL: host, the default), for the agent to apply
    (SELECT q.egress FROM core.queues q WHERE q.name = moved.queue) AS egress"""

#: the most attempts one turn's answer carries again (``resend``)
MAX_RESEND = 256
#: how much of a closed attempt's error a refusal of its report quotes
ENDED_WHY_CHARS = 200


# The lease: each chosen task moved (guarded by the claim's sources in the transitions
# table and by the state the pick saw), its attempt numbered and inserted with the id the
# move gave it (so an attempt exists only for a task that moved, and is its current one),
# and its event appended. The move is driven by the chosen ids through the primary key
# (``t.id = ANY(:ids)``, as ``_FINISH`` is): a join of the tasks with the chosen rows alone
# was planned as a scan of all the claimable work (the state guard matches the waiting
# index), which grows with the backlog: 4,744 rows read to move 64 at 5,000 waiting. The
# sources guard is on the chosen rows' states (``c.from_state``, which the task's state
# must equal), not a constant on ``t.state``: with one, a table whose statistics predate
# its backlog got a bitmap scan of ``ix_tasks_live_queue_state`` (every live task's
# entry, 1,000 at 1,000 tasks) ANDed with, or instead of, the primary key's.
_CLAIM = text(f"""
WITH holder AS (
    -- the worker, still live (not draining, not gone), locked against the reaper and a
    -- drain until commit
    SELECT id FROM core.workers
    WHERE id = :worker AND state = '{Workers.LIVE}' FOR SHARE
), moved AS (
    UPDATE core.tasks t SET
        state = :target, version = t.version + 1, updated_at = now(),
        current_attempt_id = nextval('core.attempts_id_seq'), attempts = t.attempts + 1
    FROM unnest(
        CAST(:ids AS bigint[]), CAST(:cpus AS float8[]), CAST(:memories AS float8[]),
        CAST(:froms AS text[]), CAST(:devices AS jsonb[])
    ) AS c(id, cpu, memory_mb, from_state, devices)
    WHERE t.id = ANY(CAST(:ids AS bigint[])) AND t.id = c.id
      AND c.from_state = ANY(CAST(:sources AS text[])) AND t.state = c.from_state
      AND EXISTS (SELECT FROM holder)
    RETURNING t.*, t.current_attempt_id AS attempt_id,
              1 + (SELECT count(*) FROM core.attempts a WHERE a.task_id = t.id)
                  AS attempt_number,
              c.cpu AS charge_cpu, c.memory_mb AS charge_memory_mb,
              c.devices AS charge_devices, c.from_state,
              -- the fencing secret (gen_random_uuid: PostgreSQL's strong random source);
              -- the attempt keeps only its digest
              replace(CAST(gen_random_uuid() AS text), '-', '') AS fence
), leased AS (
    INSERT INTO core.attempts (
        id, task_id, number, worker_id, charge_cpu, charge_memory_mb, charge_devices,
        concurrency_key, fence_sha256, started_at
    ) OVERRIDING SYSTEM VALUE
    SELECT attempt_id, id, attempt_number, :worker, charge_cpu, charge_memory_mb,
           charge_devices, concurrency_key, sha256(convert_to(fence, 'UTF8')),
           -- leased ahead: it starts at its run_at, and every deadline counts from then
           CASE WHEN from_state = '{S.READY}' THEN GREATEST(now(), run_at) ELSE now() END
    FROM moved
), events AS (
    INSERT INTO core.task_events (task_id, seq, owner, op, from_state, to_state, attempt_id)
    SELECT id, version, owner, :op, from_state, state, attempt_id FROM moved
)
-- What the assignment needs (``_assignment``), not the whole row: the turn's answer is
-- built from these, and every column more is decoded for each lease.
SELECT {_ASSIGNED},
       GREATEST(0, EXTRACT(EPOCH FROM clock_timestamp() - run_at)) AS waited_s,
       CASE WHEN from_state = '{S.READY}' AND run_at > now() THEN run_at END AS start_at
FROM moved ORDER BY priority DESC, id
""")


# The attempts of a worker whose lease it never saw (``Turn.holding``): open on it, its
# tasks' current ones, never started nor listed among those it holds. Each gets a new
# fencing secret (the first went out in the lost answer only; the attempt keeps the new
# digest) and comes back as the claim returned it: an attempt leased ahead keeps its start.
_RESEND = text(f"""
WITH lost AS (
    SELECT a.id, replace(CAST(gen_random_uuid() AS text), '-', '') AS fence
    FROM core.attempts a JOIN core.tasks t ON t.id = a.task_id AND t.current_attempt_id = a.id
    WHERE a.worker_id = :worker AND a.outcome IS NULL AND a.seen_at IS NULL
      AND {found_by_id(S.RUNNING)} AND NOT (a.id = ANY(CAST(:holding AS bigint[])))
    ORDER BY a.id LIMIT :most
    FOR UPDATE OF a
), again AS (
    UPDATE core.attempts a SET fence_sha256 = sha256(convert_to(lost.fence, 'UTF8'))
    FROM lost WHERE a.id = lost.id
    RETURNING a.id, a.task_id, a.number, a.charge_cpu, a.charge_memory_mb,
              a.charge_devices, a.started_at, lost.fence
), moved AS (
    SELECT t.*, again.id AS attempt_id, again.number AS attempt_number, again.charge_cpu,
           again.charge_memory_mb, again.charge_devices, again.fence,
           again.started_at AS starts
    FROM again JOIN core.tasks t ON t.id = again.task_id
)
SELECT {_ASSIGNED}, CASE WHEN starts > now() THEN starts END AS start_at
FROM moved ORDER BY priority DESC, id
""")


async def resend(conn: AsyncConnection, worker_id: int, holding: Sequence[int]) -> Leases:
    """The attempts core holds for the worker that it never saw leased (``_RESEND``), as
    a claim returns them; ``with_secrets``: all of them (``db.secrets.fill`` looks)."""
    params = {"worker": worker_id, "holding": sorted(set(holding)), "most": MAX_RESEND}
    found = list(await conn.execute(_RESEND, params))
    return Leases(_assignments(found), frozenset(r.id for r in found))


# A turn's statements are planned once per connection (prepared, ``db.pipeline``), not at
# each run: PostgreSQL plans a prepared statement anew for its first five runs and then
# for as long as its generic plan looks dearer than those, and planning the pick (five
# scans over a table of twenty partial indexes) cost more than running it. Their generic
# plans find the rows by ids, a worker or a queue (test_claim_plan); a worker of several
# queues sorts their waiting work either way, and its generic pick ran faster than the
# custom one behind 5,000 waiting and 100,000 finished tasks (14 ms against 19, planning
# included). A generic plan is kept for as long as its connection lives, so it is made
# with sequential scans off: one made while the tables were young (a few hundred tasks,
# never analysed) scanned every task in the report's lock, its move, the pick and the
# lease, at every turn after, however large the table grew (test_claim_plan). Both
# settings local to the turn's transaction, in one statement.
_GENERIC = text(
    "SELECT set_config('plan_cache_mode', 'force_generic_plan', true) AS plan_cache_mode,"
    " set_config('enable_seqscan', 'off', true) AS enable_seqscan"
)


def _clean(value: str | None) -> str | None:
    """PostgreSQL text holds no NUL; a process's output may."""
    return value.replace("\x00", "\ufffd") if value else value


@dataclass
class Tally:
    """What a call ended on the way, for the metrics: returned with its result, and
    added up (``+``) by the caller."""

    lost: int = 0
    poisoned: int = 0
    buried: int = 0
    waits: list[float] = field(default_factory=list)
    #: candidates a claim held back, by what held them (quota, concurrency, rate)
    held: Counter[str] = field(default_factory=Counter)
    #: the earliest instant (UNIX seconds) a backoff set on the way ends: the promoter's
    #: due hint (``Notifier.announce_due``), so that a retry starts on time, not at the
    #: promoter's next poll
    due: float = math.inf

    def __add__(self, other: Tally) -> Tally:
        return Tally(
            self.lost + other.lost,
            self.poisoned + other.poisoned,
            self.buried + other.buried,
            self.waits + other.waits,
            self.held + other.held,
            min(self.due, other.due),
        )

    @staticmethod
    def of(move: Move) -> Tally:
        """A move's count: a burial, and whether a poison pill made it; or the instant
        its backoff ends. Its ``run_at`` is the database's ``now()`` (the transaction's
        start) plus the delay, a little before this clock's reading: the hint is late by
        the transaction's time, not early."""
        if move.target is S.FAILED and move.delay_s is not None:
            return Tally(due=time.time() + move.delay_s)
        if move.target is not S.DEAD:
            return Tally()
        return Tally(poisoned=int(move.reason.startswith("poison pill")), buried=1)


# The worker is heard (a turn, a claim): the attempts it says it started marked seen, and
# its liveness times refreshed only when older than ``fresh_s`` (``domain.workers.
# turn_fresh_s``), so an idle turn of a fresh worker writes nothing: no transaction id, no
# WAL flush at commit. Either way the row comes back in this one round trip. (LEAST skips
# a NULL ``last_turn_at``: an agent registered without ``hang_watch`` keeps it NULL.) The reaper's
# dead-declaration locks the row and re-checks the silence; a fresh row cannot meet it,
# and a stale one is locked here until commit. A lease locks the row too (``_CLAIM``), so
# work is never leased to a worker the reaper buried meanwhile. Only an idle turn takes
# that path (``hear``): what it holds by then is the waiting tasks it picked, which no
# holder of a worker's row (a heartbeat, the reaper, a turn with reports) waits for.
# A turn that must hold the row however fresh (``:always``) locks it as an update would
# (``FOR NO KEY UPDATE``, which a heartbeat's update and the reaper's lock wait for)
# without writing it: a fresh row's rewrite cost a new row version and an entry in each of
# the table's indexes (``ix_workers_heartbeat`` keys the time), at every turn with reports.
_HEARD = text(f"""
WITH seen AS (
    UPDATE core.attempts SET seen_at = COALESCE(seen_at, now())
    WHERE id = ANY(CAST(:started AS bigint[])) AND worker_id = :worker AND outcome IS NULL
), stale AS (
    UPDATE core.workers
    SET last_heartbeat_at = now(),
        last_turn_at = CASE WHEN last_turn_at IS NOT NULL THEN now() END
    WHERE id = :worker AND {sql_in("state", Workers.PRESENT)}
      AND LEAST(last_heartbeat_at, last_turn_at) < now() - make_interval(secs => :fresh_s)
    RETURNING *
), held AS (
    SELECT * FROM core.workers
    WHERE id = :worker AND {sql_in("state", Workers.PRESENT)} AND CAST(:always AS boolean)
      AND NOT EXISTS (SELECT FROM stale)
    FOR NO KEY UPDATE
)
SELECT * FROM stale
UNION ALL
SELECT * FROM held
UNION ALL
SELECT * FROM core.workers
WHERE id = :worker AND {sql_in("state", Workers.PRESENT)}
  AND NOT EXISTS (SELECT FROM stale) AND NOT EXISTS (SELECT FROM held)
""")


@dataclass(frozen=True)
class Heard:
    """What a turn's first round trip read: the worker's row (None when it is dead or
    gone: the reaper won), the reported attempts with their tasks, locked (by attempt
    id), and what is placed on the worker before the reports close any: the reported
    attempts still open on it one by one (``placement.PLACED``'s rows, read with them by
    ``_REPORTED``), what the others hold in all (``placement.USE``)."""

    worker: Any | None
    reported: dict[int, Any] = field(default_factory=dict)
    placed: list[Any] = field(default_factory=list)
    rest: Amount = ZERO
    #: the rows an early pick locked (``hear(..., early=)``), None without one
    picked: Picked | None = None


async def hear(
    conn: AsyncConnection,
    worker_id: int,
    started: Sequence[int] = (),
    reported: Sequence[int] = (),
    fresh_s: float = 0.0,
    always: bool = False,
    early: Ask | None = None,
    waits: bool = True,
) -> Heard:
    """Refresh the worker's liveness if older than ``fresh_s`` (and mark ``started``
    attempts seen), read what is placed on it and lock the tasks of the ``reported``
    attempts: one round trip. A turn that carries reports or starts locks the worker's
    row whatever its age (refreshing it only when stale), before any attempt or task
    row, as a heartbeat and the reaper do: its lease after those rows could otherwise
    wait on a heartbeat that waits on them. ``always``: so does a turn
    that will write attempt rows for another reason (``resend``). The turn's first round
    trip: the statements of its transaction run on their generic plans (``_GENERIC``).

    ``early``: a claim's pick sent in the same round trip, asked before the worker was
    heard (``early_ask``: the claim's room, at most the worker's capacity); the turn
    uses its rows only if the pick asked once heard would have found the same
    (``same_pick``), and picks again otherwise; ``waits``: the claim waits for work if
    it leases none (the probe goes with its pick: ``finish_and_pick``)."""
    ids = sorted(set(reported))
    heard_params = {
        "worker": worker_id,
        "started": sorted(set(started)),
        "fresh_s": fresh_s,
        "always": bool(started or reported or always),
    }
    chain: list[pipeline.Statement] = [
        (_GENERIC, {}),
        (_HEARD, heard_params),
        (placement.USE, {"workers": [worker_id], "listed": ids}),
    ]
    if reported:
        chain.append((_REPORTED, {"ids": ids}))
    picks = _picks(waits) if early is not None else 0
    if early is not None:
        chain += _pick_statements(early, waits)
    found = await pipeline.run(conn, chain)
    picked = _picked(found[len(found) - picks :], waits) if early is not None else None
    _, heard, use, *among = found[: len(found) - picks]
    locked = among[0] if among else []
    rest = placement.rest_from(use).get(worker_id, ZERO)
    rows = {r.attempt_id: r for r in locked}
    return Heard(heard[0] if heard else None, rows, _placed(locked, worker_id), rest, picked)


def _placed(reported: Sequence[Any], worker_id: int) -> list[placement.Placement]:
    """``placement.PLACED``'s rows of the reported attempts still open on the worker,
    from their rows of ``_REPORTED`` (which reads them as ``PLACED`` does, in the same
    round trip). A statement of its own costs a turn about 0.05 ms of core's CPU and
    0.03 ms of PostgreSQL's (``USE``'s, left out in a probe with ``bench/turn_ab.py``)."""
    return [
        placement.Placement(
            r.attempt_id,
            r.id,
            r.worker_id,
            r.priority,
            r.preemptible,
            r.charge_cpu,
            r.charge_memory_mb,
            r.charge_devices,
            r.started,
            r.squeezed,
            r.preempted,
        )
        for r in reported
        if r.ended_as is None and r.worker_id == worker_id
    ]


def early_ask(
    worker: Any,
    cpu: float,
    memory_mb: float,
    most: int,
    defaults: placement.Defaults | None = None,
    ahead_s: float = 0.0,
) -> Ask | None:
    """A claim's pick asked before its worker is heard, from the worker's row as a
    turn last read it: the claim's room, at most the worker's capacity (nothing
    placed), so never less than the room the worker's turn will find (``ask``)."""
    return ask(worker, [], ZERO, cpu, memory_mb, most, defaults, frozenset(), ahead_s)


def same_pick(early: Ask, asked: Ask, picked: Sequence[Any]) -> bool:
    """Whether the early pick locked exactly what the pick ``asked`` would have: the
    same statement but for a room at least as large (devices and all else equal), and
    either the same room or every row it found fitting the smaller one as the pick's
    filter reads it (the best ``limit`` rows fitting a larger room, all fitting the
    smaller, are the best ``limit`` fitting it)."""
    room = ("cpu", "memory_mb")
    if early.worker.id != asked.worker.id or early.most != asked.most:
        return False
    if any(early.params[k] != v for k, v in asked.params.items() if k not in room):
        return False
    if early.room.cpu < asked.room.cpu or early.room.memory_mb < asked.room.memory_mb:
        return False
    if (early.room.cpu, early.room.memory_mb) == (asked.room.cpu, asked.room.memory_mb):
        return True
    cpu, memory_mb = asked.params["cpu"], asked.params["memory_mb"]
    return all(r.preemptible or (r.cpu <= cpu and r.memory_mb <= memory_mb) for r in picked)


@dataclass(frozen=True)
class Leases:
    """A claim's assignments, and the tasks among them whose env refers to secrets
    (``db.secrets.fill`` opens those; the others need no look-up). ``committed``:
    the lease went with the transaction's COMMIT (``lease(..., last=True)``)."""

    assignments: list[Assignment]
    with_secrets: frozenset[int] = frozenset()
    committed: bool = False
    #: the waits of the tasks leased, and the candidates held back
    tally: Tally = field(default_factory=Tally)


@dataclass(frozen=True)
class Ask:
    """A claim's first half: the room it may fill and its pick (``statement``), which
    can travel with the turn's other statements; ``lease`` is the second half."""

    worker: Any
    room: Amount
    most: int
    defaults: placement.Defaults
    params: dict[str, Any]

    def statement(self) -> pipeline.Statement:
        queues = self.params["queues"]
        query = _WAITING_IN_QUEUE if len(queues) == 1 else _WAITING_IN_QUEUES
        return query, {**self.params, "queue": queues[0], "worker": self.worker.id}


def ask(
    worker: Any,
    placed: Sequence[Any],
    rest: Amount,
    cpu: float,
    memory_mb: float,
    most: int,
    defaults: placement.Defaults | None = None,
    closing: frozenset[int] = frozenset(),
    ahead_s: float = 0.0,
) -> Ask | None:
    """A claim's first half, for a worker just heard (``Heard``: its row, locked,
    liveness refreshed): lease waiting work of its queues that fits both the room it
    reports and its capacity less what core has placed on it (``domain.placement``;
    without the attempts whose reports this turn closes, ``closing``) and that its
    owner's quotas and its concurrency key admit (``domain.sharing``): work reserved for
    it first, then highest effective priority, then fair share across owners; rows other
    claims hold are skipped, never shared (``lease``). None when there is nothing to
    lease. ``ahead_s``: also delayed work due within it, into the room the work due now
    leaves, each started at its ``run_at``. Devices are counted by core alone (the
    claim's room says none): what the worker offers less what its open attempts hold,
    so a claim that waits sees the devices a report frees meanwhile."""
    defaults = defaults or placement.Defaults()
    if worker.state != Workers.LIVE or most <= 0:
        return None
    listed = [p for p in placed if p.id not in closing]
    [node] = placement.nodes_from([worker], listed, {worker.id: rest})
    free = node.free()
    room = Amount(
        min(cpu, free.cpu),
        min(memory_mb, free.memory_mb),
        tuple((name, n) for name, n in free.devices if n > 0),
    )
    if room.cpu <= 0 or room.memory_mb <= 0:
        return None
    facts = selectors.facts(worker.labels)
    params = {
        "sources": sources(Op.CLAIM, S.RUNNING),
        "queues": list(worker.queues),
        "facts": jsonb(facts),
        "fact_names": facts,
        "cpu": room.cpu,
        "memory_mb": room.memory_mb,
        "devices": jsonb(dict(room.devices)),
        "limit": claim_depth(most),
        "aged_limit": most,
        "defer_above": defaults.defer_above,
        "defer_margin_s": defaults.defer_margin_s,
        "defer_max_s": defaults.defer_max_s,
        "aging_s": defaults.aging_s,
        "aging_max": defaults.aging_max,
        "ahead_s": ahead_s,
    }
    return Ask(worker, room, most, defaults, params)


async def lease(
    conn: AsyncConnection,
    asked: Ask,
    picked: Sequence[Any],
    last: bool = False,
    first: Sequence[pipeline.Statement] = (),
) -> Leases:
    """The claim's second half: of the rows its pick locked, lease what placement and
    sharing admit, best first. A worker reserved for a task that does not fit yet
    starts nothing else. ``last``: the caller runs nothing after the lease in this
    transaction unless some leased task refers to secrets; then, when none does, the
    lease and the COMMIT go in one round trip (the transaction's own commit on leaving
    finds nothing to do: psycopg sends no COMMIT on an idle connection). ``first``:
    statements that must run before the lease reads or moves anything (the turn's
    reports and notes, after an early pick: ``hear``), sent with the lease when it
    reads nothing else, else on their own first; always run, lease or none."""
    # Reserved work first, then the rest due now, then what is leased ahead, each by
    # effective priority (priority plus aging), fair-share stamp and id.
    rows = sorted(
        picked, key=lambda r: (not r.reserved, r.ahead, -(r.priority + r.boost), r.vtime, r.id)
    )
    reads = asked.worker.reserved_for is not None or any(r.placement for r in rows)
    if first and (reads or _gated(rows)):
        # what the reads see (a concurrency key's slot) follows the reports
        await pipeline.run(conn, first)
        first = ()
    if any(r.placement for r in rows):  # preferences and spreads: docs/placement.md
        rows = await placement.by_labels(conn, asked.worker, rows)
    gate = await _gate(conn, rows)
    # Built as choose walks them: it stops at ``most``, before the over-fetched tail.
    candidates = (placement.candidate(row, asked.defaults) for row in rows)
    chosen = choose(asked.room, candidates, asked.most, gate)
    held = Tally(held=Counter(gate.refused)) if gate is not None else Tally()
    if not chosen or await _held_for(conn, asked.worker.reserved_for, chosen):
        if first:
            await pipeline.run(conn, [*first, pipeline.COMMIT] if last else first)
        return Leases([], tally=held)
    by_id = {row.id: row for row in rows}
    params = {
        "ids": ints(c.task_id for c, _ in chosen),
        "cpus": floats(float(cost.cpu) for _, cost in chosen),
        "memories": floats(float(cost.memory_mb) for _, cost in chosen),
        "froms": words(by_id[c.task_id].state for c, _ in chosen),
        "devices": words(jsonb(dict(cost.devices)) if cost.devices else None for _, cost in chosen),
        "worker": asked.worker.id,
        "target": S.RUNNING.value,
        "sources": asked.params["sources"],
        "op": Op.CLAIM.value,
    }
    commit = last and not any(by_id[c.task_id].secret_refs for c, _ in chosen)
    chain = [*first, (_CLAIM, params)]
    if commit or first:
        ran = await pipeline.run(conn, [*chain, pipeline.COMMIT] if commit else chain)
        found = ran[len(first)]
    else:
        found = list(await conn.execute(_CLAIM, params))
    waited = Tally(waits=[float(row.waited_s) for row in found])
    # The pick said which tasks refer to secrets (one rule: db.secrets).
    refs = frozenset(r.id for r in found if by_id[r.id].secret_refs)
    return Leases(_assignments(found), refs, commit, held + waited)


async def _held_for(conn: AsyncConnection, hold: int | None, chosen: list[Any]) -> bool:
    """The worker is reserved for a guaranteed task still waiting that does not fit yet:
    it starts nothing else, so that its room frees up for that task."""
    if hold is None or any(c.task_id == hold for c, _ in chosen):
        return False
    waiting = select(tasks.c.id).where(tasks.c.id == hold, tasks.c.state == S.WAITING.value)
    return (await conn.execute(waiting)).first() is not None


def _gated(rows: Sequence[Any]) -> bool:
    """Whether any candidate has a quota (its owner's, its team's) or a concurrency key:
    the gate reads what runs under them (``_gate``). A row's quotas are its owner's and
    its team's (``_DETAILS`` joins them by name), so each is read once, not once a row."""
    if any(r.concurrency_key for r in rows):
        return True
    owners = {r.owner: r for r in rows}.values()
    teams = {r.team: r for r in rows if r.team is not None}.values()
    return any(sharing.quota_of(r) is not None for r in owners) or any(
        sharing.team_quota_of(r) is not None for r in teams
    )


async def _gate(conn: AsyncConnection, rows: list[Any]) -> Gate | None:
    """Quotas (its owner's, its team's) and concurrency keys, when any candidate has them
    (the common claim has none and costs no more queries)."""
    if not _gated(rows):
        return None
    quotas = {r.owner: q for r in rows if (q := sharing.quota_of(r)) is not None}
    team_quotas = {r.team: q for r in rows if (q := sharing.team_quota_of(r)) is not None}
    tasks = {r.id: sharing.gated(r) for r in rows}
    return await sharing.gate(conn, tasks, quotas, lock=True, team_quotas=team_quotas)


def fencing_token(attempt_id: int, number: int, secret: str) -> str:
    """An attempt's fencing token: its id, its epoch (the attempt's number, which grows
    with each attempt of its task) and its secret, whose digest the attempt keeps."""
    return f"{attempt_id}.{number}.{secret}"


# Whether the attempt holding a fencing token is its task's current one, still running:
# found by the attempt's id and the digest of the token's secret (a wrong secret finds
# nothing, the same as a missing attempt).
_FENCE = text(f"""
SELECT a.task_id, a.id AS attempt_id, a.number AS epoch,
       a.outcome IS NULL AND t.current_attempt_id = a.id AND t.state = '{S.RUNNING.value}'
           AS current
FROM core.attempts a JOIN core.tasks t ON t.id = a.task_id
WHERE a.id = :attempt AND a.number = :epoch AND a.fence_sha256 = sha256(convert_to(:secret, 'UTF8'))
""")


async def fence(conn: AsyncConnection, attempt_id: int, epoch: int, secret: str) -> Any | None:
    """The attempt a fencing token names, with whether it is current; None when no
    attempt holds that token."""
    params = {"attempt": attempt_id, "epoch": epoch, "secret": secret}
    return (await conn.execute(_FENCE, params)).first()


def _assignments(rows: Sequence[Any]) -> list[Assignment]:
    """The leases of a claim's rows (``_assignment``), its tasks' equal artifacts,
    requests and charges each one shared model (most of a claim's tasks run the same
    program at the same size): validating them once, not once a lease, halves the
    validation of a lease (4.3 against 2.2 µs)."""
    shared: dict[tuple[Any, ...], Any] = {}
    return [_assignment(row, shared) for row in rows]


def _one(
    shared: dict[tuple[Any, ...], Any],
    key: tuple[Any, ...] | None,
    fields: dict[str, Any],
    model: type[BaseModel],
) -> Any:
    """The model of ``fields`` validated once for all of a claim's rows with the same
    ``key`` (None: not shared); ``fields`` as they are when they do not validate, for
    ``Assignment``'s validation to refuse (``_assignment``)."""
    if key is None:
        return fields
    found = shared.get(key)
    if found is None:
        try:
            found = shared[key] = model.model_validate(fields)
        except ValidationError:
            return fields
    return found


def _assignment(row: Any, shared: dict[tuple[Any, ...], Any]) -> Assignment:
    """The lease as the worker gets it, from the claim's row (the claim's hot loop: one per
    attempt). Validated by pydantic-core, which costs a third of ``model_construct``'s
    loop in Python over the same fields; a row that today's bounds refuse (stored under
    looser ones) goes out as it is, as it did before. ``shared``: the claim's artifacts,
    requests and charges validated so far (``_assignments``)."""
    devices, charged = row.devices or {}, row.charge_devices or {}
    fields = {
        "attempt_id": row.attempt_id,
        "attempt_number": row.attempt_number,
        "task_id": row.id,
        "kind": row.kind,
        "artifact": _one(
            shared,
            ("artifact", row.artifact_uri, row.artifact_sha256),
            {"uri": row.artifact_uri, "sha256": row.artifact_sha256},
            Artifact,
        ),
        "args": row.args,
        # Secret references are filled in by the claim itself (db.secrets).
        "env": {k: v for k, v in row.env.items() if isinstance(v, str)},
        "input_path": row.input_path,
        "output_path": row.output_path,
        "resources": _one(
            shared,
            None if devices else ("resources", row.cpu, row.memory_mb, row.disk_mb),
            {
                "cpu": row.cpu,
                "memory_mb": row.memory_mb,
                "devices": devices,
                "disk_mb": row.disk_mb,
            },
            Resources,
        ),
        "timeout_s": row.timeout_s,
        "charge": _one(
            shared,
            None if charged else ("charge", row.charge_cpu, row.charge_memory_mb),
            {"cpu": row.charge_cpu, "memory_mb": row.charge_memory_mb, "devices": charged},
            Charge,
        ),
        "traceparent": traces.claimed(row.id, row.created_at, row.attempt_id, row.attempt_number),
        "preemptible": row.preemptible,
        "start_at": row.start_at,
        "progress_timeout_s": row.progress_timeout_s,
        "checkpoint": b64encode(row.checkpoint).decode() if row.checkpoint is not None else None,
        "fencing_token": fencing_token(row.attempt_id, row.attempt_number, row.fence),
        "egress": row.egress,
        "service": row.service,
    }
    try:
        return Assignment.model_validate(fields)
    except ValidationError:
        return _unvalidated(fields)


def _unvalidated(fields: dict[str, Any]) -> Assignment:
    """An assignment built without validating its fields (``_assignment``); a part
    validated already (shared: ``_one``) is kept as it is."""
    egress, service = fields["egress"], fields["service"]

    def part(model: type[BaseModel], value: Any) -> Any:
        return value if isinstance(value, model) else model.model_construct(**value)

    return Assignment.model_construct(
        **{
            **fields,
            "artifact": part(Artifact, fields["artifact"]),
            "resources": part(Resources, fields["resources"]),
            "charge": part(Charge, fields["charge"]),
            "egress": as_stored(Egress, egress) if egress is not None else None,
            "service": as_stored(ServiceSpec, service) if service is not None else None,
        }
    )


async def _current_task(conn: AsyncConnection, attempt_id: int) -> Any:
    """The task of the attempt, locked, if this attempt is still its current one."""
    row = (
        await conn.execute(
            text(f"""
                SELECT t.*, {tasks_db.RECENT_CRASHES} AS recent_crashes
                FROM core.tasks t JOIN core.attempts a ON a.task_id = t.id
                WHERE a.id = :attempt FOR UPDATE OF t
            """),
            {"attempt": attempt_id},
        )
    ).first()
    if row is None:
        raise NotFound(f"attempt {attempt_id} not found")
    if row.current_attempt_id != attempt_id or row.state != S.RUNNING:
        raise StaleAttempt(
            f"attempt {attempt_id} is not task {row.id}'s current attempt; its report is refused"
        )
    return row


async def _close_attempt(
    conn: AsyncConnection, attempt_id: int, outcome: str, **values: Any
) -> None:
    await conn.execute(
        update(attempts)
        .where(attempts.c.id == attempt_id, attempts.c.outcome.is_(None))
        .values(outcome=outcome, ended_at=func.now(), **values)
    )


async def _apply(
    conn: AsyncConnection, task_id: int, attempt_id: int, move: Move
) -> tuple[TaskState, Tally]:
    """One task's move through ``tasks_db.transition`` (the reaper's and a service's path)."""
    await tasks_db.transition(
        conn,
        task_id,
        move.op,
        move.target,
        reason=move.reason,
        error=move.error,
        delay_s=move.delay_s,
        crashed=move.crashed,
        refund=move.refund,
        attempt_id=attempt_id,
    )
    return move.target, Tally.of(move)


# A service's recent attempts (the one just closed included): restarts since its last
# healthy run, and crashes within the window; attempts lost with their host count for
# neither.
_SERVICE_HISTORY = text(f"""
WITH recent AS (
    SELECT a.id, a.outcome, a.ended_at,
           a.ended_at - a.started_at >= make_interval(secs => :healthy_s) AS healthy,
           COALESCE(a.outcome = 'lost' AND w.state = '{Workers.DEAD}' AND a.ended_at >= w.gone_at, false)
               AS host_died
    FROM core.attempts a LEFT JOIN core.workers w ON w.id = a.worker_id
    WHERE a.task_id = :task AND a.outcome IS NOT NULL
    ORDER BY a.id DESC
    LIMIT 64
)
SELECT
    count(*) FILTER (WHERE NOT host_died
        AND id > COALESCE((SELECT max(id) FROM recent WHERE healthy), 0)) AS streak,
    count(*) FILTER (WHERE NOT host_died AND outcome IN ('crashed', 'lost')
        AND ended_at > now() - make_interval(secs => :window_s)) AS crashes
FROM recent
""")


async def _restart_service(
    conn: AsyncConnection,
    task: Any,
    attempt_id: int,
    error: str,
    crashed: bool,
    host_died: bool,
) -> tuple[TaskState, Tally]:
    """A service's exit (its attempt already closed), decided by its recent history."""
    policy = SERVICE_RESTARTS
    params = {"task": task.id, "healthy_s": policy.healthy_s, "window_s": policy.window_s}
    history = (await conn.execute(_SERVICE_HISTORY, params)).one()
    move = outcomes.restarted(
        task,
        error,
        crashes=history.crashes,
        streak=history.streak,
        crashed=crashed,
        host_died=host_died,
    )
    return await _apply(conn, task.id, attempt_id, move)


_CONFIRM_START = text(f"""
UPDATE core.attempts a SET seen_at = COALESCE(a.seen_at, now())
FROM core.tasks t
WHERE a.id = :attempt AND a.worker_id = :worker AND a.outcome IS NULL
  AND t.id = a.task_id AND t.current_attempt_id = a.id AND {found_by_id(S.RUNNING)}
RETURNING t.id
""")


async def confirm_start(conn: AsyncConnection, attempt_id: int, worker_id: int) -> int:
    """The agent is about to start the attempt: core still holds it for this worker, and
    from now on it counts as started. Refused (``StaleAttempt``) when the lease is gone,
    e.g. the reaper requeued it between the claim and the start. Its row lock orders this
    against the reaper's loss of the same attempt: whichever commits first wins. (The
    agent asks only when its last turn is too old to vouch for it: docs/architecture.md.)"""
    task_id = (
        await conn.execute(_CONFIRM_START, {"attempt": attempt_id, "worker": worker_id})
    ).scalar()
    if task_id is None:
        raise StaleAttempt(f"attempt {attempt_id} is no longer held for worker {worker_id}")
    return int(task_id)


# A read: a burst of attempts due at one instant is checked without writing a row each.
# The start is acknowledged afterwards as any start is (the turn's ``started``, the
# sidecar's board), which is what makes a loss after it count as a crash.
_HELD_STARTS = text(f"""
SELECT a.id FROM core.attempts a JOIN core.tasks t ON t.id = a.task_id
WHERE a.id = ANY(CAST(:attempts AS bigint[])) AND a.worker_id = :worker AND a.outcome IS NULL
  AND t.current_attempt_id = a.id AND {found_by_id(S.RUNNING)}
""")


async def held_starts(
    conn: AsyncConnection, attempt_ids: Sequence[int], worker_id: int
) -> set[int]:
    """Which of these attempts (leased ahead, due together) core still holds for this
    worker: ``confirm_start`` for many at once, without marking them started."""
    params = {"attempts": sorted(set(attempt_ids)), "worker": worker_id}
    return {int(row.id) for row in await conn.execute(_HELD_STARTS, params)}


async def lose(
    conn: AsyncConnection,
    attempt_id: int,
    why: str,
    *,
    host_died: bool = False,
    excused: bool = False,
) -> tuple[TaskState | None, Tally]:
    """An attempt whose process is gone without a report. Once a heartbeat has shown it
    running, that is a crash (towards the poison-pill limit); a lease no heartbeat ever
    showed (its claim's answer lost on the way, say), or one lost while core could not
    hear its worker (``excused``), goes back without cost."""
    lost = Tally(lost=1)
    try:
        task = await _current_task(conn, attempt_id)
    except StaleAttempt:
        await _close_attempt(conn, attempt_id, "lost", error=why)
        return None, lost
    seen = (
        await conn.execute(select(attempts.c.seen_at).where(attempts.c.id == attempt_id))
    ).scalar_one()
    await _close_attempt(conn, attempt_id, "lost", error=why)
    if seen is None or excused:
        cause = "it never started" if seen is None else "core was away"
        move = outcomes.lost_unstarted(why, cause)
        state, moved = await _apply(conn, task.id, attempt_id, move)
    elif task.kind == "service":
        state, moved = await _restart_service(conn, task, attempt_id, why, True, host_died)
    else:
        move = outcomes.failed(task, why, retryable=True, crashed=True)
        state, moved = await _apply(conn, task.id, attempt_id, move)
    return state, lost + moved


# The reported attempts with their tasks, the tasks locked (in id order, so two batches
# never deadlock), and what the decision and the measured use need; for a refusal, how
# an attempt already closed ended (its outcome, the start of its error); for a turn's
# placement, what ``placement.PLACED`` reads of them (``_placed``). The tasks are
# found through their primary key (``t.id = ANY(ARRAY(...))``, as ``_FINISH`` finds them):
# a join on ``a.task_id`` alone got, on a connection that prepared it while the table was
# young and unanalysed, a generic plan hashing a scan of every task, kept for as long as
# the connection lives: each turn with reports read the whole table (968,000 rows read
# for 1,000 tasks claimed and reported at one a turn).
_REPORTED = text(f"""
SELECT a.id AS attempt_id, a.worker_id, a.preempted_by, a.number,
       a.outcome AS ended_as, left(a.error, {ENDED_WHY_CHARS}) AS ended_why,
       EXTRACT(EPOCH FROM now() - a.started_at)::float8 AS ran_s,
       t.id, t.owner, t.name, t.kind, t.state, t.current_attempt_id, t.attempts,
       t.max_attempts, {tasks_db.RECENT_CRASHES} AS recent_crashes, t.poison_after,
       t.poison_window_s, t.retry_causes, t.backoff_base_s, t.backoff_cap_s,
       t.backoff_jitter, t.artifact_uri, t.source_handbacks,
       {refers_to_secrets("t.env")} AS has_secrets,
       {placement.PLACEMENT}
FROM core.attempts a JOIN core.tasks t ON t.id = a.task_id
WHERE a.id = ANY(CAST(:ids AS bigint[]))
  AND t.id = ANY(ARRAY(
      SELECT r.task_id FROM core.attempts r WHERE r.id = ANY(CAST(:ids AS bigint[]))))
ORDER BY t.id
FOR UPDATE OF t
""")


# Close the attempts, move their tasks (each guarded by its op's sources in the
# transitions table and by still being the task's current attempt), append the events
# fold the measured use into each kind's decaying peak, and keep the outputs the task
# wrote: one statement for the batch, which comes as one json array of records (cheaper
# to send than an array per column), each without its null keys (``_finish_params``: a
# key left out reads as NULL), read from json text (not first built into a jsonb
# document). The rows are found through their primary keys.
_FINISH = text(f"""
WITH input AS MATERIALIZED (
    SELECT * FROM json_to_recordset(CAST(:input AS json)) AS i(
        attempt_id bigint, task_id bigint, outcome text, exit_code integer, error text,
        peak_memory_mb float8, cpu_seconds float8, cores float8, log_tail text, owner text,
        name text, op text, target text, sources text, from_state text, reason text,
        last_error text, delay_s float8, crashed integer, refund integer, final boolean,
        outputs jsonb, signal smallint, log_bytes bigint, unanswered integer)
), closed AS (
    UPDATE core.attempts a SET
        outcome = i.outcome, ended_at = now(), exit_code = i.exit_code, error = i.error,
        peak_memory_mb = i.peak_memory_mb, cpu_seconds = i.cpu_seconds, log_tail = i.log_tail,
        outputs = i.outputs, signal = i.signal, log_bytes = i.log_bytes
    FROM input i
    WHERE a.id = ANY(ARRAY(SELECT attempt_id FROM input)) AND a.id = i.attempt_id
      AND a.outcome IS NULL
    RETURNING a.id
), moved AS (
    UPDATE core.tasks t SET
        state = i.target,
        version = t.version + 1,
        updated_at = now(),
        finished_at = CASE WHEN i.final THEN now() END,
        run_at = CASE WHEN i.delay_s IS NOT NULL
                      THEN now() + make_interval(secs => i.delay_s) ELSE t.run_at END,
        attempts = t.attempts - i.refund,
        crashes = t.crashes + i.crashed,
        crashed_at = CASE WHEN i.crashed > 0 THEN {tasks_db.CRASHED_NOW} ELSE t.crashed_at END,
        source_handbacks = CASE WHEN i.unanswered > 0 THEN t.source_handbacks + 1
                                WHEN i.outcome = 'handed_back' THEN t.source_handbacks
                                ELSE 0 END,
        last_error = COALESCE(i.last_error, t.last_error),
        deferred = false
    FROM input i
    WHERE t.id = ANY(ARRAY(SELECT task_id FROM input)) AND t.id = i.task_id
      AND i.op IS NOT NULL AND t.current_attempt_id = i.attempt_id
      AND t.state = ANY(string_to_array(i.sources, ','))
    RETURNING t.id, t.owner, t.version, t.state, i.op, i.from_state, i.reason, i.attempt_id
), ran AS (
    -- A service's exit (its restart is decided after this): its source answered.
    UPDATE core.tasks t SET source_handbacks = 0
    WHERE t.id = ANY(ARRAY(SELECT task_id FROM input WHERE op IS NULL))
      AND t.source_handbacks > 0
), events AS (
    INSERT INTO core.task_events (
        task_id, seq, owner, op, from_state, to_state, reason, attempt_id
    )
    SELECT id, version, owner, op, from_state, state, reason, attempt_id FROM moved
), used AS (
    INSERT INTO core.usage AS u (owner, name, peak_cpu, peak_memory_mb, samples)
    SELECT owner, name, max(cores), max(peak_memory_mb), count(*) FROM input
    WHERE cores IS NOT NULL AND peak_memory_mb IS NOT NULL
    GROUP BY owner, name
    ON CONFLICT (owner, name) DO UPDATE SET
        peak_cpu = GREATEST(EXCLUDED.peak_cpu, u.peak_cpu * power(:decay, EXCLUDED.samples)),
        peak_memory_mb = GREATEST(
            EXCLUDED.peak_memory_mb, u.peak_memory_mb * power(:decay, EXCLUDED.samples)),
        samples = u.samples + EXCLUDED.samples,
        updated_at = now()
)
SELECT id, attempt_id, state FROM moved
""")


Masker = Callable[[AsyncConnection, int], Awaitable[Callable[[str], str] | None]]


def _refusal(item: AttemptReport, worker_id: int, row: Any, seen: set[int]) -> ReportVerdict | None:
    """Why this report is refused (fenced by attempt and worker), or None."""
    attempt = item.attempt_id
    if row is None:
        return ReportVerdict(attempt_id=attempt, status=404, detail=f"attempt {attempt} not found")
    ended_as = None
    if row.worker_id != worker_id:
        detail = f"attempt {attempt} is not leased to worker {worker_id}"
    elif row.ended_as is not None:
        # Which of core's paths closed it (the reaper, a beat without it, a cancel, this
        # report once before): the worker's log says so beside the refusal.
        why = f": {row.ended_why}" if row.ended_why else ""
        detail = (
            f"attempt {attempt} is not task {row.id}'s current attempt: it already ended "
            f"({row.ended_as}{why}); its report is refused"
        )
        ended_as = row.ended_as
    elif attempt in seen or row.current_attempt_id != attempt or row.state != S.RUNNING:
        detail = f"attempt {attempt} is not task {row.id}'s current attempt; its report is refused"
    else:
        return None
    return ReportVerdict(
        attempt_id=attempt, status=409, task_id=row.id, detail=detail, ended_as=ended_as
    )


def _masked(item: AttemptReport, mask: Callable[[str], str] | None) -> AttemptReport:
    error, tail, outputs = _clean(item.error), _clean(item.log_tail), item.outputs
    if mask is None and error == item.error and tail == item.log_tail:
        return item  # nothing to change (the common report): no copy
    if mask is not None:
        error = mask(error) if error else error
        tail = mask(tail) if tail else tail
        outputs = mask_json(mask, outputs)
    return item.model_copy(update={"error": error, "log_tail": tail, "outputs": outputs})


@dataclass(frozen=True)
class Settled:
    """A batch of reports decided, not yet applied: in the order sent, a verdict for
    each refused one (final) and the attempt id of each accepted one (its verdict, with
    the state it moved its task to, is ``applied``'s); and the accepted ones with their
    moves (None: a service, whose restart is decided with its history once its attempt
    is closed)."""

    order: list[ReportVerdict | int]
    batch: list[tuple[AttemptReport, Any, Move | None]]

    @property
    def closing(self) -> frozenset[int]:
        """The attempts the batch closes."""
        return frozenset(item.attempt_id for item, _, _ in self.batch)

    def statements(self) -> list[pipeline.Statement]:
        """What applies the batch (``_FINISH``), if anything."""
        return [(_FINISH, _finish_params(self.batch))] if self.batch else []


async def settle(
    conn: AsyncConnection,
    worker_id: int,
    items: Sequence[AttemptReport],
    rows: dict[int, Any],
    masker: Masker | None = None,
    source_cap: int = outcomes.SOURCE_UNANSWERED_MAX,
) -> Settled:
    """Decide a worker's reports of how its attempts ended, over their rows as
    ``_REPORTED`` read them (``hear``), each fenced by its attempt id and this worker: a
    stale one (not the task's current attempt, not this worker's, or reported twice) is
    refused alone and changes nothing. The move of each comes from ``domain.outcomes``
    (``source_cap``: ``CAIRN_SOURCE_UNANSWERED_MAX``)."""
    order: list[ReportVerdict | int] = []
    batch: list[tuple[AttemptReport, Any, Move | None]] = []
    seen: set[int] = set()
    for raw in items:
        row: Any = rows.get(raw.attempt_id)
        refused = _refusal(raw, worker_id, row, seen)
        seen.add(raw.attempt_id)
        if refused is not None:
            order.append(refused)
            continue
        mask = await masker(conn, raw.attempt_id) if masker and row.has_secrets else None
        item = _masked(raw, mask)
        move = outcomes.reported(
            row,
            item.outcome,
            item.error,
            retryable=item.retryable,
            preempted_by=row.preempted_by,
            cause=outcomes.Cause(item.exit_code, item.signal, row.number),
            hand_back_cause=item.hand_back_cause,
            source_cap=source_cap,
        )
        batch.append((item, row, move))
        order.append(item.attempt_id)
    return Settled(order, batch)


async def applied(conn: AsyncConnection, settled: Settled) -> tuple[list[ReportVerdict], Tally]:
    """Once the batch's statement ran: each service's exit decided, one at a time; the
    verdicts in the order sent."""
    verdicts: dict[int, ReportVerdict] = {}
    tally = Tally()
    for item, row, move in settled.batch:
        if move is None:
            error = outcomes.service_error(item.outcome, item.error)
            crashed = item.outcome == "crashed"
            target, moved = await _restart_service(
                conn, row, item.attempt_id, error, crashed, False
            )
            tally = tally + moved
        else:
            target = move.target
            if target is S.DEAD or target is S.FAILED:  # the rest count nothing: no Tally each
                tally = tally + Tally.of(move)
        verdicts[item.attempt_id] = ReportVerdict(
            attempt_id=item.attempt_id, status=200, task_id=row.id, state=target
        )
    return [verdicts[v] if isinstance(v, int) else v for v in settled.order], tally


async def report_many(
    conn: AsyncConnection,
    worker_id: int,
    items: Sequence[AttemptReport],
    masker: Masker | None = None,
) -> tuple[list[ReportVerdict], Tally]:
    """Apply a worker's reports (``settle``, then its statement, then ``applied``), in
    round trips of their own (a turn sends them with its other statements)."""
    if not items:
        return [], Tally()
    ids = sorted({i.attempt_id for i in items})
    rows = {r.attempt_id: r for r in await conn.execute(_REPORTED, {"ids": ids})}
    settled = await settle(conn, worker_id, items, rows, masker)
    for query, params in settled.statements():
        await conn.execute(query, params)
    return await applied(conn, settled)


# Whether any work of a claim's queues waits, whatever its size or labels (due or not,
# locked or not: a superset of what its pick could take in a larger room): one probe of
# each state's index, sent with the pick of a claim that waits. A claim whose look found
# nothing and none of this has nothing to gain from room freed on its worker
# (``feed.Line.may_grow``). A claim that does not wait never reads it, and it is not
# free: the probe walks its index past the entries of every task claimed since the last
# vacuum (59 to 150 pages a call while 20,000 queued tasks drain), so it is not sent.
_ANY_WAITING = text(f"""
SELECT EXISTS (SELECT FROM core.tasks t WHERE t.state = '{_FROM_WAITING}'
                 AND t.queue = ANY(CAST(:queues AS text[])))
    OR EXISTS (SELECT FROM core.tasks t WHERE t.state = '{_FROM_READY}'
                 AND t.queue = ANY(CAST(:queues AS text[]))
                 AND t.run_at <= now() + make_interval(secs => :ahead_s)) AS waiting
""")


class Picked(list[Any]):
    """The rows a claim's pick locked, and whether any work of its queues waited at all
    (``waiting``: probed with the pick of a claim that waits, read by a look that leased
    nothing; True, may have been short, when not probed)."""

    waiting = True


async def finish_and_pick(
    conn: AsyncConnection,
    settled: Settled,
    asked: Ask | None,
    first: Sequence[pipeline.Statement] = (),
    last: bool = False,
    waits: bool = True,
) -> list[Any]:
    """A turn's second round trip: ``first`` (its progress notes), the reports applied,
    then the claim's pick (after them, so it sees the room they made): the rows picked.
    ``last``: the caller runs nothing after this in the transaction unless there is a
    pick to lease or a service's exit to decide (``applied``); without either (a turn
    that only reports, as the agent's courier sends them), the COMMIT goes in the same
    round trip (as ``lease(..., last=True)`` does), not in one of its own. ``waits``:
    the claim waits for work if it leases none, so whether any waited is probed
    (``Picked.waiting``, ``_ANY_WAITING``)."""
    chain = [*first, *settled.statements()]
    if asked is not None:
        chain += _pick_statements(asked, waits)
    if not chain:
        return []
    done = last and asked is None and all(move is not None for _, _, move in settled.batch)
    found = await pipeline.run(conn, [*chain, pipeline.COMMIT] if done else chain)
    if asked is None:
        return []
    return _picked(found[len(chain) - _picks(waits) : len(chain)], waits)


def _picks(waits: bool) -> int:
    """How many statements ``_pick_statements`` sends."""
    return 2 if waits else 1


def _pick_statements(asked: Ask, waits: bool) -> list[pipeline.Statement]:
    """The claim's pick and, for a claim that waits (nothing else reads its answer), the
    probe of whether any work of its queues waits."""
    if not waits:
        return [asked.statement()]
    probe = {"queues": asked.params["queues"], "ahead_s": asked.params["ahead_s"]}
    return [asked.statement(), (_ANY_WAITING, probe)]


def _picked(found: list[list[Any]], waits: bool) -> Picked:
    """``_pick_statements``' rows."""
    picked = Picked(found[0])
    if waits:
        picked.waiting = bool(found[1][0].waiting)
    return picked


def _finish_params(batch: list[tuple[AttemptReport, Any, Move | None]]) -> dict[str, Any]:
    def measured(item: AttemptReport, row: Any) -> float | None:
        if item.peak_memory_mb is None or item.cpu_seconds is None:
            return None
        return item.cpu_seconds / max(float(row.ran_s), 1.0)

    def record(item: AttemptReport, row: Any, move: Move | None) -> dict[str, Any]:
        doc = {
            "attempt_id": item.attempt_id,
            "task_id": row.id,
            "outcome": item.outcome,
            "exit_code": item.exit_code,
            "error": item.error,
            "peak_memory_mb": item.peak_memory_mb,
            "cpu_seconds": item.cpu_seconds,
            "cores": measured(item, row),
            "log_tail": item.log_tail,
            "owner": row.owner,
            "name": row.name,
            "op": move.op.value if move else None,
            "target": move.target.value if move else None,
            "sources": ",".join(sources(move.op, move.target)) if move else None,
            "from_state": row.state,
            "reason": move.reason if move else None,
            "last_error": move.error if move else None,
            "delay_s": move.delay_s if move else None,
            "crashed": int(move.crashed) if move else 0,
            "refund": int(move.refund) if move else 0,
            "final": move.target in FINAL if move else False,
            "outputs": item.outputs,
            "signal": item.signal,
            "log_bytes": item.log_bytes,
            "unanswered": int(move.unanswered) if move else 0,
        }
        return {k: v for k, v in doc.items() if v is not None}

    return {"input": jsonb([record(*entry) for entry in batch]), "decay": DECAY}


async def task_of(conn: AsyncConnection, attempt_id: int) -> int:
    query = select(attempts.c.task_id).where(attempts.c.id == attempt_id)
    return int((await conn.execute(query)).scalar_one())
