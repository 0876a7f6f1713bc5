from __future__ import annotations

import os

import httpx
from click.testing import Result

from services.core import admin
from tests.support import Core, cairn_cli, spec


def _cairn(core: Core, tmp_path, *args: str) -> Result:
    env = {"CAIRN_DATABASE_URL": core.db_url, "CAIRN_HOME": str(tmp_path)}
    return cairn_cli(*args, env=env)


def test_cli_token_create_prints_a_working_token(core: Core, tmp_path) -> None:
    made = _cairn(core, tmp_path, "token", "create", "carol", "--role", "user", "--db")
    assert made.exit_code == 0, made.stderr
    token = made.stdout.strip()
    answer = httpx.post(
        core.url + "/v1/tasks", json=spec(), headers={"Authorization": f"Bearer {token}"}
    )
    assert answer.status_code == 201 and answer.json()["owner"] == "carol"


def test_cli_refuses_to_change_a_principals_role(core: Core, tmp_path) -> None:
    assert (
        _cairn(core, tmp_path, "token", "create", "dave", "--role", "user", "--db").exit_code == 0
    )
    again = _cairn(core, tmp_path, "token", "create", "dave", "--role", "admin", "--db")
    assert again.exit_code == 2 and "exists with role 'user'" in again.stderr


def test_cli_registers_a_deployments_own_token_once(core: Core, tmp_path) -> None:
    secret = "deploy-secret-for-cron-0123456789"
    env_name = "CAIRN_TEST_CRON_SECRET"
    os.environ[env_name] = secret
    try:
        for _ in range(2):  # idempotent: a restarted setup job registers it again
            made = _cairn(
                core,
                tmp_path,
                "token",
                "create",
                "cron",
                "--role",
                "service",
                "--from-env",
                env_name,
            )
            assert made.exit_code == 0, made.stderr
            assert made.stdout.strip() == secret
        taken = _cairn(core, tmp_path, "token", "create", "eve", "--from-env", env_name)
        assert taken.exit_code == 2
        assert "belongs to 'cron'" in taken.stderr
    finally:
        del os.environ[env_name]
    who = httpx.get(core.url + "/v1/whoami", headers={"Authorization": f"Bearer {secret}"})
    assert who.json() == {
        "name": "cron",
        "role": "service",
        "teams": [],
        "expires_at": None,
        "team_sources": [],
        "via": "token",
    }
    missing = _cairn(core, tmp_path, "token", "create", "x", "--from-env", "CAIRN_UNSET_VAR")
    assert missing.exit_code == 2


def test_a_revoked_token_is_refused(core: Core) -> None:
    with core.client("erin") as erin:
        assert erin.get("/v1/tasks").status_code == 200
        assert admin.revoke_tokens(core.db_url, "erin") == 1
        refused = erin.get("/v1/tasks")
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"] == "Bearer"


def test_a_worker_token_cannot_read_tasks(core: Core) -> None:
    with core.client("alice") as alice, core.client("w1", "worker") as worker:
        task = alice.post("/v1/tasks", json=spec()).json()
        assert worker.get(f"/v1/tasks/{task['id']}").status_code == 403


def test_whoami_names_the_tokens_principal(core: Core) -> None:
    with core.client("alice") as alice, core.client("cron", role="service") as cron:
        assert alice.get("/v1/whoami").json() == {
            "name": "alice",
            "role": "user",
            "teams": [],
            "expires_at": None,
            "team_sources": [],
            "via": "token",
        }
        assert cron.get("/v1/whoami").json()["role"] == "service"
    assert httpx.get(core.url + "/v1/whoami").status_code == 401


def test_a_service_submits_on_behalf_of_an_owner(core: Core) -> None:
    header = {"X-Cairn-On-Behalf-Of": "alice"}
    with core.client("cron", role="service") as cron, core.client("alice") as alice:
        made = cron.post("/v1/tasks", json=spec(idempotency_key="k1"), headers=header)
        assert made.status_code == 201, made.text
        assert made.json()["owner"] == "alice"
        # The key lives with the owner: alice's own retry of it finds the same task.
        again = alice.post("/v1/tasks", json=spec(idempotency_key="k1"))
        assert again.status_code == 200
        assert again.json()["id"] == made.json()["id"]
        batch = cron.post("/v1/tasks/batch", json={"tasks": [spec()]}, headers=header)
        assert batch.status_code == 201
        assert alice.get(f"/v1/tasks/{batch.json()['tasks'][0]['id']}").status_code == 200


def test_only_the_service_role_may_submit_for_someone_else(core: Core) -> None:
    with core.client("mallory") as mallory:
        answer = mallory.post("/v1/tasks", json=spec(), headers={"X-Cairn-On-Behalf-Of": "alice"})
        assert answer.status_code == 403
        assert "X-Cairn-On-Behalf-Of" in answer.json()["detail"]
        # Naming oneself is allowed, and means nothing.
        own = mallory.post("/v1/tasks", json=spec(), headers={"X-Cairn-On-Behalf-Of": "mallory"})
        assert own.status_code == 201


def test_without_a_valid_token_the_hot_paths_answer_401_before_judging_the_rest(
    core: Core,
) -> None:
    """Submissions and an agent's calls solve the caller before their other parameters: a
    request with no token (or a wrong one) and a bad header or path is refused as 401."""
    long_owner = {"X-Cairn-On-Behalf-Of": "x" * 201}
    for headers in ({}, {"Authorization": "Bearer cairn_not-a-token"}):
        for path, body in (("/v1/tasks", spec()), ("/v1/tasks/batch", {"tasks": [spec()]})):
            answer = httpx.post(core.url + path, json=body, headers={**headers, **long_owner})
            assert answer.status_code == 401, (path, answer.text)
        agent_calls = ("turn", "heartbeat", "claim", "attempts/1/report")
        for path in (f"/v1/workers/0/{call}" for call in agent_calls):
            answer = httpx.post(
                core.url + path, json={}, headers={**headers, "X-Cairn-Worker-Lease": "l" * 201}
            )
            assert answer.status_code == 401, (path, answer.text)
    with core.client() as alice:
        # With one, the same header is judged: 422, naming it.
        answer = alice.post("/v1/tasks", json=spec(), headers=long_owner)
        assert answer.status_code == 422 and "on-behalf-of" in answer.text.lower()
        # A user's token on an agent's call: its role is refused (403) before the rest.
        answer = alice.post(
            "/v1/workers/0/turn", json={}, headers={"X-Cairn-Worker-Lease": "l" * 201}
        )
        assert answer.status_code == 403, answer.text
