"""Callers of the cron and DAG services, known through core.

Core holds the tokens. A service that is not core learns who a bearer token stands for by
asking core's ``GET /v1/whoami`` with that token, and keeps the answer for ``ttl_s`` (so a
revoked token stops working within that time, as it does in core itself). Core being
unreachable is a 503, never a 401: the caller's token may be fine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated

import httpx
from fastapi import Depends, Header, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from libs.common.client import ON_BEHALF_OF, CoreClient
from libs.common.errors import Forbidden, Unauthorized, Unavailable
from libs.common.expiring import Expiring

_bearer = HTTPBearer(auto_error=False, description="A token from `cairn token create`.")


# A bearer credential longer than this is refused unread; JWTs from an identity provider
# are the long ones, Cairn's own tokens at most 200 characters.
MAX_CREDENTIAL = 8192


def looks_like_jwt(credential: str) -> bool:
    """A compact JWS (``header.payload.signature``, the header a JSON object)."""
    return credential.startswith("eyJ") and credential.count(".") == 2


@dataclass(frozen=True)
class Visibility:
    """The work a caller limited to its own sees: its name's, and its teams'."""

    owner: str
    teams: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Caller:
    """Who is calling: a name (the owner of what it creates), a role, the teams it belongs
    to, and when its credential expires (None: it does not)."""

    name: str
    role: str
    teams: frozenset[str] = field(default_factory=frozenset)
    expires_at: datetime | None = None

    @property
    def sees_all(self) -> bool:
        return self.role in ("admin", "service")

    @property
    def owner_filter(self) -> str | None:
        """The owner this caller is limited to, or None when it may see every owner."""
        return None if self.sees_all else self.name

    @property
    def visibility(self) -> Visibility | None:
        """What this caller may see, or None when it may see every owner's work."""
        return None if self.sees_all else Visibility(self.name, self.teams)


def cache_for(ttl_s: float, expires_at: datetime | None) -> float:
    """How long to keep an answer: ``ttl_s``, or less if the credential expires sooner."""
    if expires_at is None:
        return ttl_s
    return max(0.0, min(ttl_s, expires_at.timestamp() - time.time()))


class RemoteAuth:
    """Resolves bearer tokens through core, with a small cache of recent answers.

    One client, made once, checks every caller's token over its pooled keep-alive
    connections (the token goes in each request); close it with ``aclose`` when the
    service stops. Resolves of one token that is not cached share one call to core, and
    its answer or error (errors are not kept)."""

    def __init__(
        self,
        cores: str | Sequence[str],
        ttl_s: float = 30.0,
        size: int = 10_000,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self.ttl_s = ttl_s
        self.size = size
        # ``timeout_s``: how long one check waits for a core's answer (then the next
        # core's, then a 503); a core that cannot be reached or answers 5xx passes the
        # check to the next of ``cores`` (``ApiClient``), a 401 is final
        timeout = httpx.Timeout(timeout_s, connect=min(2.0, timeout_s))
        self._core = CoreClient(cores, None, transport=transport, timeout=timeout)
        self._kept: Expiring[str, Caller] = Expiring(ttl_s, size)
        # The calls under way, one per token; past ``size`` of them a resolve asks alone.
        self._asking: dict[str, asyncio.Task[Caller]] = {}

    @property
    def closed(self) -> bool:
        return self._core.is_closed

    async def aclose(self) -> None:
        await self._core.aclose()

    async def resolve(self, token: str) -> Caller:
        kept = self._kept.get(token)
        if kept is not None:
            return kept
        asking = self._asking.get(token)
        if asking is None:
            if len(self._asking) >= self.size:
                return await self._ask(token)
            asking = asyncio.create_task(self._ask(token), name="whoami")
            self._asking[token] = asking
            asking.add_done_callback(lambda done: self._asked(token, done))
        # A caller that goes away does not cancel the call the others wait on.
        return await asyncio.shield(asking)

    def _asked(self, token: str, done: asyncio.Task[Caller]) -> None:
        if self._asking.get(token) is done:
            del self._asking[token]
        if not done.cancelled():
            done.exception()  # seen here, should every waiter have gone away

    async def _ask(self, token: str) -> Caller:
        try:
            who = await self._core.whoami(token)
        except httpx.TransportError as exc:
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise Unavailable(f"core cannot be reached to check the token ({why})") from None
        caller = Caller(
            name=who.name, role=who.role, teams=frozenset(who.teams), expires_at=who.expires_at
        )
        self._kept.put(token, caller, cache_for(self.ttl_s, who.expires_at))
        return caller


async def current_caller(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Caller:
    if credentials is None or not credentials.credentials:
        raise Unauthorized("send 'Authorization: Bearer <token>'")
    if len(credentials.credentials) > MAX_CREDENTIAL:
        raise Unauthorized("unknown or revoked token")
    auth: RemoteAuth = request.app.state.auth
    return await auth.resolve(credentials.credentials)


async def _person(caller: Annotated[Caller, Depends(current_caller)]) -> Caller:
    if caller.role not in ("user", "admin", "service"):
        raise Forbidden(f"the {caller.role} role may not do this")
    return caller


# Workers may not touch schedules or workflows; everyone else may, each their own.
Person = Annotated[Caller, Depends(_person)]


OnBehalfOf = Annotated[
    str | None,
    Header(
        alias=ON_BEHALF_OF,
        min_length=1,
        max_length=200,
        pattern=r"^[^\x00-\x1f\x7f]+$",
        description="The owner of what is created; only the service role may name someone "
        "else (cron and DAG create tasks and runs for the person who owns the schedule or run).",
    ),
]


def acting_owner(caller: Caller, on_behalf_of: str | None) -> str:
    """The owner of what ``caller`` creates: itself, or whom a service token names."""
    if on_behalf_of is None or on_behalf_of == caller.name:
        return caller.name
    if caller.role != "service":
        raise Forbidden(f"only the service role may use {ON_BEHALF_OF}")
    return on_behalf_of


async def _acting_owner(caller: Person, on_behalf_of: OnBehalfOf = None) -> str:
    return acting_owner(caller, on_behalf_of)


# The owner of what the call creates: the caller, or whom a service token names.
ActingOwner = Annotated[str, Depends(_acting_owner)]
