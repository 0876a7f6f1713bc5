"""The service controller's rules (services/core/domain/services.py): a rolling update
step by step as Kubernetes takes it, and the count kept without one."""

from __future__ import annotations

import pytest

from libs.common.errors import InvalidInput
from services.core.domain.services import Plan, Replica, check, plan, rollout_failing


def _r(task_id: int, revision: int, ready: bool = True) -> Replica:
    return Replica(task_id, revision, ready)


def test_without_a_rollout_the_count_is_kept_and_the_extra_stopped_unready_first() -> None:
    assert plan(3, 1, 1, 0, [_r(1, 1)]) == Plan(start=2)
    assert plan(1, 1, 1, 0, [_r(1, 1), _r(2, 1, ready=False), _r(3, 1)]) == Plan(stop=(2, 3))
    assert plan(2, 1, 1, 0, [_r(1, 1), _r(2, 1)]).settled
    assert not plan(2, 1, 1, 0, [_r(1, 1), _r(2, 1, ready=False)]).settled


def test_a_rolling_update_surges_then_stops_old_ones_only_while_enough_stay_ready() -> None:
    old = [_r(1, 1), _r(2, 1)]
    # surge 1, unavailable 0: one new; no old one stops until it is ready.
    assert plan(2, 2, 1, 0, old) == Plan(start=1)
    assert plan(2, 2, 1, 0, [*old, _r(3, 2, ready=False)]) == Plan()
    assert plan(2, 2, 1, 0, [*old, _r(3, 2)]) == Plan(stop=(2,))
    assert plan(2, 2, 1, 0, [_r(1, 1), _r(3, 2)]) == Plan(start=1)
    assert plan(2, 2, 1, 0, [_r(1, 1), _r(3, 2), _r(4, 2)]) == Plan(stop=(1,))
    # surge 0, unavailable 1: an old one stops first, making room.
    assert plan(2, 2, 0, 1, old) == Plan(stop=(2,))
    # an old one that is not ready serves nothing: it goes at once.
    assert plan(2, 2, 1, 0, [_r(1, 1), _r(2, 1, ready=False)]) == Plan(start=1, stop=(2,))


def test_a_service_spec_on_a_plain_task_and_an_unknown_port_name_are_refused() -> None:
    with pytest.raises(InvalidInput, match=r"body\.service:"):
        check({"ports": []}, "task")
    with pytest.raises(InvalidInput, match=r"body\.service\.readiness\.http\.port: no port named"):
        check(
            {"ports": [{"name": "a", "port": 0}], "readiness": {"http": {"port": "b"}}}, "service"
        )


def test_a_rollout_fails_at_its_max_failures_naming_the_last() -> None:
    assert rollout_failing([], 3, 2) is None
    assert rollout_failing(["exited 1", "exited 1"], 3, 2) is None
    why = rollout_failing(["liveness probe failed: HTTP 500", "exited 1", "exited 1"], 3, 2)
    assert why == "revision 2 failed 3 times (last: liveness probe failed: HTTP 500)"
    assert rollout_failing(["x" * 5000], 1, 7) == f"revision 7 failed once (last: {'x' * 200})"
