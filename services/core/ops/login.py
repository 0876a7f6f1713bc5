"""People signing in through the identity provider: the principal a verified JWT stands
for (the CLI's ``cairn login`` token and the dashboard's ID token alike), the
dashboard's authorization-code flow (start, finish into a session) and its sessions."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from urllib.parse import urlencode

from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common import signin
from libs.common.errors import InvalidInput, Unauthorized
from services.core.db import login, tokens
from services.core.db.audit import Auditor
from services.core.db.principals import is_disabled
from services.core.db.teams import recorded_teams
from services.core.domain.principals import Principal
from services.core.identity.oidc import OidcVerifier
from services.core.identity.signin import ProviderClient
from services.core.ops.teams import claims_seen

ENDED = "your session has ended: sign in again"
#: a JWT, a session or its token of a disabled principal (``db.principals``)
DISABLED = "this principal is disabled"
#: what a session's bearer token begins with: never a ``cairn token create`` token's
#: beginning (``cairn_`` and base64url), so the two are told apart without a query
SESSION_TOKEN_PREFIX = "cairns_"  # noqa: S105 - a prefix, not a secret


async def jwt_principal(
    engine: AsyncEngine, oidc: OidcVerifier, token: str, nonce: str | None = None
) -> Principal:
    """Whom a provider's JWT stands for (its claimed teams with those an admin recorded);
    the teams it claims are kept (``ops.teams.claims_seen``). 401 for a disabled name."""
    found = await oidc.verify(token, nonce)
    async with engine.connect() as conn:
        role = await tokens.role_of(conn, found.name)
        known = await recorded_teams(conn, found.name)
        disabled = await is_disabled(conn, found.name)
    if disabled:
        raise Unauthorized(DISABLED)
    if role is not None and role not in ("user", found.role):
        # The provider names someone who is a service or worker here: not the same one.
        raise Unauthorized("unknown or revoked token")
    await claims_seen(engine, found)
    return replace(found, teams=found.teams | known)


@dataclass(frozen=True)
class Started:
    """Where to send the browser, and the state its cookie binds the flow to."""

    location: str
    state: str


async def start(
    engine: AsyncEngine, client: ProviderClient, redirect_uri: str, next_: str
) -> Started:
    """Begin an authorization-code flow with PKCE (S256) and a nonce."""
    provider = await client.provider()
    state, nonce = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    verifier, challenge = signin.pkce_pair()
    async with engine.begin() as conn:
        await login.start_flow(conn, state, verifier, nonce, next_)
    query = {
        "response_type": "code",
        "client_id": client.client_id,
        "redirect_uri": redirect_uri,
        "scope": client.scopes,
        "state": state,
        "nonce": nonce,
        "code_challenge": challenge,
        "code_challenge_method": "S256",
    }
    return Started(f"{provider.authorization_endpoint}?{urlencode(query)}", state)


@dataclass(frozen=True)
class Signed:
    """A new session: its cookie, its CSRF token, where the browser goes next."""

    session_id: str
    csrf: str
    next: str
    principal: Principal


async def finish(
    engine: AsyncEngine,
    oidc: OidcVerifier,
    client: ProviderClient,
    code: str,
    state: str,
    redirect_uri: str,
    lifetime_s: float,
    source: str | None = None,
) -> Signed:
    """The provider sent the browser back with ``code``: the flow of ``state`` (once),
    the code exchanged with its verifier, the ID token verified with its nonce, and a
    session made for whom it names, audited (``login.session``, from ``source``) in the
    session's own transaction. The session's short-lived bearer tokens
    (``session_token``) are derived from it and end with it: its row stands for them."""
    async with engine.begin() as conn:
        flow = await login.take_flow(conn, state)
    if flow is None:
        raise InvalidInput("query.state: no sign-in under way has this state (or it expired)")
    tokens_ = await client.exchange(code, flow.verifier, redirect_uri)
    principal = await jwt_principal(engine, oidc, tokens_.id_token, flow.nonce)
    session_id, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    async with engine.begin() as conn:
        await login.create_session(
            conn,
            session_id,
            csrf,
            principal.name,
            principal.role,
            principal.claimed,
            principal.key_id,
            lifetime_s,
        )
        await Auditor(principal, source)(
            conn,
            "login.session",
            f"principal:{principal.name}",
            after={
                "role": principal.role,
                "claimed_teams": sorted(principal.claimed),
                "lifetime_s": lifetime_s,
            },
        )
    return Signed(session_id, csrf, flow.next, principal)


async def session_principal(engine: AsyncEngine, session_id: str) -> tuple[Principal, str]:
    """Whom a session cookie stands for, and the digest of its CSRF token; 401 when the
    session is unknown or has ended, or its principal is disabled."""
    async with engine.connect() as conn:
        found = await login.get_session(conn, session_id)
        if found is None:
            raise Unauthorized(ENDED)
        if await is_disabled(conn, found.principal):
            raise Unauthorized(DISABLED)
        known = await recorded_teams(conn, found.principal)
    return _principal(found, known), found.csrf_hash


def _principal(found: login.Session, known: frozenset[str]) -> Principal:
    return Principal(
        name=found.principal,
        role=found.role,
        teams=found.teams | known,
        expires_at=found.expires_at,
        key_id=found.kid,
        claimed=found.teams,
    )


def _session_token(session_id: str, turn: int) -> str:
    """The session's token for stretch ``turn``: derived from the cookie (which only the
    browser holds), so asking again within a stretch gives the same one, and the table
    holds no more than its digest."""
    mac = hmac.new(session_id.encode(), f"cairn bearer {turn}".encode(), hashlib.sha256)
    return SESSION_TOKEN_PREFIX + base64.urlsafe_b64encode(mac.digest()).rstrip(b"=").decode()


async def session_token(
    engine: AsyncEngine, session_id: str, lifetime_s: float, now: float | None = None
) -> tuple[str, datetime]:
    """A bearer token of the session's person and when it expires: time runs in
    stretches of half ``lifetime_s``; a stretch's token lasts to the end of the next one
    (so it has half to all of ``lifetime_s`` left when given out) and never past the
    session. A session has at most two live ones; they end with it. 401 when it has ended."""
    stretch = lifetime_s / 2
    turn = int((time.time() if now is None else now) // stretch)
    token = _session_token(session_id, turn)
    until = datetime.fromtimestamp((turn + 2) * stretch, UTC)
    async with engine.begin() as conn:
        ends = await login.keep_token(conn, session_id, token, until)
    if ends is None:
        raise Unauthorized(ENDED)
    return token, ends


async def token_principal(engine: AsyncEngine, token: str) -> Principal | None:
    """Whom a session's bearer token stands for: the session's person, its claimed teams
    with those recorded, until the token or the session ends; None if neither is live.
    401 when its principal is disabled."""
    async with engine.connect() as conn:
        found = await login.token_session(conn, token)
        if found is None:
            return None
        if await is_disabled(conn, found.principal):
            raise Unauthorized(DISABLED)
        known = await recorded_teams(conn, found.principal)
    return _principal(found, known)


async def sign_out(
    engine: AsyncEngine, session_id: str, who: Principal, source: str | None = None
) -> None:
    """End ``who``'s session, audited (``login.sign_out``)."""
    async with engine.begin() as conn:
        await login.end_session(conn, session_id)
        await Auditor(who, source)(conn, "login.sign_out", f"principal:{who.name}")


async def forget_sessions(engine: AsyncEngine, kids: list[str]) -> int:
    """The provider withdrew these keys: the sessions their ID tokens began end."""
    async with engine.begin() as conn:
        return await login.end_sessions_of_keys(conn, kids)
