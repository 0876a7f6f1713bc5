"""OIDC: core accepts JWTs signed by the company's identity provider (PyJWT verifies them
against its JWKS, from a URL or a file), mapping one claim to the principal and one to
its teams. Every refusal is the same 401: the caller learns nothing of why."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from datetime import UTC, datetime
from typing import Any

import httpx
import jwt

from libs.common.errors import Unauthorized, Unavailable
from services.core.settings import CoreSettings
from services.core.store import Principal

log = logging.getLogger("cairn.core.oidc")

REFUSED = "unknown or revoked token"
# An unknown key id refetches the key set, but not more often than this: a flood of
# made-up key ids must not become a flood of requests to the identity provider.
REFETCH_MIN_S = 30.0
_TEAM = re.compile(r"^[a-z0-9][a-z0-9_.\-]{0,63}$")
_NAME = re.compile(r"^[^\x00-\x1f\x7f]{1,100}$")


class OidcVerifier:
    """Verifies identity-provider JWTs and says whom they stand for."""

    def __init__(
        self, settings: CoreSettings, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.issuer = settings.oidc_issuer
        self.audience = settings.oidc_audience
        self.jwks_url = settings.oidc_jwks_url
        self.jwks_file = settings.oidc_jwks_file
        self.principal_claim = settings.oidc_principal_claim
        self.teams_claim = settings.oidc_teams_claim
        self.admin_team = settings.oidc_admin_team
        self.algorithms = [a.strip() for a in settings.oidc_algorithms.split(",") if a.strip()]
        self.leeway_s = settings.oidc_leeway_s
        self._transport = transport
        self._keys: dict[str | None, jwt.PyJWK] = {}
        self._fetched_at = float("-inf")
        self._lock = asyncio.Lock()

    async def _read_keyset(self) -> dict[str, Any]:
        if self.jwks_file is not None:
            return dict(json.loads(await asyncio.to_thread(self.jwks_file.read_text)))
        assert self.jwks_url is not None
        timeout = httpx.Timeout(5.0, connect=2.0)
        async with httpx.AsyncClient(timeout=timeout, transport=self._transport) as http:
            answer = await http.get(self.jwks_url)
            answer.raise_for_status()
            return dict(answer.json())

    async def _refresh(self) -> None:
        async with self._lock:
            if time.monotonic() - self._fetched_at < REFETCH_MIN_S and self._keys:
                return
            self._fetched_at = time.monotonic()
            try:
                keyset = jwt.PyJWKSet.from_dict(await self._read_keyset())
            except (OSError, ValueError, httpx.HTTPError, jwt.PyJWTError) as exc:
                log.warning("cannot load the OIDC key set: %s", exc)
                if not self._keys:
                    raise Unavailable("the identity provider's keys cannot be loaded") from None
                return
            self._keys = {key.key_id: key for key in keyset.keys}

    async def _key(self, kid: str | None) -> jwt.PyJWK | None:
        if kid not in self._keys and time.monotonic() - self._fetched_at >= REFETCH_MIN_S:
            await self._refresh()
        if kid is None and len(self._keys) == 1:
            return next(iter(self._keys.values()))
        return self._keys.get(kid)

    async def verify(self, token: str) -> Principal:
        """The principal a valid JWT stands for; ``Unauthorized`` for any other."""
        try:
            header = jwt.get_unverified_header(token)
            alg = header.get("alg")
            if alg not in self.algorithms:
                raise jwt.InvalidAlgorithmError(f"algorithm {alg!r} is not accepted")
            key = await self._key(header.get("kid"))
            if key is None:
                raise jwt.InvalidKeyError(f"no key {header.get('kid')!r} in the key set")
            if key.algorithm_name != alg:
                raise jwt.InvalidAlgorithmError(f"key is for {key.algorithm_name}, not {alg}")
            claims = jwt.decode(
                token,
                key.key,
                algorithms=[alg],
                audience=self.audience,
                issuer=self.issuer,
                leeway=self.leeway_s,
                options={"require": ["exp", "iss", "aud", self.principal_claim]},
            )
        except jwt.PyJWTError as exc:
            log.info("refused a JWT: %s", exc)
            raise Unauthorized(REFUSED) from None
        return self._principal(claims)

    def _principal(self, claims: dict[str, Any]) -> Principal:
        name = claims[self.principal_claim]
        if not isinstance(name, str) or not _NAME.match(name):
            log.info("refused a JWT: claim %s is not a usable name", self.principal_claim)
            raise Unauthorized(REFUSED)
        raw = claims.get(self.teams_claim, [])
        found = raw if isinstance(raw, list) else [raw]
        teams = frozenset(t for t in found if isinstance(t, str) and _TEAM.match(t))
        admin = self.admin_team is not None and self.admin_team in teams
        return Principal(
            name=name,
            role="admin" if admin else "user",
            teams=teams,
            expires_at=datetime.fromtimestamp(float(claims["exp"]), UTC),
        )
