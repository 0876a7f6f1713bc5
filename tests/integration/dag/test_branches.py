"""Branches (a node's ``when``) against a real core and PostgreSQL: the side whose
condition is false is skipped and never reaches core, the skip flows down by the trigger
rules, a join runs, a condition that cannot be evaluated fails its node, a mapped node's
condition decides before its list is read, and bad conditions are refused by name."""

from __future__ import annotations

import json

import psycopg

from tests.fixtures.dag import DagServer, Runner, Worker, node, workflow
from tests.integration.dag.test_runs import _tasks
from tests.support import wait_for


def _nodes(db: psycopg.Connection, run_id: int) -> dict[str, tuple[str, str | None]]:
    rows = db.execute(
        "SELECT name, state, error FROM dag.nodes WHERE run_id = %s", (run_id,)
    ).fetchall()
    return {name: (state, error) for name, state, error in rows}


def _branching(name: str) -> dict:
    return workflow(
        name,
        [
            node("check", args=("out", json.dumps({"rows": 120})), outputs={"rows": {}}),
            node("load", "check", when="nodes.check.outputs.rows > 0"),
            node("alert-empty", "check", when="nodes.check.outputs.rows == 0"),
            node("after-alert", "alert-empty"),
            node("publish", "load", when='params.env == "prod"'),
            node("report", "load", "alert-empty", trigger_rule="none_failed_min_one_success"),
        ],
        params={"env": "dev"},
    )


def test_a_branch_runs_one_side_skips_the_other_and_the_join_runs(
    runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    runner.define(_branching("branch"))
    dev = runner.wait_end(runner.start("branch")["id"])
    prod = runner.wait_end(runner.start("branch", params={"env": "prod"})["id"])
    assert _nodes(db, dev["id"]) == {
        "check": ("succeeded", None),
        "load": ("succeeded", None),
        "alert-empty": ("skipped", "when is false: nodes.check.outputs.rows == 0"),
        "after-alert": ("skipped", None),  # all_success below a skip
        "publish": ("skipped", 'when is false: params.env == "prod"'),
        "report": ("succeeded", None),
    }
    assert dev["state"] == "succeeded"
    assert set(_tasks(db, dev["id"])) == {"check", "load", "report"}
    assert _nodes(db, prod["id"])["publish"] == ("succeeded", None)
    assert set(_tasks(db, prod["id"])) == {"check", "load", "publish", "report"}


def test_a_condition_that_cannot_be_evaluated_fails_its_node_and_a_mapped_one_decides_first(
    runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    body = workflow(
        "branch-edges",
        [
            node("source", args=("out", json.dumps({"n": "many"})), outputs={"n": {}}),
            node("bad", "source", when="nodes.source.outputs.n > 3"),
            node("below-bad", "bad"),
            node("each", when="params.go", map={"over": "{{ params.items }}"}),
            node("after-each", "each", trigger_rule="all_done"),
        ],
    )
    runner.define(body)
    off = runner.wait_end(runner.start("branch-edges", params={"go": False, "items": [1, 2]})["id"])
    on = runner.wait_end(runner.start("branch-edges", params={"go": True, "items": [1, 2]})["id"])
    nodes = _nodes(db, off["id"])
    assert nodes["bad"] == ("failed", "when: cannot compare a string > a number")
    assert nodes["below-bad"] == ("upstream_failed", None)
    assert nodes["each"] == ("skipped", "when is false: params.go")
    assert nodes["after-each"] == ("succeeded", None)
    assert off["state"] == "failed"
    assert set(_tasks(db, off["id"])) == {"source", "after-each"}  # no instance was made
    assert {n: s for n, (s, _) in _nodes(db, on["id"]).items() if n.startswith("each")} == {
        "each": "succeeded",
        "each[0]": "succeeded",
        "each[1]": "succeeded",
    }


def test_a_retry_decides_a_failed_branch_again(
    runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    body = workflow(
        "branch-retry",
        [
            node("flaky", args=("fail-below", "2", "{{ node.try }}")),
            node("gated", "flaky", when="params.on"),
        ],
        params={"on": True},
    )
    run = runner.run(body)
    assert _nodes(db, run["id"])["gated"] == ("upstream_failed", None)
    runner.http.post(f"/v1/runs/{run['id']}/retry").raise_for_status()
    again = runner.wait_end(run["id"])
    assert again["state"] == "succeeded"
    assert _nodes(db, run["id"]) == {"flaky": ("succeeded", None), "gated": ("succeeded", None)}


def test_a_rule_met_early_waits_for_the_node_its_condition_reads(
    runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    body = workflow(
        "branch-waits",
        [
            node("fast"),
            node("slow", args=("hold",), outputs={"go": {}}),
            node("after-fast", "fast"),
            node(
                "each",
                "fast",
                "slow",
                trigger_rule="one_success",
                when="nodes.slow.outputs.go == true",
                map={"over": "{{ params.items }}"},
            ),
        ],
    )
    runner.define(body)
    rid = runner.start("branch-waits", params={"items": [1, 2]})["id"]
    wait_for(lambda: _nodes(db, rid)["after-fast"][0] == "succeeded", timeout=30, interval=0.05)
    # fast's success met each's rule in the transaction after-fast was readied in; each
    # waits for slow (still running) rather than reading its output as null
    assert _nodes(db, rid)["each"] == ("pending", None)
    runner.http.post(f"/v1/runs/{rid}/cancel").raise_for_status()
    wait_for(lambda: _nodes(db, rid)["slow"][0] == "cancelled", timeout=30, interval=0.05)
    assert _nodes(db, rid)["each"] == ("cancelled", None)


def _refusal(dag: DagServer, body: dict) -> dict:
    with dag.client() as http:
        answer = http.post("/v1/workflows", json=body)
    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    return answer.json()


def test_bad_conditions_are_refused_naming_the_node_and_the_field(dag: DagServer) -> None:
    cases = [
        ("params.env = 'prod'", "does not parse"),
        ("nodes.c.outputs.rows > 0", "'c' is not upstream of 'b'"),
        ("nodes.a.outputs.size > 0", "'a' declares no output 'size'"),
        ("params.env.__class__", "is not params.NAME"),
        ("open('/etc/passwd')", "is not allowed in a condition"),
    ]
    for when, reason in cases:
        body = workflow(
            "bad-when",
            [
                node("a", outputs={"rows": {}}),
                node("b", "a", when=when),
                node("c"),
            ],
        )
        problem = _refusal(dag, body)
        assert problem["errors"][0]["field"] == "body.nodes.1.when", problem
        assert reason in problem["errors"][0]["reason"], problem
        assert problem["detail"].startswith("body.nodes.1.when: ")
    too_long = _refusal(dag, workflow("long-when", [node("a", when="true or " * 200 + "true")]))
    assert too_long["errors"][0]["field"] == "body.nodes.0.when"
    with dag.client() as http:
        http.post("/v1/workflows", json=workflow("needs", [node("a", when="params.x == 1")]))
        missing = http.post("/v1/workflows/needs/runs", json={})
    assert missing.status_code == 422
    assert missing.json()["errors"] == [
        {"field": "body.params.x", "reason": "required: a node uses it"}
    ]
