"""Disabling a principal (someone who left) over real HTTP on real PostgreSQL: their
tokens, JWTs and sessions are refused on every replica, what services submit on their
behalf (cron's fires, a workflow's nodes, a service's replicas) is refused naming the
owner, their webhooks are not delivered; their waiting work is left as it is, and
enabling them restores all of it. Each asserts what the database holds."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from cairn.cli import app
from libs.common.client import ON_BEHALF_OF
from services.core.db.workers import lease_digest
from tests.fixtures.cron import EPOCH, Cron, FakeClock
from tests.fixtures.dag import DagServer, Runner, node, workflow
from tests.integration.core.test_oidc import AUDIENCE, ISSUER, Keys
from tests.integration.cron.test_engine import create, fires, settled, tasks_of
from tests.support import Core, cli_as, spec, start_core, wait_for
from tests.webhooks import Receiver, subscribe

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


def test_a_service_submitting_for_a_disabled_owner_is_a_403_naming_the_owner(
    core: Core, db: Any
) -> None:
    with core.client("bob") as bob:
        waiting = bob.post("/v1/tasks", json=spec(name="before")).json()["id"]
    _disable(core, "bob")
    with core.client("svc", "service") as svc:
        one = svc.post("/v1/tasks", json=spec(name="fire"), headers={ON_BEHALF_OF: "bob"})
        assert one.status_code == 403, one.text
        assert one.headers["content-type"] == "application/problem+json"
        assert one.json()["detail"] == "owner: principal 'bob' is disabled"
        assert one.json()["errors"] == [
            {"field": f"header.{ON_BEHALF_OF}", "reason": "principal 'bob' is disabled"}
        ]
        batch = {"tasks": [spec(name="a"), spec(name="b")], "owners": ["carol", "bob"]}
        refused = svc.post("/v1/tasks/batch", json=batch)
        assert refused.status_code == 403
        assert refused.json()["errors"][0]["field"] == "body.owners.1"
        # Its own work and others' go on.
        assert svc.post("/v1/tasks", json=spec(name="own")).status_code == 201
        carol = svc.post("/v1/tasks", json=spec(name="c"), headers={ON_BEHALF_OF: "carol"})
        assert carol.status_code == 201
        owned = db.execute(
            "SELECT name, state FROM core.tasks WHERE owner = 'bob' ORDER BY id"
        ).fetchall()
        # What bob had waiting is left as it was (an admin may cancel it).
        assert owned == [("before", "waiting")]
        assert db.execute("SELECT count(*) FROM core.tasks WHERE owner = 'carol'").fetchone() == (
            1,
        )
        _disable(core, "bob", "enable")
        again = svc.post("/v1/tasks", json=spec(name="fire"), headers={ON_BEHALF_OF: "bob"})
        assert again.status_code == 201 and again.json()["owner"] == "bob"
    assert db.execute("SELECT state FROM core.tasks WHERE id = %s", (waiting,)).fetchone() == (
        "waiting",
    )


def test_a_service_is_refused_for_a_disabled_owner_on_every_replica_within_the_cache_time(
    db_url: str, tmp_path: Path, db: Any
) -> None:
    cache_s = 1.0
    a = start_core(db_url, tmp_path / "a", token_cache_s=cache_s)
    b = start_core(db_url, tmp_path / "b", token_cache_s=cache_s)
    headers = {ON_BEHALF_OF: "bob"}
    try:
        with a.client("svc", "service") as on_a, _bearer(b, a.tokens["svc"]) as on_b:

            def status(http: httpx.Client) -> int:
                return http.post("/v1/tasks", json=spec(), headers=headers).status_code

            # Each replica reads bob's state once and keeps it for its cache time ...
            assert (status(on_a), status(on_b)) == (201, 201)
            _disable(a, "bob")
            # ... the one that disabled bob forgets it at once, the other within that time.
            assert status(on_a) == 403
            wait_for(lambda: status(on_b) == 403, timeout=10 * cache_s)
            _disable(a, "bob", "enable")
            assert status(on_a) == 201
            wait_for(lambda: status(on_b) == 201, timeout=10 * cache_s)
        assert db.execute("SELECT count(*) FROM core.tasks WHERE owner = 'bob'").fetchone()[0] >= 4
    finally:
        a.stop()
        b.stop()


def test_a_teammates_retry_of_a_disabled_owners_task_is_refused(core: Core, db: Any) -> None:
    with core.client("root", "admin") as root:
        assert root.post("/v1/teams", json={"name": "sre"}).status_code == 201
        for member in ("alice", "bob"):
            assert root.put(f"/v1/teams/sre/members/{member}").status_code == 200
    with core.client("bob") as bob:
        task = bob.post("/v1/tasks", json=spec(team="sre")).json()["id"]
        assert bob.post(f"/v1/tasks/{task}/cancel").status_code == 200
    _disable(core, "bob")
    with core.client("alice") as alice:
        # A retry puts it to work again in bob's name, as a service's submission would.
        refused = alice.post(f"/v1/tasks/{task}/retry")
        assert refused.status_code == 403, refused.text
        assert refused.json()["errors"][0]["field"] == "task.owner"
        assert db.execute("SELECT state FROM core.tasks WHERE id = %s", (task,)).fetchone() == (
            "cancelled",
        )
        _disable(core, "bob", "enable")
        assert alice.post(f"/v1/tasks/{task}/retry").status_code == 200
    assert db.execute("SELECT state FROM core.tasks WHERE id = %s", (task,)).fetchone() != (
        "cancelled",
    )


def test_crons_fire_for_a_disabled_owner_is_recorded_refused_and_fires_again_once_enabled(
    cron: Cron, clock: FakeClock, db: Any
) -> None:
    wait_for(lambda: cron.engine.leader)
    sid = create(cron, expression="* * * * *", timezone="UTC")  # alice's
    _disable(cron.core, "alice")
    start = EPOCH.replace(second=0)
    clock.set(start + timedelta(minutes=1))
    wait_for(lambda: settled(db, sid, 1))
    [(_, outcome, task_id)] = fires(db, sid)
    assert (outcome, task_id) == ("failed", None)
    (detail,) = db.execute(
        "SELECT detail FROM cron.fires WHERE schedule_id = %s", (sid,)
    ).fetchone()
    assert "refused" in detail and "principal 'alice' is disabled" in detail
    assert tasks_of(db, sid) == []
    _disable(cron.core, "alice", "enable")
    clock.set(start + timedelta(minutes=2))
    wait_for(lambda: settled(db, sid, 2))
    assert [r[1] for r in fires(db, sid)] == ["failed", "submitted"]
    assert [t[1] for t in tasks_of(db, sid)] == ["alice"]


def test_a_workflows_node_for_a_disabled_owner_fails_as_refused(dag: DagServer, db: Any) -> None:
    with dag.client("bob") as bob, dag.client("cron", "service") as cron:
        Runner(bob).define(workflow("nightly", [node("a"), node("b", "a")]))
        _disable(dag.core, "bob")
        started = cron.post("/v1/workflows/nightly/runs", json={}, headers={ON_BEHALF_OF: "bob"})
        assert started.status_code == 201, started.text
    with dag.client("root", "admin") as root:
        run = Runner(root).wait_end(started.json()["id"])
    assert run["state"] == "failed"
    (detail,) = db.execute(
        "SELECT error FROM dag.nodes WHERE run_id = %s AND name = 'a'", (run["id"],)
    ).fetchone()
    assert "core refused the task" in detail and "disabled" in detail
    assert db.execute("SELECT count(*) FROM core.tasks WHERE owner = 'bob'").fetchone() == (0,)


@pytest.mark.core(**FAST_NOTIFY)
def test_a_disabled_owners_webhooks_are_not_delivered_until_enabled(core: Core, db: Any) -> None:
    hook = Receiver(fail_first=None)  # every try fails for now: bob's stays pending
    try:
        with core.client("alice") as alice, core.client("bob") as bob:
            alices = subscribe(alice, hook.url, events=["fire.failed"])
            bobs = subscribe(bob, hook.url, name="bob's", events=["fire.failed"])

        def post(owner: str, key: str) -> int:
            event = {
                "event": "fire.failed",
                "owner": owner,
                "key": key,
                "summary": "schedule nightly: core refused the submission",
                "subject": {"schedule_id": "7"},
            }
            with core.client("cron", "service") as cron:
                answer = cron.post("/v1/notifications/events", json=event)
                assert answer.status_code == 202, answer.text
                queued: int = answer.json()["queued"]
                return queued

        def tries(sub: int) -> list[tuple[str, int]]:
            rows = db.execute(
                "SELECT state, tries FROM core.notifications WHERE subscription_id = %s"
                " ORDER BY id",
                (sub,),
            ).fetchall()
            return [tuple(r) for r in rows]

        assert post("bob", "before") == 1
        wait_for(lambda: tries(bobs["id"]) and tries(bobs["id"])[0][1] >= 1)
        _disable(core, "bob")
        # A try picked before the disable may still be on its way: let it fail as the
        # receiver says now (it did get through once on a loaded CI), then take tries.
        time.sleep(1.0)
        hook.fail_first = 0  # the receiver would take it now
        # A new event of bob's matches nothing; alice's is delivered.
        assert post("bob", "while disabled") == 0
        assert post("alice", "while bob is disabled") == 1
        wait_for(lambda: tries(alices["id"]) and tries(alices["id"])[0][0] == "delivered")
        held = tries(bobs["id"])
        time.sleep(1.0)  # ten times the retry backoff's cap
        assert tries(bobs["id"]) == held and held[0][0] == "pending"
        taken = [r for r in hook.all() if r.answered == 200]
        assert [r.doc["subscription"]["id"] for r in taken] == [alices["id"]]
        _disable(core, "bob", "enable")
        wait_for(lambda: tries(bobs["id"])[0][0] == "delivered")
        assert len(tries(bobs["id"])) == 1  # what came while disabled was never queued
    finally:
        hook.close()


@pytest.mark.core(services_interval_s=0.1)
def test_a_disabled_owners_service_replicas_are_not_started_again(core: Core, db: Any) -> None:
    template = {
        "name": "web",
        "kind": "service",
        "artifact": {"uri": "file:///bin/true", "sha256": "0" * 64},
        "resources": {"cpu": 0.1, "memory_mb": 64},
        "service": {"ports": [{"name": "http"}]},
    }

    def replicas() -> list[tuple[int, str]]:
        rows = db.execute(
            "SELECT id, state FROM core.tasks WHERE owner = 'alice' AND name = 'web' ORDER BY id"
        ).fetchall()
        return [tuple(r) for r in rows]

    with core.client("alice") as alice:
        made = alice.post("/v1/services", json={"name": "web", "replicas": 1, "template": template})
        assert made.status_code == 201, made.text
    wait_for(lambda: len(replicas()) == 1)
    [(first, state)] = replicas()
    assert state == "waiting"  # no worker: it waits, and is left so by disabling
    _disable(core, "alice")
    with core.client("root", "admin") as root:
        assert root.post(f"/v1/tasks/{first}/cancel").status_code == 200

    def refused() -> str | None:
        row = db.execute("SELECT message FROM core.services WHERE name = 'web'").fetchone()
        return row[0] if row and row[0] and "disabled" in row[0] else None

    message = wait_for(refused)
    assert "start refused" in message and "principal 'alice' is disabled" in message
    assert replicas() == [(first, "cancelled")]
    _disable(core, "alice", "enable")
    wait_for(lambda: len(replicas()) == 2)
    assert replicas()[1][1] == "waiting"


def test_the_cli_shows_disables_and_enables_a_principal(
    core: Core, db: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with core.client("bob"):
        pass
    runner = cli_as(core, monkeypatch, tmp_path, "root", "admin")

    def cairn(*args: str) -> Any:
        return runner.invoke(app, list(args))

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
