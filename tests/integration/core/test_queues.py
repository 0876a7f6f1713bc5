from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from sqlalchemy import event

from services.core.db import tasks as tasks_db
from tests.support import Core, spec, wait_for


def test_pause_parks_waiting_work_and_resume_releases_it(core: Core, db) -> None:
    with core.client() as alice, core.client("root", "admin") as admin:
        before = alice.post("/v1/tasks", json=spec(queue="batch")).json()
        paused = admin.post("/v1/queues/batch/pause").json()
        assert paused["paused"] is True
        assert alice.get(f"/v1/tasks/{before['id']}").json()["state"] == "ready"
        during = alice.post("/v1/tasks", json=spec(queue="batch")).json()
        assert during["state"] == "ready"
        other = alice.post("/v1/tasks", json=spec(queue="default")).json()
        assert other["state"] == "waiting"
        resumed = admin.post("/v1/queues/batch/resume").json()
        assert resumed["paused"] is False and resumed["depth"]["waiting"] == 2
        reasons = alice.get(f"/v1/tasks/{before['id']}/events").json()["items"]
    assert [(e["op"], e["to_state"]) for e in reasons] == [
        ("submit", "waiting"),
        ("park", "ready"),
        ("promote", "waiting"),
    ]


def test_a_submit_racing_a_pause_is_parked_by_the_promoter(core: Core, db) -> None:
    with core.client() as alice, core.client("root", "admin") as admin:
        admin.post("/v1/queues/q/pause")
        # As if the submit had read the queue just before the pause committed:
        task = alice.post("/v1/tasks", json=spec(queue="q")).json()
        db.execute("UPDATE core.tasks SET state = 'waiting' WHERE id = %s", (task["id"],))
        wait_for(lambda: alice.get(f"/v1/tasks/{task['id']}").json()["state"] == "ready")


def test_queue_list_reports_depth_and_oldest_waiting_age(core: Core, db) -> None:
    with core.client() as alice:
        for _ in range(3):
            alice.post("/v1/tasks", json=spec(queue="reports"))
        alice.post("/v1/tasks", json=spec(queue="reports", run_at="2999-01-01T00:00:00Z"))
        db.execute(
            "UPDATE core.tasks SET updated_at = now() - interval '90 s' WHERE state = 'waiting'"
        )
        queues = {q["name"]: q for q in alice.get("/v1/queues").json()["items"]}
    reports = queues["reports"]
    assert reports["depth"]["waiting"] == 3 and reports["depth"]["ready"] == 1
    assert 89 < reports["oldest_waiting_age_s"] < 300


def test_the_backlogs_counts_are_shared_only_as_old_as_a_caller_accepts(core: Core) -> None:
    """``/v1/queues``, its history and ``/v1/owners`` count the whole backlog
    (``db.readings``): a caller that sends ``Cache-Control: max-age`` may get the last
    count while it is that young, told its age; one that sends nothing gets a count made
    after it asked, so it sees what was submitted just before."""
    app = core.server.config.app
    engine = app.state.readings.engine.sync_engine
    depths = str(tasks_db.QUEUE_DEPTHS)
    ran: list[str] = []

    def count(conn, cursor, statement, parameters, context, executemany) -> None:
        if statement == depths:
            ran.append("depths")
        elif statement.startswith("\nWITH recent AS"):  # QUEUE_HISTORY, its :minutes bound
            ran.append("history")

    shared = {"Cache-Control": "max-age=30"}
    with core.client() as alice:
        alice.post("/v1/tasks", json=spec(queue="counted"))
        event.listen(engine, "before_cursor_execute", count)
        try:
            first = alice.get("/v1/queues", headers=shared)
            time.sleep(1.1)
            kept = alice.get("/v1/queues", headers=shared)
            alice.post("/v1/tasks", json=spec(queue="counted"))
            fresh = alice.get("/v1/queues")
            charts = [alice.get("/v1/queues/history", headers=shared) for _ in range(2)]
        finally:
            event.remove(engine, "before_cursor_execute", count)

    def waiting(answer: httpx.Response) -> int:
        [counted] = [q for q in answer.json()["items"] if q["name"] == "counted"]
        return int(counted["depth"]["waiting"])

    assert ran == ["depths", "depths", "history"]
    assert (waiting(first), first.headers["Age"]) == (1, "0")
    assert waiting(kept) == 1 and int(kept.headers["Age"]) >= 1  # the first count, 1 s on
    assert (waiting(fresh), fresh.headers["Age"]) == (2, "0")
    assert charts[0].json() == charts[1].json()
    assert charts[0].json()["items"][0]["backlog"][-1] == 2


def test_a_caller_waiting_for_a_shared_count_holds_no_connection(core: Core) -> None:
    """A handler reads its shared counts before it takes a connection of core's data pool
    (``db.readings``): callers waiting for a slow count hold none of that pool, which
    submissions and claims need. Here every count is held until the test lets it go."""
    app = core.server.config.app
    shared, pool = app.state.readings, app.state.engine.sync_engine.pool
    entered, release = threading.Event(), threading.Event()
    original = shared._read

    async def held(statement, params):
        entered.set()
        await asyncio.to_thread(release.wait, 20)
        return await original(statement, params)

    shared._read = held
    paths = ("/v1/queues", "/v1/queues/history", "/v1/owners")
    try:
        with core.client() as alice, ThreadPoolExecutor(len(paths)) as calls:
            answers = [calls.submit(alice.get, path) for path in paths]
            assert entered.wait(10)
            time.sleep(0.5)  # each call now waits for its count
            held_out = []
            for _ in range(10):
                held_out.append(pool.checkedout())
                time.sleep(0.05)
            release.set()
            assert [a.result(20).status_code for a in answers] == [200, 200, 200]
    finally:
        release.set()
        shared._read = original
    # three waiting calls holding a connection each would keep at least three out; the
    # core's own loops take one now and then
    assert min(held_out) < len(paths), held_out
