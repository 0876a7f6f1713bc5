"""Secrets: create, replace and delete one, each audited in its transaction (the values
sealed by ``db.secrets``; re-sealing under a new key is ``ops.rekey``)."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common.models import SecretInfo
from services.core.db import secrets
from services.core.db.audit import Auditor
from services.core.db.secrets import Scope
from services.core.identity.crypto import SecretBox


def target(scope: Scope, name: str) -> str:
    return f"secret:team:{scope.team}/{name}" if scope.team else f"secret:{scope.owner}/{name}"


async def create(
    engine: AsyncEngine,
    box: SecretBox,
    record: Auditor,
    scope: Scope,
    name: str,
    value: str,
    by: str,
) -> SecretInfo:
    async with engine.begin() as conn:
        info = await secrets.create(conn, box, scope, name, value, by)
        await record(conn, "secret.create", target(scope, name), after=info.model_dump())
    return info


async def replace(
    engine: AsyncEngine,
    box: SecretBox,
    record: Auditor,
    scope: Scope,
    name: str,
    value: str,
    by: str,
) -> SecretInfo:
    async with engine.begin() as conn:
        info = await secrets.replace(conn, box, scope, name, value, by)
        await record(conn, "secret.update", target(scope, name), after=info.model_dump())
    return info


async def remove(engine: AsyncEngine, record: Auditor, scope: Scope, name: str) -> None:
    async with engine.begin() as conn:
        before = await secrets.remove(conn, scope, name)
        await record(conn, "secret.delete", target(scope, name), before=before.model_dump())
