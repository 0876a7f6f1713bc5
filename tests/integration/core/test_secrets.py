"""Secrets over real HTTP: stored sealed, never in an answer, an event, a log line or a
database column in clear; opened only into the claim of the worker that leases the
attempt; masked in what comes back from it."""

from __future__ import annotations

import logging
import subprocess
import uuid
from pathlib import Path

import pytest

from libs.common.embedded import binaries
from libs.common.settings import libpq_url
from tests.support import Core, register_worker, spec

PG_DUMP = binaries() / "pg_dump"


class Worker:
    def __init__(self, core: Core, name: str = "w1") -> None:
        self.http = core.client(name, "worker")
        offer = {"hostname": "w.test", "queues": ["default"], "cpu": 8, "memory_mb": 16384}
        self.id = register_worker(self.http, offer)

    def claim(self) -> list[dict]:
        room = {"cpu": 8, "memory_mb": 16384, "max": 16}
        answer = self.http.post(f"/v1/workers/{self.id}/claim", json=room)
        assert answer.status_code == 200, answer.text
        return answer.json()["attempts"]

    def close(self) -> None:
        self.http.close()


@pytest.fixture
def worker(core: Core):
    found = Worker(core)
    yield found
    found.close()


def _value() -> str:
    return f"hunter2-{uuid.uuid4().hex}"


def _dump(db_url: str) -> bytes:
    return subprocess.run(
        [str(PG_DUMP), "--data-only", libpq_url(db_url)],
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout


def test_a_secret_reaches_only_the_leasing_worker_and_nothing_else(
    core: Core, worker: Worker, db, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    value = _value()
    with core.client("alice") as alice, core.client("root", "admin") as root:
        made = alice.post("/v1/secrets", json={"name": "db-main", "value": value})
        assert made.status_code == 201, made.text
        assert value not in made.text
        env = {"DB_PASSWORD": {"secret": "db-main"}, "MODE": "plain"}
        task = alice.post("/v1/tasks", json=spec(env=env))
        assert task.status_code == 201, task.text
        task_id = task.json()["id"]
        [leased] = worker.claim()
        assert leased["env"] == {"DB_PASSWORD": value, "MODE": "plain"}
        attempt = leased["attempt_id"]
        # What the worker sends back is masked before it is stored.
        text = f"password={value}\nbytes \ufffd\n"
        chunk = {"attempt_id": attempt, "offset": 0, "length": len(text), "text": text}
        log = worker.http.post(f"/v1/workers/{worker.id}/logs", json={"chunks": [chunk]})
        assert log.status_code == 200 and log.json()["items"][0]["status"] == 200, log.text
        report = worker.http.post(
            f"/v1/workers/{worker.id}/attempts/{attempt}/report",
            json={"outcome": "failed", "log_tail": f"connecting with {value}\n", "error": value},
        )
        assert report.status_code == 200, report.text
        answers = [
            alice.get("/v1/secrets"),
            root.get("/v1/secrets"),
            alice.get(f"/v1/tasks/{task_id}"),
            alice.get("/v1/tasks"),
            alice.get(f"/v1/tasks/{task_id}/attempts"),
            alice.get(f"/v1/tasks/{task_id}/events"),
            alice.get(f"/v1/tasks/{task_id}/logs"),
            root.get("/v1/events"),
            root.get("/v1/audit"),
        ]
        for answer in answers:
            assert answer.status_code == 200, answer.text
            assert value not in answer.text, answer.request.url
        assert alice.get(f"/v1/tasks/{task_id}").json()["env"]["DB_PASSWORD"] == {
            "secret": "db-main",
            "team": None,
        }
        assert "password=***" in alice.get(f"/v1/tasks/{task_id}/logs").text
        tail = alice.get(f"/v1/tasks/{task_id}/attempts").json()["items"][0]["log_tail"]
        assert tail == "connecting with ***\n"
    dump = _dump(core.db_url)
    assert b"db-main" in dump  # the dump holds the data, ...
    assert value.encode() not in dump  # ... but not the value in clear
    assert not [r for r in caplog.records if value in r.getMessage()]


def test_referring_to_a_missing_or_foreign_secret_is_refused(core: Core) -> None:
    with core.client("alice") as alice, core.client("mallory") as mallory:
        alice.post("/v1/secrets", json={"name": "db-main", "value": _value()})
        missing = alice.post("/v1/tasks", json=spec(env={"DB": {"secret": "nope"}}))
        assert missing.status_code == 422 and "env.DB" in missing.json()["detail"]
        # mallory names alice's secret: it resolves in mallory's own scope, where there is none.
        theirs = mallory.post("/v1/tasks", json=spec(env={"DB": {"secret": "db-main"}}))
        assert theirs.status_code == 422
        team = mallory.post("/v1/tasks", json=spec(env={"DB": {"secret": "x", "team": "sre"}}))
        assert team.status_code == 403 and "env.DB" in team.json()["detail"]
        batch = alice.post(
            "/v1/tasks/batch", json={"tasks": [spec(), spec(env={"DB": {"secret": "nope"}})]}
        )
        assert batch.status_code == 422 and "tasks.1.env.DB" in batch.json()["detail"]
        assert mallory.delete("/v1/secrets/db-main").status_code == 404
        assert mallory.put("/v1/secrets/db-main", json={"value": "x"}).status_code == 404
        assert [s["name"] for s in mallory.get("/v1/secrets").json()["items"]] == []
        assert alice.post("/v1/secrets", json={"name": "db-main", "value": "y"}).status_code == 409
        bad = alice.post("/v1/secrets", json={"name": "ok", "value": "v", "extra": 1})
        assert bad.status_code == 422


def test_team_secrets_serve_the_teams_work(core: Core, worker: Worker) -> None:
    value = _value()
    with core.client("root", "admin") as root:
        root.post("/v1/teams", json={"name": "sre"})
        root.put("/v1/teams/sre/members/alice")
        root.put("/v1/teams/sre/members/bob")
    with (
        core.client("alice") as alice,
        core.client("bob") as bob,
        core.client("mallory") as mallory,
    ):
        made = alice.post("/v1/secrets", json={"name": "pager", "value": value, "team": "sre"})
        assert made.status_code == 201, made.text
        assert (
            mallory.post(
                "/v1/secrets", json={"name": "pager2", "value": "v", "team": "sre"}
            ).status_code
            == 404
        )
        assert "pager" in [s["name"] for s in bob.get("/v1/secrets").json()["items"]]
        env = {"PAGER": {"secret": "pager", "team": "sre"}}
        assert bob.post("/v1/tasks", json=spec(env=env, team="sre")).status_code == 201
        [leased] = worker.claim()
        assert leased["env"] == {"PAGER": value}


def test_a_ciphertext_moved_to_another_scope_does_not_open(core: Core, worker: Worker, db) -> None:
    """Someone who can write the database but has no key copies alice's sealed value into
    mallory's secret: it is bound to alice's scope, so it opens for nobody."""
    with core.client("alice") as alice, core.client("mallory") as mallory:
        alice.post("/v1/secrets", json={"name": "db-main", "value": _value()})
        mallory.post("/v1/secrets", json={"name": "stolen", "value": "placeholder"})
        db.execute("""
            UPDATE core.secrets m SET nonce = a.nonce, ciphertext = a.ciphertext, key_id = a.key_id
            FROM core.secrets a WHERE a.owner = 'alice' AND m.owner = 'mallory'
        """)
        task = mallory.post("/v1/tasks", json=spec(env={"X": {"secret": "stolen"}})).json()
        assert worker.claim() == []
        failed = mallory.get(f"/v1/tasks/{task['id']}").json()
        assert failed["state"] == "dead"
        assert "cannot be opened" in failed["last_error"]


def test_a_deleted_secret_fails_the_attempt_saying_so(core: Core, worker: Worker) -> None:
    with core.client("alice") as alice:
        alice.post("/v1/secrets", json={"name": "db-main", "value": _value()})
        task = alice.post("/v1/tasks", json=spec(env={"DB": {"secret": "db-main"}})).json()
        assert alice.delete("/v1/secrets/db-main").status_code == 204
        assert worker.claim() == []
        found = alice.get(f"/v1/tasks/{task['id']}").json()
        assert found["state"] == "dead" and "db-main" in found["last_error"]


def test_a_replaced_value_reaches_the_next_lease(core: Core, worker: Worker, db) -> None:
    old, new = _value(), _value()
    with core.client("alice") as alice, core.client("root", "admin") as root:
        alice.post("/v1/secrets", json={"name": "db-main", "value": old})
        assert alice.put("/v1/secrets/db-main", json={"value": new}).status_code == 200
        alice.post("/v1/tasks", json=spec(env={"DB": {"secret": "db-main"}}))
        [leased] = worker.claim()
        assert leased["env"]["DB"] == new
        assert alice.delete("/v1/secrets/db-main").status_code == 204
        actions = [
            e["action"] for e in root.get("/v1/audit", params={"action": "secret"}).json()["items"]
        ]
    assert actions == ["secret.delete", "secret.update", "secret.create"]


def test_core_refuses_to_start_in_production_without_a_key(db_url: str, tmp_path: Path) -> None:
    from pydantic import ValidationError

    from services.core.settings import CoreSettings

    with pytest.raises(ValidationError, match="CAIRN_SECRETS_KEY"):
        CoreSettings(env="production", database_url=db_url, home=tmp_path)


def test_rotated_keys_still_open_old_values(core: Core, db_url: str, tmp_path: Path) -> None:
    from services.core.identity.crypto import SecretBox, new_key

    old, new = new_key(), new_key()
    sealed = SecretBox([old]).seal("v1", b"ctx")
    assert SecretBox([new, old]).open(*sealed, b"ctx") == "v1"
    assert SecretBox([new, old]).seal("v2", b"ctx")[0] == SecretBox([new]).current
    with pytest.raises(Exception, match="not configured"):
        SecretBox([new]).open(*sealed, b"ctx")
    with pytest.raises(Exception, match="its place"):
        SecretBox([old]).open(*sealed, b"other")


def test_the_cli_stores_and_uses_secrets_without_showing_them(
    core: Core, worker: Worker, tmp_path: Path
) -> None:
    import json
    import os
    import sys

    value = _value()
    with core.client("alice"):
        pass
    env = {
        **os.environ,
        "CAIRN_URL": core.url,
        "CAIRN_TOKEN": core.tokens["alice"],
        "CAIRN_HOME": str(tmp_path),
        "TEST_DB_SECRET": value,
    }

    def cairn(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cairn", *args],
            env=env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
        )

    stored = cairn("secret", "set", "db-main", "--from-env", "TEST_DB_SECRET")
    assert stored.returncode == 0, stored.stderr
    replaced = cairn("secret", "set", "db-main", stdin=value + "\n")
    assert replaced.returncode == 0, replaced.stderr
    listed = cairn("--json", "secret", "ls")
    assert [s["name"] for s in json.loads(listed.stdout)] == ["db-main"]
    submitted = cairn(
        "--json", "submit", "t", "--artifact", "file:///bin/true", "--secret", "DB=db-main"
    )
    assert submitted.returncode == 0, submitted.stderr
    assert json.loads(submitted.stdout)["env"] == {"DB": {"secret": "db-main", "team": None}}
    for shown in (stored, replaced, listed, submitted):
        assert value not in shown.stdout + shown.stderr
    [leased] = worker.claim()
    assert leased["env"] == {"DB": value}
    assert cairn("secret", "rm", "db-main").returncode == 0
