"""Random DAGs with random trigger rules, random branch conditions (over the run's
params and upstream outputs) and random outcomes, checked against an oracle that
evaluates the conditions itself: which nodes run, which are skipped, which fail because
their condition could not be evaluated, and how the run ends."""

from __future__ import annotations

import itertools
import json
from typing import Any

import networkx as nx
import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.common.dag_models import NodeState, TriggerRule
from services.dag.domain import rules
from services.dag.domain.conditions import decide, parse_condition
from tests.fixtures.dag import Runner, Worker, node, workflow
from tests.integration.dag.test_property import FAILED, _runs, graphs

_names = itertools.count()
Cond = tuple[Any, ...]


class Broken(Exception):
    """The oracle's condition could not be evaluated (null ordered against a number)."""


@st.composite
def conditions(draw: st.DrawFn, ancestors: list[str], depth: int = 0) -> Cond:
    if depth < 2 and draw(st.integers(0, 3)) == 0:
        kind = draw(st.sampled_from(["not", "and", "or"]))
        parts = [draw(conditions(ancestors, depth + 1)) for _ in range(1 if kind == "not" else 2)]
        return (kind, *parts)
    op = draw(st.sampled_from(["==", "!=", "<", ">=", "in"]))
    value = draw(st.lists(st.integers(0, 2), max_size=2)) if op == "in" else draw(st.integers(0, 2))
    if ancestors and draw(st.booleans()):
        return ("output", draw(st.sampled_from(ancestors)), op, value)
    return ("param", draw(st.integers(0, 1)), op, value)


def text(cond: Cond) -> str:
    if cond[0] == "not":
        return f"not ({text(cond[1])})"
    if cond[0] in ("and", "or"):
        return f"({text(cond[1])}) {cond[0]} ({text(cond[2])})"
    kind, what, op, value = cond
    ref = f"params.p{what}" if kind == "param" else f"nodes.{what}.outputs.v"
    return f"{ref} {op} {json.dumps(value)}"


def truth(cond: Cond, params: dict[str, int], out: dict[str, int]) -> bool:
    """The oracle's evaluation, with Python's own operators and short-circuits."""
    if cond[0] == "not":
        return not truth(cond[1], params, out)
    if cond[0] == "and":
        return truth(cond[1], params, out) and truth(cond[2], params, out)
    if cond[0] == "or":
        return truth(cond[1], params, out) or truth(cond[2], params, out)
    kind, what, op, value = cond
    left = params[f"p{what}"] if kind == "param" else out.get(what)
    if op in ("<", ">=") and left is None:
        raise Broken
    return {
        "==": lambda: left == value,
        "!=": lambda: left != value,
        "<": lambda: left < value,
        ">=": lambda: left >= value,
        "in": lambda: left in value,
    }[op]()


@st.composite
def branching(draw: st.DrawFn) -> tuple[Any, ...]:
    graph, rule, fails = draw(graphs())
    when: dict[str, Cond] = {}
    for name in graph:
        if draw(st.booleans()):
            when[name] = draw(conditions(sorted(nx.ancestors(graph, name))))
    value = {name: draw(st.integers(0, 2)) for name in graph}
    params = {"p0": draw(st.integers(0, 2)), "p1": draw(st.integers(0, 2))}
    return graph, rule, fails, when, value, params


def expected(case: tuple[Any, ...]) -> tuple[dict[str, str], set[str], str]:
    """Each node's final state, the nodes whose task ran, and the run's outcome."""
    graph, rule, fails, when, value, params = case
    final: dict[str, str] = {}
    ran: set[str] = set()
    for name in nx.topological_sort(graph):
        verdict = _runs(rule[name], [final[up] for up in graph.predecessors(name)])
        if verdict is not True:
            final[name] = str(verdict)
            continue
        if name in when:
            out = {n: value[n] for n, s in final.items() if s == "succeeded"}
            try:
                holds = truth(when[name], params, out)
            except Broken:
                final[name] = "failed"
                continue
            if not holds:
                final[name] = "skipped"
                continue
        ran.add(name)
        final[name] = "failed" if fails[name] else "succeeded"
    leaves = [n for n in graph if graph.out_degree(n) == 0]
    outcome = "failed" if any(final[n] in FAILED for n in leaves) else "succeeded"
    return final, ran, outcome


@settings(max_examples=600, deadline=None)
@given(branching(), st.data())
def test_branches_settle_as_the_oracle_says_in_any_order_of_outcomes(case, data) -> None:
    graph, rule, fails, when, value, params = case
    order = list(nx.topological_sort(graph))
    upstream = {n: list(graph.predecessors(n)) for n in order}
    parsed = {n: parse_condition(text(c)) for n, c in when.items()}
    state = dict.fromkeys(order, NodeState.PENDING)

    def settle() -> None:
        while True:
            changed = rules.settle(order, upstream, rule, state)
            gated = {
                n: parsed[n] for n, s in changed.items() if s is NodeState.READY and n in parsed
            }
            outputs = {n: {"v": value[n]} for n in order if state[n] is NodeState.SUCCEEDED}
            decided = decide(gated, state, params, outputs)
            for name, (to, _) in decided.items():
                state[name] = to
            if all(to is NodeState.PENDING for to, _ in decided.values()):
                return

    settle()
    while ready := sorted(n for n, s in state.items() if s is NodeState.READY):
        finished = data.draw(st.sampled_from(ready))
        state[finished] = NodeState.FAILED if fails[finished] else NodeState.SUCCEEDED
        settle()
    final, _, outcome = expected(case)
    assert {n: str(s) for n, s in state.items()} == final
    leaves = [n for n in order if graph.out_degree(n) == 0]
    assert rules.run_outcome(leaves, state) == outcome


def test_a_rule_met_early_waits_for_the_node_its_condition_reads() -> None:
    order, upstream = ["a", "b", "c"], {"a": [], "b": [], "c": ["a", "b"]}
    rule = {"a": TriggerRule.ALL_SUCCESS, "b": TriggerRule.ALL_SUCCESS}
    rule["c"] = TriggerRule.ONE_SUCCESS
    gated = {"c": parse_condition("nodes.b.outputs.v == 1")}
    state = {"a": NodeState.SUCCEEDED, "b": NodeState.RUNNING, "c": NodeState.PENDING}
    assert rules.settle(order, upstream, rule, state) == {"c": NodeState.READY}
    assert decide(gated, state, {}, {"a": {"v": 0}}) == {"c": (NodeState.PENDING, None)}
    state["b"] = NodeState.SUCCEEDED
    assert decide(gated, state, {}, {"b": {"v": 1}}) == {"c": (NodeState.READY, None)}


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=branching())
def test_random_branching_runs_end_as_the_oracle_says(
    runner: Runner, worker: Worker, db: psycopg.Connection, case
) -> None:
    graph, rule, fails, when, value, params = case
    name = f"branching-{next(_names)}"
    nodes = [
        node(
            n,
            *graph.predecessors(n),
            args=("fail",) if fails[n] else ("out", json.dumps({"v": value[n]})),
            trigger_rule=rule[n],
            outputs={"v": {}},
            **({"when": text(when[n])} if n in when else {}),
        )
        for n in graph
    ]
    run = runner.run(workflow(name, nodes, params={"p0": 0, "p1": 0}), params=params, timeout=60)
    final, ran, outcome = expected(case)
    stored = db.execute(
        "SELECT name, state, task_id FROM dag.nodes WHERE run_id = %s", (run["id"],)
    ).fetchall()
    assert {n: s for n, s, _ in stored} == final
    assert {n for n, _, task in stored if task is not None} == ran
    assert run["state"] == outcome
