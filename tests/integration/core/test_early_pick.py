"""A claim's pick sent with its turn's first round trip (``attempts.hear(..., early=)``),
from the worker's row as the replica last read it: used only when it found what the pick
asked once the worker was heard finds, the turn's reports then applied with the lease
and its COMMIT. One round trip fewer a claiming turn (docs/architecture.md, "A turn")."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from libs.common.models import AttemptReport
from libs.common.settings import libpq_url
from services.core.db import attempts as attempts_db
from tests.support import REAPER_AWAY, Core, TurnWorker, spec

# The tests drive the workers' turns and reap by hand.
pytestmark = REAPER_AWAY

DB = psycopg.Connection[tuple[Any, ...]]
ROOM = {"cpu": 8, "memory_mb": 16384, "max": 16}


@pytest.fixture
def worker(core: Core) -> Iterator[TurnWorker]:
    w = TurnWorker(core, "w1")
    yield w
    w.http.close()


def _submit(core: Core, *bodies: dict[str, Any]) -> list[int]:
    with core.client("alice") as alice:
        answer = alice.post("/v1/tasks/batch", json={"tasks": list(bodies)})
        assert answer.status_code in (200, 201), answer.text
        return [t["id"] for t in answer.json()["tasks"]]


def _picks(core: Core) -> dict[str, float]:
    found = {}
    for line in httpx.get(core.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("cairn_claim_picks_total{"):
            found[line.split('when="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return found


def _states(db: DB, ids: list[int]) -> list[str]:
    rows = dict(db.execute("SELECT id, state FROM core.tasks WHERE id = ANY(%s)", (ids,)))
    return [rows[i] for i in ids]


def test_a_turns_pick_goes_with_its_first_round_trip_and_its_reports_with_the_lease(
    core: Core, worker: TurnWorker, db: DB, db_url: str
) -> None:
    first, *waiting = _submit(core, spec(priority=9), spec(), spec())
    attempt = worker.turn(claim={**ROOM, "max": 1})["attempts"][0]["attempt_id"]

    def locked() -> list[int]:
        # Rows another session's pick would skip: those this turn's transaction locked.
        with psycopg.connect(libpq_url(db_url)) as other:
            free = other.execute(
                "SELECT id FROM core.tasks WHERE id = ANY(%s) FOR UPDATE SKIP LOCKED",
                (waiting,),
            ).fetchall()
            return sorted(set(waiting) - {i for (i,) in free})

    def seen() -> tuple[str, int]:
        [(state,)] = db.execute("SELECT state FROM core.tasks WHERE id = %s", (first,))
        [(n,)] = db.execute(
            "SELECT count(*) FROM core.attempts WHERE task_id = ANY(%s)", (waiting,)
        )
        return str(state), int(n)

    async def turn() -> tuple[list[int], tuple[str, int], tuple[str, int], bool]:
        engine = create_async_engine(db_url)
        try:
            async with engine.begin() as conn:
                row = (await attempts_db.hear(conn, worker.id)).worker
            async with engine.begin() as conn:
                early = attempts_db.early_ask(row, 8, 16384, 16)
                assert early is not None
                heard = await attempts_db.hear(conn, worker.id, reported=[attempt], early=early)
                after_hear = await asyncio.to_thread(locked)
                item = AttemptReport(attempt_id=attempt, outcome="succeeded")
                settled = await attempts_db.settle(conn, worker.id, [item], heard.reported)
                asked = attempts_db.ask(
                    heard.worker, heard.placed, heard.rest, 8, 16384, 16, closing=settled.closing
                )
                assert asked is not None and heard.picked is not None
                same = attempts_db.same_pick(early, asked, heard.picked)
                before = await asyncio.to_thread(seen)
                leases = await attempts_db.lease(
                    conn, asked, heard.picked, last=True, first=settled.statements()
                )
                assert leases.committed
                during = await asyncio.to_thread(seen)  # the transaction not yet left
            return after_hear, before, during, same
        finally:
            await engine.dispose()

    after_hear, before, during, same = asyncio.run(turn())
    assert after_hear == sorted(waiting)  # picked (locked) in the turn's first round trip
    assert same
    assert before == ("running", 0)  # nothing of the report nor the lease yet
    assert during == ("succeeded", 2)  # both went with the lease's COMMIT


def test_a_claiming_turn_picks_early_once_its_worker_is_known(
    core: Core, worker: TurnWorker, db: DB
) -> None:
    ids = _submit(core, spec(), spec(), spec())
    assert _picks(core) == {"first": 0, "again": 0, "after": 0}
    worker.turn(claim={**ROOM, "max": 1})  # the replica has not read the worker yet
    assert _picks(core) == {"first": 0, "again": 0, "after": 1}
    worker.turn(claim={**ROOM, "max": 2})
    assert _picks(core) == {"first": 1, "again": 0, "after": 1}
    assert _states(db, ids) == ["running"] * 3
    [(n,)] = db.execute("SELECT count(*) FROM core.attempts WHERE task_id = ANY(%s)", (ids,))
    assert n == 3


def test_an_early_pick_that_found_work_the_room_cannot_take_is_picked_again(
    core: Core, worker: TurnWorker, db: DB
) -> None:
    # The worker (8 cpu) runs a 4-cpu task; the claim says 8 free (the agent's view, as
    # when a report it counts as freed has not reached core). The early pick, asked in
    # the claim's room, finds the 6-cpu task first; in the room core finds (4) it cannot
    # run: the turn picks again and leases the 2-cpu one.
    held, big, small = _submit(
        core,
        spec(priority=9, resources={"cpu": 4, "memory_mb": 64}),
        spec(priority=5, resources={"cpu": 6, "memory_mb": 64}),
        spec(priority=0, resources={"cpu": 2, "memory_mb": 64}),
    )
    worker.turn(claim={**ROOM, "max": 1})
    leased = worker.turn(claim=ROOM)["attempts"]
    assert [a["task_id"] for a in leased] == [small]
    assert _picks(core) == {"first": 0, "again": 1, "after": 1}
    assert _states(db, [held, big, small]) == ["running", "waiting", "running"]
