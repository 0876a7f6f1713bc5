"""The time-limit rule of a submission (``services.core.domain.limits``): which timeout a
task gets, what is refused and with which field named."""

from __future__ import annotations

import pytest

from libs.common.errors import InvalidInput
from services.core.domain.limits import NO_LIMITS, Defaults, QueueLimits, check_queue, fill

CORE = Defaults(timeout_s=7200, poison_window_s=3600.0)


@pytest.mark.parametrize(
    ("queue", "defaults", "expected"),
    [
        (NO_LIMITS, Defaults(), None),
        (NO_LIMITS, CORE, 7200),
        (QueueLimits(default_timeout_s=60), CORE, 60),
        (QueueLimits(max_timeout_s=600), CORE, 600),
        (QueueLimits(max_timeout_s=600), Defaults(timeout_s=300), 300),
        (QueueLimits(max_timeout_s=600), Defaults(), 600),
    ],
)
def test_a_task_without_a_timeout_gets_the_queues_then_cores_never_above_the_maximum(
    queue: QueueLimits, defaults: Defaults, expected: int | None
) -> None:
    assert fill("task", None, None, None, queue, defaults, "body.").timeout_s == expected


def test_a_service_gets_no_default_but_is_held_to_the_maximum() -> None:
    queue = QueueLimits(default_timeout_s=60, max_timeout_s=600)
    assert fill("service", None, None, None, queue, CORE, "body.").timeout_s is None
    with pytest.raises(InvalidInput) as refused:
        fill("service", 601, None, None, queue, CORE, "body.tasks.2.")
    assert refused.value.extra["errors"][0]["field"] == "body.tasks.2.timeout_s"
    assert refused.value.status == 422


def test_the_shorter_wait_bound_and_the_tasks_own_window_apply() -> None:
    queue = QueueLimits(max_wait_s=60)
    assert fill("task", None, 30, None, queue, CORE, "").max_wait_s == 30
    assert fill("task", None, 90, None, queue, CORE, "").max_wait_s == 60
    assert fill("task", None, None, None, NO_LIMITS, CORE, "").max_wait_s is None
    assert fill("task", None, None, 60.0, NO_LIMITS, CORE, "").poison_window_s == 60.0
    assert fill("task", None, None, None, NO_LIMITS, CORE, "").poison_window_s == 3600.0


@pytest.mark.parametrize(
    ("changed", "field"),
    [
        ({"max_timeout_s"}, "body.max_timeout_s"),
        ({"default_timeout_s", "max_timeout_s"}, "body.max_timeout_s"),
        ({"default_timeout_s"}, "body.default_timeout_s"),
    ],
)
def test_a_default_above_the_maximum_names_what_was_changed(changed: set[str], field: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        check_queue(QueueLimits(default_timeout_s=600, max_timeout_s=60), changed)
    assert refused.value.extra["errors"][0]["field"] == field
    check_queue(QueueLimits(default_timeout_s=60, max_timeout_s=60), changed)
    check_queue(QueueLimits(default_timeout_s=600), changed)


@pytest.mark.parametrize(
    ("queue", "asked", "expected"),
    [
        (NO_LIMITS, None, None),  # the worker's default
        (NO_LIMITS, 4096, 4096),
        (QueueLimits(default_disk_mb=256), None, 256),
        (QueueLimits(max_disk_mb=512), None, 512),
        (QueueLimits(default_disk_mb=256, max_disk_mb=512), 512, 512),
    ],
)
def test_a_disk_quota_is_the_tasks_then_the_queues(
    queue: QueueLimits, asked: int | None, expected: int | None
) -> None:
    assert fill("task", None, None, None, queue, CORE, "body.", asked).disk_mb == expected


def test_a_disk_quota_over_the_queues_maximum_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidInput) as refused:
        fill("task", None, None, None, QueueLimits(max_disk_mb=512), CORE, "body.tasks.1.", 513)
    assert refused.value.extra["errors"][0]["field"] == "body.tasks.1.resources.disk_mb"
    assert "over the queue's maximum of 512 MB" in str(refused.value)


def test_a_disk_default_above_the_disk_maximum_is_refused() -> None:
    limits = QueueLimits(default_disk_mb=900, max_disk_mb=100)
    with pytest.raises(InvalidInput) as refused:
        check_queue(limits, {"max_disk_mb"})
    assert refused.value.extra["errors"][0]["field"] == "body.max_disk_mb"
    with pytest.raises(InvalidInput) as refused:
        check_queue(limits, {"default_disk_mb"})
    assert refused.value.extra["errors"][0]["field"] == "body.default_disk_mb"
