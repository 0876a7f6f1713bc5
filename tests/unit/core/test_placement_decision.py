"""The placement decision (``services.core.domain.placement``), without a database."""

from __future__ import annotations

from services.core.domain.placement import (
    Amount,
    Candidate,
    Node,
    Placed,
    best_plan,
    charge,
    choose,
    decayed_peak,
    make_room,
    utilisation,
)

CAP = Amount(4, 4000)


def _job(task_id: int, request: Amount, *, preemptible: bool = False, **kw) -> Candidate:
    return Candidate(task_id, kw.pop("priority", 0), preemptible, request, **kw)


def _placed(attempt: int, cpu: float, memory: float, *, preemptible=True, **kw) -> Placed:
    return Placed(attempt, attempt, kw.pop("priority", 0), preemptible, Amount(cpu, memory), **kw)


def test_guaranteed_work_is_charged_its_request_whatever_it_used() -> None:
    job = _job(1, Amount(2, 3000), measured=Amount(0.1, 1000), overcommit=3)
    assert charge(job) == Amount(2, 3000)


def test_preemptible_work_is_charged_its_measured_peak_over_the_overcommit() -> None:
    fresh = _job(1, Amount(2, 3000), preemptible=True, overcommit=2)
    seen = _job(1, Amount(2, 3000), preemptible=True, measured=Amount(1, 1000), overcommit=2)
    idle = _job(1, Amount(2, 3000), preemptible=True, measured=Amount(0, 10))
    assert charge(fresh) == Amount(1, 1500)
    assert charge(seen) == Amount(0.5, 500)
    assert charge(idle) == Amount(0.2, 300)  # never below a tenth of the request


def test_a_decaying_peak_follows_a_rise_at_once_and_a_fall_slowly() -> None:
    assert decayed_peak(None, 100) == 100
    assert decayed_peak(100, 300) == 300
    assert decayed_peak(300, 10) == 270


def test_choose_takes_candidates_in_order_while_they_fit() -> None:
    jobs = [_job(1, Amount(3, 100)), _job(2, Amount(2, 100)), _job(3, Amount(1, 100))]
    assert [c.task_id for c, _ in choose(CAP, jobs, most=8)] == [1, 3]
    assert [c.task_id for c, _ in choose(CAP, jobs, most=1)] == [1]


def test_a_cpu_shortfall_squeezes_and_a_memory_one_preempts() -> None:
    node = Node(1, CAP, (_placed(10, 3, 500, started=1), _placed(11, 1, 3000, started=2)))
    cpu_short = make_room(node, Amount(2, 400))
    assert cpu_short is not None and cpu_short.preempt == ()
    assert cpu_short.squeeze == (11, 10)  # youngest first
    memory_short = make_room(node, Amount(0.5, 2000))
    assert memory_short is not None and memory_short.preempt == (11,)


def test_victims_are_the_lowest_priority_then_the_youngest() -> None:
    node = Node(
        1,
        CAP,
        (
            _placed(10, 1, 1000, priority=5, started=9),
            _placed(11, 1, 1000, priority=0, started=1),
            _placed(12, 1, 1000, priority=0, started=2),
        ),
    )
    plan = make_room(node, Amount(1, 2500))
    assert plan is not None and plan.preempt == (12, 11)


def test_guaranteed_work_never_preempts_guaranteed_work() -> None:
    node = Node(1, CAP, (_placed(10, 3, 3000, preemptible=False, started=1),))
    assert make_room(node, Amount(2, 100)) is None
    assert best_plan([node], Amount(2, 100)) is None


def test_attempts_already_preempted_are_not_counted_twice() -> None:
    node = Node(1, CAP, (_placed(10, 4, 4000, started=1, preempted=True),))
    plan = make_room(node, Amount(4, 4000))
    assert plan is not None and plan.preempt == () and plan.squeeze == ()


def test_the_cheapest_worker_is_chosen() -> None:
    crowded = Node(1, CAP, (_placed(10, 2, 2000, started=1), _placed(11, 2, 2000, started=2)))
    lighter = Node(2, CAP, (_placed(20, 1, 3500, started=1),))
    plan = best_plan([crowded, lighter], Amount(1, 1000))
    assert plan is not None and plan.worker_id == 2 and plan.preempt == (20,)


def test_utilisation_is_the_fuller_resource_of_the_pool() -> None:
    nodes = [Node(1, CAP, (_placed(10, 1, 3000, started=1),)), Node(2, CAP)]
    assert utilisation(nodes) == 3000 / 8000
    assert utilisation([]) == 0.0


def test_a_submission_hash_ignores_placement_fields_left_at_their_defaults() -> None:
    import hashlib
    import json

    from libs.common.models import TaskCreate
    from services.core.db.tasks import spec_hash

    body = {"name": "n", "artifact": {"uri": "file:///bin/true", "sha256": "0" * 64}}
    spec = TaskCreate.model_validate(body)
    before = spec.model_dump(mode="json")
    del before["defer_ok"], before["deadline"], before["team"], before["concurrency"]
    # and the policy's fields (issue 31): a key sent before them still matches
    del before["start_by"], before["max_wait_s"], before["progress_timeout_s"]
    del before["placement"]  # and placement by label (issue 32)
    before["resources"].pop("devices", None)  # and countable devices (issue 32)
    del before["service"]  # and a service's ports and probes (issue 32)
    del before["retry"]["poison_window_s"], before["retry"]["never"], before["retry"]["always"]
    canonical = json.dumps(before, sort_keys=True, separators=(",", ":"))
    assert spec_hash(spec) == hashlib.sha256(canonical.encode()).hexdigest()
    assert spec_hash(TaskCreate.model_validate({**body, "defer_ok": True})) != spec_hash(spec)
    gpu = {**body, "resources": {"devices": {"gpu": 1}}}
    assert spec_hash(TaskCreate.model_validate(gpu)) != spec_hash(spec)
    placed = {**body, "placement": {"required": ["disk=ssd"]}}
    assert spec_hash(TaskCreate.model_validate(placed)) != spec_hash(spec)
    never = {**body, "retry": {"never": {"exit_codes": [3]}}}
    assert spec_hash(TaskCreate.model_validate(never)) != spec_hash(spec)
    stalls = TaskCreate.model_validate({**body, "progress_timeout_s": 60})
    assert spec_hash(stalls) != spec_hash(spec)
