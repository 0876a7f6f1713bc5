"""Concurrent single submissions are written together (``ops.groupcommit``): one
statement and one commit for those of a moment, each still answered for itself, and a
refusal of one never the others'."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import psycopg
from sqlalchemy.exc import IntegrityError

from libs.common.database import connect_args
from libs.common.errors import IdempotencyMismatch, Unavailable
from libs.common.models import TaskCreate
from libs.common.settings import CairnSettings, libpq_url
from services.core.db import tasks as tasks_db
from services.core.db.feed import WORK_CHANNEL, Notifier, Work
from services.core.ops.groupcommit import GroupCommit
from tests.support import Core, make_token, spec


def _largest_commit(db: Any) -> int:
    """The most tasks one transaction stored."""
    row = db.execute(
        "SELECT coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM core.tasks"
        " GROUP BY xmin::text) g"
    ).fetchone()
    return int(row[0])


async def _post_all(url: str, bodies: list[tuple[str, dict[str, Any]]]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        return await asyncio.gather(
            *(
                client.post("/v1/tasks", json=body, headers={"Authorization": f"Bearer {token}"})
                for token, body in bodies
            )
        )


def test_concurrent_submissions_each_get_their_own_answer(core: Core, db: Any) -> None:
    alice, bob = make_token(core.db_url, "alice", "user"), make_token(core.db_url, "bob", "user")
    good = [(alice, spec(name=f"good-{i}")) for i in range(30)]
    same = [(alice, spec(name="same", idempotency_key="k-same")) for _ in range(8)]
    bobs = [(bob, spec(name="same", idempotency_key="k-same")) for _ in range(2)]
    rival = [(alice, spec(name=f"rival-{i}", idempotency_key="k-rival")) for i in range(5)]
    bad = [(alice, spec(name=f"bad-{i}", priority=1000)) for i in range(5)]
    bodies = good + same + bobs + rival + bad
    answers = dict(zip(range(len(bodies)), asyncio.run(_post_all(core.url, bodies)), strict=True))

    def statuses(lo: int, hi: int) -> list[int]:
        return sorted(answers[i].status_code for i in range(lo, hi))

    assert statuses(0, 30) == [201] * 30
    assert statuses(30, 38) == [200] * 7 + [201]
    assert len({answers[i].json()["id"] for i in range(30, 38)}) == 1
    assert statuses(38, 40) == [200, 201]
    assert statuses(40, 45) == [201] + [409] * 4
    assert statuses(45, 50) == [422] * 5
    assert all(answers[i].json()["errors"][0]["field"] == "body.priority" for i in range(45, 50))
    # The database holds exactly the tasks answered 201, as answered, each with its event.
    stored = dict(db.execute("SELECT id, name FROM core.tasks").fetchall())
    created = {r.json()["id"]: r.json()["name"] for r in answers.values() if r.status_code == 201}
    assert stored == created
    assert len(stored) == 30 + 1 + 1 + 1
    events = db.execute("SELECT task_id, op, to_state FROM core.task_events").fetchall()
    assert sorted(events) == sorted((i, "submit", "waiting") for i in stored)
    assert _largest_commit(db) > 1  # they were written together


def _docs(owner: str, *bodies: dict[str, Any]) -> list[dict[str, Any]]:
    specs = [TaskCreate.model_validate(body) for body in bodies]
    return tasks_db.submission_docs(owner, specs)


async def _through_group(db_url: str, docs: list[dict[str, Any]]) -> list[Any]:
    group = GroupCommit(libpq_url(db_url), connect_args(CairnSettings(), db_url), 1.0)
    group.start()
    try:
        return await asyncio.gather(*(group.submit(doc) for doc in docs), return_exceptions=True)
    finally:
        await group.stop()


def test_one_statement_one_commit_for_what_waits_together(db_url: str, db: Any) -> None:
    docs = _docs("alice", *(spec(name=f"t{i}") for i in range(12)))
    outcomes = asyncio.run(_through_group(db_url, docs))
    assert [created for _, created in outcomes] == [True] * 12
    assert _largest_commit(db) == 12
    rows = db.execute("SELECT id, name FROM core.tasks ORDER BY id").fetchall()
    assert rows == [(row.id, f"t{i}") for i, (row, _) in enumerate(outcomes)]


def test_its_commit_tells_the_other_replicas_in_one_note(db_url: str) -> None:
    async def run() -> tuple[list[Any], set[int]]:
        notifier = Notifier(db_url)  # not started: the group commit sends, not it
        listener = await psycopg.AsyncConnection.connect(libpq_url(db_url), autocommit=True)
        await listener.execute(f"LISTEN {WORK_CHANNEL}")
        group = GroupCommit(libpq_url(db_url), connect_args(CairnSettings(), db_url), 1.0, notifier)
        group.start()
        docs = _docs("alice", *(spec(name=f"t{i}") for i in range(3)))
        await asyncio.gather(*(group.submit(doc, Work.of_queues(["q1"])) for doc in docs))
        telling = set(notifier._telling_pids)
        await group.stop()
        notes = []
        async for note in listener.notifies(timeout=1.0):
            notes.append((note.pid, Work.load(note.payload).queues))
        await listener.close()
        return notes, telling

    notes, telling = asyncio.run(run())
    assert len(telling) == 1
    assert notes == [(next(iter(telling)), {"q1": 3})]


def test_a_refused_submission_fails_alone(db_url: str, db: Any) -> None:
    [taken] = _docs("alice", spec(name="first", idempotency_key="k"))
    asyncio.run(_through_group(db_url, [taken]))
    docs = _docs(
        "alice",
        spec(name="a"),
        spec(name="other", idempotency_key="k"),  # the key, with a different request
        spec(name="b"),
        spec(name="again", idempotency_key="fresh"),
        spec(name="c"),
    )
    docs.insert(2, {**docs[0], "name": "broken", "max_attempts": 0})  # a CHECK refuses it
    outcomes = asyncio.run(_through_group(db_url, docs))
    assert isinstance(outcomes[1], IdempotencyMismatch)
    assert isinstance(outcomes[2], IntegrityError)
    assert "max_attempts_positive" in str(outcomes[2])
    stored = {name for (name,) in db.execute("SELECT name FROM core.tasks").fetchall()}
    assert stored == {"first", "a", "b", "again", "c"}
    assert [o[1] for i, o in enumerate(outcomes) if i not in (1, 2)] == [True] * 4


def test_a_lost_connection_fails_its_group_and_the_next_one_reconnects(
    db_url: str, db: Any
) -> None:
    async def run() -> tuple[Any, Any]:
        group = GroupCommit(libpq_url(db_url), connect_args(CairnSettings(), db_url), 1.0)
        group.start()
        try:
            [first] = _docs("alice", spec(name="before"))
            await group.submit(first)
            db.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            [second] = _docs("alice", spec(name="cut"))
            [third] = _docs("alice", spec(name="after"))
            cut = await asyncio.gather(group.submit(second), return_exceptions=True)
            return cut[0], await group.submit(third)
        finally:
            await group.stop()

    cut, after = asyncio.run(run())
    assert getattr(cut, "connection_invalidated", False)  # answered 503 by core
    assert after[1] is True
    names = {name for (name,) in db.execute("SELECT name FROM core.tasks").fetchall()}
    assert {"before", "after"} <= names and "cut" not in names


def test_a_submission_held_in_line_past_its_wait_is_refused_and_never_stored(
    db_url: str, db: Any
) -> None:
    """A write held up (here by a lock on the table): the one written waits for it, however
    long; one that waits in line behind it past ``wait_s`` is answered 503 and dropped
    from the line, before its client gives up: not stored later for nobody."""
    locker = psycopg.connect(libpq_url(db_url))
    locker.execute("LOCK TABLE core.tasks IN SHARE MODE")

    async def run() -> tuple[Any, Any, float]:
        group = GroupCommit(
            libpq_url(db_url), connect_args(CairnSettings(), db_url), 1.0, wait_s=0.5
        )
        group.start()
        try:
            [held] = _docs("alice", spec(name="held"))
            queued = _docs("alice", *(spec(name=f"queued-{i}") for i in range(20)))
            writing = asyncio.ensure_future(group.submit(held))
            await asyncio.sleep(0.2)  # the writer took it and waits on the lock
            began = asyncio.get_running_loop().time()
            refused = await asyncio.gather(
                *(group.submit(doc) for doc in queued), return_exceptions=True
            )
            took = asyncio.get_running_loop().time() - began
            await asyncio.sleep(0.5)  # the held write is past its wait_s too, still writing
            assert not writing.done()
            locker.rollback()
            return await writing, refused, took
        finally:
            await group.stop()

    try:
        written, refused, took = asyncio.run(run())
    finally:
        locker.close()
    assert written[1] is True
    assert all(isinstance(one, Unavailable) and one.status == 503 for one in refused), refused
    assert 0.4 < took < 4.0  # its wait, and well before a client's 5 s
    names = {name for (name,) in db.execute("SELECT name FROM core.tasks").fetchall()}
    assert names == {"held"}
