"""Services' declared ports and probes (docs/services.md): the rules a submission's
``service`` must hold beyond its shape, each refusal a 422 naming the field."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.core.domain.limits import refuse

PROBES = ("startup", "liveness", "readiness")


def check(service: Mapping[str, Any] | None, kind: str, field: str = "body.service") -> None:
    """Refuse a ``service`` on a plain task, a port name declared twice, two ports of one
    fixed number, and a probe that names a port the service did not declare."""
    if service is None:
        return
    if kind != "service":
        raise refuse(field, "only a task of kind service may declare ports and probes")
    names: set[str] = set()
    numbers: set[int] = set()
    for i, port in enumerate(service.get("ports") or []):
        if port["name"] in names:
            raise refuse(f"{field}.ports.{i}.name", f"port {port['name']!r} is declared twice")
        if port["port"] and port["port"] in numbers:
            raise refuse(f"{field}.ports.{i}.port", f"port {port['port']} is declared twice")
        names.add(port["name"])
        numbers.add(port["port"])
    for which in PROBES:
        probe = service.get(which) or {}
        for how in ("http", "tcp"):
            ref = (probe.get(how) or {}).get("port")
            if isinstance(ref, str) and ref not in names:
                raise refuse(
                    f"{field}.{which}.{how}.port",
                    f"no port named {ref!r} is declared (service.ports)",
                )


# --- the controller's rules (a service kept at N replicas, rolling updates) -------------

#: the labels a service's tasks carry: its name and the revision of its template
SERVICE_LABEL = "cairn.service"
REVISION_LABEL = "cairn.revision"


@dataclass(frozen=True)
class Replica:
    """A live task of a service: its revision, and whether it runs and is ready."""

    task_id: int
    revision: int
    ready: bool


@dataclass(frozen=True)
class Plan:
    """What the controller does in one pass: start ``start`` tasks of the current
    revision, stop the tasks ``stop``; ``settled``: every replica is of the current
    revision, as many as asked, all ready."""

    start: int = 0
    stop: tuple[int, ...] = ()
    settled: bool = False


def plan(replicas: int, revision: int, surge: int, unavailable: int, live: list[Replica]) -> Plan:
    """Kubernetes' rolling update: new replicas while the total stays within ``replicas
    + surge``; old ones stopped, the unready first, while at least ``replicas -
    unavailable`` replicas stay ready. Without old ones: as many as asked (the extra
    stopped, unready and newest first)."""
    current = [r for r in live if r.revision == revision]
    old = [r for r in live if r.revision != revision]
    if not old:
        extra = sorted(current, key=lambda r: (r.ready, -r.task_id))[
            : max(0, len(current) - replicas)
        ]
        ready = sum(r.ready for r in current)
        settled = len(current) == replicas and ready == replicas
        return Plan(max(0, replicas - len(current)), tuple(r.task_id for r in extra), settled)
    start = max(0, min(replicas + surge - len(live), replicas - len(current)))
    ready = sum(r.ready for r in live)
    floor = replicas - unavailable
    stop: list[int] = []
    for replica in sorted(old, key=lambda r: (r.ready, -r.task_id)):
        if replica.ready:
            if ready - 1 < floor:
                break
            ready -= 1
        stop.append(replica.task_id)
    return Plan(start, tuple(stop))


#: how a replica's attempt ends that counts as its failure in a rollout: an exit (even
#: 0: a service runs until stopped), a failed startup or liveness probe, a kill; not a
#: lost host, a preemption or a cancel
REPLICA_FAILURES = ("succeeded", "failed", "timeout", "crashed", "oom_killed", "disk_exceeded")


def rollout_failing(failures: list[str], max_failures: int, revision: int) -> str | None:
    """Why a rollout is certain to fail before its deadline: its new replicas have failed
    ``max_failures`` times in all (``failures``: why each failed, newest first)."""
    if len(failures) < max_failures:
        return None
    times = "once" if len(failures) == 1 else f"{len(failures)} times"
    return f"revision {revision} failed {times} (last: {failures[0][:200]})"


def rollout_overdue(started_s: float, now_s: float, deadline_s: int) -> bool:
    """Whether a rollout that has not settled has run past its deadline."""
    return now_s - started_s > deadline_s


def check_template(template: Mapping[str, Any], field: str = "body.template") -> None:
    """A service's template: a ``kind: service`` task, without an idempotency key or a
    start time (the controller starts its tasks), with room for the two labels it adds."""
    if template.get("kind") != "service":
        raise refuse(f"{field}.kind", "a service's template must be of kind service")
    if template.get("idempotency_key") is not None:
        raise refuse(f"{field}.idempotency_key", "the controller starts a service's tasks")
    if template.get("run_at") is not None or template.get("start_by") is not None:
        raise refuse(f"{field}.run_at", "a service's tasks start when the controller asks")
    labels = template.get("labels") or {}
    if SERVICE_LABEL in labels or REVISION_LABEL in labels:
        raise refuse(
            f"{field}.labels", f"{SERVICE_LABEL} and {REVISION_LABEL} are the controller's"
        )
    if len(labels) > 30:
        raise refuse(f"{field}.labels", "at most 30 labels: the controller adds two")
