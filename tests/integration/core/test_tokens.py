"""Tokens over the API, driven over real HTTP by their holders and by people trying to
get more than they have."""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
from click.testing import Result

from tests.support import Core, cairn_cli, start_core


def _bearer(core: Core, token: str) -> httpx.Client:
    return httpx.Client(base_url=core.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)


def _create(client: httpx.Client, **body) -> httpx.Response:
    return client.post("/v1/tokens", json={"name": "test", **body})


def test_a_user_creates_lists_and_revokes_its_own_token(core: Core, db) -> None:
    with core.client("alice") as alice:
        made = _create(alice, name="laptop")
        assert made.status_code == 201, made.text
        token, info = made.json()["token"], made.json()["info"]
        assert info["principal"] == "alice" and info["role"] == "user"
        assert info["name"] == "laptop" and info["last_used_at"] is None
        with _bearer(core, token) as laptop:
            assert laptop.get("/v1/whoami").json()["name"] == "alice"
        listed = alice.get("/v1/tokens").json()["items"]
        mine = next(t for t in listed if t["id"] == info["id"])
        assert mine["last_used_at"] is not None
        assert token not in alice.get("/v1/tokens").text
        assert alice.delete(f"/v1/tokens/{info['id']}").status_code == 204
        with _bearer(core, token) as laptop:
            refused = laptop.get("/v1/whoami")
        assert refused.status_code == 401
        assert refused.headers["content-type"] == "application/problem+json"
        assert [t["id"] for t in alice.get("/v1/tokens").json()["items"]] != [info["id"]]
        revoked = alice.get("/v1/tokens", params={"include_revoked": "true"}).json()["items"]
        assert any(t["id"] == info["id"] and t["revoked_at"] for t in revoked)
    # Only a digest is stored: the token's text is nowhere in the table.
    rows = db.execute("SELECT t::text FROM core.tokens t").fetchall()
    assert not any(token in row[0] for row in rows)
    digest = hashlib.sha256(token.encode()).digest()
    assert (
        db.execute("SELECT count(*) FROM core.tokens WHERE token_hash = %s", [digest]).fetchone()[0]
        == 1
    )


def test_a_user_cannot_mint_more_rights_than_it_has(core: Core) -> None:
    with core.client("mallory") as mallory, core.client("root", "admin"):
        for_other = _create(mallory, principal="root")
        assert for_other.status_code == 403 and "principal" in for_other.json()["detail"]
        as_admin = _create(mallory, role="admin")
        assert as_admin.status_code == 403 and "role" in as_admin.json()["detail"]
        short = _create(mallory, expires_at=(datetime.now(UTC) + timedelta(hours=1)).isoformat())
        assert short.status_code == 201
        with _bearer(core, short.json()["token"]) as brief:
            # A token that expires in an hour cannot make one that lives longer.
            longer = _create(brief, expires_at=(datetime.now(UTC) + timedelta(days=9)).isoformat())
            assert longer.status_code == 403 and "expires_at" in longer.json()["detail"]
            forever = _create(brief)
            assert forever.status_code == 403
            inside = _create(
                brief, expires_at=(datetime.now(UTC) + timedelta(minutes=5)).isoformat()
            )
            assert inside.status_code == 201
        assert _create(mallory, extra="x").status_code == 422


def test_workers_cannot_mint_tokens(core: Core) -> None:
    with core.client("w1", "worker") as worker:
        assert _create(worker).status_code == 403


def test_another_users_token_is_a_404_to_revoke_and_invisible(core: Core) -> None:
    with core.client("alice") as alice, core.client("mallory") as mallory:
        theirs = _create(alice).json()["info"]["id"]
        assert mallory.delete(f"/v1/tokens/{theirs}").status_code == 404
        assert mallory.delete("/v1/tokens/999999").status_code == 404
        assert mallory.get("/v1/tokens", params={"principal": "alice"}).json()["items"] == []
        assert theirs not in [t["id"] for t in mallory.get("/v1/tokens").json()["items"]]
        assert alice.get("/v1/whoami").status_code == 200


def test_an_admin_makes_tokens_for_anyone_but_never_changes_a_role(core: Core) -> None:
    with core.client("root", "admin") as root, core.client("bob"):
        made = _create(root, principal="carol", role="user")
        assert made.status_code == 201
        with _bearer(core, made.json()["token"]) as carol:
            assert carol.get("/v1/whoami").json() == {
                "name": "carol",
                "role": "user",
                "teams": [],
                "expires_at": None,
                "team_sources": [],
                "via": "token",
            }
        assert _create(root, principal="bob", role="admin").status_code == 409
        assert _create(root, principal="nobody").status_code == 422
        bobs = root.get("/v1/tokens", params={"principal": "bob"}).json()["items"]
        assert len(bobs) == 1
        assert root.delete(f"/v1/tokens/{bobs[0]['id']}").status_code == 204


def test_an_expired_token_is_refused(core: Core, db) -> None:
    with core.client("alice") as alice:
        soon = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        made = _create(alice, expires_at=soon).json()
        with _bearer(core, made["token"]) as brief:
            assert brief.get("/v1/whoami").status_code == 200
            db.execute(
                "UPDATE core.tokens SET expires_at = now() - interval '1 second' WHERE id = %s",
                [made["info"]["id"]],
            )
            assert brief.get("/v1/whoami").status_code == 401
        past = _create(alice, expires_at="2001-01-01T00:00:00Z")
        assert past.status_code == 422 and "expires_at" in past.json()["detail"]


def test_revocation_reaches_every_replica_within_the_token_cache_time(
    db_url: str, tmp_path: Path
) -> None:
    cache_s = 1.0
    a = start_core(db_url, tmp_path / "a", token_cache_s=cache_s)
    b = start_core(db_url, tmp_path / "b", token_cache_s=cache_s)
    try:
        with a.client("alice") as alice:
            made = _create(alice).json()
            with _bearer(a, made["token"]) as on_a, _bearer(b, made["token"]) as on_b:
                assert on_a.get("/v1/whoami").status_code == 200
                assert on_b.get("/v1/whoami").status_code == 200  # now cached by b ...
                cached_by = time.monotonic()  # ... before its answer came
                assert alice.delete(f"/v1/tokens/{made['info']['id']}").status_code == 204
                # The replica that revoked it forgets it at once ...
                assert on_a.get("/v1/whoami").status_code == 401
                # ... the other within its cache time: any request that reaches b once
                # that time has passed since b kept the token is refused, however long
                # the requests themselves take (a bound on the wall time of a wait for
                # the refusal failed on a loaded machine: 1.73 s for a cache time of 1 s).
                time.sleep(max(0.0, cached_by + cache_s - time.monotonic()) + 0.05)
                assert on_b.get("/v1/whoami").status_code == 401
    finally:
        a.stop()
        b.stop()


def test_the_cli_creates_lists_and_revokes_tokens_over_the_api(core: Core, tmp_path) -> None:
    with core.client("root", "admin"):
        pass
    env = {
        "CAIRN_URL": core.url,
        "CAIRN_TOKEN": core.tokens["root"],
        "CAIRN_HOME": str(tmp_path),
        "CAIRN_DATABASE_URL": None,
    }

    def cairn(*args: str) -> Result:
        return cairn_cli(*args, env=env)

    made = cairn("token", "create", "dora", "--role", "user", "--name", "ci", "--expires", "30d")
    assert made.exit_code == 0, made.stderr
    token = made.stdout.strip()
    with _bearer(core, token) as dora:
        assert dora.get("/v1/whoami").json()["name"] == "dora"
    listed = cairn("--json", "token", "ls", "--principal", "dora")
    assert listed.exit_code == 0, listed.stderr
    assert token not in listed.stdout
    import json

    [info] = json.loads(listed.stdout)
    assert info["name"] == "ci" and info["expires_at"] is not None
    assert cairn("token", "revoke", str(info["id"])).exit_code == 0
    with _bearer(core, token) as dora:
        assert dora.get("/v1/whoami").status_code == 401
