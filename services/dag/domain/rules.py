"""Trigger rules: what a node becomes given its upstream nodes' states, and how a run
ends. Pure functions over states; the engine applies them and the database guards them."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
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


# The four below follow Airflow's TriggerRuleDep: what fails a rule early, and what a
# node whose rule can no longer be met becomes.


def _none_failed_min_one_success(
    done: bool, failed: bool, upstream: Collection[NodeState]
) -> Verdict:
    if failed:
        return "upstream_failed"
    if not done:
        return "wait"
    return "ready" if any(state is S.SUCCEEDED for state in upstream) else "skipped"


def _all_failed(done: bool, failed: bool, upstream: Collection[NodeState]) -> Verdict:
    if any(state in (S.SUCCEEDED, S.SKIPPED) for state in upstream):
        return "skipped"
    if not done:
        return "wait"
    return "ready" if all(state in NODE_FAILED for state in upstream) else "skipped"


def _one_done(done: bool, failed: bool, upstream: Collection[NodeState]) -> Verdict:
    # Airflow counts a task that ran: succeeded or failed, not upstream_failed.
    if any(state in (S.SUCCEEDED, S.FAILED) for state in upstream):
        return "ready"
    return "skipped" if done else "wait"


def _always(done: bool, failed: bool, upstream: Collection[NodeState]) -> Verdict:
    return "ready"


_RULES = {
    TriggerRule.ALL_SUCCESS: _all_success,
    TriggerRule.ALL_DONE: _all_done,
    TriggerRule.ONE_FAILED: _one_failed,
    TriggerRule.ONE_SUCCESS: _one_success,
    TriggerRule.NONE_FAILED: _none_failed,
    TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS: _none_failed_min_one_success,
    TriggerRule.ALL_FAILED: _all_failed,
    TriggerRule.ONE_DONE: _one_done,
    TriggerRule.ALWAYS: _always,
}


def verdict(rule: TriggerRule, upstream: Collection[NodeState]) -> Verdict:
    """What a pending node with these upstream states becomes now: ``failed`` counts
    ``failed`` and ``upstream_failed``; a rule that fails early does not wait for the rest."""
    if not upstream:
        return "ready"
    done = all(state in NODE_FINAL for state in upstream)
    failed = any(state in NODE_FAILED for state in upstream)
    return _RULES[rule](done, failed, upstream)


def mapped_outcome(instances: Collection[NodeState]) -> NodeState | None:
    """How a mapped node ends once all its instances have: failed if one did (or was
    cancelled), else succeeded. None while one is open."""
    if any(state not in NODE_FINAL for state in instances):
        return None
    if any(state in NODE_FAILED or state is S.CANCELLED for state in instances):
        return S.FAILED
    return S.SUCCEEDED


def settle(
    order: Collection[str],
    upstream: Mapping[str, Collection[str]],
    rules: Mapping[str, TriggerRule],
    states: dict[str, NodeState],
    instances: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, NodeState]:
    """Apply the rules to every pending node, in topological ``order`` so that a skip or
    an upstream failure flows down in one pass; return the nodes that changed.

    ``instances`` names the instances of mapped nodes (in ``states`` too): a mapped node
    ends when they all have, and its downstream nodes' rules count each instance as an
    upstream node of its own (as Airflow's mapped tasks do)."""
    instances = instances or {}
    changed: dict[str, NodeState] = {}

    def seen(up: str) -> list[NodeState]:
        mine = instances.get(up)
        return [states[i] for i in mine] if mine else [states[up]]

    for name in order:
        if states[name] is S.MAPPED:
            ended = mapped_outcome([states[i] for i in instances.get(name, ())])
            if ended is not None:
                states[name] = changed[name] = ended
            continue
        if states[name] is not S.PENDING:
            continue
        outcome = verdict(rules[name], [s for up in upstream[name] for s in seen(up)])
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
