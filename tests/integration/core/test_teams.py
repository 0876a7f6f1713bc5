"""Teams over real HTTP: admins manage members; members see and act on team-owned work;
everyone else gets the same 404 as for a task that does not exist."""

from __future__ import annotations

from tests.support import Core, spec


def _team(core: Core, name: str, *members: str, reuse_name: bool = False) -> None:
    with core.client("root", "admin") as root:
        made = root.post("/v1/teams", json={"name": name, "reuse_name": reuse_name})
        assert made.status_code == 201, made.text
        for member in members:
            assert root.put(f"/v1/teams/{name}/members/{member}").status_code == 200


def test_admins_manage_teams_and_members_see_their_own(core: Core) -> None:
    _team(core, "sre", "alice", "bob")
    with core.client("root", "admin") as root, core.client("alice") as alice:
        assert root.post("/v1/teams", json={"name": "sre"}).status_code == 409
        assert root.get("/v1/teams/sre").json()["members"] == ["alice", "bob"]
        assert alice.get("/v1/teams").json()["items"][0]["name"] == "sre"
        assert alice.get("/v1/whoami").json()["teams"] == ["sre"]
        # A user may not manage teams, not even its own.
        assert alice.post("/v1/teams", json={"name": "mine"}).status_code == 403
        assert alice.put("/v1/teams/sre/members/mallory").status_code == 403
        assert alice.delete("/v1/teams/sre/members/bob").status_code == 403
        assert root.delete("/v1/teams/sre/members/bob").json()["members"] == ["alice"]
        assert root.delete("/v1/teams/sre/members/bob").status_code == 404
        assert root.post("/v1/teams", json={"name": "Bad Name"}).status_code == 422


def test_a_non_member_sees_a_404_for_the_team(core: Core) -> None:
    _team(core, "sre", "alice")
    with core.client("mallory") as mallory:
        assert mallory.get("/v1/teams/sre").status_code == 404
        assert mallory.get("/v1/teams/nope").status_code == 404
        assert mallory.get("/v1/teams").json()["items"] == []


def test_members_see_and_act_on_team_work_and_outsiders_get_404(core: Core, db) -> None:
    _team(core, "sre", "alice", "bob")
    with (
        core.client("alice") as alice,
        core.client("bob") as bob,
        core.client("mallory") as mallory,
    ):
        shared = alice.post("/v1/tasks", json=spec(team="sre", run_at="2099-01-01T00:00:00Z"))
        assert shared.status_code == 201, shared.text
        task = shared.json()
        assert task["team"] == "sre" and task["owner"] == "alice"
        private = alice.post("/v1/tasks", json=spec()).json()
        # bob, a teammate: sees it, lists it, cancels it, retries it.
        assert bob.get(f"/v1/tasks/{task['id']}").status_code == 200
        assert bob.get(f"/v1/tasks/{task['id']}/events").status_code == 200
        ids = [t["id"] for t in bob.get("/v1/tasks").json()["items"]]
        assert task["id"] in ids and private["id"] not in ids
        assert [t["id"] for t in bob.get("/v1/tasks", params={"team": "sre"}).json()["items"]] == [
            task["id"]
        ]
        assert bob.get(f"/v1/tasks/{private['id']}").status_code == 404
        assert bob.post(f"/v1/tasks/{task['id']}/cancel").json()["state"] == "cancelled"
        assert bob.post(f"/v1/tasks/{task['id']}/retry").status_code == 200
        # mallory: the same 404 as for a task that does not exist, for every verb.
        for path in (f"/v1/tasks/{task['id']}", f"/v1/tasks/{task['id']}/attempts"):
            assert mallory.get(path).status_code == 404
        for verb in ("cancel", "retry"):
            answer = mallory.post(f"/v1/tasks/{task['id']}/{verb}")
            missing = mallory.post(f"/v1/tasks/99999999/{verb}")
            assert answer.status_code == missing.status_code == 404
            assert answer.json()["detail"].replace(str(task["id"]), "N") == missing.json()[
                "detail"
            ].replace("99999999", "N")
        assert task["id"] not in [t["id"] for t in mallory.get("/v1/tasks").json()["items"]]
        assert mallory.get("/v1/tasks", params={"team": "sre"}).json()["items"] == []
        assert mallory.get("/v1/tasks", params={"owner": "alice"}).json()["items"] == []
    # A teammate acting on alice's work leaves an audit row.
    actions = db.execute(
        "SELECT actor, action, target FROM core.audit WHERE action LIKE 'task.%' ORDER BY id"
    ).fetchall()
    assert actions == [
        ("bob", "task.cancel", f"task:{task['id']}"),
        ("bob", "task.retry", f"task:{task['id']}"),
    ]


def test_only_a_member_may_give_work_to_a_team(core: Core) -> None:
    _team(core, "sre", "alice")
    with core.client("mallory") as mallory, core.client("cron", "service") as cron:
        refused = mallory.post("/v1/tasks", json=spec(team="sre"))
        assert refused.status_code == 403 and "team" in refused.json()["detail"]
        batch = mallory.post("/v1/tasks/batch", json={"tasks": [spec(), spec(team="sre")]})
        assert batch.status_code == 403 and "tasks.1.team" in batch.json()["detail"]
        # A service submitting for someone: that person's memberships count.
        on_behalf = {"X-Cairn-On-Behalf-Of": "alice"}
        assert cron.post("/v1/tasks", json=spec(team="sre"), headers=on_behalf).status_code == 201
        on_behalf = {"X-Cairn-On-Behalf-Of": "mallory"}
        assert cron.post("/v1/tasks", json=spec(team="sre"), headers=on_behalf).status_code == 403


def test_leaving_a_team_ends_access(core: Core) -> None:
    _team(core, "sre", "alice", "bob")
    with (
        core.client("alice") as alice,
        core.client("bob") as bob,
        core.client("root", "admin") as root,
    ):
        task = alice.post("/v1/tasks", json=spec(team="sre")).json()
        assert bob.get(f"/v1/tasks/{task['id']}").status_code == 200
        assert root.delete("/v1/teams/sre/members/bob").status_code == 200
        assert bob.get(f"/v1/tasks/{task['id']}").status_code == 404
        assert root.delete("/v1/teams/sre").status_code == 204
        assert alice.get(f"/v1/tasks/{task['id']}").status_code == 200


def test_a_deleted_teams_secrets_go_with_it_not_to_a_team_of_its_name(core: Core, db) -> None:
    """A team's secrets outlived the team: an admin who later made a team of the same
    name (names are reused in a company this size) gave its new members the old team's
    values, which open under the same scope."""
    _team(core, "payroll", "alice")
    with core.client("alice") as alice:
        made = alice.post(
            "/v1/secrets", json={"name": "bank", "value": "s3cr3t", "team": "payroll"}
        )
        assert made.status_code == 201, made.text
    with core.client("root", "admin") as root:
        assert root.delete("/v1/teams/payroll").status_code == 204
    assert db.execute("SELECT count(*) FROM core.secrets WHERE team = 'payroll'").fetchone() == (0,)
    _team(core, "payroll", "mallory", reuse_name=True)
    with core.client("mallory") as mallory:
        assert mallory.get("/v1/secrets").json()["items"] == []
        env = {"BANK": {"secret": "bank", "team": "payroll"}}
        refused = mallory.post("/v1/tasks", json=spec(env=env))
        assert refused.status_code == 422, refused.text
    audit = db.execute(
        "SELECT before FROM core.audit WHERE action = 'team.delete' AND target = 'team:payroll'"
    ).fetchone()
    assert audit[0]["secrets"] == ["bank"]


def test_a_deleted_teams_name_is_not_taken_again_unless_asked_for(core: Core, db) -> None:
    """A deleted team's tasks (and its schedules and workflows) still name it: a team
    made later with the same name showed them to its new members, who could read their
    logs and act on them. Such a name is a 409 now, unless the admin asks to take the
    work on (``reuse_name``), which the audit trail records."""
    _team(core, "payroll", "alice")
    with core.client("alice") as alice:
        made = alice.post("/v1/tasks", json=spec(name="salaries", team="payroll"))
        assert made.status_code == 201, made.text
        task = made.json()["id"]
    with core.client("root", "admin") as root:
        assert root.delete("/v1/teams/payroll").status_code == 204
        again = root.post("/v1/teams", json={"name": "payroll"})
        assert again.status_code == 409, again.text
        problem = again.json()
        assert problem["errors"][0]["field"] == "body.name", problem
        assert "was deleted on" in problem["detail"] and "reuse_name" in problem["detail"]
        assert root.get("/v1/teams/payroll").status_code == 404  # nothing made
    kept = db.execute("SELECT name, deleted_by FROM core.retired_teams").fetchall()
    assert kept == [("payroll", "root")]
    with core.client("mallory") as mallory:
        assert mallory.get(f"/v1/tasks/{task}").status_code == 404
    _team(core, "payroll", "mallory", reuse_name=True)
    with core.client("mallory") as mallory:
        assert mallory.get(f"/v1/tasks/{task}").status_code == 200  # asked for: taken on
    assert db.execute("SELECT count(*) FROM core.retired_teams").fetchone() == (0,)
    audit = db.execute(
        "SELECT after FROM core.audit WHERE action = 'team.create' AND target = 'team:payroll'"
        " ORDER BY id"
    ).fetchall()
    assert [row[0].get("reused_name") for row in audit] == [None, True]
