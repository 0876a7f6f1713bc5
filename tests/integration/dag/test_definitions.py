"""Bad definitions and bad runs are 4xx problems naming the field and the reason."""

from __future__ import annotations

import psycopg
import pytest

from libs.common.dag_models import MAX_NODES
from tests.fixtures.dag import DagServer, node, workflow


def _refused(dag: DagServer, path: str, body: object, status: int = 422) -> dict:
    with dag.client() as http:
        answer = http.post(path, json=body)
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    return answer.json()


def test_a_cycle_is_refused_with_its_path(dag: DagServer) -> None:
    body = workflow("loop", [node("a", "c"), node("b", "a"), node("c", "b"), node("d")])
    problem = _refused(dag, "/v1/workflows", body)
    assert problem["cycle"] in (["a", "b", "c", "a"], ["b", "c", "a", "b"], ["c", "a", "b", "c"])
    assert " -> ".join(problem["cycle"]) in problem["detail"]


def test_a_node_depending_on_itself_is_a_cycle(dag: DagServer) -> None:
    problem = _refused(dag, "/v1/workflows", workflow("self", [node("a", "a")]))
    assert problem["cycle"] == ["a", "a"]


def test_unknown_and_duplicate_nodes_are_named(dag: DagServer) -> None:
    unknown = _refused(dag, "/v1/workflows", workflow("u", [node("a", "ghost", "spook")]))
    assert unknown["unknown"] == ["ghost", "spook"]
    assert unknown["errors"][0] == {
        "field": "body.nodes.0.depends_on.0",
        "reason": "unknown node 'ghost'",
    }
    duplicate = _refused(dag, "/v1/workflows", workflow("d", [node("a"), node("b"), node("a")]))
    assert duplicate["duplicates"] == ["a"]
    assert "duplicate node names: a" in duplicate["detail"]


@pytest.mark.parametrize(
    ("task", "field", "reason"),
    [
        ({"args": ["{{ params.x | upper }}"]}, "body.nodes.1.task.args.0", "unknown template"),
        ({"env": {"A": "{{ secrets.x }}"}}, "body.nodes.1.task.env.A", "unknown template"),
        (
            {"args": ["{{ nodes.b.output_path }}"]},
            "body.nodes.1.task",
            "'b' is not upstream of 'b'",
        ),
        ({"args": ["{{ nodes.a.output_path }}"]}, "body.nodes.1.task", "'a' has no output_path"),
        ({"idempotency_key": "mine"}, "body.nodes.1.task", "set by the DAG service"),
    ],
)
def test_templates_name_only_what_exists(
    dag: DagServer, task: dict, field: str, reason: str
) -> None:
    body = workflow("t", [node("a"), node("b", "a", task=task)])
    problem = _refused(dag, "/v1/workflows", body)
    assert problem["errors"][0]["field"].startswith(field)
    assert reason in problem["errors"][0]["reason"]


def test_sizes_are_bounded(dag: DagServer) -> None:
    artifact = {"uri": "file:///x", "sha256": "0" * 64}
    nodes = [{"name": f"n{i}", "task": {"artifact": artifact}} for i in range(MAX_NODES + 1)]
    too_many = _refused(dag, "/v1/workflows", workflow("big", nodes))
    assert too_many["errors"][0]["field"] == "body.nodes"
    long_name = _refused(dag, "/v1/workflows", workflow("x" * 101, [node("a")]))
    assert long_name["errors"][0]["field"] == "body.name"
    params = {f"p{i}": "v" for i in range(101)}
    assert (
        _refused(dag, "/v1/workflows", workflow("p", [node("a")], params=params))["errors"][0][
            "field"
        ]
        == "body.params"
    )


def test_a_run_needs_every_parameter_its_nodes_use(dag: DagServer) -> None:
    with dag.client() as http:
        body = workflow("needs", [node("a", args=("{{ params.day }}",))])
        assert http.post("/v1/workflows", json=body).status_code == 201
    missing = _refused(dag, "/v1/workflows/needs/runs", {})
    assert missing["errors"] == [{"field": "body.params.day", "reason": "required: a node uses it"}]
    unknown = _refused(dag, "/v1/workflows/needs/runs", {"params": {"day": "1", "dya": "2"}})
    assert unknown["errors"][0]["field"] == "body.params.dya"
    too_long = _refused(dag, "/v1/workflows/needs/runs", {"params": {"day": "x" * 8192 * 2}})
    assert too_long["errors"][0]["field"].startswith("body.params")
    _refused(dag, "/v1/workflows/nothing/runs", {}, status=404)


def test_a_parameter_that_renders_an_invalid_task_is_refused_at_start(dag: DagServer) -> None:
    with dag.client() as http:
        body = workflow("render", [node("a", task={"output_path": "{{ params.path }}"})])
        assert http.post("/v1/workflows", json=body).status_code == 201
    problem = _refused(dag, "/v1/workflows/render/runs", {"params": {"path": ""}})
    assert problem["errors"][0]["field"] == "nodes.a.task.output_path"
    assert "after templating" in problem["detail"]


def test_run_ids_and_cursors_out_of_range_are_4xx(dag: DagServer) -> None:
    with dag.client() as http:
        assert http.get(f"/v1/runs/{2**63}").status_code == 422
        assert http.get("/v1/runs", params={"cursor": "9" * 19}).status_code == 422
        assert http.get("/v1/runs/0/graph", params={"format": "svg"}).status_code == 422
        assert http.post("/v1/runs/12345/cancel").status_code == 404


_DEFINITION = (
    '{"name": "w", "nodes": [{"name": "a", "task": {"artifact": {"uri": "file:///x", "sha256": "%s"}}}], '
    % ("0" * 64)
)


@pytest.mark.parametrize(
    ("path", "body", "field", "why"),
    [
        # kept as null: the workflow's default, an event's data (a node's outputs)
        ("/v1/workflows", _DEFINITION + '"params": {"limit": Infinity}}', "body.params", "NaN"),
        ("/v1/runs/1/events/paid", '{"data": {"amount": NaN}}', "body.data", "NaN"),
        # a 500: orjson, which writes the event, refused them
        ("/v1/runs/1/events/paid", '{"data": {"id": "\\ud800"}}', "body.data", "surrogate"),
        ("/v1/runs/1/events/paid", '{"data": {"id": 1180591620717411303424}}', "body.data", "64"),
        (
            "/v1/runs/1/events/paid",
            '{"data": {"a": %s}}' % ("[" * 300 + "]" * 300),
            "body.data",
            "deeper",
        ),
        # a 422 naming no field: PostgreSQL refused the NUL
        ("/v1/runs/1/events/paid", '{"data": {"a\\u0000": 1}}', "body.data", "NUL"),
        ("/v1/workflows", _DEFINITION + '"description": "a\\u0000"}', "body.description", ""),
        ("/v1/runs/1/nodes/gate/approve", '{"comment": "ok\\u0000"}', "body.comment", ""),
        ("/v1/workflows/w/runs", '{"params": {"day": NaN}}', "body.params", "NaN"),
    ],
)
def test_values_that_cannot_be_kept_as_given_are_refused_naming_the_field(
    dag: DagServer, db: psycopg.Connection, path: str, body: str, field: str, why: str
) -> None:
    with dag.client() as http:
        answer = http.post(
            path, content=body.encode(), headers={"content-type": "application/json"}
        )
    assert answer.status_code == 422, answer.text
    [error] = answer.json()["errors"]
    assert error["field"] == field and why in error["reason"], error
    assert db.execute("SELECT count(*) FROM dag.workflows").fetchone() == (0,)
