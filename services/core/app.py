"""Core's FastAPI application."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI
from sqlalchemy.ext.asyncio import create_async_engine

from libs.common import health, metrics, problems
from libs.common.limits import BodyLimit
from services.core import loops, sharing
from services.core.api import events, principals, queues, tasks, usage, workers
from services.core.api import sharing as sharing_api
from services.core.deps import TokenCache
from services.core.feed import Notifier
from services.core.metrics import CoreMetrics
from services.core.settings import CoreSettings
from services.core.ui import router as ui


def create_app(settings: CoreSettings, database_url: str) -> FastAPI:
    """The API over ``database_url``, whose schema must already be migrated."""
    meter = CoreMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = create_async_engine(
            database_url,
            pool_size=settings.db_pool_size,
            max_overflow=0,
            pool_timeout=10,
        )
        notifier = Notifier(database_url)
        notifier.start()
        app.state.engine = engine
        app.state.settings = settings
        app.state.notifier = notifier
        app.state.tokens = TokenCache(settings.token_cache_s)
        app.state.sharing = sharing.Book(settings.sharing_cache_s)
        background = loops.start(engine, notifier, settings, meter)
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            for task in background:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await notifier.stop()
            await engine.dispose()

    app = FastAPI(
        title="Cairn core",
        version="0.1.0",
        summary="Single tasks: submit, follow, cancel, retry; the event feed; queues.",
        lifespan=lifespan,
    )
    app.state.core_metrics = meter
    app.state.metrics = meter.metrics
    problems.install(app)
    for module in (tasks, events, queues, workers, usage, sharing_api, principals, health, metrics):
        app.include_router(module.router)
    app.include_router(ui)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    return app
