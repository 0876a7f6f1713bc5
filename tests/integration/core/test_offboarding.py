"""Disabling a principal (someone who left) over real HTTP on real PostgreSQL: their
tokens, JWTs and sessions are refused on every replica, what services submit on their
behalf (cron's fires, a workflow's nodes, a service's replicas) is refused naming the
owner, their webhooks are not delivered; their waiting work is left as it is, and
enabling them restores all of it. Each asserts what the database holds."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.core.db.workers import lease_digest
from tests.integration.core.test_oidc import AUDIENCE, ISSUER, Keys
from tests.support import Core, cairn_cli, spec, start_core, wait_for

FAST_NOTIFY = {
    "notify_interval_s": 0.05,
    "notify_backoff_base_s": 0.05,
    "notify_backoff_cap_s": 0.1,
    "notify_timeout_s": 2.0,
}


def _bearer(core: Core, token: str) -> httpx.Client:
    return httpx.Client(base_url=core.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)


def _state(db: Any, name: str) -> tuple[Any, ...] | None:
    row = db.execute(
        "SELECT disabled_at IS NOT NULL, disabled_by FROM core.principals WHERE name = %s",
        (name,),
    ).fetchone()
    return None if row is None else tuple(row)


def _audited(db: Any, name: str) -> list[tuple[str, str]]:
    rows = db.execute(
        "SELECT action, actor FROM core.audit WHERE target = %s AND action LIKE 'principal.%%'"
        " ORDER BY id",
        (f"principal:{name}",),
    ).fetchall()
    return [tuple(r) for r in rows]


def _disable(core: Core, name: str, verb: str = "disable") -> dict[str, Any]:
    with core.client("root", "admin") as root:
        answer = root.post(f"/v1/principals/{name}/{verb}")
        assert answer.status_code == 200, answer.text
        done: dict[str, Any] = answer.json()
        return done


def test_a_disabled_principals_tokens_are_refused_on_every_replica_until_enabled(
    db_url: str, tmp_path: Path, db: Any
) -> None:
    cache_s = 1.0
    a = start_core(db_url, tmp_path / "a", token_cache_s=cache_s)
    b = start_core(db_url, tmp_path / "b", token_cache_s=cache_s)
    try:
        with a.client("alice") as alice:
            laptop = alice.post("/v1/tokens", json={"name": "laptop"}).json()
            revoked = alice.post("/v1/tokens", json={"name": "old"}).json()
            assert alice.delete(f"/v1/tokens/{revoked['info']['id']}").status_code == 204
        tokens = [a.tokens["alice"], laptop["token"]]
        clients = [_bearer(s, t) for s in (a, b) for t in tokens]
        try:
            assert all(c.get("/v1/whoami").status_code == 200 for c in clients)  # cached
            done = _disable(a, "alice")
            assert done["disabled_at"] and done["disabled_by"] == "root"
            assert _state(db, "alice") == (True, "root")
            # The replica that disabled it forgets its tokens at once ...
            refused = clients[0].get("/v1/whoami")
            assert refused.status_code == 401, refused.text
            assert refused.headers["content-type"] == "application/problem+json"
            assert clients[1].post("/v1/tasks", json=spec()).status_code == 401
            # ... the other within its cache time.
            wait_for(
                lambda: all(c.get("/v1/whoami").status_code == 401 for c in clients[2:]),
                timeout=10 * cache_s,
            )
            # Nothing of it was revoked: enabling it again restores every live token.
            assert db.execute(
                "SELECT count(*) FROM core.tokens t JOIN core.principals p"
                " ON p.id = t.principal_id WHERE p.name = 'alice' AND t.revoked_at IS NULL"
            ).fetchone() == (2,)
            assert _disable(a, "alice", "enable")["disabled_at"] is None
            assert _state(db, "alice") == (False, None)
            assert all(c.get("/v1/whoami").status_code == 200 for c in clients)
            with _bearer(a, revoked["token"]) as old:
                assert old.get("/v1/whoami").status_code == 401  # revoked stays revoked
        finally:
            for c in clients:
                c.close()
        # Once each, by the admin, in the audit trail; doing it again records nothing.
        _disable(a, "alice", "enable")
        assert _audited(db, "alice") == [
            ("principal.disable", "root"),
            ("principal.enable", "root"),
        ]
    finally:
        a.stop()
        b.stop()


def test_only_an_admin_disables_never_itself_and_enabling_an_unknown_name_is_a_404(
    core: Core, db: Any
) -> None:
    with core.client("alice") as alice, core.client("root", "admin") as root:
        assert alice.post("/v1/principals/bob/disable").status_code == 403
        assert alice.get("/v1/principals/alice").status_code == 403
        itself = root.post("/v1/principals/root/disable")
        assert itself.status_code == 409 and "itself" in itself.json()["detail"]
        assert root.post("/v1/principals/nobody/enable").status_code == 404
        assert root.get("/v1/principals/nobody").status_code == 404
        long = root.post(f"/v1/principals/{'x' * 101}/disable")
        assert long.status_code == 422
        shown = root.get("/v1/principals/alice").json()
        assert shown["role"] == "user" and shown["disabled_at"] is None
    assert _state(db, "root") == (False, None)
    assert _audited(db, "root") == []


@pytest.fixture
def oidc_core(db_url: str, tmp_path: Path) -> Iterator[tuple[Core, Keys]]:
    keys = Keys("k1")
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [keys.jwk]}))
    server = start_core(
        db_url, tmp_path, oidc_issuer=ISSUER, oidc_audience=AUDIENCE, oidc_jwks_file=jwks
    )
    yield server, keys
    server.stop()


def test_a_disabled_names_jwts_and_dashboard_sessions_are_refused(
    oidc_core: tuple[Core, Keys], db: Any
) -> None:
    core, keys = oidc_core
    name = "alice@example.test"  # known only through the provider: core has no row
    # A dashboard session of hers, as signing in stores it (only digests are kept).
    db.execute(
        "INSERT INTO core.sessions (id_hash, csrf_hash, principal, role, teams, kid, expires_at)"
        " VALUES (%s, %s, %s, 'user', '{}', 'k1', now() + interval '1 hour')",
        (lease_digest("the-session"), lease_digest("the-csrf"), name),
    )
    browser = httpx.Client(base_url=core.url, cookies={"cairn_session": "the-session"}, timeout=10)
    with _bearer(core, keys.sign()) as jwt, browser:
        assert jwt.get("/v1/whoami").json()["name"] == name
        assert browser.get("/v1/whoami").json()["via"] == "session"
        assert _state(db, name) is None
        done = _disable(core, name)
        assert done["role"] == "user" and done["disabled_by"] == "root"
        assert _state(db, name) == (True, "root")  # recorded, as a user, to be disabled
        for who in (jwt, browser):
            refused = who.get("/v1/whoami")
            assert refused.status_code == 401 and "disabled" in refused.json()["detail"]
        with _bearer(core, keys.sign()) as fresh:  # a new JWT: not from the cache
            assert fresh.get("/v1/whoami").status_code == 401
        _disable(core, name, "enable")
        assert jwt.get("/v1/whoami").status_code == 200
        assert browser.get("/v1/whoami").status_code == 200
    assert [a for a, _ in _audited(db, name)] == ["principal.disable", "principal.enable"]


def test_the_cli_shows_disables_and_enables_a_principal(core: Core, db: Any, tmp_path) -> None:
    with core.client("root", "admin"), core.client("bob"):
        pass
    env = {
        "CAIRN_URL": core.url,
        "CAIRN_TOKEN": core.tokens["root"],
        "CAIRN_HOME": str(tmp_path),
        "CAIRN_DATABASE_URL": None,
    }

    def cairn(*args: str) -> Any:
        return cairn_cli(*args, env=env)

    done = cairn("principal", "disable", "bob", "--json")
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["disabled_by"] == "root"
    assert _state(db, "bob") == (True, "root")
    shown = cairn("principal", "show", "bob")
    assert shown.exit_code == 0 and "root" in shown.output
    assert cairn("principal", "enable", "bob").exit_code == 0
    assert _state(db, "bob") == (False, None)
    missing = cairn("principal", "enable", "nobody")
    assert missing.exit_code != 0 and "not found" in missing.output
