"""Placement with real worker agents: overcommit, preemption, squeeze and deferral, and
what the database and the events say afterwards."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from tests.support import Core, shared_dir, shell_spec, start_core, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def core(db_url: str, tmp_path: Path) -> Iterator[Core]:
    server = start_core(
        db_url,
        tmp_path / "core",
        heartbeat_interval_s=0.2,
        heartbeat_timeout_s=3.0,
        placement_interval_s=0.1,
        preempt_after_s=0.3,
        preempt_grace_s=1.0,
    )
    yield server
    server.stop()


def shell(script: str, cpu: float, memory_mb: int, **extra: object) -> dict:
    retry = {"max_attempts": 3, "base_s": 0.1, "jitter": False}
    resources = {"cpu": cpu, "memory_mb": memory_mb}
    return shell_spec(script, resources=resources, retry=retry, **extra)


def _task(client: httpx.Client, task_id: int) -> dict:
    return client.get(f"/v1/tasks/{task_id}").json()


def _events(client: httpx.Client, task_id: int) -> list[tuple[str, str | None]]:
    items = client.get(f"/v1/tasks/{task_id}/events").json()["items"]
    return [(e["op"], e["reason"]) for e in items]


def _running(db) -> int:
    return db.execute("SELECT count(*) FROM core.tasks WHERE state = 'running'").fetchone()[0]


def test_a_guaranteed_task_preempts_a_preemptible_one_and_both_end(core, workers, tmp_path, db):
    workers.start(core, tmp_path / "w", "w", cpu=2, memory_mb=1000)
    flag = shared_dir() / "preempted-once"
    with core.client() as alice:
        backup = alice.post(
            "/v1/tasks",
            json=shell(
                f"[ -e {flag} ] && exit 0; touch {flag}; sleep 60",
                1,
                800,
                name="night-backup",
                preemptible=True,
            ),
        ).json()
        wait_for(lambda: _task(alice, backup["id"])["state"] == "running", timeout=30)
        service = alice.post("/v1/tasks", json=shell("exit 0", 1, 800, name="urgent")).json()
        wait_for(lambda: _task(alice, service["id"])["state"] == "succeeded", timeout=30)
        wait_for(lambda: _task(alice, backup["id"])["state"] == "succeeded", timeout=30)
        final = _task(alice, backup["id"])
        attempts = alice.get(f"/v1/tasks/{backup['id']}/attempts").json()["items"]
        events = _events(alice, backup["id"])
    assert [a["outcome"] for a in attempts] == ["preempted", "succeeded"]
    assert attempts[0]["preempted_by"] == service["id"]
    # The preempted attempt did not spend one: the task used one attempt of three.
    assert final["attempts"] == 1
    assert ("preempt", f"preempted by task {service['id']}, requeued") in events


def test_an_overcommitted_pool_runs_more_preemptible_work_than_declared(
    core, workers, tmp_path, db
):
    go = shared_dir() / "go"
    with core.client("root", "admin") as admin:
        pool = admin.patch("/v1/queues/default", json={"overcommit": 2}).json()
    assert pool["overcommit"] == 2
    workers.start(core, tmp_path / "w", "w", cpu=2, memory_mb=1000)
    script = f"while [ ! -e {go} ]; do sleep 0.05; done"
    with core.client() as alice:
        ids = [
            alice.post("/v1/tasks", json=shell(script, 1, 500, preemptible=True)).json()["id"]
            for _ in range(6)
        ]
        # Declared, two fit (2 CPU, 1000 MB); charged at half (no history yet), four do.
        wait_for(lambda: _running(db) == 4, timeout=30)
        time.sleep(1.0)  # a bound, not a speed: no fifth is placed while the four run
        assert _running(db) == 4
        go.touch()
        wait_for(lambda: all(_task(alice, i)["state"] == "succeeded" for i in ids), timeout=30)
    charged = db.execute(
        "SELECT charge_cpu, charge_memory_mb FROM core.attempts ORDER BY id LIMIT 4"
    ).fetchall()
    assert charged == [(0.5, 250.0)] * 4


def _nice(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[16])


def test_a_squeeze_lowers_the_cpu_share_and_is_in_the_events(core, workers, tmp_path, db):
    workers.start(core, tmp_path / "w", "w", cpu=2, memory_mb=4000)
    pidfile = shared_dir() / "pid"
    with core.client() as alice:
        batch = alice.post(
            "/v1/tasks",
            json=shell(f"echo $$ > {pidfile}; exec sleep 60", 2, 100, preemptible=True),
        ).json()
        wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=30)
        pid = int(pidfile.read_text())
        assert _nice(pid) == 0
        urgent = alice.post("/v1/tasks", json=shell("exit 0", 1, 100, name="urgent")).json()
        # CPU alone is short: the preemptible attempt is squeezed, not preempted.
        wait_for(lambda: _task(alice, urgent["id"])["state"] == "succeeded", timeout=30)
        wait_for(lambda: _nice(pid) == 19, timeout=10)
        events = _events(alice, batch["id"])
        still = _task(alice, batch["id"])["state"]
        alice.post(f"/v1/tasks/{batch['id']}/cancel")
    assert still == "running"
    reason = f"squeezed: CPU share lowered to make room for guaranteed task {urgent['id']}"
    assert ("squeeze", reason) in events
    assert db.execute(
        "SELECT count(*) FROM core.attempts WHERE outcome = 'preempted'"
    ).fetchone() == (0,)


def test_time_insensitive_work_is_deferred_while_the_pool_is_busy(core, workers, tmp_path, db):
    with core.client("root", "admin") as admin:
        admin.patch("/v1/queues/default", json={"defer_above": 0.5})
        workers.start(core, tmp_path / "w", "w", cpu=2, memory_mb=1000)
        with core.client() as alice:
            busy = alice.post("/v1/tasks", json=shell("sleep 60", 1.5, 100)).json()

            def hot() -> bool:
                queues = admin.get("/v1/queues").json()["items"]
                return any(q["name"] == "default" and (q["utilisation"] or 0) > 0.7 for q in queues)

            wait_for(hot, timeout=30)
            report = alice.post("/v1/tasks", json=shell("exit 0", 0.25, 100, defer_ok=True)).json()
            deadline = (datetime.now(UTC) + timedelta(seconds=4)).isoformat()
            due = alice.post(
                "/v1/tasks", json=shell("exit 0", 0.25, 100, deadline=deadline, timeout_s=2)
            ).json()
            wait_for(lambda: _task(alice, report["id"])["state"] == "ready", timeout=10)
            reason = _task(alice, report["id"])["pending_reason"]
            # The one with a deadline runs anyway at its latest start (deadline - timeout).
            wait_for(lambda: _task(alice, due["id"])["state"] == "succeeded", timeout=20)
            assert _task(alice, busy["id"])["state"] == "running"
            assert _task(alice, report["id"])["state"] == "ready"
            alice.post(f"/v1/tasks/{busy['id']}/cancel")
            wait_for(lambda: _task(alice, report["id"])["state"] == "succeeded", timeout=20)
            report_events = _events(alice, report["id"])
            due_events = _events(alice, due["id"])
    assert reason.startswith("deferred: pool at 75% (defers above 50%); runs by ")
    assert ("defer", "deferred: pool at 75% (defers above 50%)") in report_events
    assert ("promote", "pool at 0%: no longer deferred") in report_events
    assert ("defer", "deferred: pool at 75% (defers above 50%)") in due_events
    assert ("promote", "latest start reached: runs although its pool is busy") in due_events


# An AF_UNIX socket some earlier code of this test process left unclosed can be collected
# here and fail the test as unraisable; that leak is not this test's subject.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_under_memory_pressure_the_agent_preempts_preemptible_work_only(
    core, workers, tmp_path, db
):
    """A threshold above the host's memory is constant pressure: the agent preempts the
    preemptible attempt (the event says why) and leaves guaranteed work alone."""
    workers.start(
        core, tmp_path / "w", "w", cpu=2, memory_mb=4000, CAIRN_WORKER_MIN_AVAILABLE_MB=str(10**9)
    )
    flag = shared_dir() / "preempted-once"
    with core.client() as alice:
        backup = alice.post(
            "/v1/tasks",
            json=shell(
                f"[ -e {flag} ] && exit 0; touch {flag}; sleep 60",
                0.5,
                100,
                name="night-backup",
                preemptible=True,
            ),
        ).json()
        guaranteed = alice.post("/v1/tasks", json=shell("sleep 2", 0.5, 100)).json()
        wait_for(lambda: _task(alice, guaranteed["id"])["state"] == "succeeded", timeout=60)
        wait_for(lambda: _task(alice, backup["id"])["state"] == "succeeded", timeout=60)
        attempts = alice.get(f"/v1/tasks/{backup['id']}/attempts").json()["items"]
        events = _events(alice, backup["id"])
        kept = alice.get(f"/v1/tasks/{guaranteed['id']}/attempts").json()["items"]
    assert attempts[0]["outcome"] == "preempted"
    assert [a["outcome"] for a in kept] == ["succeeded"]
    [(_, reason)] = [e for e in events if e[0] == "preempt"]
    assert reason.startswith("preempted by its worker: memory pressure: ")
    assert _task_row(db, backup["id"]) == 1  # the preempted attempt spent none


def _task_row(db, task_id: int) -> int:
    return db.execute("SELECT attempts FROM core.tasks WHERE id = %s", (task_id,)).fetchone()[0]
