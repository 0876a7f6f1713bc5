"""The sign-in pieces core and the CLI share, against httpx.MockTransport: a discovery
document must be the issuer's own, a provider's refusal is a 401 with its words, a device
flow waits while the person has not approved and slows down when told."""

from __future__ import annotations

import base64
import hashlib
import time
from typing import Any

import httpx
import jwt
import pytest

from libs.common import signin
from libs.common.errors import Unauthorized, Unavailable

ISSUER = "https://idp.example.test"
PROVIDER = signin.Provider(
    ISSUER, f"{ISSUER}/auth", f"{ISSUER}/token", f"{ISSUER}/device", f"{ISSUER}/revoke"
)


def _id_token(exp: float) -> str:
    return jwt.encode({"sub": "alice", "exp": int(exp)}, "k" * 32, algorithm="HS256")


def test_a_discovery_document_must_name_its_issuer_and_its_endpoints() -> None:
    document = {
        "issuer": ISSUER,
        "authorization_endpoint": f"{ISSUER}/auth",
        "token_endpoint": f"{ISSUER}/token",
    }
    found = signin.provider_of(document, ISSUER)
    assert found.token_endpoint == f"{ISSUER}/token" and found.device_authorization_endpoint is None
    with pytest.raises(Unavailable, match="not issuer"):
        signin.provider_of({**document, "issuer": "https://evil.test"}, ISSUER)
    with pytest.raises(Unavailable, match="token_endpoint"):
        signin.provider_of({**document, "token_endpoint": "javascript:x"}, ISSUER)
    with pytest.raises(Unavailable, match="not a JSON object"):
        signin.provider_of(["x"], ISSUER)


def test_the_pkce_challenge_is_the_s256_of_the_verifier() -> None:
    verifier, challenge = signin.pkce_pair()
    digest = hashlib.sha256(verifier.encode()).digest()
    assert challenge == base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    assert 43 <= len(verifier) <= 128 and signin.pkce_pair()[0] != verifier


def test_a_refused_grant_is_a_401_with_the_providers_error() -> None:
    answer = httpx.Response(400, json={"error": "invalid_grant", "error_description": "gone"})
    with pytest.raises(Unauthorized, match="invalid_grant: gone"):
        signin.tokens_of(answer)
    with pytest.raises(Unavailable, match="no ID token"):
        signin.tokens_of(httpx.Response(200, json={"access_token": "x"}))
    with pytest.raises(Unavailable, match="JSON"):
        signin.tokens_of(httpx.Response(502, text="<html>bad gateway</html>"))
    exp = time.time() + 600
    tokens = signin.tokens_of(httpx.Response(200, json={"id_token": _id_token(exp)}))
    assert tokens.refresh_token is None and int(tokens.expires_at.timestamp()) == int(exp)


def test_the_device_poll_waits_for_approval_and_slows_down_when_told() -> None:
    answers = iter(
        [
            httpx.Response(400, json={"error": "authorization_pending"}),
            httpx.Response(400, json={"error": "slow_down"}),
            httpx.Response(
                200, json={"id_token": _id_token(time.time() + 60), "refresh_token": "r1"}
            ),
        ]
    )
    seen: list[dict[str, Any]] = []

    def provider(request: httpx.Request) -> httpx.Response:
        seen.append(dict(httpx.QueryParams(request.content.decode())))
        return next(answers)

    waits: list[float] = []
    device = signin.DeviceCode("dc", "ABCD-EFGH", f"{ISSUER}/device", None, 2.0, 600)
    with httpx.Client(transport=httpx.MockTransport(provider)) as http:
        tokens = signin.poll_device(http, PROVIDER, "cairn", device, sleep=waits.append)
    assert tokens.refresh_token == "r1" and waits == [2.0, 2.0, 7.0]
    assert seen[0] == {"grant_type": signin.DEVICE_GRANT, "device_code": "dc", "client_id": "cairn"}


def test_a_denied_device_code_ends_the_poll_with_a_401() -> None:
    def provider(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": "access_denied"})

    device = signin.DeviceCode("dc", "ABCD-EFGH", f"{ISSUER}/device", None, 0.0, 600)
    with (
        httpx.Client(transport=httpx.MockTransport(provider)) as http,
        pytest.raises(Unauthorized, match="access_denied"),
    ):
        signin.poll_device(http, PROVIDER, "cairn", device, sleep=lambda _: None)
