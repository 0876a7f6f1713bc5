"""Actions people took through the cron or DAG service, recorded in core's audit trail
as those services report them (an approval gate's decision)."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common.auth import Caller
from libs.common.models import AuditReport
from services.core.db import audit
from services.core.domain.principals import Principal


async def record(
    engine: AsyncEngine, reporter: Principal, report: AuditReport, address: str | None
) -> None:
    """One audit row: the reported actor (else the reporter itself), the reporting
    service (and its address) as its source."""
    actor = Caller(report.actor or reporter.name, report.actor_role or reporter.role)
    source = reporter.name if address is None else f"{reporter.name} {address}"
    async with engine.begin() as conn:
        await audit.record(
            conn, actor, report.action, report.target, source=source, after=report.after
        )
