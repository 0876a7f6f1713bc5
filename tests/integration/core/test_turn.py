"""A worker's turn: its reports, its start acknowledgements and its claim in one request and
one transaction, each report fenced alone; and the claim against the reaper."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from libs.common.models import AttemptReport
from libs.common.placement import SQUEEZED_CPU_SHARE
from libs.common.settings import libpq_url
from services.core.db import attempts as attempts_db
from services.core.db import placement
from services.core.db import workers as workers_db
from services.core.domain.placement import Amount, utilisation
from tests.support import REAPER_AWAY, Core, TurnWorker, spec, wait_for

# The tests drive the workers' turns and reap by hand.
pytestmark = REAPER_AWAY

DB = psycopg.Connection[tuple[Any, ...]]
ROOM = {"cpu": 8, "memory_mb": 16384, "max": 16}


Worker = TurnWorker


@pytest.fixture
def worker(core: Core) -> Iterator[Worker]:
    w = Worker(core, "w1")
    yield w
    w.http.close()


def _submit(core: Core, n: int) -> list[int]:
    with core.client("alice") as alice:
        answer = alice.post("/v1/tasks/batch", json={"tasks": [spec() for _ in range(n)]})
        assert answer.status_code in (200, 201), answer.text
        return [t["id"] for t in answer.json()["tasks"]]


def _state(db: DB, task_id: int) -> str:
    row = db.execute("SELECT state FROM core.tasks WHERE id = %s", (task_id,)).fetchone()
    assert row is not None
    return str(row[0])


def _events(db: DB, task_id: int) -> list[str]:
    rows = db.execute(
        "SELECT op FROM core.task_events WHERE task_id = %s ORDER BY seq", (task_id,)
    ).fetchall()
    return [r[0] for r in rows]


def test_a_batch_applies_its_valid_reports_and_refuses_each_stale_one_alone(
    core: Core, worker: Worker, db: DB
) -> None:
    ok, cancelled, failing = _submit(core, 3)
    leased = {a["task_id"]: a["attempt_id"] for a in worker.turn(claim=ROOM)["attempts"]}
    assert set(leased) == {ok, cancelled, failing}
    with core.client("alice") as alice:
        assert alice.post(f"/v1/tasks/{cancelled}/cancel").status_code == 200
    reports = [
        {"attempt_id": leased[ok], "outcome": "succeeded", "exit_code": 0},
        {"attempt_id": leased[cancelled], "outcome": "succeeded", "exit_code": 0},
        {"attempt_id": leased[failing], "outcome": "failed", "exit_code": 3, "error": "boom"},
        {"attempt_id": leased[ok], "outcome": "failed", "exit_code": 1},
        {"attempt_id": 2**62, "outcome": "succeeded"},
    ]
    answer = worker.turn(reports=reports)
    verdicts = [(v["attempt_id"], v["status"], v["state"]) for v in answer["reports"]]
    assert verdicts == [
        (leased[ok], 200, "succeeded"),
        (leased[cancelled], 409, None),
        (leased[failing], 200, "failed"),
        (leased[ok], 409, None),
        (2**62, 404, None),
    ]
    assert answer["state"] == "live" and answer["attempts"] == []
    assert (_state(db, ok), _state(db, cancelled), _state(db, failing)) == (
        "succeeded",
        "cancelled",
        "failed",
    )
    assert _events(db, ok) == ["submit", "claim", "succeed"]
    assert _events(db, cancelled) == ["submit", "claim", "cancel"]
    assert _events(db, failing) == ["submit", "claim", "fail"]
    outcome = db.execute(
        "SELECT outcome, exit_code, error FROM core.attempts WHERE id = %s", (leased[failing],)
    ).fetchone()
    assert outcome == ("failed", 3, "boom")


def test_a_turns_claim_fills_the_room_its_own_reports_free(
    core: Core, worker: Worker, db: DB
) -> None:
    # The worker's capacity (8 CPU) holds two of these; the turn reads what is placed on
    # it before its reports close anything, so the room they free must be counted too.
    with core.client("alice") as alice:
        body = {"tasks": [spec(resources={"cpu": 4, "memory_mb": 64}) for _ in range(4)]}
        answer = alice.post("/v1/tasks/batch", json=body)
        assert answer.status_code in (200, 201), answer.text
    first = worker.turn(claim=ROOM)["attempts"]
    assert len(first) == 2
    assert worker.turn(claim=ROOM)["attempts"] == []  # full
    reports = [{"attempt_id": a["attempt_id"], "outcome": "succeeded"} for a in first]
    answer = worker.turn(reports=reports, claim=ROOM)
    assert [v["state"] for v in answer["reports"]] == ["succeeded", "succeeded"]
    second = answer["attempts"]
    assert len(second) == 2
    assert answer["waited"] is False  # work waited when it looked: answered at once
    assert {a["task_id"] for a in second}.isdisjoint(a["task_id"] for a in first)
    open_attempts = db.execute(
        "SELECT count(*) FROM core.attempts WHERE worker_id = %s AND outcome IS NULL",
        (worker.id,),
    ).fetchone()
    assert open_attempts == (2,)


def test_a_turns_room_counts_a_squeezed_attempt_little_cpu_and_a_chargeless_one_its_request(
    core: Core, worker: Worker, db: DB, db_url: str
) -> None:
    # The turn and the placement pass sum what the worker's attempts hold in SQL
    # (placement.USE); the sum must be what the attempts one by one hold (Node.used).
    def batch(cpu: float, n: int = 1) -> None:
        with core.client("alice") as alice:
            body = {"tasks": [spec(resources={"cpu": cpu, "memory_mb": 64}) for _ in range(n)]}
            answer = alice.post("/v1/tasks/batch", json=body)
            assert answer.status_code in (200, 201), answer.text

    batch(4, 2)
    squeezed, chargeless = (a["attempt_id"] for a in worker.turn(claim=ROOM)["attempts"])
    db.execute("UPDATE core.attempts SET squeezed_at = now() WHERE id = %s", (squeezed,))
    db.execute(
        "UPDATE core.attempts SET charge_cpu = NULL, charge_memory_mb = NULL WHERE id = %s",
        (chargeless,),
    )
    # 8 CPU less 4 (charged its task's request) less 4 x 0.05 (squeezed): 3.8 free.
    batch(3)
    assert len(worker.turn(claim=ROOM)["attempts"]) == 1
    batch(1)
    assert worker.turn(claim=ROOM)["attempts"] == []  # 0.8 free

    async def rooms() -> tuple[object, object, dict[str, float], dict[str, float]]:
        engine = create_async_engine(db_url)
        try:
            async with engine.begin() as conn:
                summed = {n.worker_id: n.used() for n in await placement.live_rooms(conn)}
                nodes = await placement.live_nodes(conn)
                listed = {n.worker_id: n.used() for n in nodes}
                # the pass's pools, summed per queue by the database, are as full as
                # their workers one by one
                pools = await placement.measure_pools(conn)
                serving = {q for n in nodes for q in n.queues}
                one_by_one = {q: utilisation([n for n in nodes if q in n.queues]) for q in serving}
                return summed[worker.id], listed[worker.id], pools, one_by_one
        finally:
            await engine.dispose()

    summed, listed, pools, one_by_one = asyncio.run(rooms())
    assert summed == pytest.approx(listed)
    assert pools == pytest.approx(one_by_one) and pools["default"] > 0
    assert listed == Amount(pytest.approx(4 + 3 + 4 * SQUEEZED_CPU_SHARE), 3 * 64)


def test_a_report_sent_again_in_a_later_turn_is_refused_and_changes_nothing(
    core: Core, worker: Worker, db: DB
) -> None:
    [task] = _submit(core, 1)
    [attempt] = worker.turn(claim=ROOM)["attempts"]
    report = {"attempt_id": attempt["attempt_id"], "outcome": "succeeded", "exit_code": 0}
    first = worker.turn(reports=[report], claim=ROOM)
    assert [v["status"] for v in first["reports"]] == [200]
    again = worker.turn(reports=[{**report, "outcome": "failed"}])
    assert [(v["status"], v["task_id"]) for v in again["reports"]] == [(409, task)]
    assert "current attempt" in again["reports"][0]["detail"]
    assert _state(db, task) == "succeeded"
    assert _events(db, task) == ["submit", "claim", "succeed"]
    # The old endpoint answers the same as its turn of one report.
    old = worker.http.post(
        f"/v1/workers/{worker.id}/attempts/{attempt['attempt_id']}/report",
        json={"outcome": "succeeded"},
    )
    assert old.status_code == 409 and old.json()["type"].endswith("stale-attempt")


def test_a_turn_acknowledges_starts_and_its_report_ends_the_shipped_log(
    core: Core, worker: Worker, db: DB
) -> None:
    [task] = _submit(core, 1)
    [attempt] = worker.turn(claim=ROOM)["attempts"]
    aid = attempt["attempt_id"]
    worker.turn(started=[aid])
    seen = db.execute("SELECT seen_at IS NOT NULL FROM core.attempts WHERE id = %s", (aid,))
    assert seen.fetchone() == (True,)
    # The log travels apart from the turn, in chunks (docs/logs.md); the report ends it.
    chunk = {"attempt_id": aid, "offset": 0, "length": 6, "text": "hello\n"}
    shipped = worker.http.post(f"/v1/workers/{worker.id}/logs", json={"chunks": [chunk]})
    assert shipped.status_code == 200 and shipped.json()["items"][0]["status"] == 200
    report = {"attempt_id": aid, "outcome": "succeeded", "log_tail": "hello\n"}
    assert worker.turn(reports=[report])["reports"][0]["status"] == 200
    with core.client("alice") as alice:
        log = alice.get(f"/v1/tasks/{task}/logs")
    assert log.status_code == 200 and log.text == "hello\n"
    assert log.headers["X-Cairn-Log-Complete"] == "true"


def _waiting_on_lock(db_url: str, needle: str) -> bool:
    with psycopg.connect(libpq_url(db_url), autocommit=True) as watcher:
        rows = watcher.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query ILIKE %s",
            (f"%{needle}%",),
        ).fetchone()
    return bool(rows and rows[0])


def _in_thread(call: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    return thread, out


def test_the_reaper_skips_a_worker_whose_turn_committed_first(
    core: Core, worker: Worker, db_url: str, db: DB
) -> None:
    [task] = _submit(core, 1)
    [attempt] = worker.turn(claim=ROOM)["attempts"]
    # Long silent, by its last beat: the reaper would take it now.
    db.execute(
        "UPDATE core.workers SET last_heartbeat_at = now() - interval '2 hours' WHERE id = %s",
        (worker.id,),
    )
    report = {"attempt_id": attempt["attempt_id"], "outcome": "succeeded"}
    with psycopg.connect(libpq_url(db_url)) as holder:
        # Hold the task, so that the turn stops inside its transaction, worker row locked.
        holder.execute("SELECT id FROM core.tasks WHERE id = %s FOR UPDATE", (task,))
        turning, answer = _in_thread(lambda: worker.turn(reports=[report], claim=ROOM))
        # (the reports' lock, ``_REPORTED``, by a name of its own: pg_stat_activity shows
        # a query's first 1,024 bytes, and its ``FOR UPDATE OF t`` comes after them)
        wait_for(lambda: _waiting_on_lock(db_url, "AS ended_why"), timeout=15)
        reaping, reaped = _in_thread(lambda: asyncio.run(_reap(core.db_url, 60.0)))
        wait_for(lambda: _waiting_on_lock(db_url, "core.workers"), timeout=15)
        holder.rollback()
    turning.join(30)
    reaping.join(30)
    assert reaped == [0], "the reaper declared a worker dead whose turn had just heard it"
    assert answer[0]["state"] == "live"
    assert [v["status"] for v in answer[0]["reports"]] == [200]
    assert _state(db, task) == "succeeded"
    row = db.execute("SELECT state FROM core.workers WHERE id = %s", (worker.id,)).fetchone()
    assert row == ("live",)


def test_a_turn_that_waits_on_the_reaper_leases_nothing_once_it_has_lost(
    core: Core, worker: Worker, db_url: str, db: DB
) -> None:
    [task] = _submit(core, 1)
    with psycopg.connect(libpq_url(db_url)) as reaper:
        # What the reaper's dead-declaration does, held open: the row is locked.
        reaper.execute(
            "UPDATE core.workers SET state = 'dead', gone_at = now() WHERE id = %s", (worker.id,)
        )
        turning, answer = _in_thread(lambda: worker.turn(claim=ROOM))
        wait_for(lambda: _waiting_on_lock(db_url, "core.workers"), timeout=15)
        reaper.commit()
    turning.join(30)
    assert answer[0]["state"] == "dead" and answer[0]["attempts"] == []
    assert _state(db, task) == "waiting"
    assert db.execute("SELECT count(*) FROM core.attempts").fetchone() == (0,)


async def _reap(db_url: str, timeout_s: float) -> int:
    engine = create_async_engine(db_url)
    try:
        async with engine.begin() as conn:
            changed, _, _ = await workers_db.reap(conn, timeout_s)
            return changed
    finally:
        await engine.dispose()


def test_two_workers_turning_at_once_run_every_task_exactly_once(core: Core, db: DB) -> None:
    tasks = set(_submit(core, 120))
    workers = [Worker(core, f"w{i}") for i in range(2)]
    errors: list[BaseException] = []

    def loop(w: Worker) -> None:
        try:
            reports: list[dict[str, Any]] = []
            idle = 0
            while idle < 3:
                answer = w.turn(reports=reports, claim={**ROOM, "max": 7})
                assert all(v["status"] == 200 for v in answer["reports"]), answer["reports"]
                reports = [
                    {"attempt_id": a["attempt_id"], "outcome": "succeeded", "exit_code": 0}
                    for a in answer["attempts"]
                ]
                idle = 0 if answer["attempts"] else idle + 1
        except (AssertionError, httpx.HTTPError) as exc:
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for w in workers:
        w.http.close()
    assert not errors, errors
    states = dict(db.execute("SELECT state, count(*) FROM core.tasks GROUP BY 1").fetchall())
    assert states == {"succeeded": len(tasks)}
    per_task = db.execute(
        "SELECT count(*), count(DISTINCT worker_id) FROM core.attempts GROUP BY task_id"
    ).fetchall()
    assert set(per_task) == {(1, 1)} and len(per_task) == len(tasks)
    by_worker = db.execute("SELECT count(DISTINCT worker_id) FROM core.attempts").fetchone()
    assert by_worker == (2,), "both workers should have taken part"


@pytest.mark.parametrize("secret", [False, True], ids=["plain", "refers-to-a-secret"])
def test_a_lease_without_secrets_commits_in_its_own_round_trip(
    core: Core, worker: Worker, db: DB, db_url: str, secret: bool
) -> None:
    # Seen from another session while the claim's transaction is still open: a lease whose
    # tasks refer to no secret went with the COMMIT; one that refers to a secret waits for
    # the look-ups (db.secrets.fill) and commits when the transaction ends.
    [task] = _submit(core, 1)
    if secret:
        db.execute(
            """UPDATE core.tasks SET env = '{"TOKEN": {"secret": "api"}}' WHERE id = %s""",
            (task,),
        )

    def leased() -> int:
        [(n,)] = db.execute("SELECT count(*) FROM core.attempts WHERE task_id = %s", (task,))
        return int(n)

    async def claim() -> tuple[int, int, bool]:
        engine = create_async_engine(db_url)
        try:
            async with engine.begin() as conn:
                heard = await attempts_db.hear(conn, worker.id)
                asked = attempts_db.ask(heard.worker, heard.placed, heard.rest, 8, 16384, 16)
                assert asked is not None
                picked = await attempts_db.finish_and_pick(conn, attempts_db.Settled([], []), asked)
                leases = await attempts_db.lease(conn, asked, picked, last=True)
                during = await asyncio.to_thread(leased)
            return len(leases.assignments), during, leases.committed
        finally:
            await engine.dispose()

    count, during, committed = asyncio.run(claim())
    assert count == 1
    assert (during, committed) == ((0, False) if secret else (1, True))
    assert leased() == 1


@pytest.mark.parametrize("claims", [False, True], ids=["reports-only", "with-a-claim"])
def test_a_turn_that_only_reports_commits_with_its_statement(
    core: Core, worker: Worker, db: DB, db_url: str, claims: bool
) -> None:
    # Seen from another session while the turn's transaction is still open: a turn that
    # only reports (the agent's courier) committed in the round trip of its reports; one
    # that also claims leaves the COMMIT to its lease.
    _submit(core, 2)
    attempt = worker.turn(claim={**ROOM, "max": 1})["attempts"][0]["attempt_id"]

    def closed() -> bool:
        [(outcome,)] = db.execute("SELECT outcome FROM core.attempts WHERE id = %s", (attempt,))
        db.commit()
        return outcome is not None

    async def report() -> bool:
        engine = create_async_engine(db_url)
        try:
            async with engine.begin() as conn:
                heard = await attempts_db.hear(conn, worker.id, reported=[attempt])
                item = AttemptReport(attempt_id=attempt, outcome="succeeded")
                settled = await attempts_db.settle(conn, worker.id, [item], heard.reported)
                asked = None
                if claims:
                    asked = attempts_db.ask(heard.worker, heard.placed, heard.rest, 8, 16384, 1)
                await attempts_db.finish_and_pick(conn, settled, asked, last=True)
                return await asyncio.to_thread(closed)
        finally:
            await engine.dispose()

    assert asyncio.run(report()) is not claims
    assert closed()


def test_a_start_acknowledgement_is_a_hot_update(core: Core, worker: Worker, db: DB) -> None:
    # Enough attempts to fill the table's first page: the first attempt's start,
    # acknowledged by a turn (``seen_at``, which no index holds), stays in its page (a
    # HOT update: no index entry added), as the page keeps room for it (fillfactor 80).
    small = spec(resources={"cpu": 0.01, "memory_mb": 1})
    with core.client("alice") as alice:
        answer = alice.post("/v1/tasks/batch", json={"tasks": [small] * 120})
        assert answer.status_code in (200, 201), answer.text
    leased = worker.turn(claim={**ROOM, "max": 120})["attempts"]
    assert len(leased) == 120
    pages = db.execute("SELECT count(DISTINCT (ctid::text::point)[0]) FROM core.attempts")
    assert pages.fetchone()[0] > 1, "the attempts should span more than one page"
    first = min(a["attempt_id"] for a in leased)

    def where() -> str:
        [(ctid,)] = db.execute("SELECT ctid::text FROM core.attempts WHERE id = %s", (first,))
        db.commit()
        return str(ctid).strip("()").split(",")[0]

    page = where()
    worker.turn(started=[first])
    [(seen,)] = db.execute("SELECT seen_at FROM core.attempts WHERE id = %s", (first,))
    assert seen is not None
    assert where() == page


def test_only_a_claim_that_waits_probes_for_waiting_work(
    core: Core, worker: Worker, db_url: str
) -> None:
    # Whether any work waited (Picked.waiting) is read only by a waiting claim's look that
    # leased nothing, so the probe goes with the pick of a claim that waits alone; one
    # that does not wait picks the same rows and reads "may have been short" (not probed).
    async def look(waits: bool) -> tuple[list[int], bool]:
        engine = create_async_engine(db_url)
        try:
            async with engine.connect() as conn, conn.begin() as tx:
                heard = await attempts_db.hear(conn, worker.id)
                asked = attempts_db.ask(heard.worker, heard.placed, heard.rest, 8, 16384, 16)
                assert asked is not None
                picked = await attempts_db.finish_and_pick(
                    conn, attempts_db.Settled([], []), asked, waits=waits
                )
                await tx.rollback()
            assert isinstance(picked, attempts_db.Picked)
            return sorted(r.id for r in picked), picked.waiting
        finally:
            await engine.dispose()

    assert asyncio.run(look(True)) == ([], False)  # probed: nothing waits
    assert asyncio.run(look(False)) == ([], True)  # not probed
    tasks = _submit(core, 2)
    assert asyncio.run(look(True)) == (sorted(tasks), True)
    assert asyncio.run(look(False)) == (sorted(tasks), True)


def test_a_turn_is_refused_as_its_declaration_refuses_it(core: Core, worker: Worker) -> None:
    """The turn's route serves a plain turn without FastAPI's dependency solving
    (``api.workers.TurnRoute``): what that path does not take is refused as FastAPI
    refuses it, 404 for a lease that is not the worker's, 422 naming what is wrong."""
    url = f"/v1/workers/{worker.id}/turn"
    bad_reports = worker.post_turn(reports=[{"attempt_id": "x", "outcome": "succeeded"}])
    assert bad_reports.status_code == 422 and "attempt_id" in bad_reports.text
    unknown = worker.post_turn(claims={"cpu": 1})
    assert unknown.status_code == 422 and "claims" in unknown.text
    for path in ("/v1/workers/0/turn", f"/v1/workers/{2**63}/turn"):
        answer = worker.http.post(path, json={})
        assert answer.status_code == 422 and "worker_id" in answer.text, answer.text
    lease = worker.http.headers["X-Cairn-Worker-Lease"]
    for headers in ({"X-Cairn-Worker-Lease": "not-its-lease"}, {"X-Cairn-Worker-Lease": ""}):
        assert worker.http.post(url, json={}, headers=headers).status_code == 404
    long = worker.http.post(url, json={}, headers={"X-Cairn-Worker-Lease": "l" * 201})
    assert long.status_code == 422 and "x-cairn-worker-lease" in long.text.lower()
    # Not JSON by its content type: FastAPI's handler, which does not read it as JSON.
    answer = worker.http.post(url, content=b"{}", headers={"Content-Type": "text/plain"})
    assert answer.status_code == 422 and '"field":"body"' in answer.text, answer.text
    assert worker.turn()["state"] == "live"
    assert worker.http.headers["X-Cairn-Worker-Lease"] == lease


# The sweep (a floor under lost wake-ups, every second by default) out of the way: it
# would answer the claim within a second without the drain's own wake-up.
@pytest.mark.core(heartbeat_timeout_s=3600.0, claim_sweep_s=60.0)
def test_a_turn_that_says_its_worker_drains_answers_its_waiting_claim_at_once(
    core: Core, worker: Worker, db: DB
) -> None:
    [task] = _submit(core, 1)
    [attempt] = worker.turn(claim=ROOM)["attempts"]
    done = {"attempt_id": attempt["attempt_id"], "outcome": "succeeded", "exit_code": 0}
    # The report rides on a claim that finds no work and waits (a long poll).
    waiting, answer = _in_thread(lambda: worker.turn(reports=[done], claim={**ROOM, "wait": 30}))
    wait_for(lambda: _state(db, task) == "succeeded", timeout=15)
    with core.client("w1", "worker") as agent:
        agent.headers["X-Cairn-Worker-Lease"] = worker.http.headers["X-Cairn-Worker-Lease"]
        told = agent.post(f"/v1/workers/{worker.id}/turn", json={"draining": True})
        assert told.status_code == 200, told.text
        assert told.json()["state"] == "draining"
        again = agent.post(f"/v1/workers/{worker.id}/turn", json={"draining": True})
        assert again.status_code == 200, again.text
        # Audited as an admin's drain is, the agent the actor; once, when it moved.
        audited = "SELECT actor, actor_role, target, before, after, source FROM core.audit"
        assert db.execute(f"{audited} WHERE action = 'worker.drain'").fetchall() == [
            ("w1", "worker", f"worker:{worker.id}", {"state": "live"}, {"state": "draining"},
             "127.0.0.1"),
        ]  # fmt: skip
        waiting.join(15)  # woken by the drain, not at the end of its wait (30 s)
        # The claim heard: nothing leased, and the verdict of the report it carried.
        assert answer and answer[0]["state"] == "draining" and answer[0]["attempts"] == []
        assert [v["status"] for v in answer[0]["reports"]] == [200]
        [late] = _submit(core, 1)
        assert worker.turn(claim=ROOM) == {
            "state": "draining", "reports": [], "attempts": [], "waited": False,
        }  # fmt: skip
        both = agent.post(f"/v1/workers/{worker.id}/turn", json={"draining": True, "claim": ROOM})
    assert both.status_code == 422 and "claim" in both.text
    assert _state(db, late) == "waiting"
    assert db.execute("SELECT state FROM core.workers").fetchall() == [("draining",)]


def test_a_lease_that_waits_on_a_drain_leases_nothing_once_it_drained(
    core: Core, worker: Worker, db_url: str, db: DB
) -> None:
    [task] = _submit(core, 1)
    with psycopg.connect(libpq_url(db_url)) as drain:
        # A drain committing while the claim leases (its row locked until then): the
        # claim read the worker live, and its lease waits on the row.
        drain.execute("UPDATE core.workers SET state = 'draining' WHERE id = %s", (worker.id,))
        turning, answer = _in_thread(lambda: worker.turn(claim=ROOM))
        wait_for(lambda: _waiting_on_lock(db_url, "core.workers"), timeout=15)
        drain.commit()
    turning.join(30)
    assert answer[0]["attempts"] == [] and answer[0]["state"] == "draining"
    assert _state(db, task) == "waiting"
    assert db.execute("SELECT count(*) FROM core.attempts").fetchone() == (0,)


def test_outputs_core_cannot_store_are_a_422_naming_them_not_a_500(
    core: Core, worker: Worker, db: DB
) -> None:
    """An integer past 64 bits or a lone surrogate in a report's outputs passed
    validation and failed core's JSON encoder as the report was applied: a 500 for the
    whole turn, which the agent sent again and again with its claims. They, and outputs
    nested deeper than the agent takes, are refused at the door of a report alone (a 422
    naming the field), and the attempt is untouched; in a turn, such a report fails its
    attempt alone (the next test)."""
    [task] = _submit(core, 1)
    [leased] = worker.turn(claim=ROOM)["attempts"]
    bodies = [
        f'{{"n": {2**64}}}',
        f'{{"n": [{-(2**63) - 1}]}}',
        '{"s": "a\\ud800"}',
        '{"d": ' + "[" * 40 + "]" * 40 + "}",
    ]
    for outputs in bodies:
        report = f'{{"outcome": "succeeded", "outputs": {outputs}}}'
        answer = worker.http.post(
            f"/v1/workers/{worker.id}/attempts/{leased['attempt_id']}/report",
            content=report,
            headers={"Content-Type": "application/json"},
        )
        assert answer.status_code == 422, (outputs, answer.status_code, answer.text)
        assert "outputs" in answer.text, answer.text
    assert _state(db, task) == "running"
    fine = {"attempt_id": leased["attempt_id"], "outcome": "succeeded", "outputs": {"n": 2**63 - 1}}
    assert worker.turn(reports=[fine])["reports"][0]["status"] == 200
    row = db.execute(
        "SELECT outputs FROM core.attempts WHERE id = %s", (leased["attempt_id"],)
    ).fetchone()
    assert row == ({"n": 2**63 - 1},)


@pytest.mark.parametrize(
    ("outputs", "rule"),
    [
        ('{"n": 1180591620717411303424}', "integers must fit in 64 bits"),
        ('{"s": "\\ud800"}', "unpaired surrogate"),
        ('{"deep": ' + "[" * 40 + "]" * 40 + "}", "nested deeper than 32 levels"),
    ],
    ids=["big-int", "lone-surrogate", "too-deep"],
)
def test_a_report_whose_outputs_break_the_json_rule_fails_alone(
    core: Core, worker: Worker, db: DB, outputs: str, rule: str
) -> None:
    """An agent from before ``json_problem`` sends outputs the rule refuses: the turn's
    other report, its starts and its claim are applied, and that attempt fails naming the
    rule, as a newer agent fails it itself (the whole turn was a 422, again and again)."""
    bad, good, waiting = _submit(core, 3)
    first = worker.turn(claim={**ROOM, "max": 2})["attempts"]
    leased = {a["task_id"]: a["attempt_id"] for a in first}
    assert set(leased) == {bad, good}
    # Written as text: a lone surrogate is JSON an encoder of today refuses to write.
    body = (
        '{"reports": ['
        f'{{"attempt_id": {leased[bad]}, "outcome": "succeeded", "exit_code": 0,'
        f' "outputs": {outputs}}},'
        f'{{"attempt_id": {leased[good]}, "outcome": "succeeded", "exit_code": 0,'
        ' "outputs": {"n": 1}}],'
        f' "claim": {json.dumps(ROOM)}}}'
    )
    answer = worker.http.post(
        f"/v1/workers/{worker.id}/turn",
        content=body.encode("utf-8", "surrogatepass"),
        headers={"content-type": "application/json"},
    )
    assert answer.status_code == 200, answer.text
    verdicts = [(v["attempt_id"], v["status"]) for v in answer.json()["reports"]]
    assert verdicts == [(leased[bad], 200), (leased[good], 200)]
    assert [a["task_id"] for a in answer.json()["attempts"]] == [waiting]
    rows = db.execute(
        "SELECT task_id, outcome, exit_code, error, outputs FROM core.attempts"
        " WHERE id = ANY(%s) ORDER BY id",
        ([leased[bad], leased[good]],),
    ).fetchall()
    by_task = {r[0]: r[1:] for r in rows}
    outcome, exit_code, error, kept = by_task[bad]
    assert (outcome, exit_code, kept) == ("failed", 0, None)
    assert error.startswith("CAIRN_OUTPUTS: outputs") and rule in error, error
    assert by_task[good] == ("succeeded", 0, None, {"n": 1})
    assert (_state(db, bad), _state(db, good), _state(db, waiting)) == (
        "dead",
        "succeeded",
        "running",
    )
