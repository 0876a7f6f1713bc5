"""Runs against a real core and PostgreSQL: nodes released as core tasks, outcomes learnt
from core's event feed, trigger rules on failures, cancel, retry, max_active_runs."""

from __future__ import annotations

import psycopg
import pytest

from tests.fixtures.dag import DagServer, Runner, Worker, node, states, workflow
from tests.support import wait_for


def _tasks(db: psycopg.Connection, run_id: int) -> dict[str, dict]:
    rows = db.execute(
        "SELECT labels->>'cairn.dag/node', id, owner, idempotency_key, state, args,"
        " created_at, finished_at FROM core.tasks WHERE labels->>'cairn.dag/run' = %s",
        (str(run_id),),
    ).fetchall()
    keys = ("id", "owner", "key", "state", "args", "created_at", "finished_at")
    found: dict[str, dict] = {}
    for name, *rest in rows:
        assert name not in found, f"node {name} was released twice"
        found[name] = dict(zip(keys, rest, strict=True))
    return found


def test_a_diamond_runs_each_node_once_after_its_parents(
    runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    body = workflow("diamond", [node("a"), node("b", "a"), node("c", "a"), node("d", "b", "c")])
    run = runner.run(body)
    assert run["state"] == "succeeded"
    assert states(run) == dict.fromkeys("abcd", "succeeded")
    tasks = _tasks(db, run["id"])
    assert {t["key"] for t in tasks.values()} == {f"dag:{run['id']}:{n}:1" for n in "abcd"}
    assert {t["owner"] for t in tasks.values()} == {"alice"}
    assert tasks["b"]["created_at"] > tasks["a"]["finished_at"]
    assert tasks["d"]["created_at"] > max(tasks["b"]["finished_at"], tasks["c"]["finished_at"])
    assert sorted(worker.claims.values()) == [1, 1, 1, 1]
    assert {n["task_id"] for n in run["nodes"]} == {t["id"] for t in tasks.values()}


def test_a_fan_out_of_100_then_a_fan_in(
    runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    middle = [node(f"m{i}", "root") for i in range(100)]
    body = workflow("fan", [node("root"), *middle, node("sink", *(m["name"] for m in middle))])
    run = runner.run(body)
    assert run["state"] == "succeeded"
    tasks = _tasks(db, run["id"])
    assert len(tasks) == 102
    assert tasks["sink"]["created_at"] > max(
        t["finished_at"] for n, t in tasks.items() if n != "sink"
    )


def test_a_chain_of_50_runs_in_order(
    runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    body = workflow("chain", [node("n0")] + [node(f"n{i}", f"n{i - 1}") for i in range(1, 50)])
    run = runner.run(body, timeout=120)
    assert run["state"] == "succeeded"
    tasks = _tasks(db, run["id"])
    for i in range(1, 50):
        assert tasks[f"n{i}"]["created_at"] > tasks[f"n{i - 1}"]["finished_at"]


# a succeeds, b fails; c waits for both under the rule; d (all_success) follows c and is
# the only leaf, so the run ends as d does.
RULE_CASES = {
    "all_success": ("upstream_failed", "upstream_failed", "failed"),
    "all_done": ("succeeded", "succeeded", "succeeded"),
    "one_failed": ("succeeded", "succeeded", "succeeded"),
    "one_success": ("succeeded", "succeeded", "succeeded"),
    "none_failed": ("upstream_failed", "upstream_failed", "failed"),
    "none_failed_min_one_success": ("upstream_failed", "upstream_failed", "failed"),
    "all_failed": ("skipped", "skipped", "succeeded"),
    "one_done": ("succeeded", "succeeded", "succeeded"),
    "always": ("succeeded", "succeeded", "succeeded"),
}


@pytest.mark.parametrize("rule", sorted(RULE_CASES))
def test_each_trigger_rule_on_a_failure(runner: Runner, worker: Worker, rule: str) -> None:
    body = workflow(
        "rules",
        [
            node("a"),
            node("b", args=("fail",)),
            node("c", "a", "b", trigger_rule=rule),
            node("d", "c"),
        ],
    )
    run = runner.run(body)
    c, d, outcome = RULE_CASES[rule]
    assert states(run) == {"a": "succeeded", "b": "failed", "c": c, "d": d}
    assert run["state"] == outcome
    failed = next(n for n in run["nodes"] if n["name"] == "b")
    assert "dead" in failed["error"]


def test_a_one_failed_cleanup_is_skipped_when_nothing_fails_and_the_skip_flows_down(
    runner: Runner, worker: Worker
) -> None:
    body = workflow(
        "cleanup",
        [
            node("a"),
            node("on-failure", "a", trigger_rule="one_failed"),
            node("after", "on-failure"),
            node("anyway", "on-failure", trigger_rule="none_failed"),
        ],
    )
    run = runner.run(body)
    assert states(run) == {
        "a": "succeeded",
        "on-failure": "skipped",
        "after": "skipped",
        "anyway": "succeeded",
    }
    assert run["state"] == "succeeded"


def test_params_run_id_and_an_upstream_output_path_are_templated(
    runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    body = workflow(
        "templated",
        [
            node("extract", task={"output_path": "/data/{{ run.id }}/{{ params.day }}.csv"}),
            node(
                "load",
                "extract",
                args=("ok", "--in={{ nodes.extract.output_path }}", "{{ params.table }}"),
                task={"env": {"DAY": "{{ params.day }}", "TRY": "{{ node.try }}"}},
            ),
        ],
        params={"table": "sales"},
    )
    run = runner.run(body, params={"day": "2026-11-30"})
    assert run["state"] == "succeeded"
    load = db.execute(
        "SELECT args, env FROM core.tasks WHERE labels->>'cairn.dag/node' = 'load'"
    ).fetchone()
    assert load == (
        ["ok", f"--in=/data/{run['id']}/2026-11-30.csv", "sales"],
        {"DAY": "2026-11-30", "TRY": "1"},
    )
    assert run["params"] == {"table": "sales", "day": "2026-11-30"}


def test_a_service_starts_a_run_for_its_owner_once_per_key(
    dag: DagServer, worker: Worker, db: psycopg.Connection
) -> None:
    with dag.client("bob") as bob, dag.client("cron", "service") as cron:
        Runner(bob).define(workflow("nightly", [node("a")]))
        headers = {"X-Cairn-On-Behalf-Of": "bob"}
        key = {"idempotency_key": "cron:7:2026-11-30T02:30:00+01:00"}
        first = cron.post("/v1/workflows/nightly/runs", json=key, headers=headers)
        again = cron.post("/v1/workflows/nightly/runs", json=key, headers=headers)
        assert (first.status_code, again.status_code) == (201, 200)
        assert first.json()["id"] == again.json()["id"]
        assert first.json()["owner"] == "bob"
        run = Runner(bob).wait_end(first.json()["id"])
    assert run["state"] == "succeeded"
    owner, key_in_core = db.execute(
        "SELECT owner, idempotency_key FROM core.tasks WHERE id = %s",
        (run["nodes"][0]["task_id"],),
    ).fetchone()
    assert (owner, key_in_core) == ("bob", f"dag:{run['id']}:a:1")
    with dag.client("mallory") as mallory:
        refused = mallory.post(
            "/v1/workflows/nightly/runs", json={}, headers={"X-Cairn-On-Behalf-Of": "bob"}
        )
        assert refused.status_code == 403
        assert mallory.get(f"/v1/runs/{run['id']}").status_code == 404


def test_same_definition_keeps_its_version_and_a_change_makes_the_next(dag: DagServer) -> None:
    with dag.client() as http:
        body = workflow("versions", [node("a")])
        first = http.post("/v1/workflows", json=body)
        same = http.post("/v1/workflows", json=body)
        changed = http.post("/v1/workflows", json=workflow("versions", [node("a"), node("b")]))
        assert (first.status_code, same.status_code, changed.status_code) == (201, 200, 201)
        assert [first.json()["version"], same.json()["version"]] == [1, 1]
        assert changed.json()["version"] == 2
        old = http.get("/v1/workflows/versions", params={"version": 1}).json()
        assert [n["name"] for n in old["definition"]["nodes"]] == ["a"]
        run = http.post("/v1/workflows/versions/runs", json={"version": 1}).json()
        assert [n["name"] for n in http.get(f"/v1/runs/{run['id']}").json()["nodes"]] == ["a"]


def test_cancel_stops_live_tasks_in_core_and_retry_runs_again(
    dag: DagServer, core, db: psycopg.Connection
) -> None:
    with dag.client() as http:
        runner = Runner(http)
        runner.define(workflow("held", [node("a"), node("b", "a")]))
        run = runner.start("held")
        a = wait_for(lambda: runner.get(run["id"])["nodes"][0]["task_id"])
        cancelled = http.post(f"/v1/runs/{run['id']}/cancel").json()
        assert cancelled["state"] == "cancelled"
        assert states(cancelled)["b"] == "cancelled"
        wait_for(lambda: states(runner.get(run["id"]))["a"] == "cancelled")
        assert db.execute("SELECT state FROM core.tasks WHERE id = %s", (a,)).fetchone() == (
            "cancelled",
        )
        assert http.post(f"/v1/runs/{run['id']}/cancel").status_code == 409
        retried = http.post(f"/v1/runs/{run['id']}/retry").json()
        assert retried["state"] in ("queued", "running")
        worker = Worker(core)
        try:
            done = runner.wait_end(run["id"])
        finally:
            worker.stop()
    assert done["state"] == "succeeded"
    assert [n["try_number"] for n in done["nodes"]] == [2, 2]
    keys = db.execute(
        "SELECT idempotency_key FROM core.tasks WHERE labels->>'cairn.dag/run' = %s ORDER BY id",
        (str(run["id"]),),
    ).fetchall()
    assert [k for (k,) in keys] == [
        f"dag:{run['id']}:a:1",
        f"dag:{run['id']}:a:2",
        f"dag:{run['id']}:b:2",
    ]


def test_retry_reruns_only_what_failed_with_the_next_try(runner: Runner, worker: Worker) -> None:
    body = workflow(
        "flaky",
        [
            node("a"),
            node("b", "a", args=("fail-below", "2", "{{ node.try }}")),
            node("c", "b"),
            node("side", "a"),
        ],
    )
    run = runner.run(body)
    assert run["state"] == "failed"
    assert states(run) == {
        "a": "succeeded",
        "b": "failed",
        "c": "upstream_failed",
        "side": "succeeded",
    }
    assert runner.http.post(f"/v1/runs/{run['id']}/retry").status_code == 200
    done = runner.wait_end(run["id"])
    assert done["state"] == "succeeded"
    tries = {n["name"]: n["try_number"] for n in done["nodes"]}
    assert tries == {"a": 1, "b": 2, "c": 2, "side": 1}
    assert sum(worker.claims.values()) == 5
    assert runner.http.post(f"/v1/runs/{run['id']}/retry").status_code == 409


def test_max_active_runs_queues_the_rest(dag: DagServer, core) -> None:
    with dag.client() as http:
        runner = Runner(http)
        runner.define(workflow("one-at-a-time", [node("a")], max_active_runs=1))
        first, second = runner.start("one-at-a-time"), runner.start("one-at-a-time")
        wait_for(lambda: runner.get(first["id"])["state"] == "running")
        assert runner.get(second["id"])["state"] == "queued"
        worker = Worker(core)
        try:
            ends = [runner.wait_end(first["id"]), runner.wait_end(second["id"])]
        finally:
            worker.stop()
    assert [r["state"] for r in ends] == ["succeeded", "succeeded"]
    assert ends[1]["started_at"] >= ends[0]["finished_at"]


def test_the_graph_as_json_and_mermaid(runner: Runner, worker: Worker) -> None:
    run = runner.run(workflow("drawn", [node("a"), node("b.1", "a"), node("c", "a", "b.1")]))
    graph = runner.http.get(f"/v1/runs/{run['id']}/graph").json()
    assert [(n["name"], n["state"]) for n in graph["nodes"]] == [
        ("a", "succeeded"),
        ("b.1", "succeeded"),
        ("c", "succeeded"),
    ]
    assert {(e["source"], e["target"]) for e in graph["edges"]} == {
        ("a", "b.1"),
        ("a", "c"),
        ("b.1", "c"),
    }
    text = runner.http.get(f"/v1/runs/{run['id']}/graph", params={"format": "mermaid"})
    assert text.headers["content-type"].startswith("text/plain")
    assert text.text.startswith("flowchart TD\n")
    assert '    n1["b.1<br/>succeeded"]' in text.text
    assert "    n0 --> n1" in text.text and "    n1 --> n2" in text.text
    assert text.text == graph["mermaid"]
