"""Runs against a real core and PostgreSQL: nodes released as core tasks, outcomes learnt
from core's event feed, trigger rules on failures, cancel, retry, max_active_runs."""

from __future__ import annotations

import psycopg
import pytest

from tests.dag.conftest import DagServer, Runner, Worker, node, states, workflow
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
    assert tasks["sink"]["created_at"] > max(t["finished_at"] for n, t in tasks.items() if n != "sink")


def test_a_chain_of_50_runs_in_order(runner: Runner, worker: Worker, db: psycopg.Connection) -> None:
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
