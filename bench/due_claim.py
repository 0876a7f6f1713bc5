"""Which way a burst of delayed work becomes claimable: the claim's candidate scan, timed.

    .venv/bin/python bench/due_claim.py [--due 10000] [--future 90000] [--repeat 20]

A fresh embedded PostgreSQL, migrated; one task submitted through core, copied in SQL to
``--due`` tasks due now and ``--future`` due within the next minutes, all in one queue.
Two designs of "a delayed task is eligible at its run_at, without a promotion row by row
at the instant" are timed on the same rows (median of ``--repeat`` runs of each scan,
each in a transaction rolled back, ``FOR UPDATE SKIP LOCKED`` as the claim runs it):

(a) the claim takes ``ready`` rows whose run_at has come, by an index of ready work by
    (queue, run_at), sorted by effective priority (what core does: db/attempts.py);
(b) the promoter moves rows to ``waiting`` ahead of their run_at, and the claim walks the
    waiting index (queue, priority, vtime, id) holding back rows whose run_at is ahead:
    timed at the instant (all due) and in the lead window (none due yet: every idle
    claim walks them all to find nothing), and the extra promotion ahead (per row).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack import core_stack

from libs.common.settings import libpq_url
from services.core import admin

TRUE_SHA = "0" * 64
LIMIT = 288  # a claim of 256 plus its slack (db/attempts.py)

PICK = """
SELECT t.id FROM core.tasks t
WHERE {which}
ORDER BY {order}
LIMIT {limit}
FOR UPDATE OF t SKIP LOCKED
"""
AGING = "LEAST(5, GREATEST(0, floor((EXTRACT(EPOCH FROM now()) - t.vtime) / 300)))"
DUE_READY = PICK.format(
    which="t.state = 'ready' AND t.queue = 'q' AND t.run_at <= now() AND NOT t.deferred",
    order=f"t.priority + {AGING} DESC, t.vtime, t.id",
    limit=LIMIT,
)
WAITING_DUE = PICK.format(
    which="t.state = 'waiting' AND t.queue = 'q' AND t.run_at <= now()",
    order="t.priority DESC, t.vtime, t.id",
    limit=LIMIT,
)
PROMOTE = """
WITH picked AS (
    SELECT id FROM core.tasks t WHERE t.state = 'ready' AND t.run_at <= now() + interval '1 hour'
    ORDER BY t.run_at LIMIT 1000 FOR UPDATE SKIP LOCKED
), moved AS (
    UPDATE core.tasks t SET state = 'waiting', version = t.version + 1, updated_at = now()
    FROM picked WHERE t.id = picked.id RETURNING t.id, t.owner, t.version
), events AS (
    INSERT INTO core.task_events (task_id, seq, owner, op, from_state, to_state)
    SELECT id, version, owner, 'promote', 'ready', 'waiting' FROM moved
)
SELECT count(*) FROM moved
"""


def timed(conn: psycopg.Connection[tuple[object, ...]], sql: str, repeat: int) -> float:
    """Median milliseconds of ``sql``, each run rolled back."""
    runs = []
    for _ in range(repeat):
        began = time.perf_counter()
        conn.execute(sql).fetchall()
        runs.append((time.perf_counter() - began) * 1000)
        conn.rollback()
    return statistics.median(runs)


def copies(
    conn: psycopg.Connection[tuple[object, ...]], template: int, count: int, at: str
) -> None:
    conn.execute(
        f"""
        INSERT INTO core.tasks (owner, name, queue, priority, kind, artifact_uri,
            artifact_sha256, args, env, cpu, memory_mb, preemptible, max_attempts,
            backoff_base_s, backoff_cap_s, backoff_jitter, poison_after, run_at, vtime, state)
        SELECT 'user' || (g %% 100), name, 'q', priority, kind, artifact_uri, artifact_sha256,
               args, env, cpu, memory_mb, preemptible, max_attempts, backoff_base_s,
               backoff_cap_s, backoff_jitter, poison_after, {at},
               EXTRACT(EPOCH FROM {at}) + (g / 100) * 0.001, 'ready'
          FROM core.tasks, generate_series(1, %(count)s) AS g WHERE id = %(id)s
        """,
        {"count": count, "id": template},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--due", type=int, default=10_000)
    parser.add_argument("--future", type=int, default=90_000)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    with core_stack("cairn-bench-due-") as stack:
        user = admin.create_token(stack.database_url, "alice", "user")
        body = {"name": "t", "artifact": {"uri": "file:///bin/true", "sha256": TRUE_SHA}}
        answer = httpx.post(
            stack.core_url + "/v1/tasks", json=body, headers={"Authorization": f"Bearer {user}"}
        )
        template = answer.json()["id"]
        url = libpq_url(stack.database_url)
        with psycopg.connect(url) as conn:
            copies(conn, template, args.due, "now() - interval '1 second'")
            copies(conn, template, args.future, "now() + make_interval(secs => 60 + g %% 600)")
            conn.commit()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE core.tasks")
        due = "queue = 'q' AND run_at <= now()"
        with psycopg.connect(url) as conn:
            figures = {
                "a: claim's due-ready scan at the instant": timed(conn, DUE_READY, args.repeat)
            }
            promote = timed(conn, PROMOTE, args.repeat)
            conn.execute(f"UPDATE core.tasks SET state = 'waiting' WHERE {due}")
            conn.commit()
            figures["b: claim's waiting scan at the instant"] = timed(
                conn, WAITING_DUE, args.repeat
            )
            conn.execute(
                "UPDATE core.tasks SET run_at = now() + interval '30 seconds'"
                " WHERE state = 'waiting'"
            )
            conn.commit()
            figures["b: claim's waiting scan in the lead window (finds none)"] = timed(
                conn, WAITING_DUE, args.repeat
            )
            conn.execute("UPDATE core.tasks SET state = 'ready' WHERE state = 'waiting'")
            conn.commit()
            figures["a: claim's due-ready scan in the lead window (finds none)"] = timed(
                conn, DUE_READY, args.repeat
            )
    print(f"{args.due} due now, {args.future} due later, one queue; median of {args.repeat}, ms")
    for name, ms in figures.items():
        print(f"  {name:<62}{ms:>9.2f}")
    print(f"  b also: the promotion ahead, per row (1,000 a batch) {promote:>22.2f} ms/1000")


if __name__ == "__main__":
    main()
