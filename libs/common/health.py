"""Liveness and readiness, the same on every service: ``/readyz`` reaches the database
through the engine the application keeps in ``app.state.engine``, and finds every
background loop the service keeps in ``app.state.loops`` (core's, dag's) still running (a
loop that ended means the service answers but no longer does its work: a container health
check and a load balancer should see that), and asks ``app.state.unready`` where the
service has one (cron: its engine runs, and turns while it leads). What works worse but
works (``app.state.degraded``: core's OIDC key set that cannot be read again) is said in
an ``ok`` answer's detail: every replica meets it alike, so none should leave the pool."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common.client import ApiClient, CoreClient
from libs.common.models import Health

router = APIRouter(tags=["health"])


def token_refused(clients: dict[str, ApiClient]) -> str | None:
    """For an ``app.state.unready``: why the service cannot work when a service it calls
    (named by the key: "core", "the DAG service") refuses its token
    (``ApiClient.token_refused``), or None."""
    for name, client in clients.items():
        if client.token_refused is not None:
            return f"{name} refuses this service's token (CAIRN_TOKEN): {client.token_refused}"
    return None


async def probe_token(client: CoreClient) -> None:
    """One call with the service's token as it starts, so that a token core refuses
    shows in ``/readyz`` at once, not at the first fire; an unreachable core says
    nothing here."""
    with contextlib.suppress(Exception):
        await client.whoami()


def loops(app: FastAPI) -> dict[str, asyncio.Task[None]]:
    """The service's background loops by name (none until its lifespan started them)."""
    found: dict[str, asyncio.Task[None]] = getattr(app.state, "loops", {})
    return found


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process answers."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(request: Request) -> JSONResponse:
    """The process answers, reaches the database, runs its loops and (where the service
    has one) its ``app.state.unready`` check finds nothing wrong: cron's engine runs;
    ``app.state.degraded`` adds a note to the ``ok``."""
    stopped = [name for name, task in loops(request.app).items() if task.done()]
    if stopped:
        body = Health(status="unavailable", detail=f"stopped: {', '.join(sorted(stopped))}")
        return JSONResponse(body.model_dump(), status_code=503)
    unready: Callable[[], str | None] | None = getattr(request.app.state, "unready", None)
    why = unready() if unready is not None else None
    if why is not None:
        return JSONResponse(Health(status="unavailable", detail=why).model_dump(), status_code=503)
    engine: AsyncEngine = request.app.state.engine
    try:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
    except (DBAPIError, OSError) as exc:
        body = Health(status="unavailable", detail=type(exc).__name__)
        return JSONResponse(body.model_dump(), status_code=503)
    degraded: Callable[[], str | None] | None = getattr(request.app.state, "degraded", None)
    note = degraded() if degraded is not None else None
    return JSONResponse(Health(status="ok", detail=note).model_dump())
