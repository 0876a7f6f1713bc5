"""The DAG service's FastAPI application and its loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from libs.common import cors, database, health, metrics, pages, problems, waits
from libs.common.auth import RemoteAuth
from libs.common.limits import BodyLimit
from services.dag.api import runs, triggers, workflows
from services.dag.engine import Engine, Graphs
from services.dag.settings import DagSettings


def create_app(settings: DagSettings, database_url: str) -> FastAPI:
    """The API over ``database_url``, whose ``dag`` schema must already be migrated;
    ``settings.url`` is core's and ``settings.token`` this service's own (role service).
    The leader's lock is taken on ``settings.direct_url(database_url)``."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = database.pool(
            database_url, settings, pool_size=settings.db_pool_size, max_overflow=0, pool_timeout=10
        )
        graphs = Graphs(settings.graph_cache, settings.graph_cache_mb * 1024 * 1024)
        loop = Engine(engine, settings, graphs, settings.direct_url(database_url))
        app.state.engine = engine
        app.state.settings = settings
        app.state.graphs = graphs
        app.state.loop = loop
        app.state.metrics = loop.metrics.metrics
        auth = app.state.auth = RemoteAuth(
            settings.cores,
            ttl_s=settings.token_cache_s,
            timeout_s=settings.token_check_timeout_s,
        )
        task = asyncio.create_task(loop.run_forever(), name="dag-loop")
        app.state.loops = {"dag-loop": task}
        probe = asyncio.create_task(health.probe_token(loop.core), name="token-probe")
        app.state.unready = lambda: health.token_refused({"core": loop.core})
        try:
            yield
        finally:
            await waits.stop(probe)
            await waits.stop(task)
            await loop.close()
            await auth.aclose()
            await engine.dispose()

    app = pages.service_app(
        title="Cairn DAG",
        version="1.0.0",  # the API's: docs/api.md says when it moves
        summary="Workflows: versioned definitions, runs released node by node to core.",
        lifespan=lifespan,
    )
    problems.install(app)
    pages.add_routes(app, *(m.router for m in (workflows, triggers, runs, health, metrics)))
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    cors.allow_dashboard(app, settings.url, settings.ui_origins)
    return app
