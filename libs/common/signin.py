"""Signing in at the company's OpenID provider, the parts core and the CLI share: the
provider's discovery document (its endpoints), PKCE (RFC 7636, S256), the token answers
of the authorization code, device (RFC 8628) and refresh grants, and the CLI's blocking
calls of the device flow and of a refresh. Core's asynchronous calls (the dashboard's
code exchange) are in ``services.core.identity.signin``; both verify nothing here: the ID
token is checked by core's ``OidcVerifier`` whoever brings it.

Every refusal of the provider becomes ``Unauthorized`` with its ``error`` (and
description); a provider that cannot be reached, ``Unavailable``."""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import jwt

from libs.common.errors import Unauthorized, Unavailable

DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
#: a discovery document or a token answer is a few KiB
MAX_DOCUMENT_BYTES = 256 * 1024
TIMEOUT = httpx.Timeout(10.0, connect=3.0)
#: what RFC 8628 says a client polls at when the provider names no interval
DEFAULT_POLL_S = 5.0


@dataclass(frozen=True)
class Provider:
    """The endpoints of a provider's discovery document."""

    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    device_authorization_endpoint: str | None = None
    revocation_endpoint: str | None = None


@dataclass(frozen=True)
class Tokens:
    """What a grant answered: the ID token (what core accepts), the refresh token (None:
    the provider gave none) and when the ID token expires."""

    id_token: str
    refresh_token: str | None
    expires_at: datetime


@dataclass(frozen=True)
class DeviceCode:
    """The device authorization answer: what the person opens and types."""

    device_code: str
    user_code: str
    verification_uri: str
    verification_uri_complete: str | None
    interval: float
    expires_in: float


def discovery_url(issuer: str) -> str:
    return issuer.rstrip("/") + "/.well-known/openid-configuration"


def _url(document: dict[str, Any], name: str, required: bool = True) -> str | None:
    value = document.get(name)
    if isinstance(value, str) and value.startswith(("https://", "http://")):
        return value
    if required or value is not None:
        raise Unavailable(f"the provider's discovery document has no usable {name}")
    return None


def provider_of(document: object, issuer: str) -> Provider:
    """The endpoints of a discovery ``document``, which must name ``issuer`` itself
    (OpenID Connect Discovery 1.0, section 4.3)."""
    if not isinstance(document, dict):
        raise Unavailable("the provider's discovery document is not a JSON object")
    if document.get("issuer") != issuer:
        raise Unavailable(f"the provider's discovery document is not issuer {issuer!r}'s")
    return Provider(
        issuer=issuer,
        authorization_endpoint=str(_url(document, "authorization_endpoint")),
        token_endpoint=str(_url(document, "token_endpoint")),
        device_authorization_endpoint=_url(document, "device_authorization_endpoint", False),
        revocation_endpoint=_url(document, "revocation_endpoint", False),
    )


def pkce_pair() -> tuple[str, str]:
    """A PKCE code verifier and its S256 challenge."""
    verifier = secrets.token_urlsafe(48)
    return verifier, challenge_of(verifier)


def challenge_of(verifier: str) -> str:
    digest = hashlib.sha256(verifier.encode("ascii")).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def json_of(answer: httpx.Response) -> dict[str, Any]:
    """The JSON object a provider answered; ``Unavailable`` for anything else."""
    if len(answer.content) > MAX_DOCUMENT_BYTES:
        raise Unavailable("the provider's answer is too large")
    try:
        found = json.loads(answer.content)
    except ValueError:
        found = None
    if not isinstance(found, dict):
        raise Unavailable(f"the provider answered {answer.status_code} without a JSON object")
    return found


def refusal(body: dict[str, Any]) -> str:
    """An OAuth error answer in words: its ``error``, and its description when given."""
    error = str(body.get("error", "refused"))[:100]
    described = body.get("error_description")
    return f"{error}: {str(described)[:300]}" if described else error


def tokens_of(answer: httpx.Response) -> Tokens:
    """The tokens of a successful grant; ``Unauthorized`` with the provider's error for
    a refused one."""
    body = json_of(answer)
    if answer.status_code >= 400 or "error" in body:
        raise Unauthorized(f"the identity provider refused: {refusal(body)}")
    id_token = body.get("id_token")
    if not isinstance(id_token, str):
        raise Unavailable("the provider's answer has no ID token (is 'openid' in the scopes?)")
    try:
        # Read, not trusted: core verifies the token; this is only when to refresh it.
        exp = jwt.decode(id_token, options={"verify_signature": False})["exp"]
        expires_at = datetime.fromtimestamp(float(exp), UTC)
    except (jwt.PyJWTError, KeyError, TypeError, ValueError):
        raise Unavailable("the provider's ID token has no usable exp") from None
    refresh = body.get("refresh_token")
    return Tokens(id_token, refresh if isinstance(refresh, str) else None, expires_at)


def _call(http: httpx.Client, method: str, url: str, **kwargs: Any) -> httpx.Response:
    try:
        return http.request(method, url, **kwargs)
    except httpx.HTTPError as exc:
        raise Unavailable(f"the identity provider cannot be reached ({exc})") from None


def discover(http: httpx.Client, issuer: str) -> Provider:
    """The provider's endpoints, from its discovery document."""
    answer = _call(http, "GET", discovery_url(issuer))
    if answer.status_code != 200:
        raise Unavailable(f"the provider's discovery document answered {answer.status_code}")
    return provider_of(json_of(answer), issuer)


def start_device(http: httpx.Client, provider: Provider, client_id: str, scopes: str) -> DeviceCode:
    """Ask for a device code and the user code the person types (RFC 8628, 3.1)."""
    if provider.device_authorization_endpoint is None:
        raise Unavailable("the provider offers no device authorization endpoint")
    answer = _call(
        http,
        "POST",
        provider.device_authorization_endpoint,
        data={"client_id": client_id, "scope": scopes},
    )
    body = json_of(answer)
    if answer.status_code >= 400:
        raise Unauthorized(f"the identity provider refused: {refusal(body)}")
    try:
        return DeviceCode(
            device_code=str(body["device_code"]),
            user_code=str(body["user_code"]),
            verification_uri=str(body["verification_uri"]),
            verification_uri_complete=body.get("verification_uri_complete"),
            interval=float(body.get("interval", DEFAULT_POLL_S)),
            expires_in=float(body["expires_in"]),
        )
    except (KeyError, TypeError, ValueError):
        raise Unavailable("the provider's device authorization answer is incomplete") from None


def poll_device(
    http: httpx.Client,
    provider: Provider,
    client_id: str,
    device: DeviceCode,
    interval: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> Tokens:
    """Poll the token endpoint until the person has approved (RFC 8628, 3.4-3.5): wait
    ``interval`` (the provider's, unless given) between polls, five seconds more after a
    ``slow_down``; ``Unauthorized`` when they refuse or the code expires."""
    wait = device.interval if interval is None else interval
    deadline = time.monotonic() + device.expires_in
    form = {"grant_type": DEVICE_GRANT, "device_code": device.device_code, "client_id": client_id}
    while time.monotonic() < deadline:
        sleep(wait)
        answer = _call(http, "POST", provider.token_endpoint, data=form)
        if answer.status_code < 400:
            return tokens_of(answer)
        error = json_of(answer).get("error")
        if error == "slow_down":
            wait += 5.0
        elif error != "authorization_pending":
            return tokens_of(answer)  # raises, with the provider's error
    raise Unauthorized("the code expired before it was approved: run `cairn login` again")


def refresh(http: httpx.Client, token_endpoint: str, client_id: str, token: str) -> Tokens:
    """New tokens for a refresh token (RFC 6749, 6)."""
    form = {"grant_type": "refresh_token", "refresh_token": token, "client_id": client_id}
    return tokens_of(_call(http, "POST", token_endpoint, data=form))


def revoke(http: httpx.Client, endpoint: str, client_id: str, token: str) -> None:
    """Revoke a refresh token at the provider (RFC 7009); what it answers is not waited on
    beyond the call: signing out locally does not depend on it."""
    _call(
        http,
        "POST",
        endpoint,
        data={"token": token, "token_type_hint": "refresh_token", "client_id": client_id},
    )
