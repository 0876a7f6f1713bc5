"""Disabling a principal (someone who left) and enabling it again, audited."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common.errors import Conflict
from libs.common.models import PrincipalInfo
from services.core.db import principals
from services.core.db.audit import Auditor


async def set_disabled(
    engine: AsyncEngine, record: Auditor, name: str, disabled: bool, by: str
) -> PrincipalInfo:
    """Disable ``name`` (``by`` an admin, never itself) or enable it again; audited as
    ``principal.disable`` or ``principal.enable`` when it changed (doing it again changes
    nothing and records nothing)."""
    if disabled and name == by:
        raise Conflict("name: an admin may not disable itself")
    async with engine.begin() as conn:
        before, after = await principals.set_disabled(conn, name, by if disabled else None)
        if before is None or before.disabled_at != after.disabled_at:
            await record(
                conn,
                "principal.disable" if disabled else "principal.enable",
                f"principal:{name}",
                before=None if before is None else before.model_dump(),
                after=after.model_dump(),
            )
    return after
