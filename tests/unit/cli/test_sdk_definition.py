"""cairn.sdk rendering: every feature to the JSON the DAG service takes, the dependency
operators, and the refusals, each naming the node, raised before anything is sent."""

from __future__ import annotations

import inspect
import json
from datetime import UTC, datetime

import pytest

from cairn.sdk import (
    FIRE_SLOT,
    MAP_INDEX,
    MAP_ITEM,
    NODE_NAME,
    NODE_TRY,
    RUN_ID,
    RUN_OWNER,
    RUN_WORKFLOW,
    Approval,
    Artifact,
    Concurrency,
    DefinitionError,
    MapSpec,
    Node,
    OutputSpec,
    Resources,
    RetryCauses,
    RetryPolicy,
    SecretRef,
    SubWorkflow,
    TriggerRule,
    WaitForEvent,
    Workflow,
    chain,
    param,
    render_all,
)
from libs.common.dag_models import TaskTemplate, WorkflowCreate
from services.dag.domain import graph

SHA = "ab" * 32
ART = Artifact(uri="s3://bin/etl", sha256=SHA)
ART_JSON = {"uri": "s3://bin/etl", "sha256": SHA}


def nodes_of(wf: Workflow) -> dict[str, dict]:
    return {n["name"]: n for n in wf.to_dict()["nodes"]}


def deps(wf: Workflow) -> dict[str, list[str]]:
    return {name: n.get("depends_on", []) for name, n in nodes_of(wf).items()}


def test_a_minimal_node_renders_only_what_was_given() -> None:
    with Workflow("tiny") as wf:
        Node("only", artifact=ART)
    assert wf.to_dict() == {
        "name": "tiny",
        "nodes": [{"name": "only", "task": {"name": "only", "artifact": ART_JSON}}],
    }


def test_every_task_field_renders_under_task() -> None:
    deadline = datetime(2027, 1, 1, tzinfo=UTC)
    with Workflow("full") as wf:
        Node(
            "n",
            artifact=ART,
            args=["--day", param("day")],
            env={"MODE": "fast", "PASSWORD": SecretRef(secret="db")},
            queue="gpu",
            priority=5,
            kind="task",
            input_path="s3://in/x",
            output_path=f"s3://out/{RUN_ID}/n.csv",
            resources=Resources(cpu=2, memory_mb=1024),
            preemptible=True,
            retry=RetryPolicy(max_attempts=3, never=RetryCauses(exit_codes=[2])),
            timeout_s=600,
            max_wait_s=60,
            labels={"team": "data"},
            defer_ok=True,
            deadline=deadline,
            concurrency=Concurrency(key="warehouse", limit=2),
            progress_timeout_s=120,
            task_name="n-task",
        )
    task = nodes_of(wf)["n"]["task"]
    assert task == {
        "name": "n-task",
        "artifact": ART_JSON,
        "args": ["--day", "{{ params.day }}"],
        "env": {"MODE": "fast", "PASSWORD": {"secret": "db"}},
        "queue": "gpu",
        "priority": 5,
        "kind": "task",
        "input_path": "s3://in/x",
        "output_path": "s3://out/{{ run.id }}/n.csv",
        "resources": {"cpu": 2.0, "memory_mb": 1024},
        "preemptible": True,
        "retry": {"max_attempts": 3, "never": {"exit_codes": [2]}},
        "timeout_s": 600,
        "max_wait_s": 60,
        "labels": {"team": "data"},
        "defer_ok": True,
        "deadline": "2027-01-01T00:00:00Z",
        "concurrency": {"key": "warehouse", "limit": 2},
        "progress_timeout_s": 120,
    }


def test_node_takes_every_field_of_a_task_the_service_does_not_set() -> None:
    """A field added to TaskCreate must be added to Node too (this fails until it is)."""
    set_by_service = {"idempotency_key", "run_at", "start_by"}
    task_fields = set(TaskTemplate.model_fields) - set_by_service - {"name"}
    taken = set(inspect.signature(Node).parameters)
    assert task_fields - taken == set()
    assert "task_name" in taken


def test_workflow_options_render_at_the_top() -> None:
    wf = Workflow(
        "opts",
        description="nightly load",
        params={"day": None, "tables": ["a", "b"]},
        team="data",
        max_active_runs=1,
        timeout_s=3600,
        max_active_nodes=4,
        task_timeout_s=900,
        nodes=[Node("x", artifact=ART)],
    )
    body = wf.to_dict()
    del body["nodes"]
    assert body == {
        "name": "opts",
        "team": "data",
        "description": "nightly load",
        "params": {"day": None, "tables": ["a", "b"]},
        "max_active_runs": 1,
        "timeout_s": 3600,
        "max_active_nodes": 4,
        "task_timeout_s": 900,
    }


def test_the_template_constants_render_the_services_templates() -> None:
    assert [RUN_ID, RUN_WORKFLOW, RUN_OWNER, NODE_NAME, NODE_TRY, MAP_ITEM, MAP_INDEX] == [
        "{{ run.id }}",
        "{{ run.workflow }}",
        "{{ run.owner }}",
        "{{ node.name }}",
        "{{ node.try }}",
        "{{ map.item }}",
        "{{ map.index }}",
    ]
    assert FIRE_SLOT.expression == "fire.slot"
    assert f"--day={param('day')}" == "--day={{ params.day }}"
    with pytest.raises(ValueError, match="not a parameter name"):
        param("no-dashes")


def test_rshift_chains_and_fans_out_and_in() -> None:
    with Workflow("ops") as wf:
        a, b, c, d, e = (Node(n, artifact=ART) for n in "abcde")
        assert (a >> b >> c) is c
        assert (c >> [d, e]) == [d, e]
        f = Node("f", artifact=ART)
        assert ([d, e] >> f) is f
    assert deps(wf) == {"a": [], "b": ["a"], "c": ["b"], "d": ["c"], "e": ["c"], "f": ["d", "e"]}


def test_lshift_is_the_other_way_round() -> None:
    with Workflow("left") as wf:
        a, b, c, d = (Node(n, artifact=ART) for n in "abcd")
        assert (c << b << a) is a  # c after b after a
        assert (d << [b, c]) == [b, c]
        x = Node("x", artifact=ART)
        assert ([a, b] << x) is x  # a and b after x
    assert deps(wf) == {"a": ["x"], "b": ["a", "x"], "c": ["b"], "d": ["b", "c"], "x": []}


def test_depends_on_chain_and_set_upstream_and_repeats_are_one_edge() -> None:
    with Workflow("more") as wf:
        a, b, c, d = (Node(n, artifact=ART) for n in "abcd")
        e = Node("e", artifact=ART, depends_on=[a, b])
        chain(a, [b, c], d)
        d.set_upstream(a)
        a >> b
    assert deps(wf) == {"a": [], "b": ["a"], "c": ["a"], "d": ["b", "c", "a"], "e": ["a", "b"]}
    assert e.upstream == (a, b) and set(a.downstream) == {e, b, c, d}


def test_a_dependency_needs_nodes() -> None:
    a = Node("a", artifact=ART)
    with pytest.raises(TypeError, match="between nodes"):
        a >> ["b"]  # type: ignore[operator]


def test_trigger_rules_outputs_and_maps() -> None:
    with Workflow("data", params={"files": ["x", "y"]}) as wf:
        listing = Node(
            "list",
            artifact=ART,
            outputs={
                "files": OutputSpec(),
                "manifest": OutputSpec(path=f"s3://lake/{RUN_ID}/manifest.json"),
                "maybe": OutputSpec(required=False),
            },
            output_path="s3://lake/list.csv",
        )
        each = Node(
            "load",
            artifact=ART,
            args=[MAP_ITEM, MAP_INDEX, listing.output_path],
            map=MapSpec(over=listing.outputs.files, max_items=500),
            outputs=["rows"],
        )
        also = Node("also", artifact=ART, args=[MAP_ITEM], map=param("files"))
        report = Node(
            "report",
            artifact=ART,
            args=[each.outputs.rows, listing.outputs["manifest"]],
            trigger_rule=TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS,
        )
        alert = Node("alert", artifact=ART, trigger_rule="one_failed")
        listing >> [each, also] >> report >> alert
    found = nodes_of(wf)
    assert found["list"]["outputs"] == {
        "files": {},
        "manifest": {"path": "s3://lake/{{ run.id }}/manifest.json"},
        "maybe": {"required": False},
    }
    assert found["load"]["map"] == {"over": "{{ nodes.list.outputs.files }}", "max_items": 500}
    assert found["load"]["task"]["args"] == [
        "{{ map.item }}",
        "{{ map.index }}",
        "{{ nodes.list.output_path }}",
    ]
    assert found["load"]["outputs"] == {"rows": {}}
    assert found["also"]["map"] == {"over": "{{ params.files }}"}
    assert found["report"]["trigger_rule"] == "none_failed_min_one_success"
    assert found["report"]["task"]["args"] == [
        "{{ nodes.load.outputs.rows }}",
        "{{ nodes.list.outputs.manifest }}",
    ]
    assert found["alert"]["trigger_rule"] == "one_failed"
    assert list(listing.outputs) == ["files", "manifest", "maybe"]


def test_referring_to_an_output_a_node_does_not_declare_names_both() -> None:
    a = Node("extract", artifact=ART, outputs=["rows"])
    with pytest.raises(DefinitionError, match=r"node 'extract' declares no output 'row' .*rows"):
        _ = a.outputs.row
    with pytest.raises(DefinitionError, match="node 'extract' has no output_path"):
        _ = a.output_path
    mapped = Node("m", artifact=ART, output_path="s3://x/y", map=param("items"))
    with pytest.raises(DefinitionError, match="node 'm' is mapped"):
        _ = mapped.output_path


def test_a_bad_field_is_refused_when_the_node_is_made_naming_it() -> None:
    with pytest.raises(DefinitionError, match=r"node 'n': task.priority: .*less than or equal"):
        Node("n", artifact=ART, priority=1000)
    with pytest.raises(DefinitionError, match=r"node 'bad name': name: String should match"):
        Node("bad name", artifact=ART)
    with pytest.raises(DefinitionError, match=r"node 'n': trigger_rule: Input should be"):
        Node("n", artifact=ART, trigger_rule="most_success")
    with pytest.raises(DefinitionError, match=r"node 'n': task.env: .*CAIRN_"):
        Node("n", artifact=ART, env={"CAIRN_TOKEN": "x"})
    with pytest.raises(DefinitionError, match=r"node 'n': map.over"):
        Node("n", artifact=ART, map="not a template")
    with pytest.raises(DefinitionError, match="is not a workflow name"):
        Workflow("Upper Case")


def test_a_cycle_is_refused_with_its_path_before_anything_is_sent() -> None:
    with Workflow("loop") as wf:
        a, b, c = (Node(n, artifact=ART) for n in "abc")
        a >> b >> c >> a
    with pytest.raises(DefinitionError) as caught:
        wf.render()
    assert str(caught.value) == "workflow 'loop': the nodes form a cycle: a -> b -> c -> a"
    assert caught.value.extra["cycle"] == ["a", "b", "c", "a"]
    assert caught.value.status == 422


def test_a_dependency_outside_the_workflow_is_refused_naming_both_nodes() -> None:
    stray = Node("stray", artifact=ART)
    other = Node("other", artifact=ART)
    wf = Workflow("w", nodes=[Node("load", artifact=ART)])
    wf["load"].set_upstream(stray)  # the stray node joins w
    assert stray.workflow is wf
    loose_up, loose_down = Node("up", artifact=ART), Node("down", artifact=ART)
    loose_up >> loose_down
    wf.add(loose_down)  # up is left outside
    with pytest.raises(DefinitionError, match="node 'down' depends on 'up', which is not one"):
        wf.render()
    w2 = Workflow("w2", nodes=[other])
    with pytest.raises(DefinitionError, match="node 'load' of workflow 'w' cannot depend on node"):
        other >> wf["load"]
    del w2


def test_duplicate_names_and_a_node_in_two_workflows_are_refused() -> None:
    with Workflow("dup") as wf:
        Node("a", artifact=ART)
        with pytest.raises(DefinitionError, match="workflow 'dup' already has a node named 'a'"):
            Node("a", artifact=ART)
    with pytest.raises(DefinitionError, match="node 'a' is already in workflow 'dup'"):
        Workflow("other", nodes=[wf["a"]])
    with pytest.raises(DefinitionError, match="workflow 'empty' has no nodes"):
        Workflow("empty").render()
    with pytest.raises(DefinitionError, match="two workflows are named 'dup'"):
        render_all([wf, Workflow("dup", nodes=[Node("b", artifact=ART)])])


def test_the_services_graph_checks_name_the_node_and_the_field() -> None:
    with Workflow("refs") as wf:
        a = Node("a", artifact=ART, outputs=["rows"])
        Node("b", artifact=ART, args=[a.outputs.rows])  # not downstream of a
    with pytest.raises(DefinitionError) as caught:
        wf.render()
    assert str(caught.value) == "workflow 'refs': node 'b': task.args.0: 'a' is not upstream of 'b'"
    assert caught.value.extra["errors"] == [
        {"field": "body.nodes.1.task.args.0", "node": "b", "reason": "'a' is not upstream of 'b'"}
    ]
    with Workflow("tpl") as wf2:
        Node("c", artifact=ART, args=["{{ nope }}", MAP_ITEM])
    with pytest.raises(DefinitionError, match=r"node 'c': task.args.0: unknown template .*more"):
        wf2.render()


def test_workflow_bounds_are_refused_naming_the_field() -> None:
    wf = Workflow("big", timeout_s=10**9, nodes=[Node("a", artifact=ART)])
    with pytest.raises(DefinitionError, match=r"workflow 'big': timeout_s: .*less than or equal"):
        wf.render()


def test_a_rendered_definition_is_what_the_service_validates_from_its_json() -> None:
    """Round trip: the SDK's JSON read by the service's model and graph gives the same
    definition, and the same as the one written by hand in docs/dag.md's shape."""
    with Workflow("daily-files", timeout_s=3600, max_active_nodes=8) as wf:
        listing = Node(
            "list",
            artifact=ART,
            outputs={"files": OutputSpec(), "manifest": OutputSpec(path="s3://lake/m.json")},
        )
        load = Node(
            "load",
            artifact=ART,
            args=[MAP_ITEM],
            map=MapSpec(over=listing.outputs.files, max_items=500),
            outputs=["rows"],
        )
        report = Node(
            "report",
            artifact=ART,
            args=[load.outputs.rows, listing.outputs.manifest],
            trigger_rule="none_failed_min_one_success",
        )
        listing >> load >> report
    by_hand = {
        "name": "daily-files",
        "timeout_s": 3600,
        "max_active_nodes": 8,
        "nodes": [
            {
                "name": "list",
                "task": {"artifact": ART_JSON},
                "outputs": {"files": {}, "manifest": {"path": "s3://lake/m.json"}},
            },
            {
                "name": "load",
                "depends_on": ["list"],
                "task": {"args": ["{{ map.item }}"], "artifact": ART_JSON},
                "map": {"over": "{{ nodes.list.outputs.files }}", "max_items": 500},
                "outputs": {"rows": {}},
            },
            {
                "name": "report",
                "depends_on": ["load"],
                "trigger_rule": "none_failed_min_one_success",
                "task": {
                    "args": ["{{ nodes.load.outputs.rows }}", "{{ nodes.list.outputs.manifest }}"],
                    "artifact": ART_JSON,
                },
            },
        ],
    }
    rendered = wf.render()
    from_json = WorkflowCreate.model_validate_json(rendered.model_dump_json(exclude_unset=True))
    assert from_json == rendered == WorkflowCreate.model_validate(by_hand)
    assert json.loads(wf.to_json()) == WorkflowCreate.model_validate(by_hand).model_dump(
        mode="json", exclude_unset=True
    )
    dag = graph.build(from_json)
    assert dag.order == ("list", "load", "report")
    assert dag.upstream == {"list": (), "load": ("list",), "report": ("load",)}


def test_extra_carries_fields_the_sdk_has_no_keyword_for_checked_all_the_same() -> None:
    with Workflow("x", extra={"max_active_runs": 2}) as wf:
        Node("a", artifact=ART, extra={"trigger_rule": "all_done"})
    assert wf.to_dict()["max_active_runs"] == 2
    assert nodes_of(wf)["a"]["trigger_rule"] == "all_done"
    with pytest.raises(DefinitionError, match=r"node 'b': not_a_field: Extra inputs"):
        Node("b", artifact=ART, extra={"not_a_field": 1})
    with pytest.raises(DefinitionError, match="node 'c': extra may not set depends_on"):
        Node("c", artifact=ART, extra={"depends_on": ["a"]})
    with pytest.raises(DefinitionError, match="workflow 'y': extra may not set nodes"):
        Workflow("y", extra={"nodes": []})


def test_sub_workflows_and_approval_gates_render_what_the_service_validates() -> None:
    with Workflow("child", params={"day": "x"}) as child:
        Node("count", artifact=ART, args=[param("day")], outputs=["total"])
    with Workflow("release", params={"day": "2026-12-05"}) as wf:
        prep = Node("prep", artifact=ART, outputs=["day"])
        sub = SubWorkflow("sub", child, params={"day": prep.outputs.day}, outputs=["total"])
        pinned = SubWorkflow("pinned", "child", version=2, params={"day": param("day")})
        gate = Approval(
            "sign-off", timeout_s=3600, on_timeout="reject", people=["carol"], team="ops",
            trigger_rule="all_done",
        )  # fmt: skip
        ship = Node("ship", artifact=ART, args=[sub.outputs.total])
        prep >> [sub, pinned] >> gate >> ship
    by_hand = [
        {"name": "prep", "task": {"artifact": ART_JSON}, "outputs": {"day": {}}},
        {
            "name": "sub",
            "depends_on": ["prep"],
            "workflow": {"name": "child", "params": {"day": "{{ nodes.prep.outputs.day }}"}},
            "outputs": {"total": {}},
        },
        {
            "name": "pinned",
            "depends_on": ["prep"],
            "workflow": {"name": "child", "version": 2, "params": {"day": "{{ params.day }}"}},
        },
        {
            "name": "sign-off",
            "depends_on": ["sub", "pinned"],
            "trigger_rule": "all_done",
            "approval": {
                "timeout_s": 3600,
                "on_timeout": "reject",
                "approvers": {"people": ["carol"], "team": "ops"},
            },
        },
        {
            "name": "ship",
            "depends_on": ["sign-off"],
            "task": {"artifact": ART_JSON, "args": ["{{ nodes.sub.outputs.total }}"]},
        },
    ]
    rendered = wf.render()
    assert rendered == WorkflowCreate.model_validate(
        {"name": "release", "params": {"day": "2026-12-05"}, "nodes": by_hand}
    )
    assert nodes_of(wf)["sub"] == by_hand[1]
    assert "task" not in nodes_of(wf)["sign-off"]
    dag = graph.build(WorkflowCreate.model_validate_json(wf.to_json()))
    assert dag.upstream["ship"] == ("sign-off",)
    assert child.render().nodes[0].outputs == {"total": OutputSpec()}
    with pytest.raises(DefinitionError, match=r"node 'bad': approval\.timeout_s"):
        Approval("bad", timeout_s=0, on_timeout="approve")
    with Workflow("w") as broken:
        SubWorkflow("s", "child", params={"day": "{{ nodes.nowhere.outputs.x }}"})
    with pytest.raises(DefinitionError, match=r"node 's': workflow\.params\.day: 'nowhere' is not"):
        broken.render()


def test_an_event_node_renders_without_a_task_and_hands_its_data_on() -> None:
    with Workflow("settle") as wf:
        invoice = Node("invoice", artifact=ART)
        paid = WaitForEvent("paid", event="payment-received", timeout_s=3600, outputs=["amount"])
        ship = Node("ship", artifact=ART, args=[paid.outputs.amount])
        invoice >> paid >> ship
    found = nodes_of(wf)
    assert found["paid"] == {
        "name": "paid",
        "event": {"name": "payment-received", "timeout_s": 3600, "on_timeout": "fail"},
        "outputs": {"amount": {}},
        "depends_on": ["invoice"],
    }
    assert found["ship"]["task"]["args"] == ["{{ nodes.paid.outputs.amount }}"]
    definition = WorkflowCreate.model_validate(wf.to_dict())
    assert definition == wf.render()
    assert graph.build(definition).order == ("invoice", "paid", "ship")
    with pytest.raises(DefinitionError, match=r"node 'late'.*timeout_s"):
        WaitForEvent("late", event="e", timeout_s=0)
    with pytest.raises(DefinitionError, match=r"node 'bad'.*an event node cannot map"):
        WaitForEvent("bad", event="e", timeout_s=5, extra={"map": {"over": "{{ params.x }}"}})
