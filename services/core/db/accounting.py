"""Usage accounting's SQL (docs/sharing.md, "Usage"): what ended attempts used, summed per
month, owner, team and queue in ``core.usage_monthly``, so that "who used what this month"
outlives the tasks' retention (Slurm's ``sacct``).

The roll-up reads core's event feed after its own cursor (``notify_cursors`` row
``usage``), up to the feed's horizon as every reader of the feed does (no event that
commits later can land behind it), and adds, for every event that took a task out of
``running`` (an attempt ended: reported, lost, cancelled, preempted, timed out), that
attempt's figures; the sums and the cursor move in one transaction, so a page is counted
once whatever dies when. An attempt's figures are what core knows when the page is read:
one cancelled while running whose worker had not yet reported counts its wall time to
then and no CPU.

Per attempt: wall seconds (``ended_at - started_at``), the CPU seconds it used (as its
agent measured them), the CPU and memory it reserved over its wall time (its charge:
core-seconds, MB-seconds), its peak memory (the month's largest), and the devices it held
over its wall time (device-seconds by device name, in ``core.usage_monthly_devices``)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date
from typing import Any, Literal

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common.states import TaskState
from services.core.domain.sharing import HALF_LIFE_S

S = TaskState

#: how far the feed's horizon runs ahead before a page with no ended attempt moves the
#: cursor (each move is a write, which moves the horizon again: an idle core would write
#: for ever)
JUMP_XIDS = 10_000

By = Literal["owner", "team", "queue"]

_CURSOR = text("SELECT feed_xid, feed_id FROM core.notify_cursors WHERE name = 'usage' FOR UPDATE")

_MOVE = text("""
UPDATE core.notify_cursors SET feed_xid = :xid, feed_id = :id, updated_at = now()
WHERE name = 'usage'
""")


def decay(since: str, until: str, half_life: str = ":half_life") -> str:
    """SQL: what one core-second at ``since`` weighs at ``until``, halved every
    ``half_life`` seconds (Slurm's PriorityDecayHalfLife), floored at 2^-1000
    (``domain.sharing.decayed``); the submit's stamps read it too."""
    return f"""power(CAST(2 AS float8), -LEAST(CAST(1000 AS float8), GREATEST(0,
        CAST(EXTRACT(EPOCH FROM {until} - {since}) AS float8)) / {half_life}))"""


_ROLL_UP = text(f"""
WITH h AS (
    SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS horizon
), page AS (
    SELECT e.xid, e.id, e.attempt_id, e.from_state, e.to_state
    FROM core.task_events e, h
    WHERE (e.xid, e.id) > (:xid, :id) AND e.xid < h.horizon
    ORDER BY e.xid, e.id
    LIMIT :limit
), ended AS (
    SELECT CAST(date_trunc('month', COALESCE(a.ended_at, now()) AT TIME ZONE 'UTC') AS date)
               AS month,
           t.owner, COALESCE(t.team, '') AS team, t.queue,
           GREATEST(0, EXTRACT(EPOCH FROM COALESCE(a.ended_at, now()) - a.started_at))
               AS wall_s,
           COALESCE(a.cpu_seconds, 0) AS cpu_s,
           COALESCE(a.charge_cpu, 0) AS charge_cpu,
           COALESCE(a.charge_memory_mb, 0) AS charge_memory_mb,
           COALESCE(a.peak_memory_mb, 0) AS peak_memory_mb,
           COALESCE(a.ended_at, now()) AS ended_at,
           a.charge_devices
    FROM page p
    JOIN core.attempts a ON a.id = p.attempt_id
    JOIN core.tasks t ON t.id = a.task_id
    WHERE p.from_state = '{S.RUNNING}' AND p.to_state <> '{S.RUNNING}'
), added AS (
    INSERT INTO core.usage_monthly AS u (
        month, owner, team, queue, attempts, wall_s, cpu_s, cpu_reserved_s, memory_mb_s,
        peak_memory_mb
    )
    SELECT month, owner, team, queue, count(*), sum(wall_s), sum(cpu_s),
           sum(wall_s * charge_cpu), sum(wall_s * charge_memory_mb), max(peak_memory_mb)
    FROM ended GROUP BY month, owner, team, queue
    ON CONFLICT (month, owner, team, queue) DO UPDATE SET
        attempts = u.attempts + EXCLUDED.attempts,
        wall_s = u.wall_s + EXCLUDED.wall_s,
        cpu_s = u.cpu_s + EXCLUDED.cpu_s,
        cpu_reserved_s = u.cpu_reserved_s + EXCLUDED.cpu_reserved_s,
        memory_mb_s = u.memory_mb_s + EXCLUDED.memory_mb_s,
        peak_memory_mb = GREATEST(u.peak_memory_mb, EXCLUDED.peak_memory_mb)
    RETURNING 1
), decayed AS (
    -- each flow's reserved core-seconds, decayed from the attempt's end to now, added to
    -- what it had decayed to now (``decay``)
    INSERT INTO core.fair_usage AS f (kind, name, cpu_s, at)
    SELECT CASE WHEN team = '' THEN 'owner' ELSE 'team' END,
           CASE WHEN team = '' THEN owner ELSE team END,
           sum(wall_s * charge_cpu * {decay("ended_at", "now()")}), now()
    FROM ended GROUP BY 1, 2
    ON CONFLICT (kind, name) DO UPDATE SET
        cpu_s = f.cpu_s * {decay("f.at", "EXCLUDED.at")} + EXCLUDED.cpu_s,
        at = EXCLUDED.at
    RETURNING 1
), devices_added AS (
    -- device-seconds: each device an attempt held, over its wall time
    INSERT INTO core.usage_monthly_devices AS u (month, owner, team, queue, device, device_s)
    SELECT month, owner, team, queue, d.key, sum(wall_s * d.value::float8)
    FROM ended, jsonb_each_text(ended.charge_devices) d
    WHERE ended.charge_devices IS NOT NULL
    GROUP BY month, owner, team, queue, d.key
    ON CONFLICT (month, owner, team, queue, device) DO UPDATE SET
        device_s = u.device_s + EXCLUDED.device_s
    RETURNING 1
)
SELECT (SELECT count(*) FROM page) AS read,
       (SELECT count(*) FROM ended) AS ended,
       (SELECT count(*) FROM added) AS groups,
       (SELECT count(*) FROM devices_added) AS device_groups,
       last.xid AS last_xid, last.id AS last_id, h.horizon
FROM h LEFT JOIN LATERAL (
    SELECT xid, id FROM page ORDER BY xid DESC, id DESC LIMIT 1
) last ON true
""")


@dataclass(frozen=True)
class Rolled:
    """One page of the roll-up: the events read, and the ended attempts among them."""

    read: int
    ended: int


async def roll_up(conn: AsyncConnection, limit: int, half_life_s: float = HALF_LIFE_S) -> Rolled:
    """Add the next page of the feed's ended attempts to the monthly sums and to each
    fair-share flow's decayed usage (halved every ``half_life_s``), and move the cursor
    past it, in the caller's transaction (``_ROLL_UP``)."""
    at = (await conn.execute(_CURSOR)).one()
    params = {"xid": at.feed_xid, "id": at.feed_id, "limit": limit, "half_life": half_life_s}
    row = (await conn.execute(_ROLL_UP, params)).one()
    if row.last_xid is not None:
        await conn.execute(_MOVE, {"xid": row.last_xid, "id": row.last_id})
    elif row.horizon - 1 - at.feed_xid >= JUMP_XIDS:
        # Nothing visible: every event below the horizon is behind the cursor already.
        await conn.execute(_MOVE, {"xid": row.horizon - 1, "id": 2**63 - 1})
    return Rolled(int(row.read), int(row.ended))


_COLUMNS = """
    sum(attempts) AS attempts, sum(wall_s) AS wall_s,
    sum(cpu_s) AS cpu_s, sum(cpu_reserved_s) AS cpu_reserved_s,
    sum(memory_mb_s) AS memory_mb_s, max(peak_memory_mb) AS peak_memory_mb"""


def _accounts(by: By) -> Any:
    return text(f"""
SELECT {by} AS key, {_COLUMNS}
FROM core.usage_monthly
WHERE month = :month
  AND (CAST(:owner AS text) IS NULL OR owner = :owner)
  AND (CAST(:teams AS text[]) IS NULL OR team = ANY(CAST(:teams AS text[])))
  AND ({by} <> '' OR '{by}' <> 'team')
GROUP BY {by}
ORDER BY sum(cpu_reserved_s) DESC, {by}
LIMIT :limit
""")


_BY: dict[str, Any] = {by: _accounts(by) for by in ("owner", "team", "queue")}


def _devices(by: By) -> Any:
    return text(f"""
SELECT {by} AS key, device, sum(device_s) AS device_s
FROM core.usage_monthly_devices
WHERE month = :month AND {by} = ANY(CAST(:keys AS text[]))
  AND (CAST(:owner AS text) IS NULL OR owner = :owner)
  AND (CAST(:teams AS text[]) IS NULL OR team = ANY(CAST(:teams AS text[])))
GROUP BY {by}, device
""")


_DEVICES_BY: dict[str, Any] = {by: _devices(by) for by in ("owner", "team", "queue")}


async def device_seconds(
    conn: AsyncConnection,
    month: date,
    by: By,
    keys: list[str],
    owner: str | None = None,
    teams: list[str] | None = None,
) -> dict[str, dict[str, float]]:
    """Of the accounts ``keys`` (``accounts``' rows, with the same filters), the
    device-seconds held in ``month``, by device name."""
    out: dict[str, dict[str, float]] = {}
    if not keys:
        return out
    params = {"month": month, "keys": keys, "owner": owner, "teams": teams}
    for r in await conn.execute(_DEVICES_BY[by], params):
        out.setdefault(r.key, {})[r.device] = float(r.device_s)
    return out


async def accounts(
    conn: AsyncConnection,
    month: date,
    by: By,
    limit: int,
    owner: str | None = None,
    teams: list[str] | None = None,
) -> list[Any]:
    """The month's sums grouped ``by`` owner, team (tasks a team owns) or queue, the
    largest reservations first; only ``owner``'s, or only those of ``teams``, when given."""
    params = {"month": month, "owner": owner, "teams": teams, "limit": limit}
    return list(await conn.execute(_BY[by], params))
