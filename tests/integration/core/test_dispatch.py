"""The dispatch API driven over real HTTP by a scripted worker (the agent comes later):
claims, fenced reports, retries, poison pills, heartbeats, the reaper, drain."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import Core, spec, start_core, wait_for

# The reaper tolerates stalls of 3 of its turns (timeout / 4 each): room for a loaded CI.
TIMEOUT_S = 2.0
pytestmark = pytest.mark.core(heartbeat_interval_s=0.2, heartbeat_timeout_s=TIMEOUT_S)


_OPEN: list[httpx.Client] = []


@pytest.fixture(autouse=True)
def _close_agents() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


class Agent:
    """A worker as core sees it: register, claim, beat, report."""

    def __init__(self, core: Core, name: str = "w1", cpu: float = 8, queues=("default",)):
        self.http = core.client(name, "worker")
        _OPEN.append(self.http)
        # Core places within the registered capacity: room for 256 default tasks per
        # CPU count below 256, so that claims test the room reported.
        memory = 16384 if cpu < 256 else cpu * 512
        offer = {
            "hostname": f"{name}.test",
            "queues": list(queues),
            "cpu": cpu,
            "memory_mb": memory,
        }
        answer = self.http.post("/v1/workers", json=offer)
        assert answer.status_code == 201, answer.text
        self.id = answer.json()["worker"]["id"]
        self.http.headers["X-Cairn-Worker-Lease"] = answer.json()["lease"]
        self.cpu = cpu

    def claim(self, most: int = 16, cpu: float | None = None, wait: float = 0) -> list[dict]:
        room = {
            "cpu": self.cpu if cpu is None else cpu,
            "memory_mb": 16384 if self.cpu < 256 else int(self.cpu * 512),
            "max": most,
            "wait": wait,
        }
        answer = self.http.post(f"/v1/workers/{self.id}/claim", json=room)
        assert answer.status_code == 200, answer.text
        return answer.json()["attempts"]

    def report(self, attempt: int, outcome: str = "succeeded", **extra) -> httpx.Response:
        return self.http.post(
            f"/v1/workers/{self.id}/attempts/{attempt}/report", json={"outcome": outcome, **extra}
        )

    def beat(self, alive: list[int], **extra) -> dict:
        body = {"attempts": alive, **extra}
        return self.http.post(f"/v1/workers/{self.id}/heartbeat", json=body).json()


def _claim_everything(agents: list[Agent], most: int) -> list[int]:
    """Every agent claims in its own thread until nothing is left; the task ids taken."""
    taken: list[int] = []
    lock = threading.Lock()

    def drain(agent: Agent) -> None:
        while batch := agent.claim(most=most):
            with lock:
                taken.extend(a["task_id"] for a in batch)

    threads = [threading.Thread(target=drain, args=(a,)) for a in agents]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return taken


def test_claim_takes_priority_then_age_and_a_report_finishes_the_task(core: Core, db) -> None:
    with core.client() as alice:
        low = alice.post("/v1/tasks", json=spec(priority=0)).json()
        high = alice.post("/v1/tasks", json=spec(priority=5, args=["x y"])).json()
    agent = Agent(core)
    first, second = agent.claim()
    assert [first["task_id"], second["task_id"]] == [high["id"], low["id"]]
    assert first["args"] == ["x y"] and first["attempt_number"] == 1
    done = agent.report(first["attempt_id"], exit_code=0, cpu_seconds=0.5, peak_memory_mb=12)
    assert done.json() == {"task_id": high["id"], "state": "succeeded"}
    row = db.execute(
        "SELECT outcome, exit_code, cpu_seconds, worker_id FROM core.attempts WHERE id = %s",
        (first["attempt_id"],),
    ).fetchone()
    assert row == ("succeeded", 0, 0.5, agent.id)
    with core.client() as alice:
        events = alice.get(f"/v1/tasks/{high['id']}/events").json()["items"]
    assert [(e["op"], e["attempt_id"]) for e in events] == [
        ("submit", None),
        ("claim", first["attempt_id"]),
        ("succeed", first["attempt_id"]),
    ]


def test_claims_fit_the_room_the_worker_reports(core: Core) -> None:
    with core.client() as alice:
        for _ in range(3):
            alice.post("/v1/tasks", json=spec(resources={"cpu": 1.5, "memory_mb": 100}))
    agent = Agent(core, cpu=5)
    assert len(agent.claim(cpu=2)) == 1
    assert len(agent.claim(cpu=1)) == 0
    assert len(agent.claim(cpu=3.5)) == 2


def test_claims_fit_what_core_has_placed_whatever_the_worker_reports(core: Core) -> None:
    with core.client() as alice:
        for _ in range(3):
            alice.post("/v1/tasks", json=spec(resources={"cpu": 1.5, "memory_mb": 100}))
    agent = Agent(core, cpu=2)
    assert len(agent.claim(cpu=2)) == 1
    # Core knows 1.5 of its 2 CPU are placed, whatever room the worker claims to have.
    assert len(agent.claim(cpu=8)) == 0


@pytest.fixture
def patient(db_url: str, tmp_path: Path) -> Iterator[Core]:
    """A core whose reaper gives the scripted workers (who never beat) a minute: claims
    are the subject here, not how fast a loaded machine makes them."""
    server = start_core(
        db_url, tmp_path / "patient", heartbeat_interval_s=20, heartbeat_timeout_s=60
    )
    yield server
    server.stop()


def test_two_workers_never_share_an_attempt(patient: Core, db) -> None:
    with patient.client() as alice:
        alice.post("/v1/tasks/batch", json={"tasks": [spec() for _ in range(200)]})
    taken = _claim_everything([Agent(patient, f"w{i}", cpu=256) for i in range(4)], most=7)
    assert len(taken) == len(set(taken)) == 200
    assert db.execute("SELECT count(*) FROM core.attempts").fetchone() == (200,)


def test_two_core_replicas_never_hand_out_one_attempt_twice(patient: Core, db, tmp_path) -> None:
    other = start_core(
        patient.db_url, tmp_path / "replica", heartbeat_interval_s=20, heartbeat_timeout_s=60
    )
    try:
        with patient.client() as alice:
            alice.post("/v1/tasks/batch", json={"tasks": [spec() for _ in range(150)]})
        agents = [
            Agent(c, f"w{i}", cpu=256) for i, c in enumerate((patient, other, patient, other))
        ]
        taken = _claim_everything(agents, most=5)
    finally:
        other.stop()
    assert len(taken) == len(set(taken)) == 150
    assert db.execute("SELECT count(DISTINCT task_id), count(*) FROM core.attempts").fetchone() == (
        150,
        150,
    )


def test_a_failure_is_retried_after_the_sidekiq_backoff_then_buried(core: Core, db) -> None:
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=spec(retry={"max_attempts": 2})).json()
    agent = Agent(core)
    [attempt] = agent.claim()
    assert (
        agent.report(attempt["attempt_id"], "failed", exit_code=3, error="exited 3").json()["state"]
        == "failed"
    )
    delay = db.execute(
        "SELECT EXTRACT(EPOCH FROM run_at - updated_at) FROM core.tasks WHERE id = %s",
        (task["id"],),
    ).fetchone()[0]
    assert 15 <= float(delay) <= 24  # 0**4 + 15 + rand(10) * 1
    db.execute("UPDATE core.tasks SET run_at = now() WHERE id = %s", (task["id"],))
    [again] = agent.claim(wait=5)
    assert again["attempt_number"] == 2
    final = agent.report(again["attempt_id"], "failed", exit_code=1).json()
    assert final["state"] == "dead"
    last_error = db.execute("SELECT last_error FROM core.tasks").fetchone()[0]
    assert last_error == "attempt failed"


def test_not_retryable_is_dead_at_once(core: Core) -> None:
    with core.client() as alice:
        alice.post("/v1/tasks", json=spec())
    agent = Agent(core)
    [attempt] = agent.claim()
    answer = agent.report(attempt["attempt_id"], "failed", retryable=False, error="sha256 mismatch")
    assert answer.json()["state"] == "dead"


def test_a_stale_attempts_late_report_is_refused_and_changes_nothing(core: Core, db) -> None:
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=spec()).json()
    cut_off = Agent(core, "w1")
    [old] = cut_off.claim()
    cut_off.beat([old["attempt_id"]])  # seen running, then cut off
    # The worker is cut off: no heartbeat; the reaper declares it dead.
    wait_for(lambda: db.execute("SELECT state FROM core.tasks").fetchone()[0] == "failed", 30)
    db.execute("UPDATE core.tasks SET run_at = now() WHERE id = %s", (task["id"],))
    healthy = Agent(core, "w2")
    [new] = healthy.claim(wait=5)
    late = cut_off.report(old["attempt_id"], "succeeded", exit_code=0)
    assert late.status_code == 409
    assert late.json()["type"].endswith("/stale-attempt")
    # The refusal says how core ended it, so the worker's log tells which path did.
    ended = (
        f"attempt {old['attempt_id']} is not task {task['id']}'s current attempt: it already"
        " ended (lost: its worker"
    )
    assert late.json()["detail"].startswith(ended), late.json()
    assert db.execute("SELECT state, current_attempt_id FROM core.tasks").fetchone() == (
        "running",
        new["attempt_id"],
    )
    assert healthy.report(new["attempt_id"], "succeeded").json()["state"] == "succeeded"
    outcomes = db.execute("SELECT outcome FROM core.attempts ORDER BY id").fetchall()
    assert outcomes == [("lost",), ("succeeded",)]


def test_lost_three_times_is_a_poison_pill(core: Core, db) -> None:
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=spec(retry={"max_attempts": 10})).json()
    agent = Agent(core)
    for _ in range(3):
        db.execute("UPDATE core.tasks SET run_at = now() WHERE id = %s", (task["id"],))
        [attempt] = agent.claim(wait=5)
        assert agent.beat([attempt["attempt_id"]])["stop"] == []  # seen running
        db.execute("UPDATE core.attempts SET started_at = now() - interval '1 min'")
        assert agent.beat([])["state"] == "live"  # the process is not among the living
    state, error = db.execute("SELECT state, last_error FROM core.tasks").fetchone()
    assert state == "dead"
    with core.client() as alice:
        events = alice.get(f"/v1/tasks/{task['id']}/events").json()["items"]
    assert events[-1]["reason"] == "poison pill: lost 3 times within 72 h"
    assert "heartbeat" in error


def test_a_lease_no_heartbeat_ever_showed_goes_back_without_cost(core: Core, db) -> None:
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=spec()).json()
    agent = Agent(core)
    agent.claim()  # as if this answer never reached the worker
    db.execute("UPDATE core.attempts SET started_at = now() - interval '1 min'")
    agent.beat([])
    row = db.execute(
        "SELECT state, attempts, crashes FROM core.tasks WHERE id = %s", (task["id"],)
    ).fetchone()
    assert row == ("waiting", 0, 0)
    assert db.execute("SELECT outcome FROM core.attempts").fetchall() == [("lost",)]


def test_a_beat_judges_only_the_attempts_its_agent_had_been_handed(core: Core, db) -> None:
    """A beat's list read before a lease reached the agent, heard after the lease's
    grace (held at core through a failover, in CI): that lease is not missing from it.
    It was lost, went again, and the task ran twice."""
    with core.client() as alice:
        alice.post("/v1/tasks", json=spec())
        alice.post("/v1/tasks", json=spec())
    agent = Agent(core)
    [first] = agent.claim(most=1)
    [second] = agent.claim(most=1)
    ids = first["attempt_id"], second["attempt_id"]
    db.execute("UPDATE core.attempts SET started_at = now() - interval '1 min'")
    # The board as the agent wrote it before the second lease's answer came.
    answer = agent.beat([ids[0]], seen=ids[0])
    assert answer["state"] == "live" and answer["stop"] == []
    opened = db.execute("SELECT id FROM core.attempts WHERE outcome IS NULL ORDER BY id")
    assert [row[0] for row in opened.fetchall()] == sorted(ids)
    # Once the agent had been handed it, a beat without it says its process is gone.
    agent.beat([ids[0]], seen=ids[1])
    outcomes = db.execute("SELECT id, outcome FROM core.attempts ORDER BY id").fetchall()
    assert outcomes == [(ids[0], None), (ids[1], "lost")]


def test_cancelling_a_running_task_tells_its_worker_to_stop(core: Core, db) -> None:
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=spec()).json()
        agent = Agent(core)
        [attempt] = agent.claim()
        assert agent.beat([attempt["attempt_id"]])["stop"] == []
        alice.post(f"/v1/tasks/{task['id']}/cancel")
    assert agent.beat([attempt["attempt_id"]])["stop"] == [attempt["attempt_id"]]
    late = agent.report(attempt["attempt_id"], "failed")
    assert late.status_code == 409 and "already ended (cancelled" in late.json()["detail"]
    assert db.execute("SELECT outcome FROM core.attempts").fetchone() == ("cancelled",)


def test_drained_workers_get_no_work_and_hand_back_without_spending(core: Core, db) -> None:
    with core.client() as alice:
        alice.post("/v1/tasks", json=spec())
        alice.post("/v1/tasks", json=spec())
    agent = Agent(core)
    [attempt] = agent.claim(most=1)
    with core.client("root", "admin") as admin:
        assert admin.post(f"/v1/workers/{agent.id}/drain").json()["state"] == "draining"
        workers = admin.get("/v1/workers").json()["items"]
    assert workers[0]["running"] == 1 and workers[0]["used_cpu"] == 1.0
    assert agent.claim() == []
    back = agent.report(attempt["attempt_id"], "handed_back", error="drained")
    assert back.json()["state"] == "waiting"
    assert db.execute(
        "SELECT attempts FROM core.tasks WHERE id = %s", (attempt["task_id"],)
    ).fetchone() == (0,)


def test_a_worker_is_reached_only_by_its_own_principal(core: Core) -> None:
    mine = Agent(core, "w1")
    with core.client("w2", "worker") as other, core.client("bob") as user:
        assert (
            other.post(f"/v1/workers/{mine.id}/claim", json={"cpu": 1, "memory_mb": 1}).status_code
            == 404
        )
        assert (
            user.post(
                "/v1/workers", json={"hostname": "h", "queues": ["q"], "cpu": 1, "memory_mb": 1}
            ).status_code
            == 403
        )


def test_a_replica_cannot_act_for_another_with_the_same_token(core: Core) -> None:
    """Two replicas share one worker token (the compose default): each holds only its own
    worker's lease secret, and the other's worker answers 404 as a missing one."""
    replica_a, replica_b = Agent(core, "replicas"), Agent(core, "replicas")
    with core.client() as alice:
        alice.post("/v1/tasks", json=spec()).raise_for_status()
    [attempt] = replica_b.claim()
    path = f"/v1/workers/{replica_b.id}"
    report = {"outcome": "succeeded", "exit_code": 0}
    aid = attempt["attempt_id"]
    for call in (
        lambda: replica_a.http.post(f"{path}/attempts/{aid}/report", json=report),
        lambda: replica_a.http.post(f"{path}/heartbeat", json={"attempts": []}),
        lambda: replica_a.http.post(f"{path}/claim", json={"cpu": 1, "memory_mb": 1}),
        lambda: replica_a.http.post(
            f"{path}/logs",
            json={"chunks": [{"attempt_id": aid, "offset": 0, "length": 6, "text": "forged"}]},
        ),
        lambda: replica_a.http.post(f"{path}/leave"),
    ):
        answer = call()
        assert answer.status_code == 404, answer.text
        assert answer.json()["detail"] == f"worker {replica_b.id} not found"
    unleased = replica_a.http.post(
        f"{path}/heartbeat", json={"attempts": []}, headers={"X-Cairn-Worker-Lease": ""}
    )
    assert unleased.status_code == 404
    assert replica_b.report(aid).status_code == 200


def test_a_worker_that_left_cannot_be_drained_back_to_life(core: Core) -> None:
    agent = Agent(core)
    assert agent.http.post(f"/v1/workers/{agent.id}/leave").json()["state"] == "left"
    with core.client("root", "admin") as admin:
        answer = admin.post(f"/v1/workers/{agent.id}/drain")
    assert answer.status_code == 409
    assert agent.claim() == []


def test_a_heartbeat_says_nothing_of_other_workers_attempts(core: Core) -> None:
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=spec()).json()
        mine, other = Agent(core, "w1"), Agent(core, "w2")
        [attempt] = mine.claim()
        alice.post(f"/v1/tasks/{task['id']}/cancel")
    assert other.beat([attempt["attempt_id"]])["stop"] == []
    assert mine.beat([attempt["attempt_id"]])["stop"] == [attempt["attempt_id"]]
