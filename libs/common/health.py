"""Liveness and readiness, the same on every service: ``/readyz`` reaches the database
through the engine the application keeps in ``app.state.engine``."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common.models import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process answers."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(request: Request) -> JSONResponse:
    """The process answers and reaches the database (and, where the service has one,
    its ``app.state.unready`` check finds nothing wrong: cron's engine runs)."""
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
    return JSONResponse(Health(status="ok").model_dump())
