"""The sharing rules on their own: quotas, concurrency keys, policy, fair stamps, aging."""

from __future__ import annotations

import pytest

from libs.common.models import QueuePolicy, TaskCreate
from services.core.domain.placement import Amount, Candidate, choose
from services.core.domain.sharing import (
    Gate,
    Gated,
    KeyLimit,
    KeyUse,
    Quota,
    Use,
    aging_boost,
    decayed,
    fair_stamp,
    over_quota,
    refusal,
    usage_push_back,
)

ONE = Amount(1.0, 512.0)


def test_over_quota_names_the_quota_and_its_use() -> None:
    assert over_quota(Quota(max_cpu=40), Use(10, 40.0, 0), ONE) == "cpu 40/40"
    assert over_quota(Quota(max_cpu=40), Use(10, 39.0, 0), ONE) is None
    assert over_quota(Quota(max_running=3), Use(3, 0, 0), ONE) == "running 3/3"
    held = over_quota(Quota(max_memory_mb=1024), Use(1, 1, 768), ONE)
    assert held == "memory 768/1024 MB"


def test_a_gate_admits_up_to_the_quota_and_counts_what_it_admits() -> None:
    tasks = {i: Gated("alice", ONE) for i in range(5)}
    gate = Gate(tasks=tasks, quotas={"alice": Quota(max_cpu=2)}, use={"alice": Use()})
    assert [gate.admit(i) for i in range(5)] == [True, True, False, False, False]
    assert gate.held(3) == "owner at quota (cpu 2/2)"
    assert gate.refused["quota"] == 3


def test_a_team_quota_bounds_the_sum_over_its_members_tasks() -> None:
    tasks = {
        1: Gated("alice", ONE, team="sre"),
        2: Gated("bob", ONE, team="sre"),
        3: Gated("bob", ONE, team="sre"),
        4: Gated("bob", ONE),  # bob's own work is not the team's
    }
    gate = Gate(tasks=tasks, team_quotas={"sre": Quota(max_running=2)}, team_use={"sre": Use()})
    assert [gate.admit(i) for i in (1, 2, 3, 4)] == [True, True, False, True]
    assert gate.held(3) == "team sre at quota (running 2/2)"
    assert gate.team_use["sre"].running == 2


def test_a_keys_admin_limit_overrides_the_tasks_own() -> None:
    tasks = {i: Gated("alice", ONE, key="db", key_limit=5) for i in range(4)}
    gate = Gate(tasks=tasks, limits={"db": KeyLimit(max_running=2)}, keys={"db": KeyUse(1, 0)})
    assert [gate.admit(i) for i in range(4)] == [True, False, False, False]
    assert gate.held(2) == "waiting for concurrency key db (2/2 running)"
    own = Gate(tasks=tasks, keys={"db": KeyUse(4, 0)})
    assert [own.admit(i) for i in range(2)] == [True, False]


def test_a_keys_rate_limit_counts_starts_in_its_window() -> None:
    tasks = {i: Gated("alice", ONE, key="api") for i in range(3)}
    limits = {"api": KeyLimit(max_starts=2, window_s=60)}
    gate = Gate(tasks=tasks, limits=limits, keys={"api": KeyUse(0, 1)})
    assert [gate.admit(i) for i in range(3)] == [True, False, False]
    assert gate.held(1) == "concurrency key api at its rate limit (2/2 starts in 60 s)"
    assert gate.refused["rate"] == 2


def test_choose_skips_what_the_gate_refuses_and_takes_what_follows() -> None:
    tasks = {1: Gated("alice", ONE), 2: Gated("alice", ONE), 3: Gated("bob", ONE)}
    gate = Gate(tasks=tasks, quotas={"alice": Quota(max_running=1)})
    candidates = [Candidate(i, 0, False, ONE) for i in (1, 2, 3)]
    chosen = choose(Amount(8, 8192), candidates, 8, gate)
    assert [c.task_id for c, _ in chosen] == [1, 3]


def test_fair_stamps_interleave_a_newcomer_with_a_backlog() -> None:
    assert fair_stamp(None, None, now=100.0, step=1.0) == 100.0
    assert fair_stamp(None, 40.0, now=100.0, step=1.0) == 40.0, "joins at the head"
    assert fair_stamp(None, 140.0, now=100.0, step=1.0) == 100.0, "or now, if earlier"
    assert fair_stamp(7000.0, 40.0, now=100.0, step=0.5) == 7000.5, "after its own"


def test_usage_pushes_a_flows_new_work_back_and_decays() -> None:
    used = decayed(7200.0, age_s=86400.0, half_life_s=86400.0)
    assert used == 3600.0, "a half-life ago: half"
    assert decayed(1.0, age_s=1e12, half_life_s=1.0) == 2.0**-1000, "floored, never an error"
    pushed = usage_push_back(used, weight=2.0, step=1.0, unit_cpu_s=60.0)
    assert pushed == 30.0, "a core-minute a step, over the weight"
    assert fair_stamp(None, 40.0, now=100.0, step=1.0, pushed=pushed) == 130.0
    assert fair_stamp(101.0, 40.0, now=100.0, step=1.0, pushed=pushed) == 130.0
    assert fair_stamp(500.0, 40.0, now=100.0, step=1.0, pushed=pushed) == 501.0, "its own line"


def test_aging_is_one_level_per_interval_and_bounded() -> None:
    assert aging_boost(-5, 60, 200) == 0
    assert aging_boost(59, 60, 200) == 0
    assert aging_boost(120, 60, 200) == 2
    assert aging_boost(10**9, 60, 200) == 200


def _spec(**extra: object) -> TaskCreate:
    body = {"name": "n", "artifact": {"uri": "file:///bin/true", "sha256": "0" * 64}}
    return TaskCreate.model_validate({**body, **extra})


def test_policy_refuses_priorities_outside_the_roles_range() -> None:
    policy = QueuePolicy.model_validate({"priority": {"user": {"min": 0, "max": 50}}})
    refused = refusal(policy, "user", "alice", _spec(priority=100), "body")
    assert refused is not None and refused.field == "body.priority"
    assert "0..50" in refused.detail
    assert refusal(policy, "admin", "root", _spec(priority=100), "body") is None
    assert refusal(policy, "user", "alice", _spec(priority=50), "body") is None


@pytest.mark.parametrize(
    ("policy", "extra", "field"),
    [
        ({"services": False}, {"kind": "service"}, "body.kind"),
        ({"guaranteed": False}, {}, "body.preemptible"),
        ({"owners": ["bob"]}, {"preemptible": True}, "body.queue"),
    ],
)
def test_policy_names_the_field_it_refuses(policy: dict, extra: dict, field: str) -> None:
    refused = refusal(QueuePolicy.model_validate(policy), "user", "alice", _spec(**extra), "body")
    assert refused is not None and refused.field == field


def test_a_priority_range_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="above max"):
        QueuePolicy.model_validate({"priority": {"user": {"min": 10, "max": 0}}})
