"""Random DAGs with random trigger rules and random node outcomes, checked against an
oracle written with networkx: what each node ends as, that no node was released before
its rule was met, and that every run ends."""

from __future__ import annotations

import itertools
from datetime import datetime
from typing import Any

import networkx as nx
import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.common.dag_models import NodeState, TriggerRule
from services.dag.domain import rules
from tests.fixtures.dag import Runner, Worker, node, states, workflow

FAILED = {"failed", "upstream_failed"}
_names = itertools.count()


@st.composite
def graphs(draw: st.DrawFn) -> tuple[nx.DiGraph, dict[str, TriggerRule], dict[str, bool]]:
    n = draw(st.integers(1, 7))
    names = [f"n{i}" for i in range(n)]
    pairs = [(a, b) for a, b in itertools.combinations(range(n), 2)]
    edges = draw(st.sets(st.sampled_from(pairs), max_size=12)) if pairs else set()
    graph: nx.DiGraph = nx.DiGraph()
    graph.add_nodes_from(names)
    graph.add_edges_from((names[a], names[b]) for a, b in edges)
    rule = {name: draw(st.sampled_from(list(TriggerRule))) for name in names}
    fails = {name: draw(st.booleans()) for name in names}
    return graph, rule, fails


def _runs(rule: TriggerRule, ups: list[str]) -> bool | str:
    """The oracle: given the upstream nodes' final states, True if the node runs, else
    the state it ends in."""
    if not ups:
        return True
    failed = any(s in FAILED for s in ups)
    succeeded = [s == "succeeded" for s in ups]
    runs = {
        TriggerRule.ALL_SUCCESS: all(succeeded),
        TriggerRule.ALL_DONE: True,
        TriggerRule.ONE_FAILED: failed,
        TriggerRule.ONE_SUCCESS: any(succeeded),
        TriggerRule.NONE_FAILED: not failed,
        TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS: not failed and any(succeeded),
        TriggerRule.ALL_FAILED: all(s in FAILED for s in ups),
        TriggerRule.ONE_DONE: any(s in ("succeeded", "failed") for s in ups),
        TriggerRule.ALWAYS: True,
    }[rule]
    if runs:
        return True
    if rule in (TriggerRule.ONE_FAILED, TriggerRule.ALL_FAILED, TriggerRule.ONE_DONE):
        return "skipped"
    return "upstream_failed" if failed else "skipped"


def expected(
    graph: nx.DiGraph, rule: dict[str, TriggerRule], fails: dict[str, bool]
) -> tuple[dict[str, str], str]:
    final: dict[str, str] = {}
    for name in nx.topological_sort(graph):
        verdict = _runs(rule[name], [final[up] for up in graph.predecessors(name)])
        final[name] = (
            ("failed" if fails[name] else "succeeded") if verdict is True else str(verdict)
        )
    leaves = [n for n in graph if graph.out_degree(n) == 0]
    return final, "failed" if any(final[n] in FAILED for n in leaves) else "succeeded"


@settings(max_examples=300, deadline=None)
@given(graphs())
def test_settling_node_by_node_ends_as_the_oracle_says(case) -> None:
    graph, rule, fails = case
    order = list(nx.topological_sort(graph))
    upstream = {n: list(graph.predecessors(n)) for n in order}
    state = dict.fromkeys(order, NodeState.PENDING)
    rules.settle(order, upstream, rule, state)
    while ready := [n for n in order if state[n] is NodeState.READY]:
        finished = ready[0]
        for up in upstream[finished]:
            assert state[up] in (
                NodeState.SUCCEEDED,
                NodeState.FAILED,
                NodeState.UPSTREAM_FAILED,
                NodeState.SKIPPED,
            )
        state[finished] = NodeState.FAILED if fails[finished] else NodeState.SUCCEEDED
        rules.settle(order, upstream, rule, state)
    final, outcome = expected(graph, rule, fails)
    assert {n: str(s) for n, s in state.items()} == final
    assert rules.run_outcome([n for n in order if graph.out_degree(n) == 0], state) == outcome


def _met_at(rule: TriggerRule, ups: list[tuple[str, datetime]], at: datetime) -> bool:
    """Was the rule met at ``at``, knowing only the upstream nodes that had ended by then?"""
    ended = [state for state, when in ups if when < at]
    if not ups:
        return True
    if rule is TriggerRule.ONE_FAILED:
        return any(s in FAILED for s in ended)
    if rule is TriggerRule.ONE_SUCCESS:
        return "succeeded" in ended
    if rule is TriggerRule.ONE_DONE:
        return any(s in ("succeeded", "failed") for s in ended)
    if rule is TriggerRule.ALWAYS:
        return True
    if len(ended) < len(ups):
        return False
    return _runs(rule, ended) is True


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=graphs())
def test_random_runs_release_nodes_only_when_their_rule_is_met_and_end(
    runner: Runner, worker: Worker, db: psycopg.Connection, case
) -> None:
    graph, rule, fails = case
    name = f"random-{next(_names)}"
    nodes = [
        node(n, *graph.predecessors(n), args=("fail" if fails[n] else "ok",), trigger_rule=rule[n])
        for n in graph
    ]
    run = runner.run(workflow(name, nodes), timeout=60)
    final, outcome = expected(graph, rule, fails)
    assert states(run) == final
    assert run["state"] == outcome
    rows = db.execute(
        "SELECT n.name, n.state, COALESCE(t.finished_at, n.updated_at), t.created_at"
        " FROM dag.nodes n LEFT JOIN core.tasks t ON t.id = n.task_id WHERE n.run_id = %s",
        (run["id"],),
    ).fetchall()
    ended = {r[0]: (r[1], r[2]) for r in rows}
    released = {r[0]: r[3] for r in rows if r[3] is not None}
    assert set(released) == {n for n, s in final.items() if s in ("succeeded", "failed")}
    for child, at in released.items():
        ups = [ended[up] for up in graph.predecessors(child)]
        assert _met_at(rule[child], ups, at), f"{child} released before its rule was met"


@st.composite
def mapped_graphs(draw: st.DrawFn) -> tuple[Any, ...]:
    """A random graph where some nodes map over 0 to 3 items, each failing or not."""
    graph, rule, fails = draw(graphs())
    width = {n: draw(st.one_of(st.none(), st.integers(0, 3))) for n in graph}
    item_fails = {n: [draw(st.booleans()) for _ in range(width[n] or 0)] for n in graph}
    return graph, rule, fails, width, item_fails


def expected_mapped(
    graph: nx.DiGraph, rule: dict, fails: dict, width: dict, item_fails: dict
) -> dict[str, str]:
    """The oracle over mapped nodes: downstream rules see each instance as an upstream
    node; an empty map is skipped; a mapped node fails when one instance did."""
    final: dict[str, str] = {}
    for name in nx.topological_sort(graph):
        ups: list[str] = []
        for up in graph.predecessors(name):
            ran = width[up] and final[up] in ("succeeded", "failed")
            ups += [final[f"{up}[{i}]"] for i in range(width[up])] if ran else [final[up]]
        verdict = _runs(rule[name], ups)
        if verdict is not True:
            final[name] = str(verdict)
        elif width[name] is None:
            final[name] = "failed" if fails[name] else "succeeded"
        elif width[name] == 0:
            final[name] = "skipped"
        else:
            for i, failing in enumerate(item_fails[name]):
                final[f"{name}[{i}]"] = "failed" if failing else "succeeded"
            final[name] = "failed" if any(item_fails[name]) else "succeeded"
    return final


@settings(max_examples=300, deadline=None)
@given(mapped_graphs(), st.data())
def test_mapped_nodes_settle_as_the_oracle_says_in_any_order_of_outcomes(case, data) -> None:
    graph, rule, fails, width, item_fails = case
    order = list(nx.topological_sort(graph))
    upstream = {n: list(graph.predecessors(n)) for n in order}
    state = dict.fromkeys(order, NodeState.PENDING)
    instances: dict[str, list[str]] = {}
    outcome: dict[str, bool] = {n: fails[n] for n in order}

    def settle() -> None:
        while True:
            changed = rules.settle(order, upstream, rule, state, instances)
            expand = [
                n for n, s in changed.items() if s is NodeState.READY and width[n] is not None
            ]
            if not expand:
                return
            for name in expand:
                if width[name] == 0:
                    state[name] = NodeState.SKIPPED
                    continue
                instances[name] = [f"{name}[{i}]" for i in range(width[name])]
                state[name] = NodeState.MAPPED
                for i, one in enumerate(instances[name]):
                    state[one] = NodeState.READY
                    outcome[one] = item_fails[name][i]

    settle()
    while ready := sorted(n for n, s in state.items() if s is NodeState.READY):
        finished = data.draw(st.sampled_from(ready))
        state[finished] = NodeState.FAILED if outcome[finished] else NodeState.SUCCEEDED
        settle()
    assert {n: str(s) for n, s in state.items()} == expected_mapped(
        graph, rule, fails, width, item_fails
    )
