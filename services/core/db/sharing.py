"""Sharing one pool in the database: shares and quotas per owner, queue policies,
concurrency keys (docs/sharing.md). Decisions are ``domain.sharing``'s; this module reads
and writes, and keeps the per-process book of settings the submit path consults."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, or_, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.elements import TextClause

from libs.common import locks
from libs.common.errors import Forbidden, QuotaExceeded
from libs.common.models import (
    ConcurrencyLimit,
    ConcurrencyState,
    OwnerUsage,
    QueuePolicy,
    Quotas,
    RunningUse,
    ShareSettings,
)
from libs.common.states import TaskState
from libs.common.stored import as_stored
from services.core.db import readings
from services.core.db.tables import concurrency_limits, queues, shares, team_shares
from services.core.domain.limits import LIMIT_COLUMNS, NO_LIMITS, QueueLimits
from services.core.domain.placement import Amount, counts, summed
from services.core.domain.sharing import (
    HALF_LIFE_S,
    Asked,
    Gate,
    Gated,
    KeyLimit,
    KeyUse,
    Quota,
    Use,
    decayed,
    refusal,
    weights_share,
)

S = TaskState

# Advisory lock classes: an owner's running quotas (claim), a team's (claim), a
# concurrency key (claim); an owner's submission quotas (submit), a team's (submit).
# Taken in that order, each sorted: no deadlock.
_OWNER_LOCK, _KEY_LOCK, _SUBMIT_LOCK = (
    locks.OWNER_RUNNING,
    locks.CONCURRENCY_KEY,
    locks.OWNER_SUBMITS,
)
_TEAM_LOCK, _TEAM_SUBMIT_LOCK = locks.TEAM_RUNNING, locks.TEAM_SUBMITS

_LOCK = text("""
SELECT count(pg_advisory_xact_lock(CAST(:class AS integer), s.h)) FROM (
    SELECT DISTINCT hashtext(x) AS h FROM unnest(CAST(:names AS text[])) AS x ORDER BY 1
) s
""")

_OWNER_USE = text("""
SELECT t.owner, count(*) AS running, sum(t.cpu) AS cpu, sum(t.memory_mb) AS memory_mb,
       jsonb_agg(t.devices) FILTER (WHERE t.devices IS NOT NULL) AS devices
FROM core.attempts a JOIN core.tasks t ON t.id = a.task_id
WHERE a.outcome IS NULL AND t.owner = ANY(CAST(:owners AS text[]))
GROUP BY t.owner
""")

_TEAM_USE = text("""
SELECT t.team, count(*) AS running, sum(t.cpu) AS cpu, sum(t.memory_mb) AS memory_mb,
       jsonb_agg(t.devices) FILTER (WHERE t.devices IS NOT NULL) AS devices
FROM core.attempts a JOIN core.tasks t ON t.id = a.task_id
WHERE a.outcome IS NULL AND t.team = ANY(CAST(:teams AS text[]))
GROUP BY t.team
""")

_KEY_USE = text("""
SELECT k.key, l.max_running, l.max_starts, l.window_s,
       (SELECT count(*) FROM core.attempts a
        WHERE a.concurrency_key = k.key AND a.outcome IS NULL) AS running,
       CASE WHEN l.window_s IS NULL THEN 0 ELSE (
           SELECT count(*) FROM core.attempts a
           WHERE a.concurrency_key = k.key
             AND a.started_at > now() - make_interval(secs => l.window_s)) END AS started
FROM unnest(CAST(:keys AS text[])) AS k(key)
LEFT JOIN core.concurrency_limits l ON l.key = k.key
""")

_QUOTAS = text("""
SELECT name, max_cpu, max_memory_mb, max_running, max_devices FROM core.shares
WHERE name = ANY(CAST(:owners AS text[]))
  AND (max_cpu IS NOT NULL OR max_memory_mb IS NOT NULL OR max_running IS NOT NULL
       OR max_devices IS NOT NULL)
""")


_TEAM_QUOTAS = text("""
SELECT team AS name, max_cpu, max_memory_mb, max_running, max_devices FROM core.team_shares
WHERE team = ANY(CAST(:teams AS text[]))
  AND (max_cpu IS NOT NULL OR max_memory_mb IS NOT NULL OR max_running IS NOT NULL
       OR max_devices IS NOT NULL)
""")


async def lock_names(conn: AsyncConnection, lock_class: int, names: Iterable[str]) -> None:
    ordered = sorted(set(names))
    if ordered:
        await conn.execute(_LOCK, {"class": lock_class, "names": ordered})


def _quota(row: Any) -> Quota:
    return Quota(row.max_cpu, row.max_memory_mb, row.max_running, counts(row.max_devices))


def quota_of(row: Any) -> Quota | None:
    """The running quota a candidate row carries (``max_cpu``, ...), if any."""
    quota = _quota(row)
    return quota if quota.limits_running else None


def team_quota_of(row: Any) -> Quota | None:
    """The running quota of a candidate row's team (``team_max_cpu``, ...), if any."""
    quota = Quota(
        row.team_max_cpu,
        row.team_max_memory_mb,
        row.team_max_running,
        counts(row.team_max_devices),
    )
    return quota if row.team is not None and quota.limits_running else None


async def owner_use(conn: AsyncConnection, owners: Sequence[str]) -> dict[str, Use]:
    rows = await conn.execute(_OWNER_USE, {"owners": list(owners)})
    return {r.owner: _use(r) for r in rows}


def _use(row: Any) -> Use:
    """A row of ``_OWNER_USE`` or ``_TEAM_USE``."""
    return Use(int(row.running), float(row.cpu), float(row.memory_mb), summed(row.devices))


async def team_use(conn: AsyncConnection, teams: Sequence[str]) -> dict[str, Use]:
    """What the open attempts of each team's tasks request."""
    rows = await conn.execute(_TEAM_USE, {"teams": list(teams)})
    return {r.team: _use(r) for r in rows}


async def key_use(
    conn: AsyncConnection, keys: Sequence[str]
) -> tuple[dict[str, KeyLimit], dict[str, KeyUse]]:
    limits: dict[str, KeyLimit] = {}
    use: dict[str, KeyUse] = {}
    for r in await conn.execute(_KEY_USE, {"keys": list(keys)}):
        if r.max_running is not None or r.max_starts is not None:
            limits[r.key] = KeyLimit(r.max_running, r.max_starts, r.window_s)
        use[r.key] = KeyUse(int(r.running), int(r.started))
    return limits, use


async def quotas_of(conn: AsyncConnection, owners: Iterable[str]) -> dict[str, Quota]:
    """The running quotas of those of ``owners`` that have any."""
    rows = await conn.execute(_QUOTAS, {"owners": sorted(set(owners))})
    return {r.name: _quota(r) for r in rows}


async def team_quotas_of(conn: AsyncConnection, teams: Iterable[str]) -> dict[str, Quota]:
    """The running quotas of those of ``teams`` that have any."""
    rows = await conn.execute(_TEAM_QUOTAS, {"teams": sorted(set(teams))})
    return {r.name: _quota(r) for r in rows}


async def gate(
    conn: AsyncConnection,
    tasks: dict[int, Gated],
    quotas: dict[str, Quota],
    *,
    lock: bool,
    team_quotas: dict[str, Quota] | None = None,
) -> Gate | None:
    """The gate for these tasks (``quotas``, ``team_quotas``: their owners' and teams'
    running quotas), or None when no quota or key concerns them. With ``lock`` (the
    claim), the owners, teams and keys it counts are locked until the transaction ends,
    so two claims cannot both take the last room under a limit."""
    team_quotas = team_quotas or {}
    keys = sorted({t.key for t in tasks.values() if t.key is not None})
    if not quotas and not team_quotas and not keys:
        return None
    if lock:
        await lock_names(conn, _OWNER_LOCK, quotas)
        await lock_names(conn, _TEAM_LOCK, team_quotas)
        await lock_names(conn, _KEY_LOCK, keys)
    use = await owner_use(conn, sorted(quotas)) if quotas else {}
    teams_use = await team_use(conn, sorted(team_quotas)) if team_quotas else {}
    limits, running = await key_use(conn, keys) if keys else ({}, {})
    return Gate(
        tasks=tasks,
        quotas=quotas,
        use=use,
        team_quotas=team_quotas,
        team_use=teams_use,
        limits=limits,
        keys=running,
    )


def gated(row: Any) -> Gated:
    """A task row (``owner``, ``team``, ``cpu``, ``memory_mb``, ``concurrency_*``) as the
    gate sees it."""
    return Gated(
        owner=row.owner,
        request=Amount(row.cpu, row.memory_mb, counts(row.devices)),
        key=row.concurrency_key,
        key_limit=row.concurrency_limit,
        team=row.team,
    )


# --- the book: settings the submit path reads, cached per process ------------------------


@dataclass(frozen=True)
class SubmitQuota:
    max_waiting: int | None
    max_submits_per_min: int | None


@dataclass
class Book:
    """Queue policies and owners' submission quotas, reread every ``ttl_s`` (an admin's
    change through this process applies at once; through another replica, within
    ``ttl_s``)."""

    ttl_s: float
    policies: dict[str, QueuePolicy] = field(default_factory=dict)
    #: queues' time limits (``domain.limits``), those that set any
    limits: dict[str, QueueLimits] = field(default_factory=dict)
    quotas: dict[str, SubmitQuota] = field(default_factory=dict)
    team_quotas: dict[str, SubmitQuota] = field(default_factory=dict)
    _read_at: float = -math.inf
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def invalidate(self) -> None:
        self._read_at = -math.inf

    async def fresh(self, engine: AsyncEngine) -> Book:
        if time.monotonic() - self._read_at < self.ttl_s:
            return self
        async with self._lock:
            if time.monotonic() - self._read_at >= self.ttl_s:
                started = time.monotonic()
                async with engine.connect() as conn:
                    await self._read(conn)
                self._read_at = started
        return self

    async def _read(self, conn: AsyncConnection) -> None:
        rows = await conn.execute(
            select(queues.c.name, queues.c.policy).where(queues.c.policy.isnot(None))
        )
        self.policies = {r.name: as_stored(QueuePolicy, r.policy) for r in rows}
        self.limits = await queue_limits(conn)
        limited = select(shares.c.name, shares.c.max_waiting, shares.c.max_submits_per_min).where(
            (shares.c.max_waiting.isnot(None)) | (shares.c.max_submits_per_min.isnot(None))
        )
        self.quotas = {
            r.name: SubmitQuota(r.max_waiting, r.max_submits_per_min)
            for r in await conn.execute(limited)
        }
        limited_teams = select(
            team_shares.c.team, team_shares.c.max_waiting, team_shares.c.max_submits_per_min
        ).where(
            (team_shares.c.max_waiting.isnot(None))
            | (team_shares.c.max_submits_per_min.isnot(None))
        )
        self.team_quotas = {
            r.team: SubmitQuota(r.max_waiting, r.max_submits_per_min)
            for r in await conn.execute(limited_teams)
        }

    def check_policy(self, role: str, owner: str, spec: Asked, where: str) -> None:
        """403 naming the field when ``spec`` is outside its queue's policy; ``where`` is
        its place in the request body (``body``, ``body.tasks.3``)."""
        policy = self.policies.get(spec.queue)
        if policy is None:
            return
        refused = refusal(policy, role, owner, spec, where)
        if refused is not None:
            raise Forbidden(f"{refused.field}: {refused.detail}", field=refused.field)

    def limits_of(self, queue: str) -> QueueLimits:
        return self.limits.get(queue, NO_LIMITS)

    def limits_submissions(self, owners: Iterable[str], teams: Iterable[str | None] = ()) -> bool:
        return any(owner in self.quotas for owner in owners) or any(
            team in self.team_quotas for team in teams if team is not None
        )


async def queue_limits(conn: AsyncConnection) -> dict[str, QueueLimits]:
    """Every queue's time limits, of those that set any."""
    columns = [queues.c[name] for name in LIMIT_COLUMNS]
    query = select(queues.c.name, *columns).where(or_(*(column.isnot(None) for column in columns)))
    return {r.name: _limits(r) for r in await conn.execute(query)}


async def limits_for_update(conn: AsyncConnection, name: str) -> QueueLimits:
    """A queue's time limits as stored (none set: no row, or a row without them),
    its row locked until the transaction ends."""
    row = (
        await conn.execute(select(queues).where(queues.c.name == name).with_for_update())
    ).first()
    if row is None:
        return NO_LIMITS
    return _limits(row)


def _limits(row: Any) -> QueueLimits:
    return QueueLimits(**{name: getattr(row, name) for name in LIMIT_COLUMNS})


_WAITING = text(f"""
SELECT count(*) FROM (
    SELECT 1 FROM core.tasks WHERE owner = :owner AND state IN ('{S.READY}', '{S.WAITING}') LIMIT :cap
) s
""")

_COUNT_SUBMITS = text("""
UPDATE core.shares SET
    rate_count = CASE WHEN rate_window_at > now() - interval '60 seconds'
                      THEN rate_count ELSE 0 END + :n,
    rate_window_at = CASE WHEN rate_window_at > now() - interval '60 seconds'
                          THEN rate_window_at ELSE now() END
WHERE name = :owner
RETURNING rate_count,
          EXTRACT(EPOCH FROM rate_window_at + interval '60 seconds' - now()) AS left_s
""")

#: what a 429 for the waiting quota tells the caller to wait
WAITING_RETRY_AFTER_S = 10


_TEAM_WAITING = text(f"""
SELECT count(*) FROM (
    SELECT 1 FROM core.tasks WHERE team = :owner AND state IN ('{S.READY}', '{S.WAITING}') LIMIT :cap
) s
""")

_COUNT_TEAM_SUBMITS = text(
    _COUNT_SUBMITS.text.replace("core.shares", "core.team_shares").replace(
        "WHERE name = :owner", "WHERE team = :owner"
    )
)


async def admit_submissions(
    conn: AsyncConnection,
    book: Book,
    owners: Sequence[str],
    teams: Sequence[str | None] = (),
) -> None:
    """Refuse (429, nothing stored: the caller's transaction rolls back) submissions that
    would put an owner, or the team that owns them (``teams``: one per submission, or
    none), over its waiting or per-minute quota. Runs in the submit's transaction, the
    owners and teams locked so that two submits cannot both take the last room."""
    counts = Counter(owner for owner in owners if owner in book.quotas)
    team_counts = Counter(t for t in teams if t is not None and t in book.team_quotas)
    await lock_names(conn, _SUBMIT_LOCK, counts)
    await lock_names(conn, _TEAM_SUBMIT_LOCK, team_counts)
    for owner, n in sorted(counts.items()):
        await _admit_one(conn, "owner", owner, n, book.quotas[owner], _WAITING, _COUNT_SUBMITS)
    for team, n in sorted(team_counts.items()):
        quota = book.team_quotas[team]
        await _admit_one(conn, "team", team, n, quota, _TEAM_WAITING, _COUNT_TEAM_SUBMITS)


async def _admit_one(
    conn: AsyncConnection,
    kind: str,
    name: str,
    n: int,
    quota: SubmitQuota,
    waiting_query: Any,
    count_query: Any,
) -> None:
    if quota.max_waiting is not None:
        waiting = (
            await conn.execute(waiting_query, {"owner": name, "cap": quota.max_waiting + 1})
        ).scalar_one()
        if waiting + n > quota.max_waiting:
            raise QuotaExceeded(
                f"{kind} {name} at its waiting quota ({waiting}/{quota.max_waiting} tasks "
                f"waiting; {n} more asked)",
                quota="waiting",
                retry_after_s=WAITING_RETRY_AFTER_S,
            )
    if quota.max_submits_per_min is not None:
        row = (await conn.execute(count_query, {"owner": name, "n": n})).one()
        if row.rate_count > quota.max_submits_per_min:
            raise QuotaExceeded(
                f"{kind} {name} at its submission quota ({row.rate_count - n}/"
                f"{quota.max_submits_per_min} this minute; {n} more asked)",
                quota="submits_per_min",
                retry_after_s=math.ceil(float(row.left_s)),
            )


# --- admin settings and the usage report ------------------------------------------------


async def set_share(
    conn: AsyncConnection, name: str, change: ShareSettings, *, team: bool = False
) -> None:
    """Set an owner's (or with ``team``, a team's) weight and quotas."""
    values: dict[str, Any] = change.model_dump(exclude_unset=True)
    if "weight" in values and values["weight"] is None:
        values["weight"] = 1.0
    table, key = (team_shares, team_shares.c.team) if team else (shares, shares.c.name)
    stmt = pg_insert(table).values({key.name: name, **values})
    stmt = stmt.on_conflict_do_update(
        index_elements=[key], set_={**values, "updated_at": func.now()}
    )
    await conn.execute(stmt)


async def set_policy(conn: AsyncConnection, name: str, policy: QueuePolicy | None) -> None:
    doc = policy.model_dump(mode="json") if policy is not None else None
    stmt = pg_insert(queues).values(name=name, policy=doc)
    stmt = stmt.on_conflict_do_update(index_elements=[queues.c.name], set_={"policy": doc})
    await conn.execute(stmt)


async def get_policy(conn: AsyncConnection, name: str) -> QueuePolicy | None:
    doc = (await conn.execute(select(queues.c.policy).where(queues.c.name == name))).scalar()
    return as_stored(QueuePolicy, doc) if doc is not None else None


async def set_key_limit(conn: AsyncConnection, key: str, limit: ConcurrencyLimit) -> None:
    values = limit.model_dump()
    stmt = pg_insert(concurrency_limits).values(key=key, **values)
    stmt = stmt.on_conflict_do_update(
        index_elements=[concurrency_limits.c.key], set_={**values, "updated_at": func.now()}
    )
    await conn.execute(stmt)


async def key_state(conn: AsyncConnection, key: str) -> ConcurrencyState:
    limits, use = await key_use(conn, [key])
    limit = limits.get(key, KeyLimit())
    counted = use.get(key, KeyUse())
    return ConcurrencyState(
        key=key,
        max_running=limit.max_running,
        max_starts=limit.max_starts,
        window_s=limit.window_s,
        running=counted.running,
        started_in_window=counted.started,
    )


# The flows with work running or waiting: owners (their own work) and teams (work a
# team owns), each with its weight.
_ACTIVE = text(f"""
WITH active AS (
    SELECT DISTINCT t.team IS NOT NULL AS is_team, COALESCE(t.team, t.owner) AS name
    FROM core.tasks t WHERE t.state IN ('{S.RUNNING}', '{S.WAITING}')
)
SELECT a.is_team, a.name, COALESCE(s.weight, ts.weight, 1) AS weight
FROM active a
LEFT JOIN core.shares s ON NOT a.is_team AND s.name = a.name
LEFT JOIN core.team_shares ts ON a.is_team AND ts.team = a.name
""")

_WAITING_OF = text(f"""
SELECT owner, count(*) AS n FROM core.tasks
WHERE state IN ('{S.READY}', '{S.WAITING}') AND owner = ANY(CAST(:owners AS text[]))
GROUP BY owner
""")

_TEAM_WAITING_OF = text(f"""
SELECT team AS owner, count(*) AS n FROM core.tasks
WHERE state IN ('{S.READY}', '{S.WAITING}') AND team = ANY(CAST(:owners AS text[]))
GROUP BY team
""")

_TOP = text(f"""
SELECT owner FROM (
    SELECT t.owner, count(*) AS n FROM core.attempts a JOIN core.tasks t ON t.id = a.task_id
    WHERE a.outcome IS NULL GROUP BY t.owner
    UNION ALL
    SELECT owner, count(*) FROM core.tasks WHERE state = '{S.WAITING}' GROUP BY owner
) s GROUP BY owner ORDER BY sum(n) DESC, owner LIMIT :limit
""")


#: the flows with work running or waiting (``_ACTIVE``): (is a team, name) -> weight
Active = dict[tuple[bool, str], float]


async def active_flows(count: readings.Count) -> Active:
    """``_ACTIVE``: it reads every running and waiting task (bench/dashboard_backlog.py),
    so a caller that needs it for several answers reads it once, by ``count``
    (``readings``)."""
    return {(r.is_team, r.name): float(r.weight) for r in await count(_ACTIVE)}


async def usage_of(
    conn: AsyncConnection,
    names: Sequence[str],
    half_life_s: float = HALF_LIFE_S,
    active: Active | None = None,
    waiting: dict[str, int] | None = None,
) -> list[OwnerUsage]:
    """Each owner's share, running use, waiting count and quotas (its use counts every
    task it submitted, its teams' included), and its own flow's decayed usage; the
    shares among ``active``; the active flows and the waiting counts read here on
    ``conn`` if not given (``top_counts`` reads them before any connection)."""
    if active is None:
        active = await active_flows(readings.on(conn))
    if waiting is None:
        waiting = await _waiting(readings.on(conn), _WAITING_OF, names)
    use = await owner_use(conn, names)
    found = await conn.execute(select(shares).where(shares.c.name.in_(names)))
    rows = {r.name: r for r in found}
    return await _usage(conn, False, names, use, rows, waiting, half_life_s, active)


async def team_usage_of(
    conn: AsyncConnection,
    names: Sequence[str],
    half_life_s: float = HALF_LIFE_S,
    active: Active | None = None,
) -> list[OwnerUsage]:
    """Each team's share (as one flow), the use, waiting count and quotas of the tasks it
    owns, whoever of its members submitted them, and its decayed usage."""
    if active is None:
        active = await active_flows(readings.on(conn))
    waiting = await _waiting(readings.on(conn), _TEAM_WAITING_OF, names)
    use = await team_use(conn, names)
    found = await conn.execute(select(team_shares).where(team_shares.c.team.in_(names)))
    rows = {r.team: r for r in found}
    return await _usage(conn, True, names, use, rows, waiting, half_life_s, active)


async def _waiting(
    count: readings.Count, query: TextClause, names: Sequence[str]
) -> dict[str, int]:
    """The waiting (and ready) tasks of each of ``names`` (``_WAITING_OF``, or
    ``_TEAM_WAITING_OF`` for teams)."""
    return {r.owner: int(r.n) for r in await count(query, {"owners": list(names)})}


async def caller_usage(
    conn: AsyncConnection,
    name: str,
    teams: Sequence[str],
    half_life_s: float = HALF_LIFE_S,
    active: Active | None = None,
) -> list[OwnerUsage]:
    """A user's own flow and each of their teams' (``GET /v1/owners`` for a user), the
    active flows read once for all of them (here on ``conn`` if not given). Their own
    waiting counts are read on ``conn``: no one else would share them."""
    if active is None:
        active = await active_flows(readings.on(conn))
    mine = await usage_of(conn, [name], half_life_s, active)
    if not teams:
        return mine
    return mine + await team_usage_of(conn, teams, half_life_s, active)


_FAIR_USAGE = text("""
SELECT name, cpu_s, GREATEST(0, CAST(EXTRACT(EPOCH FROM now() - at) AS float8)) AS age_s
FROM core.fair_usage WHERE kind = :kind AND name = ANY(CAST(:names AS text[]))
""")


async def _usage(
    conn: AsyncConnection,
    is_team: bool,
    names: Sequence[str],
    use: dict[str, Use],
    rows: dict[str, Any],
    waiting: dict[str, int],
    half_life_s: float,
    active: Active,
) -> list[OwnerUsage]:
    kind = "team" if is_team else "owner"
    used = {
        r.name: decayed(r.cpu_s, r.age_s, half_life_s)
        for r in await conn.execute(_FAIR_USAGE, {"kind": kind, "names": list(names)})
    }
    out = []
    for name in names:
        row = rows.get(name)
        weight = float(row.weight) if row else 1.0
        others = [w for flow, w in active.items() if flow != (is_team, name)]
        quota = Quotas(
            max_cpu=row.max_cpu if row else None,
            max_memory_mb=row.max_memory_mb if row else None,
            max_running=row.max_running if row else None,
            max_devices=row.max_devices if row else None,
            max_waiting=row.max_waiting if row else None,
            max_submits_per_min=row.max_submits_per_min if row else None,
        )
        running = use.get(name, Use())
        out.append(
            OwnerUsage(
                name=name,
                kind="team" if is_team else "owner",
                weight=weight,
                share=round(weights_share(weight, [weight, *others]), 6),
                running=RunningUse(
                    attempts=running.running,
                    cpu=running.cpu,
                    memory_mb=running.memory_mb,
                    devices=dict(running.devices),
                ),
                waiting=waiting.get(name, 0),
                quota=quota,
                at_quota=at_quota(quota, running, waiting.get(name, 0)),
                submitted_last_minute=_submitted(row),
                decayed_cpu_s=round(used.get(name, 0.0), 3),
            )
        )
    return out


def _submitted(row: Any) -> int:
    if row is None or row.rate_window_at is None:
        return 0
    age = time.time() - row.rate_window_at.timestamp()
    return int(row.rate_count) if age < 60 else 0


def at_quota(quota: Quotas, running: Use, waiting: int) -> list[str]:
    """The quotas an owner is at now (bounded names: cpu, memory, running, waiting)."""
    held = []
    if quota.max_cpu is not None and running.cpu >= quota.max_cpu - 1e-9:
        held.append("cpu")
    if quota.max_memory_mb is not None and running.memory_mb >= quota.max_memory_mb:
        held.append("memory")
    if quota.max_running is not None and running.running >= quota.max_running:
        held.append("running")
    held += [
        k for k, most in sorted((quota.max_devices or {}).items()) if running.devices[k] >= most
    ]
    if quota.max_waiting is not None and waiting >= quota.max_waiting:
        held.append("waiting")
    return held


@dataclass(frozen=True)
class Top:
    """What ``top_owners`` counts over the backlog (``top_counts``): the owners with the
    most work running and waiting, the active flows, and those owners' waiting counts."""

    names: list[str]
    active: Active
    waiting: dict[str, int]


async def top_counts(count: readings.Count, limit: int) -> Top:
    """The backlog's counts for ``top_owners`` (``_TOP``, ``_ACTIVE``, ``_WAITING_OF``),
    read by ``count`` (``readings``): none needs its caller's connection."""
    names = [r.owner for r in await count(_TOP, {"limit": limit})]
    return Top(names, await active_flows(count), await _waiting(count, _WAITING_OF, names))


async def top_owners(
    conn: AsyncConnection, top: Top, half_life_s: float = HALF_LIFE_S
) -> list[OwnerUsage]:
    """The usage of the owners ``top_counts`` found, in its order."""
    return await usage_of(conn, top.names, half_life_s, top.active, top.waiting)
