"""OIDC over real HTTP: JWTs the tests sign with key pairs of their own, checked by core
against a JWKS file or URL; cron and dag accept the same through core. Every forged,
expired or misdirected JWT gets the same 401 as an unknown token."""

from __future__ import annotations

import base64
import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from services.core.identity import oidc
from tests.cron.conftest import start_cron
from tests.dag.conftest import start_dag
from tests.support import Core, spec, start_core

ISSUER = "https://idp.example.test"
AUDIENCE = "cairn"
REFUSED = {"type", "title", "status", "detail"}


class Keys:
    """A signing key pair and its public JWK."""

    def __init__(self, kid: str, kind: str = "rsa") -> None:
        self.kid = kid
        if kind == "rsa":
            self.private: Any = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            self.alg = "RS256"
            jwk = RSAAlgorithm.to_jwk(self.private.public_key(), as_dict=True)
        else:
            self.private = ec.generate_private_key(ec.SECP256R1())
            self.alg = "ES256"
            jwk = ECAlgorithm.to_jwk(self.private.public_key(), as_dict=True)
        self.jwk = {**jwk, "kid": kid, "alg": self.alg, "use": "sig"}

    def sign(self, claims: dict[str, Any] | None = None, **headers: Any) -> str:
        now = int(time.time())
        body = {
            "iss": ISSUER,
            "aud": AUDIENCE,
            "sub": "alice@example.test",
            "iat": now,
            "exp": now + 600,
            "groups": ["sre"],
            **(claims or {}),
        }
        return jwt.encode(
            body, self.private, algorithm=self.alg, headers={"kid": self.kid, **headers}
        )


@pytest.fixture
def keys() -> Keys:
    return Keys("k1")


def _core(db_url: str, home: Path, **settings: Any) -> Core:
    return start_core(
        db_url,
        home,
        oidc_issuer=ISSUER,
        oidc_audience=AUDIENCE,
        oidc_admin_team="cairn-admins",
        **settings,
    )


@pytest.fixture
def ec_keys() -> Keys:
    return Keys("e1", "ec")


@pytest.fixture
def idp_core(db_url: str, tmp_path: Path, keys: Keys, ec_keys: Keys) -> Iterator[Core]:
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [keys.jwk, ec_keys.jwk]}))
    server = _core(db_url, tmp_path, oidc_jwks_file=jwks)
    yield server
    server.stop()


def _as(core: Core, token: str) -> httpx.Client:
    return httpx.Client(base_url=core.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)


def test_a_valid_jwt_is_a_principal_with_its_teams(idp_core: Core, keys: Keys) -> None:
    with _as(idp_core, keys.sign()) as alice:
        who = alice.get("/v1/whoami").json()
        assert who["name"] == "alice@example.test" and who["role"] == "user"
        assert who["teams"] == ["sre"] and who["expires_at"] is not None
        made = alice.post("/v1/tasks", json=spec(team="sre"))
        assert made.status_code == 201 and made.json()["owner"] == "alice@example.test"
    with _as(idp_core, keys.sign({"sub": "bob@example.test"})) as bob:
        assert bob.get(f"/v1/tasks/{made.json()['id']}").status_code == 200
    with _as(idp_core, keys.sign({"sub": "eve@example.test", "groups": []})) as eve:
        assert eve.get(f"/v1/tasks/{made.json()['id']}").status_code == 404
    with _as(idp_core, keys.sign({"groups": ["cairn-admins"]})) as admin:
        assert admin.get("/v1/whoami").json()["role"] == "admin"
        assert admin.get("/v1/audit").status_code == 200


def test_an_elliptic_curve_key_of_the_set_signs_too(idp_core: Core, ec_keys: Keys) -> None:
    with _as(idp_core, ec_keys.sign({"sub": "erin"})) as erin:
        assert erin.get("/v1/whoami").json()["name"] == "erin"
    # Another EC key under the same kid is a bad signature; an RSA key claiming ES256 too.
    with _as(idp_core, Keys("e1", "ec").sign()) as forged:
        assert forged.get("/v1/whoami").status_code == 401


def _forgeries(keys: Keys) -> dict[str, str]:
    now = int(time.time())
    other = Keys("k1")  # same kid, different key: a bad signature
    public_pem = keys.private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    header, payload, signature = keys.sign().split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=="))
    claims["sub"] = "root"
    tampered = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
    unsigned = jwt.encode(
        {"iss": ISSUER, "aud": AUDIENCE, "sub": "x", "exp": now + 600},
        key=None,
        algorithm="none",
        headers={"kid": "k1"},
    )
    return {
        "wrong audience": keys.sign({"aud": "someone-else"}),
        "wrong issuer": keys.sign({"iss": "https://evil.example.test"}),
        "expired": keys.sign({"exp": now - 3600, "iat": now - 7200}),
        "not yet valid": keys.sign({"nbf": now + 3600}),
        "bad signature": other.sign(),
        "tampered payload": f"{header}.{tampered}.{signature}",
        "alg none": unsigned,
        "HS256 with the public key": jwt.encode(
            {"iss": ISSUER, "aud": AUDIENCE, "sub": "x", "exp": now + 600},
            key=base64.b64encode(public_pem).decode(),
            algorithm="HS256",
            headers={"kid": "k1"},
        ),
        "unknown kid": Keys("k9").sign(),
        "no subject": keys.sign({"sub": None}),
        "no expiry": jwt.encode(
            {"iss": ISSUER, "aud": AUDIENCE, "sub": "x"}, keys.private, "RS256", {"kid": "k1"}
        ),
        "garbage": "eyJhbGciOiJSUzI1NiJ9.not-base64!.sig",
        "huge": "eyJ" + "a" * 9000 + ".b.c",
    }


def test_every_forged_or_misdirected_jwt_gets_the_same_401(idp_core: Core, keys: Keys) -> None:
    with httpx.Client(base_url=idp_core.url, timeout=10) as anon:
        baseline = anon.get("/v1/whoami", headers={"Authorization": "Bearer cairn_unknown"})
        for what, token in _forgeries(keys).items():
            answer = anon.get("/v1/whoami", headers={"Authorization": f"Bearer {token}"})
            assert answer.status_code == 401, what
            assert answer.headers["content-type"] == "application/problem+json", what
            body = answer.json()
            assert set(body) <= REFUSED | {"instance"}, what
            # No hint of why: the same words as for a token that never existed.
            assert body["detail"] == baseline.json()["detail"], what


def test_jwts_are_refused_when_oidc_is_not_configured(core: Core, keys: Keys) -> None:
    with _as(core, keys.sign()) as alice:
        assert alice.get("/v1/whoami").status_code == 401


class Jwks(http.server.BaseHTTPRequestHandler):
    keys: list[dict[str, Any]] = []
    fetches = 0

    def do_GET(self) -> None:
        type(self).fetches += 1
        body = json.dumps({"keys": type(self).keys}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def jwks_url() -> Iterator[type[Jwks]]:
    handler = type("Served", (Jwks,), {"keys": [], "fetches": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}/jwks"  # type: ignore[attr-defined]
    yield handler
    server.shutdown()
    server.server_close()


def test_keys_come_from_a_jwks_url_and_rotate(
    db_url: str, tmp_path: Path, jwks_url: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = Keys("k1"), Keys("k2")
    jwks_url.keys = [first.jwk]
    core = _core(db_url, tmp_path, oidc_jwks_url=jwks_url.url)
    try:
        with _as(core, first.sign()) as alice:
            assert alice.get("/v1/whoami").status_code == 200
        # Made-up key ids do not make core hammer the identity provider.
        for i in range(20):
            with _as(core, Keys(f"bogus{i}").sign()) as bogus:
                assert bogus.get("/v1/whoami").status_code == 401
        assert jwks_url.fetches == 1
        # The provider rotates: the new key is fetched once the refetch pause allows it.
        jwks_url.keys = [first.jwk, second.jwk]
        monkeypatch.setattr(oidc, "REFETCH_MIN_S", 0.0)
        with _as(core, second.sign()) as rotated:
            assert rotated.get("/v1/whoami").status_code == 200
        assert jwks_url.fetches == 2
    finally:
        core.stop()


def test_cron_and_dag_accept_the_same_jwts(idp_core: Core, keys: Keys, tmp_path: Path) -> None:
    cron = start_cron(idp_core, tmp_path / "cron")
    dag = start_dag(idp_core, tmp_path / "dag")
    try:
        for url, path in ((cron.url, "/v1/schedules"), (dag.url, "/v1/workflows")):
            with httpx.Client(base_url=url, timeout=10) as service:
                good = service.get(path, headers={"Authorization": f"Bearer {keys.sign()}"})
                assert good.status_code == 200, (url, good.text)
                forged = Keys("k1").sign()
                bad = service.get(path, headers={"Authorization": f"Bearer {forged}"})
                assert bad.status_code == 401, url
    finally:
        cron.stop()
        dag.stop()


def test_an_oidc_user_makes_tokens_that_end_with_its_jwt(idp_core: Core, keys: Keys) -> None:
    jwt_exp = int(time.time()) + 600
    with _as(idp_core, keys.sign({"exp": jwt_exp})) as alice:
        forever = alice.post("/v1/tokens", json={"name": "ci"})
        assert forever.status_code == 403 and "expires_at" in forever.json()["detail"]
        later = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(jwt_exp + 3600))
        assert alice.post("/v1/tokens", json={"name": "ci", "expires_at": later}).status_code == 403
        within = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(jwt_exp - 60))
        made = alice.post("/v1/tokens", json={"name": "ci", "expires_at": within})
        assert made.status_code == 201, made.text
    with _as(idp_core, made.json()["token"]) as token:
        who = token.get("/v1/whoami").json()
    assert who["name"] == "alice@example.test" and who["role"] == "user"
    # A JWT naming a service or worker principal is not that principal, nor a user of its name.
    with idp_core.client("cron", "service"), _as(idp_core, keys.sign({"sub": "cron"})) as fake:
        assert fake.get("/v1/whoami").status_code == 401


def test_settings_refuse_a_half_or_insecure_oidc_configuration(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from services.core.settings import CoreSettings

    base = {"home": tmp_path, "database_url": "postgresql://x@127.0.0.1/x"}
    with pytest.raises(ValidationError, match="both"):
        CoreSettings(**base, oidc_issuer=ISSUER)
    with pytest.raises(ValidationError, match="JWKS"):
        CoreSettings(**base, oidc_issuer=ISSUER, oidc_audience=AUDIENCE)
    with pytest.raises(ValidationError, match="https"):
        CoreSettings(
            **base,
            env="production",
            secrets_key="k",
            oidc_issuer=ISSUER,
            oidc_audience=AUDIENCE,
            oidc_jwks_url="http://idp.example.test/jwks",
        )
