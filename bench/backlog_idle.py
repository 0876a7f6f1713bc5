"""What a waiting backlog costs core and PostgreSQL while nothing claims it.

    .venv/bin/python bench/backlog_idle.py [--finished 1000000] [--backlog 100000]
                                           [--window-s 100] [--slow-ms 5]

A fresh embedded PostgreSQL (durable settings) and core (``bench/stack.py``). First
``--finished`` finished tasks in ``core.tasks``, analysed (``dispatch.prefill``: a month
of retention and a night's autovacuum), then ``--backlog`` tasks submitted in batches,
and one worker registered that claims nothing (so the placement pass has a live worker
to serve). Then, over ``--window-s`` (after 5 s), core's and PostgreSQL's CPU a second
(``/proc``: the postmaster and all its children, autovacuum included), the statements
that took longer than ``--slow-ms`` (``log_min_duration_statement``), grouped by their
first words, and when autovacuum analysed ``core.tasks``.

Core's background loops (the promoter, the placement pass, the reaper) run once a second
whatever waits: on statistics that predate the backlog, each statement that walks the
waiting work instead of finding the few rows it needs costs in proportion to the backlog
(docs/architecture.md, "Statistics that predate the work").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dispatch import prefill, submit_all
from fleet import pg_cpu_s
from procstat import cpu_s
from stack import core_stack

from libs.common.client import CoreClient
from libs.common.models import WorkerRegister
from libs.common.settings import libpq_url
from services.core import admin

_DURATION = re.compile(r"duration: ([0-9.]+) ms\s+(?:statement|execute [^:]*): ?(.*)")
_ANALYSED = (
    "SELECT last_analyze, last_autoanalyze, autoanalyze_count FROM pg_stat_user_tables"
    " WHERE schemaname = 'core' AND relname = 'tasks'"
)


def slow_statements(log: Path) -> dict[str, tuple[int, float, float]]:
    """The statements of the server's log that took longer than the threshold, by their
    first words: (count, total ms, max ms)."""
    found: dict[str, list[float]] = defaultdict(list)
    lines = log.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        match = _DURATION.search(line)
        if match is None:
            continue
        # the statement's text, from its line and the next (a CTE's name says little)
        text = " ".join([match.group(2), *lines[i + 1 : i + 3]])
        found[" ".join(text.split()[:9])[:70]].append(float(match.group(1)))
    return {k: (len(v), sum(v), max(v)) for k, v in found.items()}


async def run(args: argparse.Namespace) -> None:
    with core_stack("cairn-bench-backlog-", CAIRN_HEARTBEAT_TIMEOUT_S="600") as stack:
        user = await asyncio.to_thread(admin.create_token, stack.database_url, "alice", "user")
        if args.finished:
            await asyncio.to_thread(prefill, stack.database_url, args.finished)
        await submit_all(stack.core_url, user, args.backlog)
        worker = await asyncio.to_thread(admin.create_token, stack.database_url, "w0", "worker")
        async with CoreClient(stack.core_url, worker) as core:
            await core.register_worker(
                WorkerRegister(hostname="w0", queues=["default"], cpu=1, memory_mb=100)
            )
        with psycopg.connect(libpq_url(stack.database_url), autocommit=True) as conn:
            conn.execute(f"ALTER SYSTEM SET log_min_duration_statement = {int(args.slow_ms)}")
            conn.execute("SELECT pg_reload_conf()")
        await asyncio.sleep(5)
        pg0, core0, began = pg_cpu_s(stack.postmaster_pid), cpu_s(stack.core_pid), time.time()
        await asyncio.sleep(args.window_s)
        pg1, core1, ended = pg_cpu_s(stack.postmaster_pid), cpu_s(stack.core_pid), time.time()
        with psycopg.connect(libpq_url(stack.database_url)) as conn:
            analysed = conn.execute(_ANALYSED).fetchone()
        slow = slow_statements(stack.root / "pg" / "data" / "server.log")
    span = ended - began
    print(
        f"{args.backlog} waiting behind {args.finished} finished, {span:.0f} s: "
        f"PostgreSQL {1000 * (pg1 - pg0) / span:.1f} ms of CPU a second, "
        f"core {1000 * (core1 - core0) / span:.1f}"
    )
    if analysed:
        print(f"core.tasks analysed: by hand {analysed[0]}, by autovacuum {analysed[1]}")
    print(f"statements over {args.slow_ms} ms (count, total ms, max ms), from the backlog on:")
    for words, (count, total, most) in sorted(slow.items(), key=lambda kv: -kv[1][1])[:10]:
        print(f"  {count:5d} {total:9.1f} {most:7.1f}  {words}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--finished", type=int, default=1_000_000)
    parser.add_argument("--backlog", type=int, default=100_000)
    parser.add_argument("--window-s", type=float, default=100.0)
    parser.add_argument("--slow-ms", type=float, default=5.0)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
