"""Artifact credentials (docs/security.md, "Artifact credentials"): an ``s3://`` artifact
may name a secret of its owner or team, checked as an env secret is (at submit, retry and
every lease), stored as a reference only, opened into the leasing worker's answer only,
and masked in what that worker sends back."""

from __future__ import annotations

import json
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cairn.cli import app
from tests.fixtures.s3 import INTERNAL_SHA, TOOL_SHA, iam_s3_server, worker_env
from tests.integration.core.test_membership import _leave, _payroll
from tests.integration.core.test_secrets import Worker
from tests.support import Core, cli_as, spawn_worker, spec, stop_process, wait_for

SHA = "a" * 64
TEAM_REF = {"secret": "s3-payroll", "team": "payroll"}


@pytest.fixture
def claimer(core: Core) -> Iterator[Worker]:
    found = Worker(core)
    yield found
    found.close()


def _keys() -> dict[str, str]:
    return {
        "access_key_id": f"AKIA{uuid.uuid4().hex[:16].upper()}",
        "secret_access_key": f"sk-{uuid.uuid4().hex}",
        "region": "eu-west-1",
    }


def _s3_task(credentials: object, uri: str = "s3://payroll-tools/run.sh") -> dict:
    return spec(artifact={"uri": uri, "sha256": SHA, "credentials": credentials})


def test_a_teams_credentials_reach_only_the_lease_and_the_row_holds_the_reference(
    core: Core, db
) -> None:
    _payroll(core)
    keys = _keys()
    worker = Worker(core)
    try:
        with core.client("alice") as alice:
            made = alice.post(
                "/v1/secrets",
                json={"name": "s3-payroll", "value": json.dumps(keys), "team": "payroll"},
            )
            assert made.status_code == 201, made.text
            created = alice.post("/v1/tasks", json=_s3_task(TEAM_REF))
            assert created.status_code == 201, created.text
            shown = alice.get(f"/v1/tasks/{created.json()['id']}").json()
            plain_id = alice.post("/v1/tasks", json=spec()).json()["id"]
            by_task = {a["task_id"]: a for a in worker.claim()}
    finally:
        worker.close()
    leased, plain = by_task[created.json()["id"]], by_task[plain_id]
    # Left out when unset: an older worker's Artifact model forbids unknown fields.
    assert "credentials" not in plain["artifact"] and "artifact_credentials" not in plain
    assert shown["artifact"]["credentials"] == TEAM_REF
    assert leased["artifact_credentials"] == {**keys, "session_token": None, "endpoint": None}
    assert leased["env"] == {}  # the keys are the fetch's, not the process's
    stored = db.execute("SELECT artifact_credentials FROM core.tasks ORDER BY id").fetchall()
    assert stored == [(TEAM_REF,), (None,)]
    assert keys["secret_access_key"] not in str(db.execute("SELECT * FROM core.tasks").fetchall())


def test_bad_artifact_credentials_are_refused_naming_the_field(core: Core) -> None:
    _payroll(core)
    with core.client("alice") as alice, core.client("carol") as carol:
        refused = {
            "malformed": alice.post("/v1/tasks", json=_s3_task("no spaces allowed/")),
            "bad name": alice.post("/v1/tasks", json=_s3_task({"secret": "a b"})),
            "not s3": alice.post(
                "/v1/tasks",
                json=_s3_task({"secret": "k"}, uri="https://example.com/tool"),
            ),
            "missing": alice.post("/v1/tasks", json=_s3_task({"secret": "absent"})),
        }
        outsider = carol.post("/v1/tasks", json=_s3_task(TEAM_REF))
    for why, answer in refused.items():
        assert answer.status_code == 422, (why, answer.text)
        assert "credentials" in answer.text, (why, answer.text)
    assert "artifact.credentials: no secret 'absent'" in refused["missing"].text
    assert outsider.status_code == 403, outsider.text
    assert "artifact.credentials" in outsider.text and "payroll" in outsider.text


def test_a_removed_members_task_dies_at_lease_without_the_credentials(core: Core, db) -> None:
    _payroll(core)
    keys = _keys()
    worker = Worker(core)
    try:
        with core.client("alice") as alice, core.client("bob") as bob:
            value = json.dumps(keys)
            alice.post(
                "/v1/secrets", json={"name": "s3-payroll", "value": value, "team": "payroll"}
            )
            waiting = alice.post("/v1/tasks", json=_s3_task(TEAM_REF)).json()["id"]
            teammates = bob.post("/v1/tasks", json=_s3_task(TEAM_REF)).json()["id"]
            _leave(core, "alice")
            leased = worker.claim()
            task = alice.get(f"/v1/tasks/{waiting}").json()
    finally:
        worker.close()
    assert [(a["task_id"], a["artifact_credentials"]["secret_access_key"]) for a in leased] == [
        (teammates, keys["secret_access_key"])
    ]
    assert task["state"] == "dead"
    assert (
        "artifact.credentials: 'alice' is no longer a member of team 'payroll'"
        in (task["last_error"])
    )


def test_a_secret_that_is_not_credentials_fails_the_attempt_without_its_value(
    core: Core, claimer: Worker
) -> None:
    value = f"not-json-{uuid.uuid4().hex}"
    with core.client("alice") as alice:
        alice.post("/v1/secrets", json={"name": "s3", "value": value})
        task_id = alice.post("/v1/tasks", json=_s3_task({"secret": "s3"})).json()["id"]
        assert claimer.claim() == []
        task = alice.get(f"/v1/tasks/{task_id}").json()
    assert task["state"] == "dead"
    assert "is not S3 credentials" in task["last_error"]
    assert value not in task["last_error"]


def test_what_the_worker_sends_back_has_the_keys_masked(core: Core, claimer: Worker, db) -> None:
    keys = _keys()
    with core.client("alice") as alice:
        alice.post("/v1/secrets", json={"name": "s3", "value": json.dumps(keys)})
        alice.post("/v1/tasks", json=_s3_task({"secret": "s3"}))
    [leased] = claimer.claim()
    said = f"s3 GET failed for {keys['access_key_id']} / {keys['secret_access_key']}"
    answer = claimer.http.post(
        f"/v1/workers/{claimer.id}/attempts/{leased['attempt_id']}/report",
        json={"outcome": "failed", "retryable": False, "error": said},
    )
    assert answer.status_code == 200, answer.text
    [(error,)] = db.execute("SELECT error FROM core.attempts").fetchall()
    assert keys["access_key_id"] not in error and keys["secret_access_key"] not in error
    assert error == "s3 GET failed for *** / ***"


def test_the_cli_names_the_artifacts_credentials(
    core: Core, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _payroll(core)
    runner = cli_as(core, monkeypatch, tmp_path)
    with core.client("alice") as alice:
        value = json.dumps(_keys())
        alice.post("/v1/secrets", json={"name": "s3-payroll", "value": value, "team": "payroll"})
    submitted = runner.invoke(
        app,
        [
            "--json",
            "submit",
            "t",
            "--artifact",
            "s3://payroll-tools/run.sh",
            "--sha256",
            SHA,
            "--artifact-credentials",
            "payroll/s3-payroll",
        ],
    )
    assert submitted.exit_code == 0, submitted.output
    task = json.loads(submitted.output)
    assert task["artifact"]["credentials"] == TEAM_REF
    shown = runner.invoke(app, ["get", str(task["id"])])
    assert shown.exit_code == 0, shown.output
    assert "payroll/s3-payroll" in shown.output


@pytest.mark.slow
def test_a_real_agent_fetches_as_the_tasks_owner_and_never_as_itself(
    core: Core, tmp_path: Path, db
) -> None:
    """One agent whose own keys read ``internal`` only: a payroll task fetches with its
    team's keys; without them its bucket is refused by name; the internal tool, fetched
    and cached by the agent's own keys for bob, is not what alice gets by naming its
    digest from her bucket."""
    _payroll(core)
    with iam_s3_server() as server:
        payroll = server.keys["payroll"].model_dump_json(exclude_none=True)
        env = {**worker_env(server), "CAIRN_WORKER_S3_OWN_BUCKETS": "internal"}
        agent = spawn_worker(core, tmp_path / "w", "w-s3", **env)
        try:
            with core.client("alice") as alice, core.client("bob") as bob:
                alice.post(
                    "/v1/secrets", json={"name": "s3-payroll", "value": payroll, "team": "payroll"}
                )
                ids = {
                    "team": _submit(alice, "payroll-tools", TOOL_SHA, TEAM_REF),
                    "none": _submit(alice, "payroll-tools", TOOL_SHA, None),
                    "own": _submit(bob, "internal", INTERNAL_SHA, None),
                }
                wait_for(lambda: _ended(db, ids["own"]), timeout=20)
                ids["digest"] = _submit(alice, "payroll-tools", INTERNAL_SHA, TEAM_REF)
                ended = wait_for(lambda: _ended(db, *ids.values()), timeout=20)
        finally:
            stop_process(agent, signal.SIGKILL)
    by = dict(zip(ids, ended, strict=True))
    assert by["team"] == ("succeeded", None)
    assert by["own"] == ("succeeded", None)
    assert by["none"][0] == "dead"
    assert "'payroll-tools'" in by["none"][1] and "CAIRN_WORKER_S3_OWN_BUCKETS" in by["none"][1]
    assert by["digest"][0] == "dead" and "sha256 mismatch" in by["digest"][1]


def _submit(client: httpx.Client, bucket: str, sha: str, credentials: object) -> int:
    artifact = {"uri": f"s3://{bucket}/tool.sh", "sha256": sha, "credentials": credentials}
    if credentials is None:
        del artifact["credentials"]
    made = client.post("/v1/tasks", json=spec(artifact=artifact, retry={"max_attempts": 1}))
    assert made.status_code == 201, made.text
    return int(made.json()["id"])


def _ended(db, *ids: int) -> list[tuple[str, str | None]] | None:
    rows = db.execute(
        "SELECT id, state, last_error FROM core.tasks WHERE id = ANY(%s)", (list(ids),)
    ).fetchall()
    found = {row[0]: (row[1], row[2]) for row in rows}
    if any(found[i][0] not in ("succeeded", "dead") for i in ids):
        return None
    return [found[i] for i in ids]
