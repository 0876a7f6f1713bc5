"""Teams in sharing, over real HTTP with a scripted worker: a team's quota bounds the sum
over its members' team tasks, a team's tasks are one fair-share flow, members read their
teams' events and usage (outsiders do not), and members act in bulk on team tasks."""

from __future__ import annotations

import pytest
from sqlalchemy import event

from services.core.db import sharing
from tests.integration.core.test_dispatch import Agent
from tests.support import Core, spec

pytestmark = pytest.mark.core(heartbeat_interval_s=0.2, heartbeat_timeout_s=120.0)


def _team(core: Core, name: str, *members: str) -> None:
    with core.client("root", "admin") as root:
        assert root.post("/v1/teams", json={"name": name}).status_code == 201
        for member in members:
            assert root.put(f"/v1/teams/{name}/members/{member}").status_code == 200


def _submit(client, n: int = 1, **overrides) -> list[int]:
    body = {"tasks": [spec(**overrides) for _ in range(n)]}
    answer = client.post("/v1/tasks/batch", json=body)
    assert answer.status_code == 201, answer.text
    return [item["id"] for item in answer.json()["tasks"]]


def test_a_team_quota_holds_the_third_task_of_two_members(core: Core, db) -> None:
    _team(core, "sre", "alice", "bob")
    with core.client("root", "admin") as root:
        answer = root.patch("/v1/teams/sre/share", json={"max_running": 2})
        assert answer.status_code == 200, answer.text
        assert answer.json()["kind"] == "team" and answer.json()["quota"]["max_running"] == 2
    with core.client("alice") as alice, core.client("bob") as bob:
        first = _submit(alice, 2, team="sre")
        third = _submit(bob, 1, team="sre")
        own = _submit(bob, 1)  # bob's own work is not the team's
        agent = Agent(core, cpu=64)
        taken = {a["task_id"] for a in agent.claim(most=16)}
        assert taken == {*first, *own}
        held = bob.get(f"/v1/tasks/{third[0]}").json()
        assert held["state"] == "waiting"
        assert held["pending_reason"] == "team sre at quota (running 2/2)"
        usage = bob.get("/v1/teams/sre/usage").json()
        assert usage["running"]["attempts"] == 2 and usage["waiting"] == 1
        assert usage["at_quota"] == ["running"]
        assert agent.claim(most=16) == []
    running = db.execute(
        "SELECT count(*) FROM core.tasks WHERE team = 'sre' AND state = 'running'"
    ).fetchone()[0]
    assert running == 2
    audit = db.execute("SELECT actor, action, target FROM core.audit WHERE action = 'team.share'")
    assert audit.fetchall() == [("root", "team.share", "team:sre")]


def test_a_team_waiting_quota_refuses_any_member_with_429(core: Core, db) -> None:
    _team(core, "sre", "alice", "bob")
    with core.client("root", "admin") as root:
        root.patch("/v1/teams/sre/share", json={"max_waiting": 2}).raise_for_status()
    with core.client("alice") as alice, core.client("bob") as bob:
        _submit(alice, 2, team="sre")
        refused = bob.post("/v1/tasks", json=spec(team="sre"))
        assert refused.status_code == 429
        assert refused.json()["quota"] == "waiting" and "team sre" in refused.json()["detail"]
        assert bob.post("/v1/tasks", json=spec()).status_code == 201
    stored = db.execute("SELECT count(*) FROM core.tasks WHERE team = 'sre'").fetchone()[0]
    assert stored == 2


def test_a_teams_tasks_are_one_fair_share_flow(core: Core, db) -> None:
    """Three members flooding for their team count as one flow against carol alone."""
    _team(core, "sre", "alice", "bob", "dave")
    with (
        core.client("alice") as alice,
        core.client("bob") as bob,
        core.client("dave") as dave,
        core.client("carol") as carol,
    ):
        for member in (alice, bob, dave):
            _submit(member, 40, team="sre")
        _submit(carol, 40)
        agent = Agent(core, cpu=64)
        taken = [a["task_id"] for a in agent.claim(most=20)]
    rows = db.execute(
        "SELECT COALESCE(team, owner) FROM core.tasks WHERE id = ANY(%s)", (taken,)
    ).fetchall()
    flows = [r[0] for r in rows]
    assert len(flows) == 20
    assert 9 <= flows.count("carol") <= 11, "one to one between the team and carol"


def test_members_read_their_teams_events_and_usage_and_outsiders_do_not(core: Core) -> None:
    _team(core, "sre", "alice", "bob")
    with (
        core.client("alice") as alice,
        core.client("bob") as bob,
        core.client("mallory") as mallory,
    ):
        [shared] = _submit(alice, 1, team="sre")
        [private] = _submit(alice, 1)

        def feed(client) -> set[int]:
            page = client.get("/v1/events", params={"after": "0.0", "limit": 1000}).json()
            return {e["task_id"] for e in page["items"]}

        assert feed(alice) == {shared, private}
        assert feed(bob) == {shared}
        assert feed(mallory) == set()
        assert bob.get("/v1/teams/sre/usage").json()["waiting"] == 1
        assert mallory.get("/v1/teams/sre/usage").status_code == 404
        assert mallory.get("/v1/teams/nope/usage").status_code == 404
        mine = bob.get("/v1/owners").json()["items"]
        assert [(u["kind"], u["name"]) for u in mine] == [("owner", "bob"), ("team", "sre")]
        assert bob.get("/v1/usage", params={"team": "sre"}).status_code == 200
        assert mallory.get("/v1/usage", params={"team": "sre"}).json()["items"] == []
        with core.client("root", "admin") as root:
            assert root.patch("/v1/teams/nope/share", json={"weight": 2}).status_code == 404
            assert bob.patch("/v1/teams/sre/share", json={"weight": 2}).status_code == 403


def test_a_users_owner_list_reads_the_active_flows_once(core: Core) -> None:
    """``sharing._ACTIVE`` reads every running and waiting task (100,000 at a backlog of
    that size: bench/dashboard_backlog.py); a user's list of their own flow and their
    teams' reads it once (bob's and alice's lists: twice in all), not once more for the
    teams; the answer is what it was."""
    _team(core, "sre", "alice", "bob")
    _team(core, "ops", "bob")
    ran = []
    # the backlog's counts run on their own pool (db.readings)
    engine = core.server.config.app.state.readings.engine.sync_engine
    active = str(sharing._ACTIVE)

    def count(conn, cursor, statement, parameters, context, executemany) -> None:
        if statement == active:
            ran.append(1)

    with core.client("alice") as alice, core.client("bob") as bob:
        _submit(alice, 2, team="sre")
        _submit(alice, 1)
        _submit(bob, 1)
        event.listen(engine, "before_cursor_execute", count)
        try:
            items = bob.get("/v1/owners").json()["items"]
            alone = alice.get("/v1/owners").json()["items"]
        finally:
            event.remove(engine, "before_cursor_execute", count)
    assert len(ran) == 2  # once for bob (his flow and two teams), once for alice
    assert [(u["kind"], u["name"], u["waiting"]) for u in items] == [
        ("owner", "bob", 1),
        ("team", "ops", 0),
        ("team", "sre", 2),
    ]
    # three active flows of weight 1 (alice's, bob's, sre's); ops would make a fourth
    assert [u["share"] for u in items] == pytest.approx([1 / 3, 1 / 4, 1 / 3], abs=1e-5)
    assert [(u["kind"], u["name"], u["waiting"]) for u in alone] == [
        ("owner", "alice", 3),  # what she submitted, her team's included
        ("team", "sre", 2),
    ]


def test_members_retry_and_cancel_their_teams_tasks_in_bulk(core: Core, db) -> None:
    _team(core, "sre", "alice", "bob")
    with (
        core.client("alice") as alice,
        core.client("bob") as bob,
        core.client("mallory") as mallory,
    ):
        shared = _submit(alice, 3, team="sre", run_at="2099-01-01T00:00:00Z")
        private = _submit(alice, 2, run_at="2099-01-01T00:00:00Z")
        # An outsider naming the team: 403 naming the field, nothing moved.
        refused = mallory.post("/v1/tasks/cancel", json={"filter": {"team": "sre"}})
        assert refused.status_code == 403
        assert refused.json()["errors"][0]["field"] == "body.filter.team"
        cancelled = bob.post("/v1/tasks/cancel", json={"filter": {"team": "sre"}})
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["changed"] == 3
        retried = bob.post("/v1/tasks/retry", json={"filter": {"team": "sre", "owner": "alice"}})
        assert retried.json()["changed"] == 3
        # Without team, bob's bulk action reaches only his own tasks: alice's are untouched.
        assert bob.post("/v1/tasks/cancel", json={}).json()["changed"] == 0
    states = dict(
        db.execute(
            "SELECT id, state FROM core.tasks WHERE id = ANY(%s)", (shared + private,)
        ).fetchall()
    )
    assert {states[i] for i in shared} == {"waiting"}
    assert {states[i] for i in private} == {"ready"}
    audit = db.execute(
        "SELECT actor, action, target FROM core.audit WHERE action LIKE 'task.bulk.%' ORDER BY id"
    ).fetchall()
    assert audit == [
        ("bob", "task.bulk.cancel", "team:sre"),
        ("bob", "task.bulk.retry", "team:sre"),
    ]


def test_cairn_quota_sets_and_shows_a_teams_quota(core: Core, monkeypatch, tmp_path) -> None:
    from typer.testing import CliRunner

    from cairn.cli import app

    _team(core, "sre", "alice")
    with core.client("root", "admin"), core.client("alice"):
        pass  # their tokens
    monkeypatch.setenv("CAIRN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CAIRN_CONFIG", str(tmp_path / "none.toml"))
    monkeypatch.setenv("CAIRN_URL", core.url)
    monkeypatch.setenv("CAIRN_TOKEN", core.tokens["root"])
    runner = CliRunner()
    result = runner.invoke(app, ["quota", "--team", "sre", "--running", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert '"max_running": 2' in result.output and '"kind": "team"' in result.output
    monkeypatch.setenv("CAIRN_TOKEN", core.tokens["alice"])
    shown = runner.invoke(app, ["quota", "--team", "sre"])
    assert shown.exit_code == 0, shown.output
    assert "sre (team)" in shown.output and "0/2" in shown.output
    refused = runner.invoke(app, ["quota", "--team", "sre", "--running", "5"])
    assert refused.exit_code != 0
