"""The audit trail: a row for every security-relevant action, readable by admins only,
and append-only in the database itself."""

from __future__ import annotations

import asyncio
import json

import psycopg
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from services.core import admin
from services.core.db import audit
from tests.support import Core, cairn_cli, spec


def _rows(db) -> list[tuple[str, str, str]]:
    """What people did over the API (the tests' own tokens are made by the operator)."""
    return db.execute(
        "SELECT actor, action, target FROM core.audit WHERE actor_role <> 'operator' ORDER BY id"
    ).fetchall()


def test_every_listed_action_leaves_a_row(core: Core, db) -> None:
    with core.client("root", "admin") as root, core.client("w1", "worker") as agent:
        offer = {"hostname": "w", "queues": ["default"], "cpu": 1, "memory_mb": 512}
        worker_id = agent.post("/v1/workers", json=offer).json()["worker"]["id"]
        token = root.post("/v1/tokens", json={"name": "t", "principal": "eve", "role": "user"})
        token_id = token.json()["info"]["id"]
        assert root.delete(f"/v1/tokens/{token_id}").status_code == 204
        assert root.post("/v1/queues/default/pause").status_code == 200
        assert root.post("/v1/queues/default/resume").status_code == 200
        assert root.patch("/v1/queues/default", json={"overcommit": 2}).status_code == 200
        assert root.post(f"/v1/workers/{worker_id}/drain").status_code == 200
        assert root.post("/v1/teams", json={"name": "sre"}).status_code == 201
        assert root.put("/v1/teams/sre/members/alice").status_code == 200
        assert root.delete("/v1/teams/sre/members/alice").status_code == 200
        assert root.delete("/v1/teams/sre").status_code == 204
        assert root.post("/v1/secrets", json={"name": "k", "value": "value-1"}).status_code == 201
        assert root.patch("/v1/owners/bob/share", json={"weight": 2}).status_code == 200
        assert root.put("/v1/queues/gpu/policy", json={"owners": ["bob"]}).status_code == 200
        assert root.put("/v1/concurrency/db", json={"max_running": 2}).status_code == 200
        with core.client("alice") as alice:
            task = alice.post("/v1/tasks", json=spec()).json()
        assert root.post(f"/v1/tasks/{task['id']}/cancel").status_code == 200
        page = root.get("/v1/audit").json()
    assert _rows(db) == [
        ("root", "token.create", f"token:{token_id}"),
        ("root", "token.revoke", f"token:{token_id}"),
        ("root", "queue.pause", "queue:default"),
        ("root", "queue.resume", "queue:default"),
        ("root", "queue.settings", "queue:default"),
        ("root", "worker.drain", f"worker:{worker_id}"),
        ("root", "team.create", "team:sre"),
        ("root", "team.member.add", "team:sre"),
        ("root", "team.member.remove", "team:sre"),
        ("root", "team.delete", "team:sre"),
        ("root", "secret.create", "secret:root/k"),
        ("root", "owner.share", "owner:bob"),
        ("root", "queue.policy", "queue:gpu"),
        ("root", "concurrency.limit", "concurrency:db"),
        ("root", "task.cancel", f"task:{task['id']}"),
    ]
    newest = page["items"][0]
    assert newest["action"] == "task.cancel" and newest["source"] == "127.0.0.1"
    assert newest["before"]["owner"] == "alice" and newest["after"]["state"] == "cancelled"
    share = next(e for e in page["items"] if e["action"] == "owner.share")
    assert share["before"]["weight"] == 1 and share["after"]["weight"] == 2
    policy = next(e for e in page["items"] if e["action"] == "queue.policy")
    assert policy["before"] is None and policy["after"]["owners"] == ["bob"]
    limit = next(e for e in page["items"] if e["action"] == "concurrency.limit")
    assert limit["before"]["max_running"] is None and limit["after"]["max_running"] == 2
    pause = next(e for e in page["items"] if e["action"] == "queue.pause")
    assert pause["before"] == {"paused": False} and pause["after"] == {"paused": True}


def test_a_users_own_work_and_failed_attempts_leave_no_rows(core: Core, db) -> None:
    with core.client("alice") as alice:
        task = alice.post("/v1/tasks", json=spec()).json()
        alice.post(f"/v1/tasks/{task['id']}/cancel")
        assert alice.post("/v1/queues/default/pause").status_code == 403
    assert _rows(db) == []


def test_only_admins_read_the_trail_with_filters_and_pages(core: Core) -> None:
    with core.client("root", "admin") as root, core.client("alice") as alice:
        for name in ("a", "b", "c"):
            root.post("/v1/teams", json={"name": name})
        root.post("/v1/queues/q1/pause")
        assert alice.get("/v1/audit").status_code == 403
        teams = root.get("/v1/audit", params={"action": "team", "actor": "root"}).json()["items"]
        assert [e["target"] for e in teams] == ["team:c", "team:b", "team:a"]
        first = root.get("/v1/audit", params={"limit": 2, "actor": "root"}).json()
        assert len(first["items"]) == 2 and first["next_before"] is not None
        after = {"limit": 2, "before": first["next_before"], "actor": "root"}
        rest = root.get("/v1/audit", params=after).json()
        assert [e["target"] for e in rest["items"]] == ["team:b", "team:a"]
        assert root.get("/v1/audit", params={"actor": "nobody"}).json()["items"] == []
        by_target = root.get("/v1/audit", params={"target": "queue:q1"}).json()["items"]
        assert [e["action"] for e in by_target] == ["queue.pause"]
        assert root.get("/v1/audit", params={"action": "DROP TABLE"}).status_code == 422


def test_the_trail_is_append_only_in_the_database(core: Core, db) -> None:
    with core.client("root", "admin") as root:
        root.post("/v1/teams", json={"name": "sre"})
    for statement in (
        "UPDATE core.audit SET actor = 'someone-else'",
        "DELETE FROM core.audit",
        "TRUNCATE core.audit",
    ):
        with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
            db.execute(statement)
    assert _rows(db) == [("root", "team.create", "team:sre")]


def test_retention_purges_only_old_entries(core: Core, db) -> None:
    with core.client("root", "admin") as root:
        root.post("/v1/teams", json={"name": "old"})
        root.post("/v1/teams", json={"name": "new"})
    db.execute("ALTER TABLE core.audit DISABLE TRIGGER audit_append_only")
    db.execute("UPDATE core.audit SET at = now() - interval '500 days' WHERE target = 'team:old'")
    db.execute("ALTER TABLE core.audit ENABLE TRIGGER audit_append_only")

    async def purge() -> int:
        engine = create_async_engine(core.db_url)
        try:
            async with engine.begin() as conn:
                return await audit.purge(conn, 400 * 86400, 100)
        finally:
            await engine.dispose()

    assert asyncio.run(purge()) == 1
    assert [r[2] for r in _rows(db)] == ["team:new"]


def test_cli_tokens_and_cairn_audit(core: Core, db, tmp_path) -> None:
    admin.create_token(core.db_url, "fay", "user")
    assert db.execute("SELECT actor_role, action, target FROM core.audit").fetchall() == [
        ("operator", "token.create", "token:1")
    ]
    with core.client("root", "admin"):
        pass
    env = {"CAIRN_URL": core.url, "CAIRN_TOKEN": core.tokens["root"], "CAIRN_HOME": str(tmp_path)}
    shown = cairn_cli("--json", "audit", "--target", "token:1", env=env)
    assert shown.exit_code == 0, shown.stderr
    [entry] = json.loads(shown.stdout)["items"]
    assert entry["actor"].startswith("operator:") and entry["action"] == "token.create"
