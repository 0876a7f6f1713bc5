"""Retiring a secrets key (docs/security.md, "Rotating the secrets key"): values sealed
under key A (secrets and a webhook's signing secret), core restarted with [B, A],
`cairn secret rekey` (the real CLI against a real core) seals them all under B, and a core
holding only B still opens every one: into a worker's claim, and into a webhook's
signature."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
from click.testing import Result

from libs.common.settings import libpq_url
from services.core.identity.crypto import SecretBox, new_key
from tests.integration.core.test_secrets import Worker
from tests.support import Core, cairn_cli, make_token, spec, start_core, wait_for
from tests.webhooks import Receiver, subscribe

SECRETS = 230  # over two calls of --batch 100 and their batches of 100
SEALED = SECRETS + 2  # and a team's secret, and a webhook's signing secret


def _cairn(core: Core, home: Path, token: str, *args: str) -> Result:
    env = {
        "CAIRN_URL": core.url,
        "CAIRN_TOKEN": token,
        "CAIRN_HOME": str(home),
        "CAIRN_CONFIG": str(home / "no-config.toml"),
    }
    return cairn_cli(*args, env=env)


def _key_ids(db_url: str) -> dict[str, int]:
    with psycopg.connect(libpq_url(db_url)) as conn:
        rows = conn.execute(
            "SELECT kid, count(*) FROM (SELECT key_id AS kid FROM core.secrets UNION ALL "
            "SELECT secret_key_id FROM core.subscriptions) AS sealed GROUP BY kid"
        ).fetchall()
    return {kid: n for kid, n in rows}


def _store(core: Core) -> dict[str, str]:
    values = {f"s{i}": f"value-{i}-{new_key()}" for i in range(SECRETS)}
    with core.client("root", "admin") as root, core.client("alice") as alice:
        assert root.post("/v1/teams", json={"name": "sre"}).status_code == 201
        assert root.put("/v1/teams/sre/members/alice").status_code == 200
        for name, value in values.items():
            made = alice.post("/v1/secrets", json={"name": name, "value": value})
            assert made.status_code == 201, made.text
        team = alice.post("/v1/secrets", json={"name": "db", "value": "team-v", "team": "sre"})
        assert team.status_code == 201, team.text
    return values


def test_rekey_lets_the_old_key_go_and_every_secret_still_opens(
    db_url: str, tmp_path: Path
) -> None:
    key_a, key_b = new_key(), new_key()
    a, b = SecretBox([key_a]).current, SecretBox([key_b]).current
    hook = Receiver()
    core = start_core(db_url, tmp_path / "a", secrets_key=key_a)
    try:
        values = _store(core)
        with core.client("alice") as alice:
            env = {"DB": {"secret": "s7"}, "TEAM_DB": {"secret": "db", "team": "sre"}}
            assert alice.post("/v1/tasks", json=spec(env=env)).status_code == 201
            webhook = subscribe(alice, hook.url)
    finally:
        core.stop()
    assert _key_ids(db_url) == {a: SEALED}

    core = start_core(db_url, tmp_path / "ba", secrets_key=f"{key_b},{key_a}")
    admin = make_token(db_url, "root", "admin")
    try:
        status = json.loads(_cairn(core, tmp_path, admin, "--json", "secret", "keys").stdout)
        assert (status["current"], status["remaining"]) == (b, SEALED)
        alice = make_token(db_url, "alice", "user")
        refused = _cairn(core, tmp_path, alice, "secret", "rekey")
        assert refused.exit_code == 1 and "403" in refused.stderr
        done = _cairn(core, tmp_path, admin, "--json", "secret", "rekey", "--batch", "100")
        assert done.exit_code == 0, done.stderr
        assert json.loads(done.stdout) == {
            "key_id": b, "rekeyed": SEALED, "unreadable": 0, "remaining": 0, "next": None,
        }  # fmt: skip
        shown = _cairn(core, tmp_path, admin, "secret", "keys")
        assert shown.exit_code == 0 and f"0 values under a key other than {b}" in shown.stdout
        again = _cairn(core, tmp_path, admin, "--json", "secret", "rekey")
        assert again.exit_code == 0 and json.loads(again.stdout)["rekeyed"] == 0
        with core.client("root", "admin") as root:
            audit = root.get("/v1/audit", params={"action": "secret.rekey"}).json()["items"]
        assert sum(e["after"]["rekeyed"] for e in audit) == SEALED
        assert {e["actor"] for e in audit} == {"root"}
    finally:
        core.stop()
    assert _key_ids(db_url) == {b: SEALED}

    core = start_core(db_url, tmp_path / "b", secrets_key=key_b)
    try:
        worker = Worker(core)
        [leased] = worker.claim()
        assert leased["env"] == {"DB": values["s7"], "TEAM_DB": "team-v"}
        worker.close()
        with core.client("alice") as alice:
            assert alice.post(f"/v1/subscriptions/{webhook['id']}/test").status_code == 202
        [delivered] = wait_for(hook.accepted, timeout=30)
        assert delivered.signed_by(webhook["secret"])
    finally:
        core.stop()
        hook.close()


def test_a_value_being_replaced_is_skipped_not_waited_for_or_overwritten(
    core: Core, db_url: str, tmp_path: Path
) -> None:
    """Rekey runs while core serves: a row another transaction holds is left to it."""
    with core.client("alice") as alice:
        assert alice.post("/v1/secrets", json={"name": "x", "value": "v"}).status_code == 201
        assert alice.post("/v1/secrets", json={"name": "y", "value": "w"}).status_code == 201
    core.stop()
    key_b = new_key()
    key_a = (tmp_path / "secrets.key").read_text().strip()  # the development key core made
    core = start_core(db_url, tmp_path, secrets_key=f"{key_b},{key_a}")
    try:
        with (
            psycopg.connect(libpq_url(db_url)) as holder,
            core.client("root", "admin") as root,
        ):
            holder.execute("SELECT 1 FROM core.secrets WHERE name = 'x' FOR UPDATE")
            first = root.post("/v1/secrets/rekey", json={"limit": 10})
            assert first.status_code == 200, first.text
            assert (first.json()["rekeyed"], first.json()["remaining"]) == (1, 1)
            holder.rollback()
            second = root.post("/v1/secrets/rekey")
            assert (second.json()["rekeyed"], second.json()["remaining"]) == (1, 0)
            bad = root.post("/v1/secrets/rekey", json={"limit": 0})
            assert bad.status_code == 422 and "limit" in bad.text
    finally:
        core.stop()


def test_values_that_do_not_open_are_passed_once_not_visited_at_every_call(
    core: Core, db_url: str, tmp_path: Path, db
) -> None:
    """Two values under the old key no longer open (moved by hand to another row's
    place): with a batch of 1 they come first, yet each call goes on from the last one's
    ``next`` and reaches the value behind them (it started over at id 0, and stopped)."""
    with core.client("alice") as alice:
        for name in ("a", "b", "c"):
            assert alice.post("/v1/secrets", json={"name": name, "value": name}).status_code == 201
    # Bound to its owner and name: sealed values swapped between rows open in neither.
    db.execute(
        "UPDATE core.secrets s SET nonce = o.nonce, ciphertext = o.ciphertext FROM core.secrets o "
        "WHERE s.name = 'a' AND o.name = 'b' OR s.name = 'b' AND o.name = 'a'"
    )
    core.stop()
    key_a, key_b = (tmp_path / "secrets.key").read_text().strip(), new_key()
    core = start_core(db_url, tmp_path, secrets_key=f"{key_b},{key_a}")
    try:
        with core.client("root", "admin") as root:
            answers, after = [], None
            for _ in range(5):
                answer = root.post("/v1/secrets/rekey", json={"limit": 1, "after": after})
                assert answer.status_code == 200, answer.text
                answers.append(answer.json())
                after = answer.json()["next"]
                if after is None:
                    break
            bad = root.post("/v1/secrets/rekey", json={"after": "nowhere:1"})
            assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "body.after"
            assert root.post("/v1/secrets/rekey", json={"after": "1"}).status_code == 422
    finally:
        core.stop()
    assert [(a["rekeyed"], a["unreadable"]) for a in answers] == [(0, 1), (0, 1), (1, 0), (0, 0)]
    assert answers[-1]["remaining"] == 2 and answers[-1]["next"] is None
    home = tmp_path / "cli"
    home.mkdir()
    core = start_core(db_url, tmp_path, secrets_key=f"{key_b},{key_a}")
    try:
        # The CLI follows next too: it visits both (it stopped at a call that sealed none).
        done = _cairn(
            core,
            home,
            make_token(db_url, "root2", "admin"),
            "--json",
            "secret",
            "rekey",
            "--batch",
            "1",
        )
    finally:
        core.stop()
    assert done.exit_code == 1  # two values remain under another key, and it says so
    assert (json.loads(done.stdout)["rekeyed"], json.loads(done.stdout)["unreadable"]) == (0, 2)
