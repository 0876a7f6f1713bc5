"""Trigger rules: what a node becomes given its upstream nodes' states, and how a run
ends. Pure functions over states; the engine applies them and the database guards them."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Literal

from libs.common.dag_models import NODE_FAILED, NODE_FINAL, NodeState, RunState, TriggerRule

Verdict = Literal["wait", "ready", "upstream_failed", "skipped"]

S = NodeState


def _all_success(done: bool, failed: bool, upstream: Collection[NodeState]) -> Verdict:
    if failed:
        return "upstream_failed"
    if not done:
        # A skip decides only once the rest ended: a later failure must win, whatever
        # order the outcomes arrive in.
        return "wait"
    return "ready" if all(state is S.SUCCEEDED for state in upstream) else "skipped"


def _all_done(done: bool, failed: bool, upstream: Collection[NodeState]) -> Verdict:
    return "ready" if done else "wait"


def _one_failed(done: bool, failed: bool, upstream: Collection[NodeState]) -> Verdict:
    if failed:
        return "ready"
    return "skipped" if done else "wait"


def _one_success(done: bool, failed: bool, upstream: Collection[NodeState]) -> Verdict:
    if any(state is S.SUCCEEDED for state in upstream):
        return "ready"
    if not done:
        return "wait"
    return "upstream_failed" if failed else "skipped"


def _none_failed(done: bool, failed: bool, upstream: Collection[NodeState]) -> Verdict:
    if failed:
        return "upstream_failed"
    return "ready" if done else "wait"


_RULES = {
    TriggerRule.ALL_SUCCESS: _all_success,
    TriggerRule.ALL_DONE: _all_done,
    TriggerRule.ONE_FAILED: _one_failed,
    TriggerRule.ONE_SUCCESS: _one_success,
    TriggerRule.NONE_FAILED: _none_failed,
}


def verdict(rule: TriggerRule, upstream: Collection[NodeState]) -> Verdict:
    """What a pending node with these upstream states becomes now: ``failed`` counts
    ``failed`` and ``upstream_failed``; a rule that fails early does not wait for the rest."""
    if not upstream:
        return "ready"
    done = all(state in NODE_FINAL for state in upstream)
    failed = any(state in NODE_FAILED for state in upstream)
    return _RULES[rule](done, failed, upstream)


def settle(
    order: Collection[str],
    upstream: Mapping[str, Collection[str]],
    rules: Mapping[str, TriggerRule],
    states: dict[str, NodeState],
) -> dict[str, NodeState]:
    """Apply the rules to every pending node, in topological ``order`` so that a skip or
    an upstream failure flows down in one pass; return the nodes that changed."""
    changed: dict[str, NodeState] = {}
    for name in order:
        if states[name] is not S.PENDING:
            continue
        outcome = verdict(rules[name], [states[up] for up in upstream[name]])
        if outcome != "wait":
            states[name] = changed[name] = S(outcome)
    return changed


def run_outcome(leaves: Collection[str], states: Mapping[str, NodeState]) -> RunState | None:
    """How the run ends once every node has: failed when a leaf failed or could not run
    because of a failure, else succeeded. None while a node is still open."""
    if any(state not in NODE_FINAL for state in states.values()):
        return None
    if any(states[leaf] in NODE_FAILED or states[leaf] is S.CANCELLED for leaf in leaves):
        return RunState.FAILED
    return RunState.SUCCEEDED
