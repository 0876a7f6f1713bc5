"""A worker's liveness times as its agent's turns leave them: an idle turn of a fresh
worker writes nothing (its row keeps its version), a stale one is rewritten; the reaper
buries a worker whose agent took no turn for the hang bound while its sidecar beats, one
whose sidecar says its agent hung, and one silent altogether."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.support import REAPER_AWAY, Core, register_worker, spec, start_core, wait_for

# The tests drive the workers' turns and reap by hand.
pytestmark = REAPER_AWAY

DB = psycopg.Connection[tuple[Any, ...]]
OFFER = {
    "hostname": "w.test", "queues": ["default"], "cpu": 8, "memory_mb": 16384, "hang_watch": True,
}  # fmt: skip
ROOM = {"cpu": 8, "memory_mb": 16384, "max": 1}


@pytest.fixture
def worker(core: Core) -> Iterator[tuple[httpx.Client, int]]:
    with core.client("w", "worker") as http:
        yield http, register_worker(http, OFFER)


def _row(db: DB, worker: int) -> tuple[Any, ...]:
    row = db.execute(
        "SELECT xmin::text, last_turn_at, last_heartbeat_at, state FROM core.workers WHERE id = %s",
        (worker,),
    ).fetchone()
    assert row is not None
    return row


def _turn(http: httpx.Client, worker: int, **body: Any) -> dict[str, Any]:
    answer = http.post(f"/v1/workers/{worker}/turn", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_an_idle_turn_of_a_fresh_worker_leaves_its_row_unwritten(
    worker: tuple[httpx.Client, int], db: DB
) -> None:
    http, worker_id = worker
    before = _row(db, worker_id)
    db.autocommit = True
    first = _next_xid(db)
    for _ in range(TURNS):
        assert _turn(http, worker_id, claim=ROOM) == {
            "state": "live",
            "reports": [],
            "attempts": [],
            "waited": False,
        }
    # The same row version: no UPDATE ran. And the turns took no transaction ids (each
    # wrote before, one apiece); core's own loops take one now and then.
    assert _row(db, worker_id) == before
    assert _next_xid(db) - first - 1 < TURNS / 2


TURNS = 40


def _next_xid(db: DB) -> int:
    """A new transaction id (this takes one)."""
    row = db.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()
    assert row is not None
    return int(row[0])


def test_a_turn_rewrites_a_worker_whose_times_are_stale(
    worker: tuple[httpx.Client, int], db: DB
) -> None:
    http, worker_id = worker
    # Default bounds: 3600 s heartbeat timeout, 300 s hang: fresh for 75 s.
    for column in ("last_turn_at", "last_heartbeat_at"):
        db.execute(
            f"UPDATE core.workers SET {column} = now() - interval '80 seconds' WHERE id = %s",
            (worker_id,),
        )
        stale = _row(db, worker_id)
        _turn(http, worker_id, claim=ROOM)
        after = _row(db, worker_id)
        assert after[0] != stale[0]
        age = db.execute(
            "SELECT now() - last_turn_at < interval '10 seconds',"
            " now() - last_heartbeat_at < interval '10 seconds' FROM core.workers WHERE id = %s",
            (worker_id,),
        ).fetchone()
        assert age == (True, True), column


def _leased(core: Core, http: httpx.Client, worker: int) -> tuple[int, int]:
    """A task with an attempt leased to the worker and seen running: (task, attempt)."""
    with core.client("alice") as alice:
        task = alice.post("/v1/tasks", json=spec(retry={"max_attempts": 3})).json()["id"]
    [attempt] = _turn(http, worker, claim=ROOM)["attempts"]
    beat = http.post(f"/v1/workers/{worker}/heartbeat", json={"attempts": [attempt["attempt_id"]]})
    beat.raise_for_status()
    return task, attempt["attempt_id"]


def _loss(db: DB, attempt: int) -> tuple[Any, ...]:
    row = db.execute(
        "SELECT a.outcome, a.error, t.state, t.crashes FROM core.attempts a"
        " JOIN core.tasks t ON t.id = a.task_id WHERE a.id = %s",
        (attempt,),
    ).fetchone()
    assert row is not None
    return row


def test_a_sidecars_word_that_its_agent_hung_buries_the_worker_at_once(
    core: Core, worker: tuple[httpx.Client, int], db: DB
) -> None:
    http, worker_id = worker
    _, attempt = _leased(core, http, worker_id)
    beat = http.post(f"/v1/workers/{worker_id}/heartbeat", json={"attempts": [], "hung_s": 151.5})
    assert beat.status_code == 200, beat.text
    assert beat.json()["state"] == "dead"
    outcome, error, state, crashes = _loss(db, attempt)
    assert (outcome, state, crashes) == ("lost", "failed", 1)
    assert error == f"its worker {worker_id}'s agent hung (its loop stood still 151.5 s)"
    assert _row(db, worker_id)[3] == "dead"
    assert _turn(http, worker_id, claim=ROOM)["state"] == "dead"


@pytest.mark.parametrize("hung_s", [-1, 1e10, "soon"])
def test_a_hung_beat_out_of_range_is_refused_naming_the_field(
    worker: tuple[httpx.Client, int], db: DB, hung_s: Any
) -> None:
    http, worker_id = worker
    beat = http.post(f"/v1/workers/{worker_id}/heartbeat", json={"hung_s": hung_s})
    assert beat.status_code == 422
    assert "hung_s" in beat.text
    assert _row(db, worker_id)[3] == "live"


def test_core_buries_a_worker_whose_agent_takes_no_turn_while_its_sidecar_beats(
    db_url: str, tmp_path: Path, db: DB
) -> None:
    core = start_core(
        db_url, tmp_path, heartbeat_interval_s=0.2, heartbeat_timeout_s=30.0,
        agent_hang_timeout_s=2.0,
    )  # fmt: skip
    stop = threading.Event()
    try:
        # The worker's last turn comes after core's reaper began to hear (it begins when
        # the replica leads): a turn from before is a silence core may have caused, and
        # its loss would be excused, at no cost ('waiting', 0; docs/faults.md).
        wait_for(lambda: db.execute("SELECT count(*) FROM core.leader").fetchone() == (1,))
        time.sleep(0.5)
        with core.client("w", "worker") as http, core.client("old", "worker") as old_http:
            worker_id = register_worker(http, OFFER)
            _, attempt = _leased(core, http, worker_id)
            # An agent from before keep-alive turns: only its heartbeats count.
            unwatched = register_worker(old_http, {**OFFER, "hang_watch": False})
            _turn(old_http, unwatched, claim=ROOM)

            def sidecars() -> None:
                while not stop.wait(0.2):
                    body = {"attempts": [attempt]}
                    http.post(f"/v1/workers/{worker_id}/heartbeat", json=body, timeout=5)
                    old_http.post(f"/v1/workers/{unwatched}/heartbeat", json={}, timeout=5)

            beating = threading.Thread(target=sidecars, daemon=True)
            beating.start()
            wait_for(lambda: _row(db, worker_id)[3] == "dead", timeout=15)
            stop.set()
            beating.join(10)
        heard = db.execute(
            "SELECT now() - last_heartbeat_at < interval '2 seconds',"
            " now() - last_turn_at >= interval '2 seconds' FROM core.workers WHERE id = %s",
            (worker_id,),
        ).fetchone()
        assert heard == (True, True)  # beating to the end; no turn for the bound
        outcome, error, state, crashes = _loss(db, attempt)
        assert (outcome, state, crashes) == ("lost", "failed", 1), error
        assert error == f"its worker {worker_id}'s agent took no turn for 2 s (hung)"
        _, last_turn, _, old_state = _row(db, unwatched)
        assert (last_turn, old_state) == (None, "live")
    finally:
        stop.set()
        core.stop()


def test_the_reaper_still_buries_a_worker_whose_turns_wrote_nothing(
    db_url: str, tmp_path: Path, db: DB
) -> None:
    # Fresh for a quarter of the 2 s timeout: idle turns every 0.1 s mostly read.
    core = start_core(db_url, tmp_path, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0)
    try:
        with core.client("w", "worker") as http:
            worker_id = register_worker(http, OFFER)
            versions = set()
            for _ in range(10):
                _turn(http, worker_id, claim=ROOM)
                versions.add(_row(db, worker_id)[0])
            assert len(versions) < 10
            # Then silence: no turn, no beat.
            wait_for(lambda: _row(db, worker_id)[3] == "dead", timeout=15)
    finally:
        core.stop()


def test_a_turn_with_a_report_locks_the_worker_row_however_fresh(
    core: Core, worker: tuple[httpx.Client, int], db: DB
) -> None:
    # A fresh row, but the turn closes an attempt: it locks the worker row first (as a
    # heartbeat's update does), so its lease never waits on a beat that waits on that
    # attempt; being fresh, the row is not rewritten (the same version, locked: its xmax
    # is the turn's transaction).
    http, worker_id = worker
    _, attempt = _leased(core, http, worker_id)
    fresh = _row(db, worker_id)
    locker = _locker(db, worker_id)
    report = {"attempt_id": attempt, "outcome": "succeeded", "exit_code": 0}
    assert [v["status"] for v in _turn(http, worker_id, reports=[report])["reports"]] == [200]
    assert _row(db, worker_id) == fresh
    assert _locker(db, worker_id) not in (0, locker)


def _locker(db: DB, worker: int) -> int:
    """The transaction that last locked or deleted the worker's row version (0: none)."""
    row = db.execute(
        "SELECT xmax::text::bigint FROM core.workers WHERE id = %s", (worker,)
    ).fetchone()
    assert row is not None
    return int(row[0])


# --- a lost answer: the next turn says what the worker holds (``Turn.holding``) ---------


def _fence(core: Core, token: str) -> int:
    return httpx.post(f"{core.url}/v1/fencing", json={"token": token}, timeout=10).status_code


def test_a_lease_whose_answer_was_lost_is_handed_out_again_as_the_same_attempt(
    core: Core, worker: tuple[httpx.Client, int], db: DB
) -> None:
    http, worker_id = worker
    with core.client("alice") as alice:
        task = alice.post("/v1/tasks", json=spec(retry={"max_attempts": 1})).json()["id"]
    # Core committed this lease; the worker never saw the answer.
    [lost] = _turn(http, worker_id, claim=ROOM)["attempts"]
    # Its next turn says it holds nothing: the same attempt comes again, with a new
    # fencing token (the first went out only in the lost answer, and no longer fences).
    [again] = _turn(http, worker_id, holding=[])["attempts"]
    assert (again["attempt_id"], again["task_id"]) == (lost["attempt_id"], task)
    assert again["fencing_token"] != lost["fencing_token"]
    assert {k: v for k, v in again.items() if k != "fencing_token"} == {
        k: v for k, v in lost.items() if k != "fencing_token"
    }
    assert _fence(core, again["fencing_token"]) == 200
    assert _fence(core, lost["fencing_token"]) != 200
    # Held now: not again; nor once started.
    assert _turn(http, worker_id, holding=[again["attempt_id"]])["attempts"] == []
    assert _turn(http, worker_id, started=[again["attempt_id"]])["attempts"] == []
    assert _turn(http, worker_id, holding=[])["attempts"] == []
    report = {"attempt_id": again["attempt_id"], "outcome": "succeeded", "exit_code": 0}
    assert [v["status"] for v in _turn(http, worker_id, reports=[report])["reports"]] == [200]
    rows = db.execute(
        "SELECT t.state, count(a.id) FROM core.tasks t JOIN core.attempts a ON a.task_id = t.id"
        " WHERE t.id = %s GROUP BY t.state",
        (task,),
    ).fetchall()
    assert rows == [("succeeded", 1)]  # one attempt: the lost answer cost none


def test_a_turn_that_holds_its_leases_gets_nothing_again_and_may_claim_more(
    core: Core, worker: tuple[httpx.Client, int]
) -> None:
    http, worker_id = worker
    with core.client("alice") as alice:
        for _ in range(3):
            alice.post("/v1/tasks", json=spec()).raise_for_status()
    [first] = _turn(http, worker_id, claim=ROOM)["attempts"]
    [lost] = _turn(http, worker_id, claim=ROOM)["attempts"]
    # It holds the first; the second's answer was lost. Its claim still fits only what
    # the worker has room for beside both (core counts the lost one as placed there).
    answer = _turn(http, worker_id, holding=[first["attempt_id"]], claim={**ROOM, "max": 1})
    ids = [a["attempt_id"] for a in answer["attempts"]]
    assert ids[0] == lost["attempt_id"] and len(ids) == 2 and first["attempt_id"] not in ids
    assert http.post(f"/v1/workers/{worker_id}/turn", json={"holding": [0]}).status_code == 422
