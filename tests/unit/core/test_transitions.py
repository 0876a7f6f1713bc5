"""The table of legal moves (``services.core.domain.transitions``) against the design's
task lifecycle: what is final, who may leave it, and what every op refuses."""

from __future__ import annotations

import itertools

import pytest

from libs.common.errors import IllegalTransition
from libs.common.states import ACTIVE, FINAL, TaskState
from services.core.domain.transitions import ALLOWED, TRANSITIONS, Op, check, sources

S = TaskState
SOURCES: list[TaskState | None] = [None, *TaskState]
EVERY_MOVE = list(itertools.product(Op, SOURCES, TaskState))


def _ops_leaving(state: TaskState) -> set[Op]:
    return {op for op, rule in TRANSITIONS.items() if state in rule.sources}


def test_every_op_has_a_rule_with_sources_and_targets() -> None:
    assert set(TRANSITIONS) == set(Op)
    for rule in TRANSITIONS.values():
        assert rule.sources and rule.targets


def test_final_and_active_states_split_the_states() -> None:
    assert {S.SUCCEEDED, S.DEAD, S.CANCELLED} == FINAL
    assert set(TaskState) == ACTIVE | FINAL and not ACTIVE & FINAL


def test_succeeded_is_final_for_good() -> None:
    assert _ops_leaving(S.SUCCEEDED) == set()
    assert not [pair for pair in ALLOWED if pair[0] is S.SUCCEEDED]


@pytest.mark.parametrize("state", [S.DEAD, S.CANCELLED])
def test_dead_and_cancelled_leave_only_by_a_persons_retry(state: TaskState) -> None:
    assert _ops_leaving(state) == {Op.RETRY}
    assert {dst for src, dst in ALLOWED if src is state} == {S.WAITING, S.READY}


def test_retry_takes_dead_failed_and_cancelled_back_to_ready_or_waiting() -> None:
    rule = TRANSITIONS[Op.RETRY]
    assert rule.sources == {S.DEAD, S.FAILED, S.CANCELLED}
    assert rule.targets == {S.WAITING, S.READY}


def test_failed_is_not_final_and_goes_back_to_waiting() -> None:
    assert S.FAILED not in FINAL
    assert (S.FAILED, S.WAITING) in ALLOWED
    assert Op.PROMOTE in _ops_leaving(S.FAILED)


def test_only_submit_starts_from_nothing() -> None:
    assert {op for op in Op if None in TRANSITIONS[op].sources} == {Op.SUBMIT}
    assert TRANSITIONS[Op.SUBMIT].targets == {S.READY, S.WAITING}


def test_only_claim_leads_to_running_from_waiting_or_due_ready() -> None:
    assert {(src, op) for op in Op for src, dst in _pairs(op) if dst is S.RUNNING} == {
        (S.WAITING, Op.CLAIM),
        (S.READY, Op.CLAIM),
    }


def test_the_claims_sql_guards_are_the_claims_sources() -> None:
    from services.core.db import attempts as attempts_db

    guards = {attempts_db._FROM_WAITING, attempts_db._FROM_READY}
    assert guards == set(sources(Op.CLAIM, S.RUNNING))


def test_nothing_moves_a_task_to_the_state_it_is_in() -> None:
    assert not [pair for pair in ALLOWED if pair[0] == pair[1]]


def test_allowed_is_exactly_the_union_of_the_rules() -> None:
    assert {pair for op in Op for pair in _pairs(op)} == ALLOWED


def test_every_active_state_has_a_way_out() -> None:
    for state in ACTIVE:
        assert _ops_leaving(state), state


def test_every_state_is_reachable_from_submit() -> None:
    seen: set[TaskState | None] = {None}
    frontier: list[TaskState | None] = [None]
    while frontier:
        here = frontier.pop()
        for src, dst in ALLOWED:
            if src == here and dst not in seen:
                seen.add(dst)
                frontier.append(dst)
    assert seen == {None, *TaskState}


def test_every_final_state_is_reachable_from_every_active_state() -> None:
    for start in ACTIVE:
        reach = _reachable(start)
        assert reach >= FINAL, (start, FINAL - reach)


@pytest.mark.parametrize(("op", "source", "target"), EVERY_MOVE)
def test_check_accepts_exactly_the_pairs_of_the_rule(
    op: Op, source: TaskState | None, target: TaskState
) -> None:
    rule = TRANSITIONS[op]
    if source in rule.sources and target in rule.targets:
        check(op, source, target)
    else:
        with pytest.raises(IllegalTransition):
            check(op, source, target)


@pytest.mark.parametrize(("op", "target"), list(itertools.product(Op, TaskState)))
def test_sources_names_the_stored_states_or_refuses(op: Op, target: TaskState) -> None:
    rule = TRANSITIONS[op]
    if target not in rule.targets:
        with pytest.raises(IllegalTransition):
            sources(op, target)
        return
    expected = sorted(s.value for s in rule.sources if s is not None)
    assert sources(op, target) == expected
    assert all(TaskState(s) in rule.sources for s in expected)


def test_illegal_transition_is_a_409() -> None:
    with pytest.raises(IllegalTransition) as caught:
        check(Op.RETRY, S.SUCCEEDED, S.WAITING)
    assert caught.value.status == 409
    assert "succeeded" in str(caught.value)


def _pairs(op: Op) -> set[tuple[TaskState | None, TaskState]]:
    rule = TRANSITIONS[op]
    return set(itertools.product(rule.sources, rule.targets))


def _reachable(start: TaskState) -> set[TaskState]:
    seen = {start}
    frontier = [start]
    while frontier:
        here = frontier.pop()
        for src, dst in ALLOWED:
            if src is here and dst not in seen:
                seen.add(dst)
                frontier.append(dst)
    return seen
