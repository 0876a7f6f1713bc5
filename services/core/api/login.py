"""Signing in through the identity provider (docs/security.md, "Signing in"): what the
CLI needs for ``cairn login`` (the device flow, which it runs against the provider
itself), and the dashboard's authorization code flow with PKCE, which ends in a session
cookie (HttpOnly, SameSite=Lax, Secure when core's URL is https) and a CSRF token."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import RedirectResponse

from libs.common.errors import InvalidInput, NotFound, Unauthorized
from libs.common.models import LoginConfig, SessionToken
from libs.common.problems import PROBLEMS
from services.core.api.deps import CSRF_COOKIE, SESSION_COOKIE, Engine, authenticate
from services.core.db.login import FLOW_MAX_S
from services.core.identity.oidc import OidcVerifier
from services.core.identity.signin import ProviderClient
from services.core.ops import login as login_ops
from services.core.settings import CoreSettings

router = APIRouter(prefix="/v1/login", tags=["login"])

#: binds a sign-in under way to the browser that began it
STATE_COOKIE = "cairn_login_state"
CALLBACK = "/v1/login/callback"

NextPath = Annotated[
    str,
    Query(
        max_length=500,
        pattern=r"^/ui(/[^\x00-\x1f\\]*)?$",
        description="Where the dashboard goes after signing in (a path under /ui).",
    ),
]
Text = Annotated[str, Query(min_length=1, max_length=2048)]


def _settings(request: Request) -> CoreSettings:
    settings: CoreSettings = request.app.state.settings
    return settings


def _signin(request: Request) -> tuple[ProviderClient, OidcVerifier]:
    client: ProviderClient | None = getattr(request.app.state, "signin", None)
    oidc: OidcVerifier | None = request.app.state.oidc
    if client is None or oidc is None:
        raise NotFound("signing in is not configured here (CAIRN_OIDC_CLIENT_ID)")
    return client, oidc


def _redirect_uri(settings: CoreSettings) -> str:
    return settings.url.rstrip("/") + CALLBACK


def _cookie(
    response: Response, settings: CoreSettings, name: str, value: str, **kw: object
) -> None:
    response.set_cookie(
        name,
        value,
        secure=settings.url.startswith("https://"),
        samesite="lax",
        **kw,  # type: ignore[arg-type]
    )


@router.get("/config", response_model=LoginConfig, responses=PROBLEMS)
async def login_config(request: Request) -> LoginConfig:
    """The provider and client id ``cairn login`` signs in with (404: none configured)."""
    client, _ = _signin(request)
    return LoginConfig(issuer=client.issuer, client_id=client.client_id, scopes=client.scopes)


@router.get("/start", status_code=303, response_class=RedirectResponse, responses=PROBLEMS)
async def login_start(request: Request, engine: Engine, next: NextPath = "/ui/") -> Response:
    """Send the browser to the provider's sign-in (authorization code flow, PKCE S256)."""
    client, _ = _signin(request)
    settings = _settings(request)
    started = await login_ops.start(engine, client, _redirect_uri(settings), next)
    response = RedirectResponse(started.location, status_code=303)
    _cookie(
        response,
        settings,
        STATE_COOKIE,
        started.state,
        httponly=True,
        max_age=FLOW_MAX_S,
        path="/v1/login",
    )
    return response


@router.get(CALLBACK.removeprefix("/v1/login"), status_code=303, responses=PROBLEMS)
async def login_callback(
    request: Request,
    engine: Engine,
    state: Text,
    code: Text | None = None,
    error: Text | None = None,
    error_description: Text | None = None,
) -> Response:
    """Where the provider sends the browser back: the code is exchanged, its ID token
    verified, and a session begins (its cookie and CSRF token set); then to the page
    the sign-in began from. A state this browser did not start is a 422; a refusal of
    the provider, a 401."""
    client, oidc = _signin(request)
    settings = _settings(request)
    mine = request.cookies.get(STATE_COOKIE, "")
    if not mine or not hmac.compare_digest(mine.encode(), state.encode()):
        raise InvalidInput("query.state: not the sign-in this browser began; start again")
    if error is not None:
        said = f"{error}: {error_description}" if error_description else error
        raise Unauthorized(f"the identity provider refused the sign-in ({said[:300]})")
    if code is None:
        raise InvalidInput("query.code: the provider sent no code")
    signed = await login_ops.finish(
        engine,
        oidc,
        client,
        code,
        state,
        _redirect_uri(settings),
        settings.session_max_s,
        request.client.host if request.client else None,
    )
    response = RedirectResponse(signed.next, status_code=303)
    response.delete_cookie(STATE_COOKIE, path="/v1/login")
    lifetime = int(settings.session_max_s)
    _cookie(response, settings, SESSION_COOKIE, signed.session_id, httponly=True, max_age=lifetime)
    _cookie(response, settings, CSRF_COOKIE, signed.csrf, max_age=lifetime)
    return response


@router.post("/logout", status_code=204, responses=PROBLEMS)
async def logout(request: Request, engine: Engine) -> Response:
    """End the dashboard's session (its CSRF token required, like any change) and clear
    its cookies. Bearer tokens are not sessions: there is nothing to end for them."""
    session = request.cookies.get(SESSION_COOKIE)
    if session:
        try:
            who = await authenticate(request, engine, None)  # the session's CSRF check
        except Unauthorized:
            pass  # ended already: only its cookies are left to clear
        else:
            source = request.client.host if request.client else None
            await login_ops.sign_out(engine, session, who, source)
    response = Response(status_code=204)
    response.delete_cookie(SESSION_COOKIE)
    response.delete_cookie(CSRF_COOKIE)
    return response


@router.post("/token", response_model=SessionToken, responses=PROBLEMS)
async def session_token(request: Request, response: Response, engine: Engine) -> SessionToken:
    """A short-lived bearer token of the signed-in person, for the dashboard's calls to
    cron and dag (which take bearer tokens, not core's cookie). It needs the session
    cookie and its CSRF token; it stands for whom the session does (the teams its ID token
    claimed included), expires within ``CAIRN_SESSION_TOKEN_S`` and never after the
    session, and ends with it (signing out). Asked again soon, the same token."""
    session = request.cookies.get(SESSION_COOKIE)
    if not session:
        raise Unauthorized("no dashboard session: sign in first (a bearer token needs no other)")
    await authenticate(request, engine, None)  # the session live, its CSRF token sent
    token, until = await login_ops.session_token(
        engine, session, _settings(request).session_token_s
    )
    response.headers["Cache-Control"] = "no-store"
    return SessionToken(token=token, expires_at=until)
