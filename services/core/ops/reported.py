"""Actions people took through the cron or DAG service, recorded in core's audit trail
as those services report them (an approval gate's decision)."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common.auth import Caller
from libs.common.errors import IdempotencyMismatch
from libs.common.models import AuditReport
from services.core.db import audit
from services.core.domain.principals import Principal


async def record(
    engine: AsyncEngine, reporter: Principal, report: AuditReport, address: str | None
) -> None:
    """One audit row: the reported actor (else the reporter itself), the reporting
    service (and its address) as its source. A report with the ``idempotency_key`` of
    one already recorded by the same service records nothing (a retry whose first send
    was recorded); with another action, target or ``after``, a 409."""
    actor = Caller(report.actor or reporter.name, report.actor_role or reporter.role)
    source = reporter.name if address is None else f"{reporter.name} {address}"
    key = None if report.idempotency_key is None else f"{reporter.name}:{report.idempotency_key}"
    async with engine.begin() as conn:
        recorded = await audit.record(
            conn, actor, report.action, report.target, source=source, after=report.after, key=key
        )
        found = None if recorded or key is None else await audit.keyed(conn, key)
    given = {
        "action": report.action,
        "target": report.target,
        "after": audit.jsonable(report.after),
    }
    if found is not None and found != given:
        raise IdempotencyMismatch(
            f"idempotency_key {report.idempotency_key!r} was used for another report"
        )
