"""Sub-workflows through the API, against a real core: a definition naming a workflow
that is not the owner's, a cycle through sub-workflow references (across stored
versions) and nesting past the bound are 422s naming the node's field and the path; a
run hands params into its child and the child's outputs on, and the run view links
parent and child."""

from __future__ import annotations

import json
from collections.abc import Iterator

import psycopg
import pytest
from rich.console import Console

from cairn.dag_cli import tree
from cairn.sdk import Artifact, Node, SubWorkflow, Workflow
from libs.common.dag_models import MAX_SUBFLOW_DEPTH, Run
from libs.common.embedded import EmbeddedPostgres
from tests.fixtures.dag import DagServer, Runner, Worker, node, start_dag, workflow
from tests.support import TRUE_SHA, Core, fresh_database, start_core


# One database, core and DAG service for this module's tests (each uses workflow names
# of its own): a start of each per test costs over a second.
@pytest.fixture(scope="module")
def db_url(pg_server: EmbeddedPostgres, template_db: str) -> Iterator[str]:
    with fresh_database(pg_server.url, template_db, "sf_") as url:
        yield url


@pytest.fixture(scope="module")
def core(db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Core]:
    server = start_core(db_url, tmp_path_factory.mktemp("core"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def dag(core: Core, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DagServer]:
    server = start_dag(core, tmp_path_factory.mktemp("dag"))
    yield server
    server.stop()


def _sub(name: str, target: str, *depends_on: str, **workflow_spec: object) -> dict:
    return {
        "name": name,
        "workflow": {"name": target, **workflow_spec},
        "depends_on": list(depends_on),
    }


def _refused(runner: Runner, body: dict) -> dict:
    answer = runner.http.post("/v1/workflows", json=body)
    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    return answer.json()


def test_references_are_checked_when_a_workflow_is_stored(dag: DagServer, runner: Runner) -> None:
    missing = _refused(runner, workflow("p", [node("a"), _sub("s", "nowhere", "a")]))
    assert missing["errors"] == [
        {"field": "body.nodes.1.workflow.name", "reason": "no workflow 'nowhere' of yours"}
    ]
    runner.define(workflow("a", [node("x")]))
    pinned = _refused(runner, workflow("p", [_sub("s", "a", version=2)]))
    assert pinned["errors"][0]["field"] == "body.nodes.0.workflow.version"
    with dag.client("bob") as bob:  # another owner's workflow is as a missing one
        answer = bob.post("/v1/workflows", json=workflow("p", [_sub("s", "a")]))
    assert answer.status_code == 422, answer.text

    # a -> b -> a, across versions: b runs a's newest; a's next version runs b.
    runner.define(workflow("b", [_sub("calls-a", "a")]))
    cycle = _refused(runner, workflow("a", [node("x"), _sub("calls-b", "b", "x")]))
    assert cycle["errors"] == [
        {
            "field": "body.nodes.1.workflow.name",
            "reason": "sub-workflows form a cycle: a -> b@1 -> a",
        }
    ]
    assert cycle["subflow_path"] == ["a", "b@1", "a"]
    itself = _refused(runner, workflow("c", [_sub("me", "c")]))
    assert itself["subflow_path"] == ["c", "c"]
    # b pins a's version 1, which runs no sub-workflow: a's next version may run b.
    runner.define(workflow("b", [_sub("calls-a", "a", version=1)]))
    assert runner.define(workflow("a", [node("x"), _sub("calls-b", "b", "x")]))["version"] == 2

    runner.define(workflow("l0", [node("x")]))
    for level in range(1, MAX_SUBFLOW_DEPTH):
        runner.define(workflow(f"l{level}", [_sub("down", f"l{level - 1}")]))
    runner.define(workflow("top", [_sub("down", f"l{MAX_SUBFLOW_DEPTH - 1}")]))  # 5 levels
    deep = _refused(runner, workflow("deeper", [_sub("down", "top")]))
    assert deep["errors"][0]["field"] == "body.nodes.0.workflow.name"
    assert "nest deeper than 5 levels: deeper -> top@1 -> l4@1" in deep["errors"][0]["reason"]


def test_a_run_hands_params_in_and_the_childs_outputs_on(
    runner: Runner, worker: Worker, db: psycopg.Connection
) -> None:
    runner.define(
        workflow(
            "child",
            [node("count", args=("out", json.dumps({"total": 3})), outputs={"total": {}})],
            params={"day": "x"},
        )
    )
    parent = workflow(
        "parent",
        [
            node("prep", args=("out", json.dumps({"day": "2026-12-05"})), outputs={"day": {}}),
            _sub("sub", "child", "prep", params={"day": "{{ nodes.prep.outputs.day }}"}),
            {**_sub("missing", "child", "prep"), "outputs": {"nothing": {}}},
            node("use", "sub", args=("ok", "{{ nodes.sub.outputs.total }}")),
        ],
    )
    parent["nodes"][1]["outputs"] = {"total": {}}
    run = runner.run(parent)
    # The same parent written with the SDK is the same definition to the service.
    true = Artifact(uri="file:///bin/true", sha256=TRUE_SHA)
    with Workflow("parent") as sdk:
        prep = Node("prep", artifact=true, args=["out", '{"day": "2026-12-05"}'], outputs=["day"])
        sub = SubWorkflow("sub", "child", params={"day": prep.outputs.day}, outputs=["total"])
        missing = SubWorkflow("missing", "child", outputs=["nothing"])
        use = Node("use", artifact=true, args=["ok", sub.outputs.total])
        prep >> [sub, missing]
        sub >> use
    answer = runner.http.post("/v1/workflows", json=sdk.to_dict())
    assert (answer.status_code, answer.json()["version"]) == (200, 1), answer.text
    by_name = {n["name"]: n for n in run["nodes"]}
    assert by_name["sub"]["state"] == "succeeded"
    assert by_name["sub"]["outputs"] == {"total": 3}
    child_id = by_name["sub"]["child_run_id"]
    child = runner.get(child_id)
    assert (child["parent_run_id"], child["parent_node"]) == (run["id"], "sub")
    assert child["params"] == {"day": "2026-12-05"} and child["state"] == "succeeded"
    shown = Console(width=200, record=True)  # `cairn dag status`'s tree
    shown.print(tree(Run.model_validate(run)), tree(Run.model_validate(child)))
    text = shown.export_text()
    assert f"sub: succeeded child run {child_id}" in text
    assert f"(sub-workflow of run {run['id']}, node sub)" in text
    assert by_name["missing"]["state"] == "failed"
    assert (
        "nothing" in by_name["missing"]["error"]
        and str(by_name["missing"]["child_run_id"]) in (by_name["missing"]["error"])
    )
    assert run["state"] == "failed"
    args = db.execute(
        "SELECT t.args FROM dag.nodes n JOIN core.tasks t ON t.id = n.task_id"
        " WHERE n.run_id = %s AND n.name = 'use'",
        (run["id"],),
    ).fetchone()
    assert args == (["ok", "3"],)
    assert db.execute(
        "SELECT task_id, child_run_id FROM dag.nodes WHERE run_id = %s AND name = 'sub'",
        (run["id"],),
    ).fetchone() == (None, child_id)
