"""Time limits of a submission (docs/architecture.md, "Time limits"): the ``timeout_s`` a
task gets when it sets none, the largest it may ask for, and the longest it may wait to
start; and in the same way its disk quota (``resources.disk_mb``, docs/sharing.md). One rule for every submission: a person's, a cron fire's, a DAG node's. Pure: the
queue's limits and core's defaults come in as values."""

from __future__ import annotations

from dataclasses import dataclass

from libs.common.errors import InvalidInput


@dataclass(frozen=True)
class QueueLimits:
    """A queue's time limits (``core.queues``); None: not set."""

    default_timeout_s: int | None = None
    max_timeout_s: int | None = None
    max_wait_s: int | None = None
    #: its tasks' disk quota (MiB) when they ask none, and the most they may ask
    default_disk_mb: int | None = None
    max_disk_mb: int | None = None


NO_LIMITS = QueueLimits()
#: the fields of ``QueueLimits``, as ``core.queues`` names its columns
LIMIT_COLUMNS = tuple(QueueLimits.__dataclass_fields__)


@dataclass(frozen=True)
class Defaults:
    """Core's own (``CAIRN_DEFAULT_TIMEOUT_S``, ``CAIRN_POISON_WINDOW_S``)."""

    timeout_s: int | None = None
    poison_window_s: float = 72 * 3600.0


@dataclass(frozen=True)
class Filled:
    """What a submission is stored with: its ``timeout_s``, the wait bound its
    ``start_by`` is counted with (from when it is due), and its crash window."""

    timeout_s: int | None
    max_wait_s: int | None
    poison_window_s: float
    #: its disk quota (None: the worker's default)
    disk_mb: int | None = None


def refuse(field: str, reason: str) -> InvalidInput:
    """A 422 naming ``field`` (``body.timeout_s``), as a validation error reads."""
    return InvalidInput(f"{field}: {reason}", errors=[{"field": field, "reason": reason}])


def _least(*values: int | None) -> int | None:
    given = [v for v in values if v is not None]
    return min(given) if given else None


def default_timeout(queue: QueueLimits, defaults: Defaults) -> int | None:
    """A task's ``timeout_s`` when it sets none: its queue's default, else core's, but
    never above the queue's maximum (with only a maximum, the maximum: as a Kubernetes
    LimitRange fills a missing limit)."""
    if queue.default_timeout_s is not None:
        return queue.default_timeout_s
    return _least(defaults.timeout_s, queue.max_timeout_s)


def fill(
    kind: str,
    timeout_s: int | None,
    max_wait_s: int | None,
    poison_window_s: float | None,
    queue: QueueLimits,
    defaults: Defaults,
    where: str,
    disk_mb: int | None = None,
) -> Filled:
    """The stored limits of one submission in ``queue``; a ``timeout_s`` or a
    ``resources.disk_mb`` over the queue's maximum is refused (422 naming
    ``{where}timeout_s``, ``{where}resources.disk_mb``). A service runs until cancelled:
    it gets no default timeout, though one it sets is held to the maximum. A disk quota
    left unset is the queue's default (or, with only a maximum, the maximum), else
    None: the worker's own default."""
    most = queue.max_timeout_s
    if timeout_s is not None and most is not None and timeout_s > most:
        raise refuse(f"{where}timeout_s", f"{timeout_s} s is over the queue's maximum of {most} s")
    if timeout_s is None and kind == "task":
        timeout_s = default_timeout(queue, defaults)
    most = queue.max_disk_mb
    if disk_mb is not None and most is not None and disk_mb > most:
        why = f"{disk_mb} MB is over the queue's maximum of {most} MB"
        raise refuse(f"{where}resources.disk_mb", why)
    if disk_mb is None:
        disk_mb = queue.default_disk_mb if queue.default_disk_mb is not None else most
    return Filled(
        timeout_s=timeout_s,
        max_wait_s=_least(max_wait_s, queue.max_wait_s),
        poison_window_s=poison_window_s or defaults.poison_window_s,
        disk_mb=disk_mb,
    )


def check_queue(limits: QueueLimits, changed: set[str], where: str = "body.") -> None:
    """A queue's limits as they would stand after a change of the fields ``changed``: a
    default above the maximum is refused (422), naming the maximum unless only the
    default changed."""
    for what, unit in (("timeout", "s"), ("disk", "MB")):
        low_name, high_name = f"default_{what}_{unit.lower()}", f"max_{what}_{unit.lower()}"
        low, high = getattr(limits, low_name), getattr(limits, high_name)
        if low is None or high is None or low <= high:
            continue
        if high_name in changed or low_name not in changed:
            raise refuse(
                f"{where}{high_name}", f"{high} {unit} is below the default {what}, {low} {unit}"
            )
        raise refuse(
            f"{where}{low_name}", f"{low} {unit} is above the maximum {what}, {high} {unit}"
        )
