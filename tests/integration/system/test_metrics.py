"""``/metrics`` of core, cron and dag, scraped over real HTTP while a task, a schedule's
fire and a workflow run go through, and parsed with prometheus-client's own parser."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from libs.common.placement import SQUEEZED_CPU_SHARE
from tests.fixtures.cron import EPOCH, Cron, FakeClock, start_cron
from tests.fixtures.dag import DagServer, Runner, Worker, node, start_dag, workflow
from tests.support import Core, spec, wait_for


def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every sample of ``url``/metrics, by name then by sorted labels."""
    answer = httpx.get(url + "/metrics", timeout=10)
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain")
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            samples.setdefault(sample.name, {})[labels] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get(name, {}).get(tuple(sorted(labels.items())), 0.0)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(EPOCH)


@pytest.fixture
def cron(core: Core, tmp_path: Path, clock: FakeClock) -> Iterator[Cron]:
    server = start_cron(core, tmp_path / "cron", clock)
    yield server
    server.stop()


@pytest.fixture
def dag(core: Core, tmp_path: Path) -> Iterator[DagServer]:
    server = start_dag(core, tmp_path / "dag")
    yield server
    server.stop()


def test_core_counts_tasks_and_reads_queues_and_workers(core: Core) -> None:
    with core.client() as alice:
        held = alice.post("/v1/tasks", json=spec(queue="slow")).json()
        quick = alice.post("/v1/tasks", json=spec(idempotency_key="k")).json()
        alice.post("/v1/tasks", json=spec(idempotency_key="k")).raise_for_status()
        before = scrape(core.url)
        assert value(before, "cairn_tasks_submitted_total", queue="default") == 1
        assert value(before, "cairn_tasks_submitted_total", queue="slow") == 1
        assert value(before, "cairn_queue_depth", queue="slow", state="waiting") == 1
        assert value(before, "cairn_queue_oldest_waiting_seconds", queue="slow") >= 0
        assert value(before, "cairn_metrics_database_up") == 1

        worker = Worker(core)
        try:
            wait_for(lambda: alice.get(f"/v1/tasks/{quick['id']}").json()["state"] == "succeeded")
            during = scrape(core.url)
            assert value(during, "cairn_workers_alive", pool="default") == 1
            assert value(during, "cairn_workers_cpu", pool="default") == 4096
            assert value(during, "cairn_workers_heartbeat_age_seconds", pool="default") >= 0
            assert value(during, "cairn_queue_workers_live", queue="default") == 1
            assert value(during, "cairn_queue_workers_live", queue="slow") == 0
            alice.post(f"/v1/tasks/{held['id']}/cancel").raise_for_status()
        finally:
            worker.stop()
    after = scrape(core.url)
    assert value(after, "cairn_attempts_started_total") == 1
    assert value(after, "cairn_dispatch_latency_seconds_count") == 1
    assert value(after, "cairn_attempts_finished_total", outcome="succeeded") == 1
    assert value(after, "cairn_tasks_finished_total", state="succeeded") == 1
    assert value(after, "cairn_tasks_finished_total", state="cancelled") == 1
    assert value(after, "cairn_attempts_lost_total") == 0
    assert value(after, "cairn_tasks_poison_pills_total") == 0


def test_a_poison_pill_and_its_lost_attempts_are_counted(core: Core, db) -> None:
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=spec(retry={"poison_after": 1})).json()
    agent = core.client("agent", "worker")
    offer = {"hostname": "h", "queues": ["default"], "cpu": 4, "memory_mb": 4096}
    registered = agent.post("/v1/workers", json=offer).json()
    worker_id = registered["worker"]["id"]
    agent.headers["X-Cairn-Worker-Lease"] = registered["lease"]
    [attempt] = agent.post(
        f"/v1/workers/{worker_id}/claim", json={"cpu": 4, "memory_mb": 4096}
    ).json()["attempts"]
    db.execute("UPDATE core.attempts SET seen_at = now() WHERE id = %s", (attempt["attempt_id"],))
    agent.post(f"/v1/workers/{worker_id}/leave").raise_for_status()
    agent.close()
    samples = scrape(core.url)
    assert value(samples, "cairn_attempts_lost_total") == 1
    assert value(samples, "cairn_attempts_finished_total", outcome="lost") == 1
    assert value(samples, "cairn_tasks_poison_pills_total") == 1
    assert value(samples, "cairn_tasks_finished_total", state="dead") == 1
    assert db.execute("SELECT state FROM core.tasks WHERE id = %s", (task["id"],)).fetchone() == (
        "dead",
    )


def test_a_task_never_started_by_its_start_by_is_counted_expired_and_dead(core: Core, db) -> None:
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=spec(queue="nobody", max_wait_s=1)).json()
        wait_for(lambda: alice.get(f"/v1/tasks/{task['id']}").json()["state"] == "dead")
    samples = scrape(core.url)
    assert value(samples, "cairn_tasks_expired_total") == 1
    assert value(samples, "cairn_tasks_finished_total", state="dead") == 1


def test_metrics_and_the_workers_list_read_one_use_as_placement_counts_it(core: Core, db) -> None:
    """What a worker holds was read two ways: ``/metrics`` summed the tasks' requests,
    ``/v1/workers`` the attempts' charges. Both now read placement's: a charge where one
    was fixed (measured use of preemptible work), a squeezed attempt's small share."""
    with core.client() as alice:
        for _ in range(2):
            alice.post("/v1/tasks", json=spec(resources={"cpu": 2, "memory_mb": 256}))
    agent = core.client("agent", "worker")
    offer = {"hostname": "h", "queues": ["default"], "cpu": 8, "memory_mb": 4096}
    registered = agent.post("/v1/workers", json=offer).json()
    worker_id = registered["worker"]["id"]
    agent.headers["X-Cairn-Worker-Lease"] = registered["lease"]
    claimed = agent.post(f"/v1/workers/{worker_id}/claim", json={"cpu": 8, "memory_mb": 4096})
    first, second = sorted(a["attempt_id"] for a in claimed.json()["attempts"])
    db.execute("UPDATE core.attempts SET charge_cpu = 0.5 WHERE id = %s", (first,))
    db.execute("UPDATE core.attempts SET squeezed_at = now() WHERE id = %s", (second,))
    held = 0.5 + 2 * SQUEEZED_CPU_SHARE
    with core.client("root", "admin") as admin:
        [listed] = admin.get("/v1/workers").json()["items"]
    samples = scrape(core.url)
    agent.close()
    assert listed["running"] == 2
    assert listed["used_cpu"] == pytest.approx(held)
    assert listed["used_memory_mb"] == 512
    assert value(samples, "cairn_workers_used_cpu", pool="default") == pytest.approx(held)
    assert value(samples, "cairn_workers_used_memory_mb", pool="default") == 512
    assert value(samples, "cairn_workers_running_attempts", pool="default") == 2


def test_cron_counts_fires_and_leads(core: Core, cron: Cron, clock: FakeClock) -> None:
    wait_for(lambda: value(scrape(cron.url), "cairn_cron_leader") == 1)
    with cron.client() as alice:
        body = {
            "name": "every-minute",
            "expression": "* * * * *",
            "target": {"kind": "task", "task": spec()},
        }
        answer = alice.post("/v1/schedules", json=body)
        assert answer.status_code == 201, answer.text
    clock.advance(seconds=30)
    samples = wait_for(
        lambda: (
            (s := scrape(cron.url))
            and value(s, "cairn_cron_fires_total", outcome="submitted") == 1
            and s
        )
    )
    assert value(samples, "cairn_cron_fires_total", outcome="failed") == 0
    assert value(samples, "cairn_cron_fire_lag_seconds_count") == 1
    assert value(samples, "cairn_cron_schedules", state="active") == 1


def test_dag_counts_runs_and_release_latency(core: Core, dag: DagServer) -> None:
    worker = Worker(core)
    try:
        with dag.client() as http:
            run = Runner(http).run(workflow("pair", [node("a"), node("b", "a")]))
    finally:
        worker.stop()
    assert run["state"] == "succeeded"
    samples = scrape(dag.url)
    assert value(samples, "cairn_dag_leader") == 1
    assert value(samples, "cairn_dag_nodes_released_total") == 2
    assert value(samples, "cairn_dag_release_latency_seconds_count") == 2
    assert value(samples, "cairn_dag_runs_finished_total", state="succeeded") == 1
    assert value(samples, "cairn_dag_runs", state="running") == 0
    # The loop read the feed to its head to learn the run's end.
    assert 0 <= value(samples, "cairn_dag_feed_lag_seconds") < 30


def test_dag_counts_mapped_instances_and_timed_out_runs(core: Core, dag: DagServer) -> None:
    worker = Worker(core)
    try:
        with dag.client() as http:
            runner = Runner(http)
            mapped = workflow("mapped", [node("each", map={"over": "{{ params.items }}"})])
            run = runner.run(mapped, params={"items": [1, 2, 3]})
            runner.define(workflow("stuck", [node("a", args=("hold",))]))
            stuck = runner.wait_end(runner.start("stuck", timeout_s=1)["id"])
    finally:
        worker.stop()
    assert (run["state"], stuck["state"]) == ("succeeded", "failed")
    samples = scrape(dag.url)
    assert value(samples, "cairn_dag_map_instances_total") == 3
    assert value(samples, "cairn_dag_runs_timed_out_total") == 1
