"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from libs.common.models import Health
from services.core.deps import Engine

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process answers."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(engine: Engine) -> JSONResponse:
    """The process answers and reaches the database."""
    try:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
    except (DBAPIError, OSError) as exc:
        body = Health(status="unavailable", detail=type(exc).__name__)
        return JSONResponse(body.model_dump(), status_code=503)
    return JSONResponse(Health(status="ok").model_dump())
