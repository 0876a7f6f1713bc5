"""The dashboard's side of signing in at the provider: its endpoints (read once from its
discovery document, again after a failure) and the exchange of an authorization code for
tokens (with the PKCE verifier; the client secret when one is configured). The ID token
that comes back is verified by ``OidcVerifier`` like any other."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from libs.common import signin
from libs.common.errors import Unavailable
from services.core.settings import CoreSettings


class ProviderClient:
    """Calls of core to the OpenID provider on a person's behalf."""

    def __init__(
        self, settings: CoreSettings, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        assert settings.oidc_issuer is not None and settings.oidc_client_id is not None
        self.issuer = settings.oidc_issuer
        self.client_id = settings.oidc_client_id
        secret = settings.oidc_client_secret
        self.client_secret = secret.get_secret_value() if secret is not None else None
        self.scopes = settings.oidc_scopes
        self._transport = transport
        self._provider: signin.Provider | None = None
        self._lock = asyncio.Lock()

    async def _call(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        try:
            async with httpx.AsyncClient(timeout=signin.TIMEOUT, transport=self._transport) as http:
                return await http.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            raise Unavailable(f"the identity provider cannot be reached ({exc})") from None

    async def provider(self) -> signin.Provider:
        """The provider's endpoints (its discovery document, read once)."""
        async with self._lock:
            if self._provider is None:
                answer = await self._call("GET", signin.discovery_url(self.issuer))
                if answer.status_code != 200:
                    raise Unavailable(
                        f"the provider's discovery document answered {answer.status_code}"
                    )
                self._provider = signin.provider_of(signin.json_of(answer), self.issuer)
            return self._provider

    async def exchange(self, code: str, verifier: str, redirect_uri: str) -> signin.Tokens:
        """The tokens an authorization code stands for (``Unauthorized`` if refused)."""
        provider = await self.provider()
        form = {
            "grant_type": "authorization_code",
            "code": code,
            "code_verifier": verifier,
            "redirect_uri": redirect_uri,
            "client_id": self.client_id,
        }
        if self.client_secret is not None:
            form["client_secret"] = self.client_secret
        return signin.tokens_of(await self._call("POST", provider.token_endpoint, data=form))
