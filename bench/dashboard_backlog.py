"""What the dashboard's Queues page costs while a backlog waits.

    .venv/bin/python bench/dashboard_backlog.py [--backlog 100000] [--owners 10] [--calls 6]
        [--viewers 1,5] [--watch-s 30]

A fresh embedded PostgreSQL (durable settings) and core (``bench/stack.py``). ``--backlog``
tasks submitted in batches by ``--owners`` users, none claimed (no worker), then a wait for
autovacuum to analyse ``core.tasks``. Then each call the Queues page makes every 2 s
(``services/core/ui/static/app.js``, ``queuesPage``: ``/v1/queues``, ``/v1/queues/history``
and ``/v1/owners?limit=10``), ``--calls`` times in turn as an admin and as one of the users:
the median of its wall time and of PostgreSQL's CPU over the call (``/proc``: the
postmaster and all its children, parallel workers included; whole clock ticks, so a
single call's figure is coarse and the median is what to quote). Each open page adds the
sum of its three calls every 2 s. Then ``--viewers`` pages open at once for ``--watch-s``
(``watching``), without a ``Cache-Control`` and with the dashboard's ``max-age=2``
(``db.readings``): PostgreSQL's CPU a second while they watch.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dispatch import submit_all
from fleet import pg_cpu_s
from stack import core_stack

from services.core import admin

#: what the Queues page asks every 2 s
PAGE = ("/v1/queues", "/v1/queues/history?minutes=60", "/v1/owners?limit=10")
#: autovacuum's look (``autovacuum_naptime``, 60 s by default) and an analysis of the table
ANALYSE_WAIT_S = 70


async def run(args: argparse.Namespace) -> None:
    with core_stack("cairn-bench-dashboard-", CAIRN_HEARTBEAT_TIMEOUT_S="600") as stack:
        url = stack.database_url
        users = [
            await asyncio.to_thread(admin.create_token, url, f"user{i}", "user")
            for i in range(args.owners)
        ]
        root = await asyncio.to_thread(admin.create_token, url, "root", "admin")
        for token in users:
            await submit_all(stack.core_url, token, args.backlog // args.owners)
        await asyncio.sleep(ANALYSE_WAIT_S)
        print(f"{args.backlog} waiting tasks of {args.owners} owners, nothing claiming them")
        async with httpx.AsyncClient(base_url=stack.core_url, timeout=120) as client:
            for who, token in (("admin", root), ("user", users[0])):
                headers = {"Authorization": f"Bearer {token}"}
                page_pg = 0.0
                for path in PAGE:
                    walls, pg = [], []
                    for _ in range(args.calls):
                        pg0, began = pg_cpu_s(stack.postmaster_pid), time.perf_counter()
                        (await client.get(path, headers=headers)).raise_for_status()
                        walls.append(1000 * (time.perf_counter() - began))
                        pg.append(1000 * (pg_cpu_s(stack.postmaster_pid) - pg0))
                    page_pg += statistics.median(pg)
                    print(
                        f"  {who:5s} {path:32s} wall p50 {statistics.median(walls):7.1f} ms,"
                        f" PostgreSQL CPU p50 {statistics.median(pg):7.1f} ms"
                    )
                print(f"  {who}: one open page costs PostgreSQL {page_pg / 2:.0f} ms a second")
            for viewers in args.viewers:
                for accepted in (None, 2):
                    cost = await watching(
                        client,
                        stack.postmaster_pid,
                        [root, *users],
                        viewers,
                        accepted,
                        args.watch_s,
                    )
                    said = "without a max-age" if accepted is None else f"max-age={accepted}"
                    print(
                        f"  {viewers} pages open ({said}): PostgreSQL {cost:.0f} ms of CPU a second"
                    )


async def watching(
    client: httpx.AsyncClient,
    postmaster: int,
    tokens: list[str],
    viewers: int,
    max_age: int | None,
    seconds: float,
) -> float:
    """``viewers`` Queues pages open for ``seconds``, each asking its three calls every 2 s
    as the dashboard does (``live``, ``queuesPage``), their turns spread over the 2 s, the
    first an admin's, the rest users'; ``max_age``: their ``Cache-Control`` (the dashboard
    sends 2). PostgreSQL's CPU a second over the time."""
    stop = time.perf_counter() + seconds

    async def page(i: int) -> None:
        headers = {"Authorization": f"Bearer {tokens[i % len(tokens)]}"}
        if max_age is not None:
            headers["Cache-Control"] = f"max-age={max_age}"
        await asyncio.sleep(2.0 * i / viewers)
        while time.perf_counter() < stop:
            turn = time.perf_counter()
            answers = await asyncio.gather(*(client.get(p, headers=headers) for p in PAGE))
            for answer in answers:
                answer.raise_for_status()
            await asyncio.sleep(max(0.0, 2.0 - (time.perf_counter() - turn)))

    pg0, began = pg_cpu_s(postmaster), time.perf_counter()
    await asyncio.gather(*(page(i) for i in range(viewers)))
    return 1000 * (pg_cpu_s(postmaster) - pg0) / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backlog", type=int, default=100_000)
    parser.add_argument("--owners", type=int, default=10)
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument(
        "--viewers",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[1, 5],
        help="pages open at once, each count a run of its own (comma-separated)",
    )
    parser.add_argument("--watch-s", type=float, default=30.0)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
