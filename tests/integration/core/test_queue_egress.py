"""A queue's egress policy over real HTTP and a real PostgreSQL (issue 32, part 3): set
through ``PATCH /v1/queues/{name}``, shown, audited, carried by each lease of its tasks;
bad input a 422 naming the field. Its enforcement by a real agent:
tests/security/test_attempt_egress.py."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from libs.common.models import MAX_EGRESS_RULES
from tests.integration.core.test_dispatch import Agent, _close_agents  # noqa: F401 - closes them
from tests.support import Core, spec


def _set(core: Core, name: str, egress: object) -> httpx.Response:
    with core.client("root", "admin") as admin:
        return admin.patch(f"/v1/queues/{name}", json={"egress": egress})


def _field(answer: httpx.Response) -> str:
    assert answer.status_code == 422, answer.text
    return str(answer.json()["errors"][0]["field"])


ALLOW = {"mode": "allow", "allow": [{"cidr": "10.1.2.3/16", "port": 443}, {"cidr": "fd00::1"}]}


def test_a_queues_egress_is_set_shown_audited_and_restored(core: Core, db) -> None:
    answer = _set(core, "builds", ALLOW)
    assert answer.status_code == 200, answer.text
    # Normalised: the range's network, a bare address one host.
    assert answer.json()["egress"] == {
        "mode": "allow",
        "allow": [{"cidr": "10.1.0.0/16", "port": 443}, {"cidr": "fd00::1/128", "port": None}],
    }
    stored = db.execute("SELECT egress FROM core.queues WHERE name = 'builds'").fetchone()[0]
    assert stored["mode"] == "allow" and len(stored["allow"]) == 2
    assert _set(core, "builds", {"mode": "none"}).json()["egress"] == {"mode": "none", "allow": []}
    audit = db.execute(
        "SELECT before->'egress'->>'mode', after->'egress'->>'mode' FROM core.audit"
        " WHERE action = 'queue.settings' ORDER BY id DESC LIMIT 1"
    ).fetchone()
    assert audit == ("allow", "none")
    # null (or host) is the default, stored as none set
    assert _set(core, "builds", None).json()["egress"]["mode"] == "host"
    assert db.execute("SELECT egress FROM core.queues WHERE name = 'builds'").fetchone() == (None,)
    with core.client() as alice:
        listed = {q["name"]: q for q in alice.get("/v1/queues").json()["items"]}
    assert listed["builds"]["egress"] == {"mode": "host", "allow": []}


def test_bad_egress_is_a_422_naming_the_field(core: Core, db) -> None:
    bad_cidr = {"mode": "allow", "allow": [{"cidr": "10.0.0.0/33"}]}
    assert _field(_set(core, "q", bad_cidr)) == "body.egress.allow.0.cidr"
    bad_port = {"mode": "allow", "allow": [{"cidr": "10.0.0.0/8", "port": 65536}]}
    assert _field(_set(core, "q", bad_port)) == "body.egress.allow.0.port"
    too_long = {"mode": "allow", "allow": [{"cidr": "10.0.0.1"}] * (MAX_EGRESS_RULES + 1)}
    assert _field(_set(core, "q", too_long)) == "body.egress.allow"
    assert _field(_set(core, "q", {"mode": "open"})) == "body.egress.mode"
    assert _field(_set(core, "q", {"mode": "none", "allow": [{"cidr": "10.0.0.1"}]})) == (
        "body.egress"
    )
    assert db.execute("SELECT count(*) FROM core.queues WHERE name = 'q'").fetchone() == (0,)


def test_the_lease_carries_its_queues_egress(core: Core, db) -> None:
    assert _set(core, "sealed", {"mode": "none"}).status_code == 200
    with core.client() as alice:
        for queue in ("sealed", "default"):
            assert alice.post("/v1/tasks", json=spec(queue=queue)).status_code == 201
    agent = Agent(core, queues=("sealed", "default"))
    leased = {a["task_id"]: a["egress"] for a in agent.claim()}
    queues = dict(db.execute("SELECT id, queue FROM core.tasks").fetchall())
    assert {queues[t]: e for t, e in leased.items()} == {
        "sealed": {"mode": "none", "allow": []},
        "default": None,
    }


def test_cairn_queues_sets_and_shows_egress(
    core: Core, db, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from cairn.cli import app

    with core.client("root", "admin"):
        pass  # an admin's token: it sets queues
    for name, value in {
        "CAIRN_HOME": str(tmp_path / "home"),
        "CAIRN_CONFIG": str(tmp_path / "none.toml"),
        "CAIRN_URL": core.url,
        "CAIRN_TOKEN": core.tokens["root"],
        "COLUMNS": "250",
    }.items():
        monkeypatch.setenv(name, value)
    runner = CliRunner()
    args = ["queues", "builds", "--allow", "10.0.0.0/8:443", "--allow", "[fd00::/64]:53"]
    shown = runner.invoke(app, args)
    assert shown.exit_code == 0, shown.output
    assert "allow 10.0.0.0/8 port 443, fd00::/64 port 53" in shown.output
    stored = db.execute("SELECT egress FROM core.queues WHERE name = 'builds'").fetchone()[0]
    assert stored["allow"] == [
        {"cidr": "10.0.0.0/8", "port": 443},
        {"cidr": "fd00::/64", "port": 53},
    ]
    refused = runner.invoke(app, ["queues", "builds", "--allow", "10.0.0.0/8:70000"])
    assert refused.exit_code == 2 and "port" in refused.output
    sealed = runner.invoke(app, ["queues", "builds", "--egress", "none"])
    assert sealed.exit_code == 0 and " none" in sealed.output
