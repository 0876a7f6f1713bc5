"""The audit trail, for admins: newest first, filtered, in pages; and oldest first with
its hash chain, for an export (``cairn audit export``). The cron and DAG services report
the actions people take through them."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response, status

from libs.common.models import (
    MAX_PAGE,
    AuditChainPage,
    AuditEntry,
    AuditPage,
    AuditReport,
    StorableTime,
)
from libs.common.problems import PROBLEMS
from services.core.api.deps import AdminOnly, Engine, require
from services.core.db import audit
from services.core.domain.principals import Principal
from services.core.ops import reported

router = APIRouter(prefix="/v1/audit", tags=["audit"])

Reporter = Annotated[Principal, Depends(require("service"))]
_Text = Annotated[str | None, Query(min_length=1, max_length=200, pattern=r"^[^\x00]+$")]


@router.get("", response_model=AuditPage, responses=PROBLEMS)
async def read_audit(
    principal: AdminOnly,
    engine: Engine,
    actor: _Text = None,
    action: Annotated[
        str | None, Query(max_length=64, pattern=r"^[a-z.]+$", description="token, token.revoke")
    ] = None,
    target: _Text = None,
    since: StorableTime | None = None,
    until: StorableTime | None = None,
    before: Annotated[int | None, Query(ge=1, le=2**63 - 1)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
) -> AuditPage:
    """Who did what, when, from where; ``action`` matches a family (``token``) or one
    action (``token.revoke``)."""
    where = audit.AuditFilter(actor=actor, action=action, target=target, since=since, until=until)
    async with engine.connect() as conn:
        items = await audit.page(conn, where, before, limit)
    return AuditPage(items=items, next_before=items[-1].id if len(items) == limit else None)


@router.get("/export", response_model=AuditChainPage, responses=PROBLEMS)
async def read_chain(
    principal: AdminOnly,
    engine: Engine,
    after: Annotated[int, Query(ge=0, le=2**63 - 1, description="Rows with a larger id.")] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
) -> AuditChainPage:
    """The chained rows after ``after``, oldest first, each with ``prev_hash`` and
    ``hash``; ``exported_through`` is where the scheduled export stands."""
    async with engine.connect() as conn:
        rows = await audit.chain(conn, after, limit)
        mark = await audit.exported_through(conn)
    items = [AuditEntry.model_validate(row) for row in rows]
    return AuditChainPage(
        items=items,
        next_after=items[-1].id if len(items) == limit else None,
        exported_through=mark,
    )


@router.post("/reports", status_code=status.HTTP_204_NO_CONTENT, responses=PROBLEMS)
async def report_action(
    body: AuditReport, principal: Reporter, engine: Engine, request: Request
) -> Response:
    """For the cron and DAG services: record an action a person took through them (an
    approval gate's decision: ``dag.approve``, ``dag.reject``) in the audit trail, with
    the reporting service as its source."""
    address = request.client.host if request.client else None
    await reported.record(engine, principal, body, address)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
