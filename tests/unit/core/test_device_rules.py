"""Countable devices in the pure rules (docs/placement.md, "Devices"): whole devices fit
by count, are never overcommitted nor squeezed, count in quotas, and a task that waits
for one says so."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime

from libs.common.states import TaskState
from services.core.domain.pending import Pool, Standing, pending_reason
from services.core.domain.placement import (
    Amount,
    Candidate,
    Node,
    Placed,
    charge,
    choose,
    counts,
    make_room,
    utilisation,
)
from services.core.domain.sharing import Gate, Gated, Quota, Use, over_quota

GPU = counts({"gpu": 1})
TWO = Amount(8, 16000, counts({"gpu": 2}))
NOW = datetime(2027, 1, 4, 12, 0, tzinfo=UTC)


def _gpu_job(task_id: int, n: int = 1, *, preemptible: bool = False) -> Candidate:
    return Candidate(task_id, 0, preemptible, Amount(1, 100, counts({"gpu": n})))


def test_devices_fit_by_count_and_a_name_the_room_lacks_is_none() -> None:
    assert Amount(1, 100, GPU).fits_in(TWO)
    assert not Amount(1, 100, counts({"gpu": 3})).fits_in(TWO)
    assert not Amount(1, 100, counts({"fpga": 1})).fits_in(TWO)
    assert Amount(1, 100).fits_in(Amount(1, 100))  # no devices: as before
    assert (TWO - Amount(1, 100, GPU)).devices == (("gpu", 1),)
    assert counts({"gpu": 0, "b": 2, "a": 1}) == (("a", 1), ("b", 2))


def test_choose_leases_as_many_gpu_tasks_as_there_are_gpus() -> None:
    jobs = [_gpu_job(1), _gpu_job(2), _gpu_job(3), Candidate(4, 0, False, Amount(1, 100))]
    assert [c.task_id for c, _ in choose(TWO, jobs, most=8)] == [1, 2, 4]
    assert [c.task_id for c, _ in choose(TWO, [_gpu_job(5, 2), *jobs], most=8)] == [5, 4]


def test_a_preemptible_task_is_charged_its_whole_devices_whatever_the_overcommit() -> None:
    job = Candidate(1, 0, True, Amount(2, 1000, GPU), Amount(0.1, 10), overcommit=4)
    assert charge(job).devices == GPU
    assert charge(job).cpu < 1  # CPU and memory on measured use, as before


def test_guaranteed_gpu_work_preempts_the_preemptible_attempt_holding_the_gpu() -> None:
    node = Node(
        1,
        Amount(8, 16000, GPU),
        (
            Placed(10, 10, 0, True, Amount(1, 100, GPU), started=1),
            Placed(11, 11, 0, True, Amount(1, 100), started=2),
        ),
    )
    plan = make_room(node, Amount(1, 100, GPU))
    assert plan is not None and plan.preempt == (10,) and plan.squeeze == ()
    assert make_room(node, Amount(1, 100, counts({"gpu": 2}))) is None


def test_a_squeezed_attempt_keeps_its_devices() -> None:
    placed = Placed(10, 10, 0, True, Amount(2, 100, GPU), started=1, squeezed=True)
    assert placed.held.devices == GPU


def test_a_pool_whose_gpus_are_taken_is_not_full_for_cpu_work() -> None:
    busy = Node(1, Amount(8, 16000, GPU), (Placed(1, 1, 0, False, Amount(1, 1600, GPU), 1),))
    assert utilisation([busy]) == 0.125


def test_a_gpu_quota_holds_the_task_that_would_pass_it() -> None:
    need = Amount(1, 100, GPU)
    quota = Quota(max_devices=counts({"gpu": 2}))
    assert quota.limits_running
    assert over_quota(quota, Use(devices=Counter(gpu=2)), need) == "gpu 2/2"
    gate = Gate(
        tasks={i: Gated("alice", need) for i in (1, 2, 3)},
        quotas={"alice": quota},
        use={"alice": Use()},
    )
    assert [gate.admit(i) for i in (1, 2, 3)] == [True, True, False]
    assert gate.held(3) == "owner at quota (gpu 2/2)"
    assert over_quota(quota, Use(), Amount(1, 100)) is None  # CPU-only work passes


def _waiting(need: Amount, *nodes: Node) -> str | None:
    pool = Pool("default", False, nodes, 0.0, 0.8)
    return pending_reason(Standing(TaskState.WAITING, NOW, need), pool, NOW)


def test_a_task_waiting_for_a_device_names_it() -> None:
    need = Amount(1, 512, GPU)
    full = Node(1, Amount(4, 8192, GPU), (Placed(1, 1, 0, False, Amount(1, 512, GPU), 1),))
    assert _waiting(need, full) == (
        "needs 1 CPU / 512 MB / 1 gpu, largest free slot 3 CPU / 7.5 GB / 0 gpu (short of gpu)"
    )
    assert _waiting(need, Node(2, Amount(64, 65536))) == (
        "needs 1 gpu: no live worker of queue default has that many"
    )
    assert _waiting(need, Node(3, Amount(4, 8192, GPU))) == (
        "fits a worker; waiting for its next claim"
    )
