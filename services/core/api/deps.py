"""Request dependencies. Their names state who may call: ``Submitter``, ``Reader``,
``AdminOnly``, and ``OwnedTask`` (a task loaded by id filtered by who may see it, so
another owner's task is a 404 exactly like a missing one); ``Audit`` records an action."""

from __future__ import annotations

import hmac
import re
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Path, Request, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common import cache_control
from libs.common.auth import MAX_CREDENTIAL, OnBehalfOf, acting_owner, cache_for, looks_like_jwt
from libs.common.client import ON_BEHALF_OF
from libs.common.errors import Forbidden, Unauthorized
from libs.common.expiring import Expiring
from libs.common.models import Task
from services.core.db import readings
from services.core.db import tasks as tasks_db
from services.core.db import workers as workers_db
from services.core.db.audit import Auditor
from services.core.db.feed import Notifier
from services.core.domain.principals import Principal
from services.core.identity.crypto import SecretBox
from services.core.identity.oidc import OidcVerifier
from services.core.ops import login as login_ops
from services.core.ops import tokens as tokens_ops
from services.core.ops.metrics import CoreMetrics

#: the dashboard's session (HttpOnly) and its CSRF token (readable by core's own pages)
SESSION_COOKIE = "cairn_session"
CSRF_COOKIE = "cairn_csrf"
CSRF_HEADER = "X-CSRF-Token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

_bearer = HTTPBearer(auto_error=False, description="A token from `cairn token create`.")

TaskIdPath = Annotated[int, Path(ge=1, le=2**63 - 1, description="The task's id.")]


def engine_of(request: Request) -> AsyncEngine:
    """The data path's pool, or the liveness pool on a route that asks for it."""
    engine: AsyncEngine = getattr(request.state, "engine", None) or request.app.state.engine
    return engine


async def get_engine(request: Request) -> AsyncEngine:
    return engine_of(request)


async def on_liveness_pool(request: Request) -> None:
    """A route dependency (``dependencies=[...]``, solved before the others): this
    request's queries, its caller's authentication included, use the small pool of its
    own that the data path's load cannot exhaust (``CAIRN_LIVENESS_POOL_SIZE``)."""
    request.state.engine = request.app.state.liveness_engine


async def get_notifier(request: Request) -> Notifier:
    notifier: Notifier = request.app.state.notifier
    return notifier


async def get_meter(request: Request) -> CoreMetrics:
    meter: CoreMetrics = request.app.state.core_metrics
    return meter


Engine = Annotated[AsyncEngine, Depends(get_engine)]
Meter = Annotated[CoreMetrics, Depends(get_meter)]
Announcer = Annotated[Notifier, Depends(get_notifier)]


def max_age_of(request: Request) -> float:
    """How old an answer the caller accepts, in seconds: its ``Cache-Control: max-age``
    (over all its ``Cache-Control`` lines), else 0 (an answer read after it asked), as
    with ``no-cache`` or ``no-store``."""
    return cache_control.lifetime(",".join(request.headers.getlist("cache-control"))) or 0.0


async def backlog_counts(request: Request) -> readings.Answer:
    """The reader of the backlog's counts for this request: shared with this core's other
    callers (``db.readings``), as old as its ``Cache-Control: max-age`` accepts. Its
    handler says the age of what it gave in the ``Age`` header (``aged``)."""
    shared: readings.Shared = request.app.state.readings
    return shared.within(max_age_of(request))


def aged(response: Response, answer: readings.Answer) -> None:
    """The ``Age`` header: how old the oldest reading in the answer was, whole seconds."""
    response.headers["Age"] = str(int(answer.age_s))


BacklogCounts = Annotated[readings.Answer, Depends(backlog_counts)]


class TokenCache:
    """Recently seen credentials, so a hot path does not query principals on every
    request. A token revoked through another replica stops working here within ``ttl_s``
    (through this one at once); none outlives its own expiry."""

    def __init__(self, ttl_s: float, size: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self._kept: Expiring[str, Principal] = Expiring(ttl_s, size)

    def get(self, token: str) -> Principal | None:
        return self._kept.get(token)

    def put(self, token: str, principal: Principal) -> None:
        self._kept.put(token, principal, cache_for(self.ttl_s, principal.expires_at))

    def evict(self, token_id: int) -> None:
        """Forget the token with this id (revoked through this replica)."""
        self._kept.forget_where(lambda _, p: p.token_id == token_id)

    def evict_principal(self, name: str) -> None:
        """Forget every credential of ``name`` (disabled through this replica)."""
        self._kept.forget_where(lambda _, p: p.name == name)

    def evict_jwts(self, kids: list[str]) -> None:
        """Forget every JWT, and the tokens resting on ``kids``: the identity provider
        withdrew these keys (every replica reads the key set, so each forgets its own,
        whichever revoked the tokens in the database)."""
        gone = set(kids)
        self._kept.forget_where(lambda k, p: looks_like_jwt(k) or p.key_id in gone)


class LeaseCache:
    """Worker lease secrets this replica has checked, so a worker's every request does
    not read its row again. A worker's lease and the principal that registered it never
    change, so a hit proves what a read would; only digests are kept. An entry lasts
    ``ttl_s`` (0: no caching); a wrong lease is never cached and always reads the row."""

    def __init__(
        self, ttl_s: float, size: int = 10_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._kept: Expiring[int, tuple[str, str]] = Expiring(ttl_s, size, clock)

    def principal_of(self, worker_id: int, lease: str | None) -> str | None:
        """Who registered the worker, if ``lease`` is the one checked for it lately."""
        entry = self._kept.get(worker_id)
        if entry is None or not lease:
            return None
        if not hmac.compare_digest(entry[0], workers_db.lease_digest(lease)):
            return None
        return entry[1]

    def put(self, worker_id: int, lease: str | None, principal: str) -> None:
        if lease:
            self._kept.put(worker_id, (workers_db.lease_digest(lease), principal))


Bearer = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


async def current_principal(request: Request, engine: Engine, credentials: Bearer) -> Principal:
    return await authenticate(request, engine, credentials)


async def authenticate(
    request: Request, engine: AsyncEngine, credentials: HTTPAuthorizationCredentials | None
) -> Principal:
    """Who sent ``credentials``: from the token cache, else the database or the OIDC
    provider; 401 if no one."""
    if credentials is None or not credentials.credentials:
        session = request.cookies.get(SESSION_COOKIE)
        if session:
            return await _from_session(request, engine, session)
        raise Unauthorized("send 'Authorization: Bearer <token>'")
    token = credentials.credentials
    if len(token) > MAX_CREDENTIAL:
        raise Unauthorized("unknown or revoked token")
    cache: TokenCache = request.app.state.tokens
    principal = cache.get(token)
    if principal is None:
        principal = await _resolve(request, engine, token)
        if not token.startswith(login_ops.SESSION_TOKEN_PREFIX):
            cache.put(token, principal)  # a session's ends with it, at once
    return principal


async def _from_session(request: Request, engine: AsyncEngine, session: str) -> Principal:
    """Whom the dashboard's session cookie stands for. A call that changes anything must
    also send the session's CSRF token (``X-CSRF-Token``, the value of the ``cairn_csrf``
    cookie, which only pages of core's own origin can read): another site can make the
    browser send the cookie, not the header."""
    if len(session) > 200:
        raise Unauthorized(login_ops.ENDED)
    principal, csrf_hash = await login_ops.session_principal(engine, session)
    request.state.via_session = True
    if request.method not in SAFE_METHODS:
        sent = request.headers.get(CSRF_HEADER, "")
        if not sent or not hmac.compare_digest(workers_db.lease_digest(sent[:200]), csrf_hash):
            raise Forbidden(
                f"a call with the session cookie that changes something needs the "
                f"{CSRF_HEADER} header (the {CSRF_COOKIE} cookie's value)"
            )
    return principal


async def _resolve(request: Request, engine: AsyncEngine, token: str) -> Principal:
    oidc: OidcVerifier | None = request.app.state.oidc
    if looks_like_jwt(token):
        if oidc is None:
            raise Unauthorized("unknown or revoked token")
        return await login_ops.jwt_principal(engine, oidc, token)
    if len(token) > 200:
        raise Unauthorized("unknown or revoked token")
    if token.startswith(login_ops.SESSION_TOKEN_PREFIX):
        from_session = await login_ops.token_principal(engine, token)
        if from_session is not None:
            return from_session
    principal = await tokens_ops.principal_for(engine, token)
    if principal is None:
        raise Unauthorized("unknown or revoked token")
    return principal


CurrentPrincipal = Annotated[Principal, Depends(current_principal)]


def allow(principal: Principal, roles: tuple[str, ...]) -> Principal:
    """``principal``, if its role is one of ``roles``; else 403."""
    if principal.role not in roles:
        raise Forbidden(f"the {principal.role} role may not do this")
    return principal


def require(*roles: str) -> Callable[[Principal], Coroutine[Any, Any, Principal]]:
    async def check(principal: CurrentPrincipal) -> Principal:
        return allow(principal, roles)

    return check


SUBMITTERS = ("user", "admin", "service")
READERS = SUBMITTERS


async def submitter(request: Request, credentials: Bearer) -> Principal:
    """A caller who may submit, in one dependency (``require`` solves four): the hot
    submit path's, and every other ``Submitter``'s."""
    return allow(await authenticate(request, engine_of(request), credentials), SUBMITTERS)


Submitter = Annotated[Principal, Depends(submitter)]
Reader = Annotated[Principal, Depends(require(*READERS))]
AdminOnly = Annotated[Principal, Depends(require("admin"))]


async def submitting_owner(principal: Submitter, on_behalf_of: OnBehalfOf = None) -> str:
    return acting_owner(principal, on_behalf_of)


SubmittingOwner = Annotated[str, Depends(submitting_owner)]


@dataclass(frozen=True)
class Submission:
    """What a submission's handler needs, solved as one dependency: who calls (a
    ``Submitter``), for whom (``SubmittingOwner``), and core's handles. FastAPI spends
    tens of microseconds on each dependency it solves; the submit path solved thirteen."""

    principal: Principal
    owner: str
    engine: AsyncEngine
    notifier: Notifier
    meter: CoreMetrics


async def submission(
    request: Request, principal: Submitter, on_behalf_of: OnBehalfOf = None
) -> Submission:
    # The caller is a dependency of its own, solved before the header is validated: a
    # request without a valid token is a 401, whatever else is wrong with it.
    state = request.app.state
    owner = acting_owner(principal, on_behalf_of)
    return Submission(principal, owner, engine_of(request), state.notifier, state.core_metrics)


Submitting = Annotated[Submission, Depends(submission)]

# What FastAPI checks of the ``X-Cairn-On-Behalf-Of`` header (``OnBehalfOf``), for
# ``plain_submission``: a value outside it goes to FastAPI's own answer.
_PLAIN_OWNER = re.compile(r"[^\x00-\x1f\x7f]{1,200}")


JSON = "application/json"


class PlainRoute(APIRoute):
    """A route as its endpoint declares it (its OpenAPI, its answers) whose common
    request, a JSON body, ``plain`` serves without FastAPI's dependency solving and body
    handling (the hot paths: ``tasks.SubmitRoute``, ``workers.TurnRoute``). A request
    ``plain`` would not take as it is (None) goes to FastAPI's own handler, so every
    refusal is the one it gives."""

    async def plain(self, request: Request) -> Response | None:
        raise NotImplementedError

    def takes(self, request: Request) -> bool:
        """Whether ``plain`` may serve the request at all: one with a JSON body."""
        return request.headers.get("content-type") == JSON

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        standard = super().get_route_handler()

        async def handle(request: Request) -> Response:
            if self.takes(request):
                # a caller gone before its body was whole: problems.install lets it go
                answer = await self.plain(request)
                if answer is not None:
                    return answer
            return await standard(request)

        return handle


async def plain_caller(request: Request, roles: tuple[str, ...]) -> Principal:
    """The caller, authenticated and of one of ``roles`` (401, 403 as the dependencies
    answer), without FastAPI's dependency solving: for the hot paths' routes."""
    return allow(await authenticate(request, engine_of(request), await _bearer(request)), roles)


async def plain_submission(request: Request) -> Submission | None:
    """``submission`` without FastAPI's dependency solving, for the hot submit path
    (``api.tasks.SubmitRoute``): the caller authenticated first (401, 403 as there), then
    the owner; None when the header is not one ``OnBehalfOf`` takes as it is, for FastAPI
    to answer (its 422 naming it)."""
    principal = await plain_caller(request, SUBMITTERS)
    on_behalf_of = request.headers.get(ON_BEHALF_OF)
    if on_behalf_of is not None and _PLAIN_OWNER.fullmatch(on_behalf_of) is None:
        return None
    state = request.app.state
    owner = acting_owner(principal, on_behalf_of)
    return Submission(principal, owner, engine_of(request), state.notifier, state.core_metrics)


async def owned_task(task_id: TaskIdPath, principal: Reader, engine: Engine) -> Task:
    async with engine.connect() as conn:
        return await tasks_db.get_task(conn, task_id, principal.visibility)


OwnedTask = Annotated[Task, Depends(owned_task)]
"""A task the caller may see: its own, its teams', or (admins, services) anyone's."""


async def get_secret_box(request: Request) -> SecretBox:
    box: SecretBox = request.app.state.secret_box
    return box


Box = Annotated[SecretBox, Depends(get_secret_box)]


def auditor_of(request: Request, principal: Principal) -> Auditor:
    """The writer of the audit rows of ``principal``'s request, from its client's address."""
    return Auditor(principal, request.client.host if request.client else None)


async def get_auditor(request: Request, principal: CurrentPrincipal) -> Auditor:
    return auditor_of(request, principal)


Audit = Annotated[Auditor, Depends(get_auditor)]
