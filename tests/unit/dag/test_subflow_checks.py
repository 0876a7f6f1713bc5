"""A sub-workflow node's own fields and the reference check (services.dag.domain.subflows):
cycles through stored versions found with their path, nesting bounded, and what the
definition refuses by field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from libs.common.dag_models import WorkflowCreate
from libs.common.errors import InvalidInput
from services.dag.domain import graph, subflows


def _build(*nodes: dict) -> None:
    graph.build(WorkflowCreate.model_validate({"name": "p", "nodes": list(nodes)}))


def test_a_sub_workflow_node_is_validated_by_field() -> None:
    task = {"artifact": {"uri": "file:///bin/true", "sha256": "ab" * 32}}
    one_of = "exactly one of a task, an approval gate, a workflow or an event"
    with pytest.raises(ValidationError, match=f"workflow: a node has {one_of}"):
        _build({"name": "s", "task": task, "workflow": {"name": "a"}})
    with pytest.raises(ValidationError, match=f"event: a node has {one_of}"):
        _build({"name": "s", "workflow": {"name": "a"}, "event": {"name": "e", "timeout_s": 9}})
    with pytest.raises(ValidationError, match=f"task: a node has {one_of}"):
        _build({"name": "s"})
    with pytest.raises(ValidationError, match="cannot map"):
        _build({"name": "s", "workflow": {"name": "a"}, "map": {"over": "{{ params.xs }}"}})
    with pytest.raises(ValidationError, match="outputs are its child's, not paths"):
        _build({"name": "s", "workflow": {"name": "a"}, "outputs": {"x": {"path": "s3://b/x"}}})
    with pytest.raises(ValidationError, match=r"workflow\.version"):
        _build({"name": "s", "workflow": {"name": "a", "version": 0}})
    with pytest.raises(InvalidInput) as refused:
        _build({"name": "s", "workflow": {"name": "a", "params": {"x": "{{ nodes.z.outputs.v }}"}}})
    assert refused.value.extra["errors"][0] == {
        "field": "body.nodes.0.workflow.params.x",
        "reason": "'z' is not upstream of 's'",
    }


def test_a_cycle_is_found_with_its_path_and_the_node_it_leaves_by() -> None:
    edges: subflows.Edges = {
        ("a", 0): [("x", ("c", 1)), ("y", ("b", 1))],
        ("b", 1): [("calls-a", ("a", 0))],
        ("c", 1): [],
    }
    problem = subflows.check("a", edges, 5)
    assert problem == subflows.Problem("y", ("a", "b@1", "a"), True)
    assert problem.reason == "sub-workflows form a cycle: a -> b@1 -> a"
    assert subflows.check("a", {("a", 0): [("me", ("a", 0))]}, 5) == subflows.Problem(
        "me", ("a", "a"), True
    )


def test_nesting_is_bounded_and_shared_versions_are_walked_once() -> None:
    chain: dict[subflows.Key, list[tuple[str, subflows.Key]]] = {
        ("top", 0): [("down", ("l3", 1))],
        ("l3", 1): [("down", ("l2", 1))],
        ("l2", 1): [("down", ("l1", 1))],
        ("l1", 1): [],
    }
    assert subflows.check("top", chain, 3) is None
    deep = subflows.check("top", chain, 2)
    assert deep is not None and not deep.cycle
    assert deep.reason == "sub-workflows nest deeper than 2 levels: top -> l3@1 -> l2@1 -> l1@1"
    # A wide diamond of references: each version's references are walked once, not once
    # per path to it (20 levels of 2 ways would be a million paths).
    wide: dict[subflows.Key, list[tuple[str, subflows.Key]]] = {
        (f"w{i}", 1): [("l", (f"w{i + 1}", 1)), ("r", (f"w{i + 1}", 2))] for i in range(20)
    }
    wide.update({(f"w{i}", 2): [("l", (f"w{i + 1}", 1))] for i in range(20)})
    wide[("root", 0)] = [("go", ("w0", 1))]
    assert subflows.check("root", wide, 25) is None
