"""The cron service's FastAPI application: the API on every replica, and the engine that
fires schedules wherever it holds the lead."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from libs.common import cors, database, health, metrics, pages, problems, waits
from libs.common.auth import RemoteAuth
from libs.common.client import CoreClient
from libs.common.dag_client import DagClient
from libs.common.limits import BodyLimit
from services.cron import api
from services.cron.engine import Clock, CronEngine, WarpedClock
from services.cron.fire import Sender
from services.cron.settings import CronSettings

ENGINE_POOL = 4


def create_app(
    settings: CronSettings, database_url: str, clock: Clock | None = None, engine: bool = True
) -> FastAPI:
    """The API over ``database_url`` (already migrated); with ``engine``, the firing engine
    runs beside it and campaigns for the lead, on ``settings.direct_url(database_url)``
    (the lock's session LISTENs too: a pooler carries neither)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        db = database.pool(
            database_url, settings, pool_size=settings.db_pool_size, max_overflow=0, pool_timeout=10
        )
        core = CoreClient(settings.cores, settings.token)
        dag = DagClient(settings.dag_url, settings.token)
        sender = Sender(core, settings.cron_submit_chunk, dag)
        if clock is None and settings.cron_clock_warp:
            chosen: Clock | None = WarpedClock.parse(settings.cron_clock_warp)
        else:
            chosen = clock
        # The engine has connections of its own: API load cannot starve it of the pool.
        engine_db = database.pool(
            database_url, settings, pool_size=ENGINE_POOL, max_overflow=0, pool_timeout=10
        )
        direct = settings.direct_url(database_url)
        cron = CronEngine(engine_db, direct, settings, sender, chosen)
        app.state.engine = db
        app.state.settings = settings
        app.state.sender = sender
        app.state.cron = cron
        app.state.metrics = cron.metrics.metrics
        auth = app.state.auth = RemoteAuth(
            settings.cores,
            settings.token_cache_s,
            timeout_s=settings.token_check_timeout_s,
        )
        runner = asyncio.create_task(cron.run(), name="cron-engine") if engine else None
        probe = asyncio.create_task(health.probe_token(core), name="token-probe")
        app.state.unready = lambda: (
            (cron.unready(runner) if engine else None)
            or health.token_refused({"core": core, "the DAG service": dag})
        )
        try:
            yield
        finally:
            await waits.stop(probe)
            if runner is not None:
                await waits.stop(runner)
            await core.aclose()
            await dag.aclose()
            await auth.aclose()
            await db.dispose()
            await engine_db.dispose()

    app = pages.service_app(
        title="Cairn cron",
        version="1.0.0",  # the API's: docs/api.md says when it moves
        summary="Schedules: cron expressions in a time zone, fired exactly once each.",
        lifespan=lifespan,
    )
    problems.install(app)
    pages.add_routes(app, api.router, health.router, metrics.router)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    cors.allow_dashboard(app, settings.url, settings.ui_origins)
    return app
