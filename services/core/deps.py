"""Request dependencies. Their names state who may call: ``Submitter``, ``Reader``,
``AdminOnly``, and ``OwnedTask`` (a task loaded by id filtered by owner, so another
owner's task is a 404 exactly like a missing one)."""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common.auth import OnBehalfOf, acting_owner
from libs.common.errors import Forbidden, Unauthorized
from libs.common.models import Task
from services.core import store
from services.core.feed import Notifier
from services.core.metrics import CoreMetrics
from services.core.store import Principal

_bearer = HTTPBearer(auto_error=False, description="A token from `cairn token create`.")

TaskIdPath = Annotated[int, Path(ge=1, le=2**63 - 1, description="The task's id.")]


async def get_engine(request: Request) -> AsyncEngine:
    engine: AsyncEngine = request.app.state.engine
    return engine


async def get_notifier(request: Request) -> Notifier:
    notifier: Notifier = request.app.state.notifier
    return notifier


async def get_meter(request: Request) -> CoreMetrics:
    meter: CoreMetrics = request.app.state.core_metrics
    return meter


Engine = Annotated[AsyncEngine, Depends(get_engine)]
Meter = Annotated[CoreMetrics, Depends(get_meter)]
Announcer = Annotated[Notifier, Depends(get_notifier)]


class TokenCache:
    """Recently seen tokens, so a hot path does not query principals on every request.
    A revoked token stops working within ``ttl_s``."""

    def __init__(self, ttl_s: float, size: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.size = size
        self._entries: dict[str, tuple[float, Principal]] = {}

    def get(self, token: str) -> Principal | None:
        entry = self._entries.get(token)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def put(self, token: str, principal: Principal) -> None:
        if len(self._entries) >= self.size:
            self._entries.clear()
        self._entries[token] = (time.monotonic() + self.ttl_s, principal)


async def current_principal(
    request: Request,
    engine: Engine,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    if credentials is None or not credentials.credentials:
        raise Unauthorized("send 'Authorization: Bearer <token>'")
    token = credentials.credentials
    if len(token) > 200:
        raise Unauthorized("unknown or revoked token")
    cache: TokenCache = request.app.state.tokens
    principal = cache.get(token)
    if principal is None:
        async with engine.connect() as conn:
            principal = await store.principal_for_token(conn, token)
        if principal is None:
            raise Unauthorized("unknown or revoked token")
        cache.put(token, principal)
    return principal


CurrentPrincipal = Annotated[Principal, Depends(current_principal)]


def require(*roles: str) -> Callable[[Principal], Coroutine[Any, Any, Principal]]:
    async def check(principal: CurrentPrincipal) -> Principal:
        if principal.role not in roles:
            raise Forbidden(f"the {principal.role} role may not do this")
        return principal

    return check


Submitter = Annotated[Principal, Depends(require("user", "admin", "service"))]
Reader = Annotated[Principal, Depends(require("user", "admin", "service"))]
AdminOnly = Annotated[Principal, Depends(require("admin"))]


async def submitting_owner(principal: Submitter, on_behalf_of: OnBehalfOf = None) -> str:
    return acting_owner(principal, on_behalf_of)


SubmittingOwner = Annotated[str, Depends(submitting_owner)]


async def owned_task(task_id: TaskIdPath, principal: Reader, engine: Engine) -> Task:
    async with engine.connect() as conn:
        return await store.get_task(conn, task_id, principal.owner_filter)


OwnedTask = Annotated[Task, Depends(owned_task)]
