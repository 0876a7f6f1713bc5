"""Workflows for data, against a real core and PostgreSQL: outputs handed downstream,
mapping over a list with a fan-in, run timeouts, the cap on live nodes, clearing a node,
and Airflow's other trigger rules."""

from __future__ import annotations

import json
from datetime import datetime

import psycopg
import pytest

from tests.fixtures.dag import DagServer, Runner, Worker, node, states, workflow
from tests.integration.dag.test_runs import _tasks
from tests.support import wait_for


def _out(values: dict) -> tuple[str, str]:
    return ("out", json.dumps(values))


def _node(run: dict, name: str) -> dict:
    return next(n for n in run["nodes"] if n["name"] == name)


def test_an_output_the_task_wrote_and_a_declared_path_reach_the_next_node(
    runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    body = workflow(
        "handoff",
        [
            node(
                "extract",
                args=_out({"path": "s3://raw/part-1.csv", "rows": 1200, "skipped": "x"}),
                outputs={"path": {}, "rows": {}, "table": {"path": "s3://lake/{{ run.id }}/t"}},
            ),
            node(
                "load",
                "extract",
                args=(
                    "ok",
                    "--in={{ nodes.extract.outputs.path }}",
                    "{{ nodes.extract.outputs.rows }}",
                    "{{ nodes.extract.outputs.table }}",
                ),
            ),
        ],
    )
    run = runner.run(body)
    assert run["state"] == "succeeded"
    rid = run["id"]
    assert _node(run, "extract")["outputs"] == {
        "path": "s3://raw/part-1.csv",
        "rows": 1200,
        "table": f"s3://lake/{rid}/t",
    }
    load = _tasks(db, rid)["load"]
    assert load["args"] == ["ok", "--in=s3://raw/part-1.csv", "1200", f"s3://lake/{rid}/t"]
    stored = db.execute(
        "SELECT a.outputs FROM core.attempts a JOIN core.tasks t ON t.current_attempt_id = a.id"
        " WHERE t.id = %s",
        (_node(run, "extract")["task_id"],),
    ).fetchone()
    assert stored == ({"path": "s3://raw/part-1.csv", "rows": 1200, "skipped": "x"},)


def test_a_node_missing_a_declared_output_fails_and_its_downstream_does_not_run(
    runner: Runner, worker: Worker
) -> None:
    body = workflow(
        "missing",
        [
            node(
                "extract",
                args=_out({"other": 1}),
                outputs={"rows": {}, "note": {"required": False}},
            ),
            node("load", "extract", args=("ok", "{{ nodes.extract.outputs.rows }}")),
        ],
    )
    run = runner.run(body)
    assert run["state"] == "failed"
    assert states(run) == {"extract": "failed", "load": "upstream_failed"}
    assert "missing from CAIRN_OUTPUTS: rows" in _node(run, "extract")["error"]


def test_a_map_over_50_items_then_a_fan_in_that_sees_every_output(
    runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    files = [f"day/{i:02}.csv" for i in range(50)]
    body = workflow(
        "fan-50",
        [
            node("list", args=_out({"files": files}), outputs={"files": {}}),
            node(
                "each",
                "list",
                args=("out", '{"n": {{ map.index }}, "file": "{{ map.item }}"}'),
                map={"over": "{{ nodes.list.outputs.files }}", "max_items": 50},
                outputs={"n": {}, "file": {}},
            ),
            node("sum", "each", args=("ok", "{{ nodes.each.outputs.n }}")),
        ],
    )
    run = runner.run(body, timeout=120)
    assert run["state"] == "succeeded"
    rid = run["id"]
    instances = [n for n in run["nodes"] if n["map_of"] == "each"]
    assert [n["name"] for n in instances] == [f"each[{i}]" for i in range(50)]
    assert [n["map_item"] for n in instances] == files
    assert {n["state"] for n in instances} == {"succeeded"}
    assert _node(run, "each")["outputs"] == {"n": list(range(50)), "file": files}
    tasks = _tasks(db, rid)
    assert len(tasks) == 52
    assert tasks["each[7]"]["args"] == ["out", '{"n": 7, "file": "day/07.csv"}']
    assert tasks["each[7]"]["key"] == f"dag:{rid}:each[7]:1"
    assert tasks["sum"]["args"] == ["ok", json.dumps(list(range(50)), separators=(",", ":"))]
    assert tasks["sum"]["created_at"] > max(
        t["finished_at"] for n, t in tasks.items() if n.startswith("each[")
    )
    assert sorted(worker.claims.values()) == [1] * 52


def test_a_map_over_a_parameter_with_one_failure_fails_the_fan_in_but_not_all_done(
    runner: Runner, worker: Worker
) -> None:
    body = workflow(
        "fan-param",
        [
            node("each", args=("{{ map.item }}",), map={"over": "{{ params.outcomes }}"}),
            node("strict", "each"),
            node("report", "each", trigger_rule="all_done"),
            node("first", "each", trigger_rule="one_success"),
        ],
    )
    run = runner.run(body, params={"outcomes": ["ok", "fail", "ok"]})
    found = states(run)
    assert found["each"] == "failed"
    assert [found[f"each[{i}]"] for i in range(3)] == ["succeeded", "failed", "succeeded"]
    assert (found["strict"], found["report"], found["first"]) == (
        "upstream_failed",
        "succeeded",
        "succeeded",
    )
    assert run["state"] == "failed"


def test_a_map_over_an_empty_list_is_skipped_and_a_too_long_one_refused(
    runner: Runner, worker: Worker
) -> None:
    body = workflow(
        "fan-edges",
        [node("each", map={"over": "{{ params.items }}", "max_items": 3}), node("after", "each")],
    )
    run = runner.run(body, params={"items": []})
    assert states(run) == {"each": "skipped", "after": "skipped"}
    assert run["state"] == "succeeded"
    refused = runner.http.post(
        "/v1/workflows/fan-edges/runs", json={"params": {"items": [1, 2, 3, 4]}}
    )
    assert refused.status_code == 422
    assert refused.json()["errors"][0]["field"] == "body.params.items"
    assert "more than 3" in refused.json()["detail"]


def test_a_run_past_its_timeout_fails_and_its_running_tasks_are_cancelled(
    runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    # "stuck" is a root, submitted with "quick" as the run starts: behind "quick" it had
    # to wait a hop, and on a loaded CI the run's time ran out before it was submitted.
    runner.define(
        workflow("stuck", [node("quick"), node("stuck", args=("hold",)), node("after", "stuck")])
    )
    run = runner.wait_end(runner.start("stuck", timeout_s=3)["id"], timeout=30)
    assert run["state"] == "failed"
    assert run["reason"] == "timed out after 3 s"
    assert run["timeout_s"] == 3
    wait_for(lambda: states(runner.get(run["id"]))["stuck"] == "cancelled")
    run = runner.get(run["id"])
    assert states(run) == {"quick": "succeeded", "stuck": "cancelled", "after": "cancelled"}
    stuck = _node(run, "stuck")
    assert db.execute(
        "SELECT state FROM core.tasks WHERE id = %s", (stuck["task_id"],)
    ).fetchone() == ("cancelled",)
    assert datetime.fromisoformat(run["finished_at"]) >= datetime.fromisoformat(run["deadline"])


def test_max_active_nodes_caps_the_tasks_a_run_has_live_in_core(
    runner: Runner, core, db: psycopg.Connection
) -> None:
    worker = Worker(core, "slow-worker", delay_s=0.05)
    try:
        body = workflow(
            "capped",
            [node("each", map={"over": "{{ params.items }}"})],
            max_active_nodes=3,
        )
        run = runner.run(body, params={"items": list(range(20))}, timeout=120)
    finally:
        worker.stop()
    assert run["state"] == "succeeded"
    spans = [(t["created_at"], t["finished_at"]) for t in _tasks(db, run["id"]).values()]
    assert len(spans) == 20
    most = max(sum(1 for a, b in spans if a <= at < b) for at, _ in spans)
    assert 1 <= most <= 3


def test_clearing_a_node_reruns_it_and_its_downstream_with_the_next_try(
    runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    body = workflow(
        "clearable",
        [node("a"), node("b", "a"), node("c", "b"), node("side", "a")],
    )
    run = runner.run(body)
    assert run["state"] == "succeeded"
    cleared = runner.http.post(f"/v1/runs/{run['id']}/clear", json={"node": "b"})
    assert cleared.status_code == 200, cleared.text
    assert cleared.json()["state"] == "queued"
    assert states(cleared.json())["b"] == "pending"
    done = runner.wait_end(run["id"])
    assert done["state"] == "succeeded"
    tries = {n["name"]: n["try_number"] for n in done["nodes"]}
    assert tries == {"a": 1, "b": 2, "c": 2, "side": 1}
    rid = run["id"]
    keys = sorted(
        k
        for (k,) in db.execute(
            "SELECT idempotency_key FROM core.tasks WHERE labels->>'cairn.dag/run' = %s",
            (str(rid),),
        )
    )
    assert keys == sorted(
        [
            f"dag:{rid}:a:1",
            f"dag:{rid}:b:1",
            f"dag:{rid}:b:2",
            f"dag:{rid}:c:1",
            f"dag:{rid}:c:2",
            f"dag:{rid}:side:1",
        ]
    )
    only = runner.http.post(f"/v1/runs/{rid}/clear", json={"node": "a", "downstream": False})
    assert only.status_code == 200
    again = runner.wait_end(rid)
    assert {n["name"]: n["try_number"] for n in again["nodes"]}["a"] == 2
    assert {n["name"]: n["try_number"] for n in again["nodes"]}["b"] == 2


def test_clear_refuses_an_unknown_node_and_a_run_still_running(dag: DagServer, core) -> None:
    with dag.client() as http:
        runner = Runner(http)
        runner.define(workflow("held-clear", [node("a", args=("hold",))]))
        run = runner.start("held-clear")
        unknown = http.post(f"/v1/runs/{run['id']}/clear", json={"node": "nope"})
        assert unknown.status_code == 422
        assert unknown.json()["errors"][0]["field"] == "body.node"
        wait_for(lambda: runner.get(run["id"])["state"] == "running")
        running = http.post(f"/v1/runs/{run['id']}/clear", json={"node": "a"})
        assert running.status_code == 409
        assert http.post(f"/v1/runs/{run['id']}/cancel").status_code == 200


def test_airflows_other_rules_on_skips_and_failures(runner: Runner, worker: Worker) -> None:
    body = workflow(
        "airflow-rules",
        [
            node("ok"),
            node("fails", args=("fail",)),
            node("skip", "ok", trigger_rule="one_failed"),
            node("cannot", "fails"),
            node("nfmos-all-skipped", "skip", trigger_rule="none_failed_min_one_success"),
            node("nfmos-one-success", "skip", "ok", trigger_rule="none_failed_min_one_success"),
            node("nfmos-a-failure", "ok", "fails", trigger_rule="none_failed_min_one_success"),
            node("all-failed-both", "fails", "cannot", trigger_rule="all_failed"),
            node("all-failed-one-ok", "fails", "ok", trigger_rule="all_failed"),
            node("one-done-none-ran", "skip", "cannot", trigger_rule="one_done"),
            node("one-done-a-failure", "fails", "skip", trigger_rule="one_done"),
            node("always", "fails", "cannot", trigger_rule="always"),
        ],
    )
    run = runner.run(body)
    assert states(run) == {
        "ok": "succeeded",
        "fails": "failed",
        "skip": "skipped",
        "cannot": "upstream_failed",
        "nfmos-all-skipped": "skipped",
        "nfmos-one-success": "succeeded",
        "nfmos-a-failure": "upstream_failed",
        "all-failed-both": "succeeded",
        "all-failed-one-ok": "skipped",
        "one-done-none-ran": "skipped",
        "one-done-a-failure": "succeeded",
        "always": "succeeded",
    }
    assert run["state"] == "failed"  # nfmos-a-failure is a leaf that could not run


def test_always_runs_at_once_while_its_upstream_still_runs(
    dag: DagServer, core, db: psycopg.Connection
) -> None:
    with dag.client() as http:
        runner = Runner(http)
        runner.define(
            workflow(
                "always", [node("slow", args=("hold",)), node("now", "slow", trigger_rule="always")]
            )
        )
        run = runner.start("always")
        worker = Worker(core)
        try:
            wait_for(lambda: states(runner.get(run["id"]))["now"] == "succeeded")
            assert states(runner.get(run["id"]))["slow"] in ("released", "running")
        finally:
            worker.stop()
        http.post(f"/v1/runs/{run['id']}/cancel")


BAD = [
    (
        [node("a"), node("b", "a", args=("{{ nodes.a.outputs.rows }}",))],
        "body.nodes.1.task.args.0",
        "declares no output 'rows'",
    ),
    (
        [node("a", outputs={"rows": {}}), node("b", args=("{{ nodes.a.outputs.rows }}",))],
        "body.nodes.1.task.args.0",
        "'a' is not upstream of 'b'",
    ),
    (
        [node("a", args=("{{ map.item }}",))],
        "body.nodes.0.task.args.0",
        "need a map",
    ),
    (
        [node("a", map={"over": "{{ nodes.z.outputs.files }}"})],
        "body.nodes.0.map.over",
        "'z' is not upstream of 'a'",
    ),
    (
        [node("a", map={"over": "{{ run.id }}"})],
        "body.nodes.0.map.over",
        "maps over",
    ),
    (
        [node("a", map={"over": "{{ params.x }}", "max_items": 10_001})],
        "body.nodes.0.map.max_items",
        "less than or equal to 10000",
    ),
    (
        [node(f"m{i}", map={"over": "{{ params.x }}", "max_items": 10_000}) for i in range(11)],
        "body.nodes",
        "add up to 110000, more than 100000",
    ),
    (
        [node("a"), node("b", "a", task={"placement": {"preferred": [{"selector": "=x"}]}})],
        "body.nodes.1.task.placement.preferred.0.selector",
        "'=x' is not a selector",
    ),
    (
        [node("a", outputs={"t": {"path": "/local/{{ run.id }}"}})],
        "body.nodes.0.outputs.t.path",
        "pattern",
    ),
    (
        [
            node("a", outputs={"t": {}}),
            node("b", "a", outputs={"u": {"path": "s3://x/{{ nodes.a.outputs.t }}"}}),
        ],
        "body.nodes.1.outputs.u.path",
        "may not name another node's",
    ),
]


@pytest.mark.parametrize(("nodes", "field", "reason"), BAD)
def test_definitions_with_bad_outputs_or_maps_are_refused_naming_the_field(
    dag: DagServer, nodes: list[dict], field: str, reason: str
) -> None:
    with dag.client() as http:
        answer = http.post("/v1/workflows", json=workflow("bad", nodes))
    assert answer.status_code == 422, answer.text
    problem = answer.json()
    fields = [e.get("field", "") for e in problem.get("errors", [])]
    assert any(f.endswith(field.removeprefix("body.")) for f in fields), problem
    assert reason in json.dumps(problem), problem


def test_run_timeout_and_node_cap_are_bounded(dag: DagServer) -> None:
    with dag.client() as http:
        too_long = http.post("/v1/workflows", json=workflow("t", [node("a")], timeout_s=31 * 86400))
        no_cap = http.post("/v1/workflows", json=workflow("t", [node("a")], max_active_nodes=0))
    assert too_long.status_code == 422 and "timeout_s" in too_long.text
    assert no_cap.status_code == 422 and "max_active_nodes" in no_cap.text


def test_a_retry_maps_a_failed_mapped_node_again_with_the_next_try(
    runner: Runner, worker: Worker
) -> None:
    body = workflow(
        "flaky-map",
        [
            node(
                "each",
                args=("{{ map.item }}", "2", "{{ node.try }}"),
                map={"over": "{{ params.items }}"},
            ),
            node("after", "each"),
        ],
    )
    run = runner.run(body, params={"items": ["ok", "fail-below", "ok"]})
    assert run["state"] == "failed"
    assert states(run)["each[1]"] == "failed"
    assert runner.http.post(f"/v1/runs/{run['id']}/retry").status_code == 200
    done = runner.wait_end(run["id"])
    assert done["state"] == "succeeded"
    tries = {n["name"]: n["try_number"] for n in done["nodes"]}
    assert tries == {"each": 2, "each[0]": 2, "each[1]": 2, "each[2]": 2, "after": 2}
    assert set(states(done).values()) == {"succeeded"}


def test_a_retry_of_failed_instances_keeps_the_instances_that_succeeded(
    runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    body = workflow(
        "flaky-instances",
        [
            node(
                "each",
                args=("{{ map.item }}", "2", "{{ node.try }}"),
                map={"over": "{{ params.items }}"},
            ),
            node("after", "each"),
        ],
    )
    run = runner.run(body, params={"items": ["ok", "fail-below", "ok", "fail-below"]})
    assert run["state"] == "failed"
    first = {n["name"]: n["task_id"] for n in run["nodes"]}
    answer = runner.http.post(f"/v1/runs/{run['id']}/retry", json={"instances": "failed"})
    assert answer.status_code == 200, answer.text
    assert states(answer.json())["each[0]"] == "succeeded"
    done = runner.wait_end(run["id"])
    assert done["state"] == "succeeded"
    tries = {n["name"]: n["try_number"] for n in done["nodes"]}
    assert tries == {"each": 2, "each[0]": 1, "each[1]": 2, "each[2]": 1, "each[3]": 2, "after": 2}
    task_ids = {n["name"]: n["task_id"] for n in done["nodes"]}
    assert task_ids["each[0]"] == first["each[0]"] and task_ids["each[2]"] == first["each[2]"]
    assert task_ids["each[1]"] != first["each[1]"]
    keys = db.execute(
        "SELECT idempotency_key FROM core.tasks WHERE labels->>'cairn.dag/run' = %s",
        (str(run["id"]),),
    ).fetchall()
    rid = run["id"]
    assert sorted(k for (k,) in keys) == sorted(
        [f"dag:{rid}:each[{i}]:1" for i in range(4)]
        + [f"dag:{rid}:each[1]:2", f"dag:{rid}:each[3]:2", f"dag:{rid}:after:2"]
    )
    assert set(states(done).values()) == {"succeeded"}


def test_a_retry_of_failed_instances_then_a_whole_retry_gets_fresh_keys(
    runner: Runner, worker: Worker
) -> None:
    body = workflow(
        "twice-flaky",
        [
            node(
                "each",
                args=("{{ map.item }}", "3", "{{ node.try }}"),
                map={"over": "{{ params.items }}"},
            )
        ],
    )
    run = runner.run(body, params={"items": ["ok", "fail-below"]})
    runner.http.post(f"/v1/runs/{run['id']}/retry", json={"instances": "failed"})
    again = runner.wait_end(run["id"])
    assert states(again)["each[1]"] == "failed"
    assert runner.http.post(f"/v1/runs/{run['id']}/retry").status_code == 200
    done = runner.wait_end(run["id"])
    assert done["state"] == "succeeded"
    assert {n["name"]: n["try_number"] for n in done["nodes"]} == {
        "each": 3,
        "each[0]": 3,
        "each[1]": 3,
    }


def test_a_retry_names_a_bad_instances_value(runner: Runner, worker: Worker) -> None:
    run = runner.run(workflow("plain-fail", [node("a", args=("fail",))]))
    answer = runner.http.post(f"/v1/runs/{run['id']}/retry", json={"instances": "some"})
    assert answer.status_code == 422 and "instances" in answer.text
