from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psycopg
from sqlalchemy.ext.asyncio import create_async_engine

from libs.common.settings import libpq_url
from libs.common.states import TaskState
from services.core.db import tasks as tasks_db
from tests.support import Core, spec


def _follow(client, after: str = "0.0", until: int = 0, wait: float = 2.0) -> tuple[list, str]:
    """Read the feed until ``until`` events arrived (or a read comes back empty)."""
    seen: list = []
    while True:
        page = client.get("/v1/events", params={"after": after, "wait": wait}).json()
        seen += page["items"]
        after = page["next_cursor"]
        if not page["items"] or len(seen) >= until > 0:
            return seen, after


def test_feed_pages_in_order_without_repeats(core: Core) -> None:
    with core.client("svc", "service") as svc, core.client() as alice:
        ids = [alice.post("/v1/tasks", json=spec()).json()["id"] for _ in range(25)]
        seen, after = [], "0.0"
        while True:
            page = svc.get("/v1/events", params={"after": after, "limit": 7}).json()
            if not page["items"]:
                break
            seen += page["items"]
            after = page["next_cursor"]
    assert [e["task_id"] for e in seen] == ids
    assert len({e["cursor"] for e in seen}) == 25


def test_an_event_committed_late_is_not_skipped(core: Core, db) -> None:
    """A transaction that took its event id first but commits last must still be read
    after the events that committed before it."""
    with core.client("svc", "service") as svc, core.client() as alice:
        with psycopg.connect(libpq_url(core.db_url)) as slow:
            slow.execute(
                "INSERT INTO core.tasks (owner, name, queue, kind, artifact_uri, artifact_sha256,"
                " cpu, memory_mb, max_attempts, backoff_cap_s, backoff_jitter, poison_after,"
                " state) VALUES ('alice', 'slow', 'default', 'task', 'file:///x', %s, 1, 1, 1,"
                " 1, true, 1, 'waiting') RETURNING id",
                ("0" * 64,),
            )
            slow.execute(
                "INSERT INTO core.task_events (task_id, seq, owner, op, to_state)"
                " SELECT id, 1, owner, 'submit', state FROM core.tasks WHERE name = 'slow'"
            )
            fast_ids = [alice.post("/v1/tasks", json=spec()).json()["id"] for _ in range(3)]
            early, cursor = _follow(svc, wait=0.3)
            assert early == []  # held back behind the open transaction
            slow.commit()
        late, _ = _follow(svc, after=cursor, until=4)
    assert sorted(e["task_id"] for e in late)[-3:] == sorted(fast_ids)
    assert len(late) == 4


def test_concurrent_writers_and_a_follower_lose_nothing(core: Core) -> None:
    total = 120
    done = threading.Event()
    seen: list[dict] = []

    def follow() -> None:
        with core.client("svc", "service") as svc:
            after = "0.0"
            while not (done.is_set() and len(seen) >= total):
                page = svc.get("/v1/events", params={"after": after, "wait": 1}).json()
                seen.extend(page["items"])
                after = page["next_cursor"]

    follower = threading.Thread(target=follow)
    follower.start()
    core.client("alice").close()

    def submit(i: int) -> int:
        with core.client("alice") as alice:
            return alice.post("/v1/tasks", json=spec(name=f"t{i}")).json()["id"]

    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(submit, range(total)))
    done.set()
    follower.join(timeout=30)
    assert sorted(e["task_id"] for e in seen) == sorted(ids)


def test_a_long_poll_wakes_when_an_event_arrives(core: Core) -> None:
    with core.client("svc", "service") as svc, core.client() as alice:
        cursor = svc.get("/v1/events").json()["next_cursor"]
        answer: dict = {}

        def poll() -> None:
            started = time.monotonic()
            page = svc.get("/v1/events", params={"after": cursor, "wait": 20}).json()
            answer.update(page=page, took=time.monotonic() - started)

        poller = threading.Thread(target=poll)
        poller.start()
        time.sleep(0.3)
        task = alice.post("/v1/tasks", json=spec()).json()
        poller.join(timeout=25)
    assert [e["task_id"] for e in answer["page"]["items"]] == [task["id"]]
    assert answer["took"] < 15  # woken by the event, not by the 20 s deadline


def test_a_held_poll_answers_at_a_tasks_end_with_what_came_before(core: Core) -> None:
    """With ``hold``, a page that ends no task waits for one that does (or ``hold``): the
    task's creation and its cancellation come in one answer, at the cancellation."""
    with core.client("svc", "service") as svc, core.client() as alice:
        cursor = svc.get("/v1/events").json()["next_cursor"]
        answer: dict = {}

        def poll(hold: float) -> None:
            started = time.monotonic()
            params = {"after": cursor, "wait": 20, "hold": hold}
            page = svc.get("/v1/events", params=params).json()
            answer.update(page=page, took=time.monotonic() - started)

        poller = threading.Thread(target=poll, args=(20,))
        poller.start()
        task = alice.post("/v1/tasks", json=spec()).json()
        time.sleep(0.5)
        assert not answer  # its creation alone is held
        alice.post(f"/v1/tasks/{task['id']}/cancel")
        poller.join(timeout=25)
        assert [e["to_state"] for e in answer["page"]["items"]] == ["waiting", "cancelled"]
        assert answer["took"] < 15  # answered at the end, not at the deadline
        # Past ``hold`` without an end, what came is answered.
        cursor = answer["page"]["next_cursor"]
        poller = threading.Thread(target=poll, args=(0.3,))
        poller.start()
        time.sleep(0.2)
        other = alice.post("/v1/tasks", json=spec()).json()
        poller.join(timeout=25)
    assert [e["task_id"] for e in answer["page"]["items"]] == [other["id"]]
    assert 0.25 < answer["took"] < 15


def test_users_read_only_their_own_events(core: Core) -> None:
    with core.client("alice") as alice, core.client("bob") as bob:
        mine = alice.post("/v1/tasks", json=spec()).json()
        bob.post("/v1/tasks", json=spec())
        events = alice.get("/v1/events").json()["items"]
        assert {e["task_id"] for e in events} == {mine["id"]}
        # An empty page still moves the cursor forward.
        after = alice.get("/v1/events", params={"after": events[-1]["cursor"]}).json()
    assert after["items"] == [] and after["next_cursor"] >= events[-1]["cursor"]


def test_the_matchers_read_of_deaths_skips_the_rest_and_moves_past_it(db_url: str, db) -> None:
    """``read_feed`` with ``to_state``: only the events that moved a task there come back,
    a page at a time, the cursor passes the others, and the partial index serves it."""
    states = ["waiting", "running", "succeeded", "dead", "waiting", "dead", "succeeded"]
    for task_id, state in enumerate(states, start=1):
        db.execute(
            "INSERT INTO core.task_events (task_id, seq, owner, op, to_state)"
            " VALUES (%s, 1, 'alice', 'submit', %s)",
            (task_id, state),
        )

    async def read() -> list[tuple[list[int], tuple[int, int]]]:
        engine = create_async_engine(db_url)
        pages, after = [], (0, 0)
        try:
            async with engine.connect() as conn:
                for _ in range(3):
                    events, after = await tasks_db.read_feed(conn, after, 1, None, TaskState.DEAD)
                    pages.append(([e.task_id for e in events], after))
        finally:
            await engine.dispose()
        return pages

    pages = asyncio.run(read())
    assert [ids for ids, _ in pages] == [[4], [6], []]
    last = db.execute("SELECT max(xid), max(id) FROM core.task_events").fetchone()
    assert last is not None and pages[-1][1] >= (last[0], last[1])
    sql = str(tasks_db.feed_statement(TaskState.DEAD)).replace(":limit", "1")
    sql = sql.replace(":xid", "0").replace(":id", "0")
    db.execute("SET enable_seqscan = off")
    plan = "\n".join(r[0] for r in db.execute("EXPLAIN " + sql).fetchall())
    assert "ix_task_events_dead" in plan
