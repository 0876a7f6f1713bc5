"""Services (docs/services.md): an agent's report of its replicas' readiness and where
they listen; services kept at N replicas, changed by people (create, change, delete,
audited) and by the controller, which one core replica at a time runs (``loops``): each
pass brings every service a step closer to its template and count, by Kubernetes'
rolling update, and rolls a rollout back when its new replicas are not ready in time.
Each step it takes is recorded (``service_steps``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from libs.common import tracing
from libs.common.errors import CairnError, Conflict, InvalidInput, NotFound
from libs.common.models import (
    ReplicaStatus,
    ServiceChange,
    ServiceCreate,
    ServiceInfo,
    TaskCreate,
    first_error,
)
from services.core.db import secrets, sharing
from services.core.db import services as services_db
from services.core.db import tasks as tasks_db
from services.core.db.audit import Auditor
from services.core.db.feed import Notifier, Work
from services.core.domain import limits
from services.core.domain import services as rules
from services.core.domain.principals import Principal
from services.core.ops import tasks as tasks_ops
from services.core.ops.metrics import CoreMetrics

log = logging.getLogger("cairn.core.services")

#: services read per page of a controller pass
PAGE = 100
#: the most services one listing shows
MAX_SERVICES_LISTED = 200
#: who the controller submits and cancels as (for the service's owner)
CONTROLLER = Principal(name="cairn-services", role="service")


async def report_replicas(
    engine: AsyncEngine, worker_id: int, items: Sequence[ReplicaStatus]
) -> list[int]:
    """Keep what the worker says of its replicas; the attempts whose status was kept
    (an attempt no longer open on it, or no longer its task's current one, is not)."""
    async with engine.begin() as conn:
        return await services_db.report(conn, worker_id, items)


# --- people's actions --------------------------------------------------------------------


def _template(spec: TaskCreate) -> dict[str, Any]:
    return spec.model_dump(mode="json", exclude_defaults=True)


def check(book: sharing.Book, principal: Principal, owner: str, template: TaskCreate) -> None:
    """A template as a submission of it is checked: its shape for a service, its ports
    and probes, its placement, its queue's policy (422 or 403 naming the field)."""
    rules.check_template(template.model_dump(mode="json"))
    tasks_ops.check_placements([template], lambda _: "template.")
    role = tasks_ops.policy_role(principal, owner)
    book.check_policy(role, owner, template, "body.template")


async def _check_owner(
    conn: AsyncConnection, principal: Principal, owner: str, template: TaskCreate
) -> None:
    """The owner's right to the template's team and secrets, as a submission's."""
    if secrets.needs_check(template):
        await tasks_ops.check_owner(conn, principal, owner, template, "template.")


async def create(
    engine: AsyncEngine, record: Auditor, principal: Principal, owner: str, create: ServiceCreate
) -> ServiceInfo:
    async with engine.begin() as conn:
        await _check_owner(conn, principal, owner, create.template)
        service_id = await services_db.insert_service(
            conn, owner, create, _template(create.template)
        )
        if service_id is None:
            raise Conflict(f"service {create.name!r} exists")
        detail = f"revision 1, {create.replicas} replicas"
        await services_db.add_step(conn, service_id, "created", detail)
        await record(
            conn,
            "service.create",
            f"service:{owner}/{create.name}",
            after={"replicas": create.replicas},
        )
        return await read(conn, owner, create.name)


async def change(
    engine: AsyncEngine,
    record: Auditor,
    principal: Principal,
    owner: str,
    name: str,
    change: ServiceChange,
) -> ServiceInfo:
    """A new template starts a rollout to a new revision (the current one kept as the
    rollback's target); a new count starts one to the same revision."""
    async with engine.begin() as conn:
        if change.template is not None:
            await _check_owner(conn, principal, owner, change.template)
        row = await services_db.get_service(conn, owner, name, lock=True)
        if row is None:
            raise NotFound(f"service {name!r} not found")
        values: dict[str, Any] = {}
        if change.rollout is not None:
            values.update(change.rollout.model_dump())
        if change.replicas is not None and change.replicas != row.replicas:
            values["replicas"] = change.replicas
        if change.template is not None and _template(change.template) != row.template:
            revision = row.revisions + 1
            values.update(
                template=_template(change.template),
                revision=revision,
                revisions=revision,
                previous=row.template,
                previous_revision=row.revision,
            )
        if "replicas" in values or "template" in values:
            values.update(rollout="progressing", rollout_at=datetime.now(UTC), message=None)
        if values:
            await services_db.change_service(conn, row.id, **values)
            shown = {k: v for k, v in values.items() if k in ("replicas", "revision")}
            await services_db.add_step(conn, row.id, "changed", _describe(shown))
            await record(conn, "service.change", f"service:{owner}/{name}", after=shown)
        return await read(conn, owner, name)


async def delete(
    engine: AsyncEngine, notifier: Notifier, record: Auditor, owner: str, name: str
) -> None:
    """Remove the service and cancel its live tasks."""
    async with engine.begin() as conn:
        row = await services_db.get_service(conn, owner, name, lock=True)
        if row is None:
            raise NotFound(f"service {name!r} not found")
        for replica in await services_db.live_replicas(conn, owner, name):
            await _stop(conn, replica.task_id, f"service {name} deleted")
        await services_db.delete_service(conn, row.id)
        await record(conn, "service.delete", f"service:{owner}/{name}")
    notifier.announce(Work(sweep=True))


async def list_of(conn: AsyncConnection, owner: str) -> list[ServiceInfo]:
    """The owner's services (at most ``MAX_SERVICES_LISTED``), without their steps."""
    found = []
    for row in await services_db.list_services(conn, owner, MAX_SERVICES_LISTED):
        live = await services_db.live_replicas(conn, owner, row.name)
        found.append(services_db.service_info(row, live, []))
    return found


async def read(conn: AsyncConnection, owner: str, name: str) -> ServiceInfo:
    row = await services_db.get_service(conn, owner, name)
    if row is None:
        raise NotFound(f"service {name!r} not found")
    live = await services_db.live_replicas(conn, owner, name)
    return services_db.service_info(row, live, await services_db.steps_of(conn, row.id))


def _describe(values: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(values.items())) or "rollout policy"


async def _stop(conn: AsyncConnection, task_id: int, reason: str) -> bool:
    try:
        await tasks_db.cancel(conn, task_id, None, reason)
    except (Conflict, NotFound):
        return False  # it ended meanwhile
    return True


# --- the controller ----------------------------------------------------------------------


@dataclass
class Controller:
    """One pass over every service (``run_pass``), each in a transaction of its own that
    holds the service's row (SKIP LOCKED: a second leader's pass skips it); a service
    whose pass fails is logged and left to the next pass."""

    engine: AsyncEngine
    notifier: Notifier
    meter: CoreMetrics
    book: sharing.Book
    quantum: float
    defaults: limits.Defaults = field(default_factory=limits.Defaults)

    async def run_pass(self) -> int:
        after = 0
        while True:
            async with self.engine.connect() as conn:
                ids = await services_db.service_ids(conn, after, PAGE)
            for service_id in ids:
                try:
                    await self.step(service_id)
                except Exception:
                    log.exception("service %s: controller step failed", service_id)
            if len(ids) < PAGE:
                return 0
            after = ids[-1]

    async def step(self, service_id: int) -> None:
        async with self.engine.begin() as conn:
            row = await services_db.lock_service(conn, service_id)
            if row is None:
                return
            row, plan = await self._decide(conn, row)
            stopped = 0
            for task_id in plan.stop:
                reason = f"service {row.name}: replaced by revision {row.revision}"
                if await _stop(conn, task_id, reason):
                    stopped += 1
                    await services_db.add_step(conn, row.id, "stopped", f"task {task_id}")
            if plan.start:
                detail = f"{plan.start} of revision {row.revision}"
                await services_db.add_step(conn, row.id, "starting", detail)
        if stopped:
            self.notifier.announce(Work(sweep=True))
        if plan.start:
            await self._start(row, plan.start)

    async def _decide(self, conn: AsyncConnection, row: Any) -> tuple[Any, rules.Plan]:
        live = await services_db.live_replicas(conn, row.owner, row.name)
        plan = self._plan(row, live)
        if row.rollout != "progressing":
            return row, plan
        if plan.settled:
            # Nothing to roll back to once complete: a later change of the count alone
            # that fails stalls, as Kubernetes' would, instead of reviving an old template.
            await services_db.change_service(
                conn,
                row.id,
                rollout="complete",
                message=None,
                previous=None,
                previous_revision=None,
            )
            await services_db.add_step(conn, row.id, "complete", f"revision {row.revision}")
            return row, plan
        why = await self._failing(conn, row)
        if why is None:
            return row, plan
        if row.previous is None:
            if row.message != why:
                await services_db.change_service(conn, row.id, message=why)
                await services_db.add_step(conn, row.id, "stalled", why)
            return row, plan
        why += f": rolled back to revision {row.previous_revision}"
        await services_db.change_service(
            conn,
            row.id,
            template=row.previous,
            revision=row.previous_revision,
            previous=None,
            previous_revision=None,
            rollout="rolled_back",
            message=why,
        )
        await services_db.add_step(conn, row.id, "rolled_back", why)
        # The template changed back, by the controller: audited as people's changes are.
        await Auditor(CONTROLLER, None)(
            conn,
            "service.rollback",
            f"service:{row.owner}/{row.name}",
            before={"revision": row.revision},
            after={"revision": row.previous_revision, "reason": why},
        )
        row = await services_db.lock_service(conn, row.id)
        return row, self._plan(row, live)

    async def _failing(self, conn: AsyncConnection, row: Any) -> str | None:
        """Why the rollout in progress fails: its deadline passed, or its new replicas
        failed ``max_failures`` times already; None while it may still succeed."""
        started = row.rollout_at.timestamp()
        if rules.rollout_overdue(started, datetime.now(UTC).timestamp(), row.deadline_s):
            return f"revision {row.revision} not ready within {row.deadline_s} s"
        failed = await services_db.failures(conn, row, rules.REPLICA_FAILURES, row.max_failures)
        return rules.rollout_failing(failed, row.max_failures, row.revision)

    def _plan(self, row: Any, live: list[rules.Replica]) -> rules.Plan:
        return rules.plan(row.replicas, row.revision, row.max_surge, row.max_unavailable, live)

    async def _start(self, row: Any, count: int) -> None:
        by = tasks_ops.Submitter(
            principal=CONTROLLER,
            engine=self.engine,
            notifier=self.notifier,
            meter=self.meter,
            book=await self.book.fresh(self.engine),
            quantum=self.quantum,
            defaults=self.defaults,
        )
        try:
            spec = _replica(row)
            await tasks_ops.submit(
                by, row.owner, [spec] * count, lambda _: "template.", {}, tracing.now_ns()
            )
        except CairnError as refused:
            why = f"start refused: {refused}"
            if row.message == why:
                return  # said once; the next pass tries again
            log.warning("service %s/%s: %s", row.owner, row.name, why)
            async with self.engine.begin() as conn:
                await services_db.change_service(conn, row.id, message=why)
                await services_db.add_step(conn, row.id, "refused", str(refused))


def _replica(row: Any) -> TaskCreate:
    """A replica's submission from the service's stored template; one that today's rules
    refuse (stored under older ones) is refused as a submission of it would be (422
    naming the field), so the controller records why and goes on."""
    labels = {
        **row.template.get("labels", {}),
        rules.SERVICE_LABEL: row.name,
        rules.REVISION_LABEL: str(row.revision),
    }
    try:
        return TaskCreate.model_validate({**row.template, "name": row.name, "labels": labels})
    except ValidationError as exc:
        raise InvalidInput(f"template.{first_error(exc)}") from None
