"""Core's FastAPI application."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common import database, health, metrics, pages, problems, waits
from libs.common.limits import BodyLimit
from libs.common.settings import libpq_url
from services.core import loops
from services.core.api import (
    audit,
    events,
    fencing,
    login,
    principals,
    queues,
    secrets,
    subscriptions,
    tasks,
    teams,
    tokens,
    usage,
    workers,
)
from services.core.api import services as services_api
from services.core.api import sharing as sharing_api
from services.core.api.deps import LeaseCache, TokenCache
from services.core.db import principals as principals_db
from services.core.db import readings, sharing
from services.core.db.feed import Notifier
from services.core.domain.keys import key_list
from services.core.identity.crypto import SecretBox, read_key_file
from services.core.identity.oidc import OidcVerifier
from services.core.identity.signin import ProviderClient
from services.core.objects import LogObjects
from services.core.ops import login as login_ops
from services.core.ops import notify, tasklogs
from services.core.ops import teams as teams_ops
from services.core.ops import tokens as tokens_ops
from services.core.ops.dispatch import Holds, Known
from services.core.ops.groupcommit import GroupCommit
from services.core.ops.metrics import CoreMetrics
from services.core.settings import CoreSettings, SecretsKeySettings
from services.core.ui import router as ui

log = logging.getLogger("cairn.core")


def secret_box(settings: SecretsKeySettings, create: bool | None = None) -> SecretBox:
    """The keys secrets are sealed with: ``CAIRN_SECRETS_KEY``, else the key file (made
    with a fresh key on first start in development, unless ``create`` says otherwise)."""
    if settings.secrets_key is not None:
        keys = key_list(settings.secrets_key.get_secret_value())
    else:
        made = settings.env == "development" if create is None else create
        keys = read_key_file(settings.secrets_key_path, create=made)
    return SecretBox(keys)


def _forget_withdrawn(app: FastAPI, engine: AsyncEngine) -> Callable[[list[str]], Awaitable[None]]:
    async def withdrawn(kids: list[str]) -> None:
        """The provider withdrew keys: what their tokens proved is not trusted either:
        the cached principals, the team claims they vouched for, the sessions they began,
        the API tokens made with them."""
        revoked = await tokens_ops.revoke_of_keys(engine, kids)
        app.state.tokens.evict_jwts(kids)  # after the revocation: none is read back live
        if revoked:
            log.info("revoked %d tokens made with withdrawn keys", len(revoked))
        gone = await teams_ops.forget_claims(engine, kids)
        if gone:
            log.info("forgot %d team claims vouched for by withdrawn keys", gone)
        ended = await login_ops.forget_sessions(engine, kids)
        if ended:
            log.info("ended %d sessions signed in with withdrawn keys", ended)

    return withdrawn


def create_app(settings: CoreSettings, database_url: str) -> FastAPI:
    """The API over ``database_url``, whose schema must already be migrated; the notifier
    LISTENs on ``settings.direct_url(database_url)`` (a pooler carries no LISTEN)."""
    meter = CoreMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = database.pool(
            database_url,
            settings,
            pool_size=settings.db_pool_size,
            max_overflow=0,
            pool_timeout=settings.db_pool_timeout_s,
            # the connections most used first: theirs are the prepared statements
            # (db.pipeline), the rest idle
            pool_use_lifo=True,
        )
        liveness = database.pool(
            database_url,
            settings,
            pool_size=settings.liveness_pool_size,
            max_overflow=0,
            pool_timeout=settings.db_pool_timeout_s,
        )
        # the backlog's counts that callers share (db.readings): a pool of their own, so
        # callers waiting for a reading, each holding a connection of the data path's
        # pool, never hold up the reading itself; one connection for each statement the
        # dashboard's Queues page reads at once (five), and room for other parameters
        counts = database.pool(
            database_url,
            settings,
            pool_size=2,
            max_overflow=6,
            pool_timeout=settings.db_pool_timeout_s,
        )
        direct = settings.direct_url(database_url)
        notifier = Notifier(direct)
        notifier.start()
        app.state.engine = engine
        app.state.liveness_engine = liveness
        app.state.readings = readings.Shared(counts)
        app.state.leases = LeaseCache(settings.lease_cache_s)
        app.state.settings = settings
        app.state.notifier = notifier
        app.state.known_workers = Known()  # for the claims' early picks (ops.dispatch)
        app.state.claim_holds = Holds()  # when this replica's claims last held work back
        # On SIGTERM, before uvicorn waits for requests to end: long polls answer now.
        app.state.on_exit = [notifier.line.close]
        app.state.tokens = TokenCache(settings.token_cache_s)
        app.state.disabled_owners = principals_db.DisabledOwners(settings.token_cache_s)
        app.state.secret_box = secret_box(settings)
        oidc = None
        if settings.oidc_enabled:
            oidc = OidcVerifier(settings, on_withdrawn=_forget_withdrawn(app, engine))
        app.state.oidc = oidc
        app.state.signin = ProviderClient(settings) if settings.signin_enabled else None
        app.state.sharing = sharing.Book(settings.sharing_cache_s)
        group = None
        if settings.submit_group_commit:
            # Direct, as the notifier's: its notes' echo is known by its backend's pid,
            # which a pooler does not tell.
            group = GroupCommit(
                libpq_url(direct),
                database.keepalive(direct),
                settings.fair_quantum_s,
                notifier,
                fair=settings.fair_share_rule,
                wait_s=settings.db_pool_timeout_s,
            )
            group.start()
        app.state.group_commit = group
        app.state.log_maskers = tasklogs.Maskers(app.state.secret_box)
        app.state.log_objects = LogObjects.of(settings)
        app.state.webhooks = await notify.Webhooks.of(
            app.state.secret_box, settings, database_url, direct
        )
        leadership, background = loops.start(
            engine,
            notifier,
            settings,
            meter,
            liveness,
            webhooks=app.state.webhooks,
            objects=app.state.log_objects,
            database_url=direct,  # the leader's session advisory lock
            book=app.state.sharing,
        )
        app.state.leadership = leadership
        meter.lead(lambda: leadership.leading)
        meter.wait_line(lambda: len(notifier.line))
        if oidc is not None:
            background.append(asyncio.create_task(oidc.run(), name="cairn-oidc-keys"))
            app.state.degraded = oidc.degraded
        app.state.loops = {t.get_name(): t for t in [*background, *notifier.tasks]}
        try:
            yield
        finally:
            await waits.stop(*background)
            if group is not None:
                await group.stop()
            await notifier.stop()
            await engine.dispose()
            await liveness.dispose()
            await counts.dispose()
            if app.state.log_objects is not None:
                app.state.log_objects.close()

    app = pages.service_app(
        title="Cairn core",
        version="1.4.0",  # the API's: docs/api.md says when it moves
        summary="Single tasks: submit, follow, cancel, retry; the event feed; queues.",
        lifespan=lifespan,
    )
    app.state.core_metrics = meter
    app.state.metrics = meter.metrics
    problems.install(app)
    routers = (
        tasks,
        events,
        queues,
        workers,
        usage,
        sharing_api,
        principals,
        login,
        tokens,
        teams,
        secrets,
        audit,
        fencing,
        services_api,
    )
    pages.add_routes(
        app,
        *(module.router for module in (*routers, health, metrics)),
        subscriptions.router,
        subscriptions.events_router,
        ui,
    )
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    return app
