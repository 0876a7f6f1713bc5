"""OIDC over real HTTP: JWTs the tests sign with key pairs of their own, checked by core
against a JWKS file or URL; cron and dag accept the same through core. Every forged,
expired or misdirected JWT gets the same 401 as an unknown token."""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from tests.fixtures.cron import start_cron
from tests.fixtures.dag import start_dag
from tests.support import Core, register_worker, spec, start_core, wait_for

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


@pytest.fixture
def mapped_core(db_url: str, tmp_path: Path, keys: Keys) -> Iterator[Core]:
    """Core whose operator maps provider groups ``cairn-team-*`` and ``Payroll Admins``."""
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [keys.jwk]}))
    server = _core(
        db_url,
        tmp_path,
        oidc_jwks_file=jwks,
        oidc_team_prefix="cairn-team-",
        oidc_team_map="Payroll Admins=payroll",
    )
    yield server
    server.stop()


def test_a_valid_jwt_is_a_principal_with_its_mapped_teams(mapped_core: Core, keys: Keys) -> None:
    with _as(mapped_core, keys.sign({"groups": ["cairn-team-sre", "sre-oncall"]})) as alice:
        who = alice.get("/v1/whoami").json()
        assert who["name"] == "alice@example.test" and who["role"] == "user"
        assert who["teams"] == ["sre"] and who["expires_at"] is not None
        made = alice.post("/v1/tasks", json=spec(team="sre"))
        assert made.status_code == 201 and made.json()["owner"] == "alice@example.test"
    with _as(
        mapped_core, keys.sign({"sub": "bob@example.test", "groups": ["cairn-team-sre"]})
    ) as bob:
        assert bob.get(f"/v1/tasks/{made.json()['id']}").status_code == 200
    with _as(mapped_core, keys.sign({"sub": "eve@example.test", "groups": []})) as eve:
        assert eve.get(f"/v1/tasks/{made.json()['id']}").status_code == 404
    # The admin group makes an admin (it is named by the operator), not a team's member.
    with _as(mapped_core, keys.sign({"groups": ["cairn-admins"]})) as admin:
        who = admin.get("/v1/whoami").json()
        assert who["role"] == "admin" and who["teams"] == []
        assert admin.get("/v1/audit").status_code == 200
    with _as(mapped_core, keys.sign({"groups": ["Payroll Admins", "cairn-team-Bad Name"]})) as pay:
        assert pay.get("/v1/whoami").json()["teams"] == ["payroll"]


def _payroll(core: Core) -> tuple[str, int]:
    """The team ``payroll`` (carol, a recorded member), its secret, and a task of it."""
    value = f"payroll-{uuid.uuid4().hex}"
    with core.client("root", "admin") as root:
        assert root.post("/v1/teams", json={"name": "payroll"}).status_code == 201
        assert root.put("/v1/teams/payroll/members/carol").status_code in (200, 201, 204)
    with core.client("carol") as carol:
        made = carol.post("/v1/secrets", json={"name": "bank", "value": value, "team": "payroll"})
        assert made.status_code == 201, made.text
        task = carol.post("/v1/tasks", json=spec(team="payroll"))
        assert task.status_code == 201, task.text
    return value, task.json()["id"]


PAYROLL_ENV = {"BANK": {"secret": "bank", "team": "payroll"}}


def _is_outsider(core: Core, token: str, task_id: int) -> None:
    """``token`` is in no team: it sees neither payroll, its task nor its secret, and
    cannot run a task with the secret."""
    with _as(core, token) as caller:
        assert caller.get("/v1/whoami").json()["teams"] == []
        assert caller.get("/v1/teams/payroll").status_code == 404
        assert caller.get(f"/v1/tasks/{task_id}").status_code == 404
        assert caller.get("/v1/secrets").json()["items"] == []
        stolen = caller.post("/v1/tasks", json=spec(env=PAYROLL_ENV, team="payroll"))
        assert stolen.status_code == 403, stolen.text


def _leased(core: Core) -> list[dict[str, Any]]:
    with core.client("w1", "worker") as worker:
        offer = {"hostname": "w.test", "queues": ["default"], "cpu": 8, "memory_mb": 16384}
        worker_id = register_worker(worker, offer)
        room = {"cpu": 8, "memory_mb": 16384, "max": 16}
        answer = worker.post(f"/v1/workers/{worker_id}/claim", json=room)
        assert answer.status_code == 200, answer.text
        return list(answer.json()["attempts"])


def test_a_group_named_like_a_team_grants_nothing_without_a_mapping(
    idp_core: Core, keys: Keys
) -> None:
    """Mallory creates a group ``payroll`` at the provider: with no mapping set, core
    gives her nothing of the team of that name."""
    _, task_id = _payroll(idp_core)
    mallory = keys.sign({"sub": "mallory@example.test", "groups": ["payroll"]})
    _is_outsider(idp_core, mallory, task_id)
    assert [a["task_id"] for a in _leased(idp_core)] == [task_id]


def test_only_mapped_groups_grant_a_team_and_its_secrets(mapped_core: Core, keys: Keys) -> None:
    value, task_id = _payroll(mapped_core)
    # A group named like the team, or like the table's team, is not in the mapping.
    for groups in (["payroll"], ["team-payroll", "cairn-payroll", "payroll admins"]):
        mallory = keys.sign({"sub": "mallory@example.test", "groups": groups})
        _is_outsider(mapped_core, mallory, task_id)
    # The prefix and the table grant what they say, the team's secret included.
    expected: dict[int, dict[str, str]] = {task_id: {}}
    for who, group in (("dave@example.test", "cairn-team-payroll"), ("erin", "Payroll Admins")):
        with _as(mapped_core, keys.sign({"sub": who, "groups": [group]})) as member:
            assert member.get("/v1/whoami").json()["teams"] == ["payroll"]
            assert member.get(f"/v1/tasks/{task_id}").status_code == 200
            made = member.post("/v1/tasks", json=spec(env=PAYROLL_ENV, team="payroll"))
            assert made.status_code == 201, made.text
            expected[made.json()["id"]] = {"BANK": value}
    assert {a["task_id"]: a["env"] for a in _leased(mapped_core)} == expected


def test_a_claim_vouches_for_a_team_secret_until_its_token_expires(
    mapped_core: Core, keys: Keys, db: Any
) -> None:
    """A lease has no token to read a claim from: the membership a JWT's groups gave at
    submit is kept until that token expires, and checked at every lease like a recorded
    one (a member the provider dropped loses the team's secret when the token ends)."""
    value, carols = _payroll(mapped_core)
    token = keys.sign({"sub": "dave@example.test", "groups": ["cairn-team-payroll"]})
    expires = datetime.fromtimestamp(
        jwt.decode(token, options={"verify_signature": False})["exp"], UTC
    )
    with _as(mapped_core, token) as dave:
        live = dave.post("/v1/tasks", json=spec(env=PAYROLL_ENV, team="payroll")).json()["id"]
        claims = db.execute("SELECT team, member, until, kid FROM core.team_claims").fetchall()
        assert claims == [("payroll", "dave@example.test", expires, "k1")]
        assert {a["task_id"]: a["env"] for a in _leased(mapped_core)} == {
            carols: {},
            live: {"BANK": value},
        }
        late = dave.post("/v1/tasks", json=spec(env=PAYROLL_ENV, team="payroll")).json()["id"]
    # The token has ended (backdated here, as the clock would): the claim no longer holds.
    db.execute("UPDATE core.team_claims SET until = now() - interval '1 second'")
    assert _leased(mapped_core) == []
    with mapped_core.client("carol") as carol:
        task = carol.get(f"/v1/tasks/{late}").json()
    assert task["state"] == "dead"
    assert "no longer a member of team 'payroll'" in task["last_error"]


def test_a_claim_lasts_no_longer_than_its_cap_nor_its_key_and_is_no_tokens_word(
    db_url: str, tmp_path: Path, jwks_url: Any, db: Any
) -> None:
    """A token that lives for days vouches for CAIRN_OIDC_CLAIM_MAX_S only; a token
    without the group does not get the team back from what an earlier one vouched for;
    the provider withdrawing the key that signed it takes the claim with it."""
    kept, leaked = Keys("k1"), Keys("k2")
    jwks_url.keys = [kept.jwk, leaked.jwk]
    core = _polling_core(
        db_url, tmp_path, jwks_url, oidc_team_prefix="cairn-team-", oidc_claim_max_s=120
    )
    try:
        value, carols = _payroll(core)
        long_lived = {"sub": "dave@example.test", "exp": int(time.time()) + 7 * 86400}
        token = leaked.sign({**long_lived, "groups": ["cairn-team-payroll"]})
        with _as(core, token) as dave:
            made = dave.post("/v1/tasks", json=spec(env=PAYROLL_ENV, team="payroll"))
            assert made.status_code == 201, made.text
        [(kid, left)] = db.execute(
            "SELECT kid, extract(epoch FROM until - now()) FROM core.team_claims"
        ).fetchall()
        assert kid == "k2" and 100 < left <= 120
        # Dropped from the group at the provider: the next token is nobody's teammate,
        # whatever the claim still vouches for the task already submitted.
        dropped = kept.sign({"sub": "dave@example.test", "groups": []})
        _is_outsider(core, dropped, carols)
        jwks_url.keys = [kept.jwk]
        wait_for(lambda: db.execute("SELECT count(*) FROM core.team_claims").fetchone()[0] == 0)
        assert {a["task_id"]: a["env"] for a in _leased(core)} == {carols: {}}
        with core.client("carol") as carol:
            task = carol.get(f"/v1/tasks/{made.json()['id']}").json()
        assert task["state"] == "dead"
        assert "no longer a member of team 'payroll'" in task["last_error"]
        assert value not in str(task)
    finally:
        core.stop()


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
    """The provider's key set as it serves it: the test changes the keys, the status, the
    Cache-Control header and how much padding the answer carries."""

    keys: list[dict[str, Any]] = []
    fetches = 0
    status = 200
    cache_control: str | None = None
    padding = 0

    def do_GET(self) -> None:
        served = type(self)
        served.fetches += 1
        body = json.dumps({"keys": served.keys, "padding": " " * served.padding}).encode()
        self.send_response(served.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if served.cache_control is not None:
            self.send_header("Cache-Control", served.cache_control)
        self.end_headers()
        with contextlib.suppress(ConnectionError):  # core stops reading an oversized set
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


def _status(core: Core, token: str) -> int:
    with _as(core, token) as caller:
        return caller.get("/v1/whoami").status_code


def _polling_core(db_url: str, tmp_path: Path, jwks_url: Any, **settings: Any) -> Core:
    """Core reading the served key set every 0.5 s (unless ``settings`` say otherwise)."""
    fast = {"oidc_jwks_refresh_s": 0.5, "oidc_jwks_min_refresh_s": 0.2}
    return _core(db_url, tmp_path, oidc_jwks_url=jwks_url.url, **{**fast, **settings})


def test_keys_come_from_a_jwks_url_and_rotate(db_url: str, tmp_path: Path, jwks_url: Any) -> None:
    first, second, bogus = Keys("k1"), Keys("k2"), Keys("bogus")
    jwks_url.keys = [first.jwk]
    pause = 2.0
    core = _core(db_url, tmp_path, oidc_jwks_url=jwks_url.url, oidc_jwks_min_refresh_s=pause)
    try:
        began = time.monotonic()
        assert _status(core, first.sign()) == 200
        # Made-up key ids do not make core hammer the identity provider: a read a pause.
        for i in range(20):
            assert _status(core, bogus.sign(kid=f"bogus{i}")) == 401
        assert jwks_url.fetches <= 1 + (time.monotonic() - began) / pause + 1
        # The provider rotates: the new key is fetched once the refetch pause allows it.
        jwks_url.keys = [first.jwk, second.jwk]
        time.sleep(pause + 0.1)
        fetched = jwks_url.fetches
        assert _status(core, second.sign()) == 200
        assert jwks_url.fetches == fetched + 1
    finally:
        core.stop()


def test_a_withdrawn_key_stops_verifying_at_the_next_scheduled_read(
    db_url: str, tmp_path: Path, jwks_url: Any
) -> None:
    """The provider withdraws a key (leaked, say): without a restart, core stops
    accepting it within CAIRN_OIDC_JWKS_REFRESH_S, a JWT it already cached included, and
    keeps the key that stayed."""
    kept, withdrawn = Keys("k1"), Keys("k2")
    jwks_url.keys = [kept.jwk, withdrawn.jwk]
    # A JWT seen is cached for a minute: the withdrawal must reach the cache too.
    core = _polling_core(db_url, tmp_path, jwks_url, oidc_jwks_refresh_s=1.0, token_cache_s=60)
    try:
        cached = withdrawn.sign()
        assert _status(core, cached) == 200
        jwks_url.keys = [kept.jwk]
        withdrawn_at = time.monotonic()
        wait_for(lambda: _status(core, cached) == 401, timeout=10, interval=0.1)
        assert time.monotonic() - withdrawn_at < 1.0 + 3.0
        assert _status(core, withdrawn.sign()) == 401
        # A known key's JWTs do not read the set: the schedule does (once a second here).
        fetched, began = jwks_url.fetches, time.monotonic()
        for _ in range(30):
            assert _status(core, kept.sign()) == 200
        assert jwks_url.fetches - fetched <= time.monotonic() - began + 1
    finally:
        core.stop()


def test_tokens_made_with_a_withdrawn_keys_jwt_are_revoked_with_it(
    db_url: str, tmp_path: Path, jwks_url: Any, db
) -> None:
    """A JWT lets its holder make API tokens (no later than the JWT's expiry, which the
    signer chose): made with a key the provider then withdrew (leaked), they went on
    working after it, as did the tokens those tokens made. They are revoked with the key;
    those another key's JWT made are not."""
    kept, withdrawn = Keys("k1"), Keys("k2")
    jwks_url.keys = [kept.jwk, withdrawn.jwk]
    core = _polling_core(db_url, tmp_path, jwks_url, token_cache_s=60)
    year = int(time.time()) + 365 * 86400
    until = datetime.fromtimestamp(year - 60, UTC).isoformat()

    def made_with(jwt_: str, name: str) -> str:
        with _as(core, jwt_) as caller:
            made = caller.post("/v1/tokens", json={"name": name, "expires_at": until})
            assert made.status_code == 201, made.text
            return str(made.json()["token"])

    try:
        forged = withdrawn.sign({"exp": year})
        minted = made_with(forged, "minted")
        with _as(core, minted) as caller:
            made = caller.post("/v1/tokens", json={"name": "chained", "expires_at": until})
            assert made.status_code == 201, made.text
            chained = made.json()["token"]
        honest = made_with(kept.sign({"sub": "bob@example.test", "exp": year}), "honest")
        assert [_status(core, t) for t in (minted, chained, honest)] == [200, 200, 200]
        jwks_url.keys = [kept.jwk]
        wait_for(lambda: _status(core, forged) == 401, timeout=10, interval=0.1)
        assert [_status(core, t) for t in (minted, chained, honest)] == [401, 401, 200]
    finally:
        core.stop()
    rows = db.execute(
        "SELECT name, kid, revoked_at IS NOT NULL FROM core.tokens ORDER BY id"
    ).fetchall()
    assert rows == [("minted", "k2", True), ("chained", "k2", True), ("honest", "k1", False)]


def test_the_providers_max_age_shortens_the_schedule(
    db_url: str, tmp_path: Path, jwks_url: Any
) -> None:
    kept, withdrawn = Keys("k1"), Keys("k2")
    jwks_url.keys = [kept.jwk, withdrawn.jwk]
    jwks_url.cache_control = "public, max-age=1"
    core = _core(db_url, tmp_path, oidc_jwks_url=jwks_url.url, oidc_jwks_min_refresh_s=0.5)
    try:
        cached = withdrawn.sign()
        assert _status(core, cached) == 200
        jwks_url.keys = [kept.jwk]
        withdrawn_at = time.monotonic()
        wait_for(lambda: _status(core, withdrawn.sign()) == 401, timeout=10, interval=0.1)
        assert time.monotonic() - withdrawn_at < 1.0 + 3.0  # not the 300 s default
        # A max-age below the least pause is held to that pause: no hammering.
        jwks_url.cache_control = "max-age=0"
        fetched = jwks_url.fetches
        time.sleep(2.0)
        assert jwks_url.fetches - fetched <= 5
    finally:
        core.stop()


def _readiness(core: Core) -> dict[str, Any]:
    answer = httpx.get(core.url + "/readyz", timeout=10)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_an_unreachable_provider_leaves_the_last_set_in_use_for_a_bounded_time(
    db_url: str, tmp_path: Path, jwks_url: Any
) -> None:
    keys = Keys("k1")
    jwks_url.keys = [keys.jwk]
    core = _polling_core(db_url, tmp_path, jwks_url, oidc_jwks_stale_s=6.0)
    try:
        assert _status(core, keys.sign()) == 200
        assert _readiness(core)["detail"] is None
        jwks_url.status = 503
        down_at = time.monotonic()
        # The last good set stays in use, and readiness says so.
        wait_for(lambda: "cannot be loaded" in (_readiness(core)["detail"] or ""), timeout=5)
        assert _status(core, keys.sign()) == 200
        # Past CAIRN_OIDC_JWKS_STALE_S it is not trusted any more: 503, not 401.
        wait_for(lambda: _status(core, keys.sign()) == 503, timeout=15, interval=0.1)
        # (The last good read was at most one interval, 0.5 s, before the provider fell.)
        assert time.monotonic() - down_at > 6.0 - 0.5 - 1.0
        assert "503" in _readiness(core)["detail"]
        # The provider is back: so are its keys, without a restart.
        jwks_url.status = 200
        wait_for(lambda: _status(core, keys.sign()) == 200, timeout=5, interval=0.1)
        assert _readiness(core)["detail"] is None
    finally:
        core.stop()


def test_an_oversized_key_set_is_refused_unread(db_url: str, tmp_path: Path, jwks_url: Any) -> None:
    """A key set answer of 8 MB (a provider gone wrong, or someone in its path) is
    refused once it passes the bound: the set in hand stays, the new one is not used."""
    first, second = Keys("k1"), Keys("k2")
    jwks_url.keys = [first.jwk]
    core = _polling_core(db_url, tmp_path, jwks_url)
    try:
        assert _status(core, first.sign()) == 200
        jwks_url.keys, jwks_url.padding = [first.jwk, second.jwk], 8 * 1024 * 1024
        fetched = jwks_url.fetches
        wait_for(lambda: jwks_url.fetches >= fetched + 2, timeout=10)
        assert _status(core, second.sign()) == 401
        assert _status(core, first.sign()) == 200
        assert "cannot be loaded" in _readiness(core)["detail"]
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
    # A mapping that is not group=team is refused at start, naming the variable.
    for table, why in (("payroll=Pay Roll", "not group=team"), ("a=x, a=y", "twice")):
        with pytest.raises(ValidationError, match=f"oidc_team_map(.|\n)*{why}"):
            CoreSettings(**base, oidc_team_map=table)
    with pytest.raises(ValidationError, match="MIN_REFRESH_S <= CAIRN_OIDC_JWKS_REFRESH_S"):
        CoreSettings(**base, oidc_jwks_refresh_s=10, oidc_jwks_min_refresh_s=20)
    with pytest.raises(ValidationError, match="CAIRN_OIDC_JWKS_STALE_S"):
        CoreSettings(**base, oidc_jwks_refresh_s=600, oidc_jwks_stale_s=60)
