"""OIDC: core accepts JWTs signed by the company's identity provider (PyJWT verifies them
against its JWKS, from a URL or a file), mapping one claim to the principal and one, its
groups, to teams through the operator's explicit mapping (``groups.TeamMapping``). Every
refusal is the same 401: the caller learns nothing of why.

The key set is read again on a schedule (``run``, one of core's loops: every
``CAIRN_OIDC_JWKS_REFRESH_S``, sooner when the provider's Cache-Control says so) and when
a JWT names a key id the set lacks, never more often than ``CAIRN_OIDC_JWKS_MIN_REFRESH_S``
either way: a key the provider withdraws stops verifying at the next read, and a flood of
made-up key ids does not become a flood of requests to the provider. A provider that
cannot be read leaves the last good set in use for ``CAIRN_OIDC_JWKS_STALE_S`` at most,
which the log and /readyz say."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import jwt

from libs.common import cache_control
from libs.common.errors import Unauthorized, Unavailable
from services.core.domain.principals import Principal
from services.core.settings import CoreSettings

log = logging.getLogger("cairn.core.oidc")

REFUSED = "unknown or revoked token"
UNREADABLE = "the identity provider's keys cannot be loaded"
# A provider's key set is a few KiB: a larger answer is refused before it is all read.
MAX_KEYSET_BYTES = 512 * 1024
# The whole read, however slowly the provider drips its answer.
READ_TIMEOUT_S = 10.0
_NAME = re.compile(r"^[^\x00-\x1f\x7f]{1,100}$")


async def _read_bounded(answer: httpx.Response, limit: int) -> bytes:
    body = bytearray()
    async for chunk in answer.aiter_bytes():
        body += chunk
        if len(body) > limit:
            raise ValueError(f"the key set is larger than {limit} bytes")
    return bytes(body)


def _document(body: bytes) -> dict[str, Any]:
    found = json.loads(body)
    if not isinstance(found, dict):
        raise ValueError("the key set is not a JSON object")
    return found


class OidcVerifier:
    """Verifies identity-provider JWTs and says whom they stand for."""

    def __init__(
        self,
        settings: CoreSettings,
        transport: httpx.AsyncBaseTransport | None = None,
        on_withdrawn: Callable[[list[str]], Awaitable[None]] | None = None,
    ) -> None:
        self.issuer = settings.oidc_issuer
        self.audience = settings.oidc_audience
        self.jwks_url = settings.oidc_jwks_url
        self.jwks_file = settings.oidc_jwks_file
        self.principal_claim = settings.oidc_principal_claim
        self.teams_claim = settings.oidc_teams_claim
        self.admin_team = settings.oidc_admin_team
        self.mapping = settings.oidc_team_mapping
        self.algorithms = [a.strip() for a in settings.oidc_algorithms.split(",") if a.strip()]
        self.leeway_s = settings.oidc_leeway_s
        self.refresh_s = settings.oidc_jwks_refresh_s
        self.min_refresh_s = settings.oidc_jwks_min_refresh_s
        self.stale_s = settings.oidc_jwks_stale_s
        self.claim_max_s = settings.oidc_claim_max_s
        self.claim_seen_s = settings.oidc_claim_seen_s
        self._transport = transport
        # Called when a read drops keys: what was checked with them is not trusted either.
        self._on_withdrawn = on_withdrawn
        self._keys: dict[str | None, jwt.PyJWK] = {}
        self._read_at = -math.inf  # when the keys in hand were read (monotonic)
        self._tried_at = -math.inf  # the last read, good or not
        self._lifetime = self.refresh_s  # how long after _read_at the next read is due
        self._failure: str | None = None  # why the last read failed, if it did
        self._lock = asyncio.Lock()
        if not self.mapping.grants_any:
            log.info("OIDC groups grant no team: CAIRN_OIDC_TEAM_PREFIX and _MAP are unset")

    async def run(self) -> None:
        """Read the key set whenever it is due, for ever (core's ``cairn-oidc-keys``)."""
        while True:
            try:
                await self.refresh()
            except Exception:
                # A loop that dies stops the reads for good, and withdrawn keys stay
                # trusted: log, and go on.
                log.exception("reading the OIDC key set failed")
            due = max(self._read_at + self._lifetime, self._tried_at + self.min_refresh_s)
            await asyncio.sleep(max(due - time.monotonic(), 0.0))

    async def refresh(self) -> None:
        """Read the key set again, unless a read began less than
        ``CAIRN_OIDC_JWKS_MIN_REFRESH_S`` ago; a failed read keeps the keys in hand."""
        async with self._lock:
            if time.monotonic() - self._tried_at < self.min_refresh_s:
                return
            self._tried_at = time.monotonic()
            try:
                async with asyncio.timeout(READ_TIMEOUT_S):  # not wait_for: libs.common.waits
                    document, lifetime = await self._read_keyset()
                keyset = jwt.PyJWKSet.from_dict(document)
            except (OSError, ValueError, TimeoutError, httpx.HTTPError, jwt.PyJWTError) as exc:
                self._failed(exc)
                return
            withdrawn = self._replace({key.key_id: key for key in keyset.keys}, lifetime)
        if withdrawn and self._on_withdrawn is not None:
            await self._on_withdrawn(withdrawn)

    async def _read_keyset(self) -> tuple[dict[str, Any], float]:
        """The key set, and how long it may be kept (the provider's max-age, bounded)."""
        if self.jwks_file is not None:
            return _document(await asyncio.to_thread(self._read_file)), self.refresh_s
        assert self.jwks_url is not None
        timeout = httpx.Timeout(5.0, connect=2.0)
        # No compression asked for: the bound is on what is parsed, not on what came.
        headers = {"Accept": "application/json", "Accept-Encoding": "identity"}
        async with (
            httpx.AsyncClient(timeout=timeout, transport=self._transport) as http,
            http.stream("GET", self.jwks_url, headers=headers) as answer,
        ):
            answer.raise_for_status()
            body = await _read_bounded(answer, MAX_KEYSET_BYTES)
            kept = cache_control.lifetime(answer.headers.get("cache-control"))
        if kept is None:
            return _document(body), self.refresh_s
        return _document(body), min(max(kept, self.min_refresh_s), self.refresh_s)

    def _read_file(self) -> bytes:
        assert self.jwks_file is not None
        with self.jwks_file.open("rb") as file:
            body = file.read(MAX_KEYSET_BYTES + 1)
        if len(body) > MAX_KEYSET_BYTES:
            raise ValueError(f"the key set is larger than {MAX_KEYSET_BYTES} bytes")
        return body

    def _replace(self, keys: dict[str | None, jwt.PyJWK], lifetime: float) -> list[str]:
        """Take ``keys``; the ids of those it drops (withdrawn by the provider)."""
        withdrawn = sorted(str(kid) for kid in self._keys.keys() - keys.keys())
        if withdrawn:
            log.info("OIDC keys withdrawn by the provider, no longer trusted: %s", withdrawn)
        if self._failure is not None:
            log.warning("the OIDC key set is read again (it could not be: %s)", self._failure)
        self._keys, self._read_at, self._lifetime = keys, self._tried_at, lifetime
        self._failure = None
        return withdrawn

    def _failed(self, exc: Exception) -> None:
        self._failure = f"{type(exc).__name__}: {exc}"[:500]
        age = self._age()
        if age <= self.stale_s:
            log.warning(
                "cannot read the OIDC key set (%s); the set read %.0f s ago stays in use"
                " for %.0f s more at most",
                self._failure,
                age,
                self.stale_s - age,
            )
        else:
            log.error("cannot read the OIDC key set (%s); JWTs are answered 503", self._failure)

    def _age(self) -> float:
        return time.monotonic() - self._read_at

    def degraded(self) -> str | None:
        """What /readyz says of the key set: None while it is read on time. (JWTs are
        not all of core's work: a provider down is said, not made a replica down.)"""
        if self._failure is None:
            return None
        age = self._age()
        if age > self.stale_s:
            return f"OIDC: {UNREADABLE}; JWTs are answered 503"
        return (
            f"OIDC: {UNREADABLE}; the set read {age:.0f} s ago is used"
            f" for {self.stale_s - age:.0f} s more"
        )

    async def _key(self, kid: str | None) -> jwt.PyJWK | None:
        # The schedule is run()'s: a known key never waits here on a slow provider.
        if kid not in self._keys or self._age() > self.stale_s:
            await self.refresh()
        if self._age() > self.stale_s:
            raise Unavailable(UNREADABLE)
        if kid is None and len(self._keys) == 1:
            return next(iter(self._keys.values()))
        return self._keys.get(kid)

    async def verify(self, token: str, nonce: str | None = None) -> Principal:
        """The principal a valid JWT stands for; ``Unauthorized`` for any other (with
        ``nonce``, also one whose ``nonce`` claim is not that: a sign-in's ID token)."""
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
            if nonce is not None and claims.get("nonce") != nonce:
                raise jwt.InvalidTokenError("the nonce is not the sign-in's")
        except jwt.PyJWTError as exc:
            log.info("refused a JWT: %s", exc)
            raise Unauthorized(REFUSED) from None
        return self._principal(claims, key.key_id)

    def _principal(self, claims: dict[str, Any], kid: str | None) -> Principal:
        name = claims[self.principal_claim]
        if not isinstance(name, str) or not _NAME.match(name):
            log.info("refused a JWT: claim %s is not a usable name", self.principal_claim)
            raise Unauthorized(REFUSED)
        raw = claims.get(self.teams_claim, [])
        groups = raw if isinstance(raw, list) else [raw]
        # The admin group is named by the operator, so it is matched as it is written.
        admin = self.admin_team is not None and self.admin_team in groups
        expires = datetime.fromtimestamp(float(claims["exp"]), UTC)
        now = datetime.now(UTC)
        teams = self.mapping.teams(groups)
        return Principal(
            name=name,
            role="admin" if admin else "user",
            teams=teams,
            expires_at=expires,
            key_id=kid,
            claims_until=min(expires, now + timedelta(seconds=self.claim_max_s)),
            claimed=teams,
            claims_standing=now + timedelta(seconds=self.claim_seen_s),
        )
