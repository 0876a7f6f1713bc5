"""Signing in against a real OpenID provider (panva's oidc-provider, tests/fixtures/idp.py):
the dashboard's authorization code flow with PKCE into a session cookie, its CSRF rule,
signing out; and the clear 4xx answers of a bad or refused sign-in. ``cairn login``'s
device flow is in tests/integration/cli/test_login.py."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from click.testing import Result
from typer.testing import CliRunner

from cairn.cli import app
from libs.common import signin as signin_lib
from libs.common.client import ON_BEHALF_OF
from tests.fixtures.cron import Cron, start_cron
from tests.fixtures.dag import DagServer, start_dag
from tests.fixtures.idp import Idp, approve_device, available, form, start_idp
from tests.support import Core, free_port, spec, start_core, wait_for

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))


@pytest.fixture
def signin(db_url: str, tmp_path: Path) -> Iterator[tuple[Idp, Core]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with start_idp(tmp_path / "idp.log", [f"{url}/v1/login/callback"]) as idp:
        core = start_core(db_url, tmp_path, port=port, **idp.core_settings(url))
        try:
            yield idp, core
        finally:
            core.stop()


def _to_provider(browser: httpx.Client, core: Core, next_: str = "/ui/") -> httpx.Response:
    """Click "Sign in": core's redirect to the provider, and the provider's login page."""
    started = browser.get(f"{core.url}/v1/login/start", params={"next": next_})
    assert started.status_code == 303, started.text
    query = parse_qs(urlsplit(started.headers["location"]).query)
    assert query["code_challenge_method"] == ["S256"] and query["code_challenge"][0]
    assert query["nonce"][0] and query["state"][0] and "code_verifier" not in query
    return browser.get(started.headers["location"], follow_redirects=True)


def _sign_in(browser: httpx.Client, core: Core, account: str) -> httpx.Response:
    """The whole sign-in as a browser makes it; the answer of core's callback."""
    page = _to_provider(browser, core)
    for _ in range(3):  # login, then consent
        action, fields = form(page.text)
        if fields.get("prompt") == "login":
            fields |= {"login": account, "password": "any"}
        page = browser.post(action, data=fields, follow_redirects=False)
        while page.status_code in (302, 303):
            where = page.url.join(page.headers["location"])
            if str(where).startswith(f"{core.url}/v1/login/callback"):
                return browser.get(where)
            page = browser.get(where, follow_redirects=False)
    raise AssertionError(page.text[-500:])


def _set_cookies(answer: httpx.Response) -> dict[str, str]:
    return {h.split("=", 1)[0]: h for h in answer.headers.get_list("set-cookie")}


def test_the_dashboard_signs_in_into_a_session_that_needs_its_csrf_token(
    signin: tuple[Idp, Core], db: Any, tmp_path: Path
) -> None:
    _, core = signin
    with core.client("root", "admin") as root:
        assert root.post("/v1/teams", json={"name": "sre"}).status_code == 201
    with httpx.Client(timeout=10) as browser:
        back = _sign_in(browser, core, "alice")
        assert back.status_code == 303 and back.headers["location"] == "/ui/"
        cookies = _set_cookies(back)
        session = cookies["cairn_session"].lower()
        assert "httponly" in session and "samesite=lax" in session and "max-age=28800" in session
        assert "secure" not in session  # core's URL is http here; https makes it Secure
        assert "httponly" not in cookies["cairn_csrf"].lower()
        csrf = browser.cookies["cairn_csrf"]
        # The session row holds digests only, never the cookie or the CSRF token.
        [(held, csrf_held, who, teams)] = db.execute(
            "SELECT id_hash, csrf_hash, principal, teams FROM core.sessions"
        ).fetchall()
        assert who == "alice" and teams == ["sre"]
        assert browser.cookies["cairn_session"] not in (held, csrf_held) and csrf != csrf_held

        me = browser.get(f"{core.url}/v1/whoami").json()
        assert me["name"] == "alice" and me["via"] == "session" and me["teams"] == ["sre"]
        assert me["team_sources"][0]["sources"] == ["claim"]
        # A change made with the cookie alone (what another site could make the browser
        # send) is refused; with the CSRF token it is done.
        task = spec()
        bare = browser.post(f"{core.url}/v1/tasks", json=task)
        assert bare.status_code == 403 and "X-CSRF-Token" in bare.json()["detail"]
        assert bare.headers["content-type"] == "application/problem+json"
        wrong = browser.post(f"{core.url}/v1/tasks", json=task, headers={"X-CSRF-Token": "x"})
        assert wrong.status_code == 403
        made = browser.post(f"{core.url}/v1/tasks", json=task, headers={"X-CSRF-Token": csrf})
        assert made.status_code == 201 and made.json()["owner"] == "alice"
        # A bearer token needs no CSRF token, cookie or not.
        with core.client("bob") as bob:
            assert bob.post("/v1/tasks", json=task).status_code == 201

        cookie = browser.cookies["cairn_session"]
        with _cron_and_dag(core, tmp_path) as (cron, dag):
            bearer = _session_token(browser, core, csrf, db)
            _works_for_alice(bearer, core, cron, dag)
            # Past its expiry (backdated, as the clock would) it is refused everywhere.
            db.execute("UPDATE core.session_tokens SET expires_at = now() - interval '1 s'")
            _refused(core, cron, dag, bearer)
            bearer = _session_token(browser, core, csrf, db)  # the dashboard renews it

            assert browser.post(f"{core.url}/v1/login/logout").status_code == 403
            out = browser.post(f"{core.url}/v1/login/logout", headers={"X-CSRF-Token": csrf})
            assert out.status_code == 204
            assert db.execute("SELECT count(*) FROM core.sessions").fetchone()[0] == 0
            assert db.execute("SELECT count(*) FROM core.session_tokens").fetchone()[0] == 0
            # The session's token ended with it: core, cron and dag refuse it at once.
            _refused(core, cron, dag, bearer)
        assert "cairn_session" not in browser.cookies
        none = browser.post(f"{core.url}/v1/login/token", headers={"X-CSRF-Token": csrf})
        assert none.status_code == 401 and "sign in" in none.json()["detail"]
        browser.cookies.set("cairn_session", cookie)  # kept by someone: it is over anyway
        ended = browser.get(f"{core.url}/v1/whoami")
        assert ended.status_code == 401 and "sign in again" in ended.json()["detail"]
        late = browser.post(f"{core.url}/v1/login/token", headers={"X-CSRF-Token": csrf})
        assert (
            late.status_code == 401 and late.headers["content-type"] == "application/problem+json"
        )
    # The sign-in and the sign-out are in the audit trail, from the browser's address;
    # the refused sign-out (no CSRF token) is not.
    trail = db.execute(
        "SELECT actor, actor_role, action, target, source, after FROM core.audit"
        " WHERE action LIKE 'login.%' ORDER BY id"
    ).fetchall()
    assert [(r[0], r[1], r[2], r[3], r[4]) for r in trail] == [
        ("alice", "user", "login.session", "principal:alice", "127.0.0.1"),
        ("alice", "user", "login.sign_out", "principal:alice", "127.0.0.1"),
    ]
    assert trail[0][5]["claimed_teams"] == ["sre"] and trail[0][5]["lifetime_s"] == 28800


@contextmanager
def _cron_and_dag(core: Core, home: Path) -> Iterator[tuple[Cron, DagServer]]:
    cron = start_cron(core, home / "cron", token_cache_s=0)  # the token's end seen at once
    try:
        dag = start_dag(core, home / "dag", token_cache_s=0)
        try:
            yield cron, dag
        finally:
            dag.stop()
    finally:
        cron.stop()


def _refused(core: Core, cron: Cron, dag: DagServer, token: str) -> None:
    """Core, cron and dag all answer ``token`` with a 401 (cron and dag ask core)."""
    for url in (f"{core.url}/v1/whoami", f"{cron.url}/v1/schedules", f"{dag.url}/v1/runs"):
        answer = httpx.get(url, headers={"Authorization": f"Bearer {token}"})
        assert answer.status_code == 401, (url, answer.text)
        assert answer.headers["content-type"] == "application/problem+json"


def _session_token(browser: httpx.Client, core: Core, csrf: str, db: Any) -> str:
    """The dashboard's bearer token for cron and dag, minted for its session: the CSRF
    token required, the same token asked twice, its digest alone kept."""
    url = f"{core.url}/v1/login/token"
    bare = browser.post(url)
    assert bare.status_code == 403 and bare.headers["content-type"] == "application/problem+json"
    minted = browser.post(url, headers={"X-CSRF-Token": csrf})
    assert minted.status_code == 200, minted.text
    assert minted.headers["cache-control"] == "no-store"
    token, until = minted.json()["token"], datetime.fromisoformat(minted.json()["expires_at"])
    assert token.startswith("cairns_")
    now = datetime.now(UTC)
    assert now + timedelta(seconds=140) < until <= now + timedelta(seconds=301)
    assert browser.post(url, headers={"X-CSRF-Token": csrf}).json()["token"] == token
    held = db.execute("SELECT token_hash FROM core.session_tokens").fetchall()
    assert len(held) == 1 and token not in held[0][0]
    # No cookie at all: nothing to mint for.
    assert httpx.post(url, headers={"X-CSRF-Token": csrf}).status_code == 401
    return str(token)


def _works_for_alice(token: str, core: Core, cron: Cron, dag: DagServer) -> None:
    """cron and dag take the session's token as alice's own, with the team that only her
    ID token's claim gave her (recorded with the session)."""
    bearer = {"Authorization": f"Bearer {token}"}
    me = httpx.get(f"{core.url}/v1/whoami", headers=bearer).json()
    assert me["name"] == "alice" and me["teams"] == ["sre"]
    with httpx.Client(base_url=cron.url, headers=bearer, timeout=10) as alice:
        body = {
            "name": "sre-nightly",
            "expression": "30 2 * * *",
            "team": "sre",
            "target": {"kind": "task", "task": spec()},
        }
        made = alice.post("/v1/schedules", json=body)
        assert made.status_code == 201 and made.json()["owner"] == "alice", made.text
        assert [s["name"] for s in alice.get("/v1/schedules").json()["items"]] == ["sre-nightly"]
    with httpx.Client(base_url=dag.url, headers=bearer, timeout=10) as alice:
        flow = {"name": "etl", "team": "sre", "nodes": [{"name": "x", "task": spec()}]}
        assert alice.post("/v1/workflows", json=flow).status_code == 201


def test_a_bad_or_refused_sign_in_is_a_clear_4xx(signin: tuple[Idp, Core], db: Any) -> None:
    _, core = signin
    with httpx.Client(timeout=10) as browser:
        callback = f"{core.url}/v1/login/callback"
        # No sign-in began in this browser, or another one's state: 422 naming the state.
        for answer in (
            browser.get(callback, params={"state": "forged", "code": "x"}),
            browser.get(callback, params={"code": "x"}),
        ):
            assert answer.status_code == 422, answer.text
            assert answer.headers["content-type"] == "application/problem+json"
        page = _to_provider(browser, core)
        assert page.status_code == 200
        state = browser.cookies["cairn_login_state"]
        other = browser.get(callback, params={"state": state + "x", "code": "x"})
        assert other.status_code == 422 and "query.state" in other.json()["detail"]
        # The person refused at the provider: 401 with its words.
        denied = browser.get(callback, params={"state": state, "error": "access_denied"})
        assert denied.status_code == 401 and "access_denied" in denied.json()["detail"]
        # A code the provider never issued: its refusal (invalid_grant), a 401; the flow
        # is spent, so the same state again is a 422.
        bogus = browser.get(callback, params={"state": state, "code": "made-up"})
        assert bogus.status_code == 401 and "invalid_grant" in bogus.json()["detail"]
        again = browser.get(callback, params={"state": state, "code": "made-up"})
        assert again.status_code == 422
        assert db.execute("SELECT count(*) FROM core.sessions").fetchone()[0] == 0
        # An expired or forged bearer token: 401, never a 500.
        for token in ("eyJhbGciOiJSUzI1NiJ9.e30.c2ln", "cairn_unknown"):
            refused = browser.get(
                f"{core.url}/v1/whoami", headers={"Authorization": f"Bearer {token}"}
            )
            assert refused.status_code == 401
        # Somewhere else than the dashboard to return to is refused before anything starts.
        away = browser.get(f"{core.url}/v1/login/start", params={"next": "https://evil.test/"})
        assert away.status_code == 422 and "next" in away.text


def _cairn(env: dict[str, str], *args: str) -> Result:
    """The real CLI, in this process, with ``env``'s CAIRN_* variables only."""
    unset: dict[str, str | None] = {k: None for k in os.environ if k.startswith("CAIRN_")}
    return CliRunner().invoke(app, list(args), env={**unset, **env})


def _login(env: dict[str, str], account: str) -> str:
    """``cairn login`` as a person runs it: the CLI shows a URL and a code, the person
    approves at the provider (its pages driven over HTTP), the CLI's poll gets the tokens."""
    cli = subprocess.Popen(
        [sys.executable, "-m", "cairn", "login", "--poll-interval", "0.1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert cli.stdout is not None and cli.stderr is not None
        first = cli.stdout.readline()
        shown = re.search(r"Open (\S+) and enter the code (\S+)", first)
        assert shown is not None, first + cli.stderr.read()
        approve_device(shown[1], shown[2], account)
        out, err = cli.communicate(timeout=30)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode == 0, err
    return out


def test_cairn_login_keeps_refreshes_and_forgets_the_providers_tokens(
    signin: tuple[Idp, Core], tmp_path: Path, db: Any
) -> None:
    """The device flow end to end with the real CLI against real core; then alice's
    team, which only the provider's groups claim gives her, runs her team's workflow
    node and fires her team's schedule (dag and cron submit for her, with no token of
    hers), until the claim lapses."""
    idp, core = signin
    with core.client("root", "admin") as root:
        assert root.post("/v1/teams", json={"name": "sre"}).status_code == 201
    conf = tmp_path / "cli" / "config.toml"
    conf.parent.mkdir()
    conf.write_text(f'url = "{core.url}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAIRN_")}
    env |= {"CAIRN_CONFIG": str(conf), "CAIRN_HOME": str(tmp_path / "cli"), "COLUMNS": "200"}

    assert "signed in as alice (user)" in _login(env, "alice")
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    kept = tomllib.loads(conf.read_text())
    assert kept["url"] == core.url and kept["login"]["issuer"] == idp.issuer
    who = json.loads(_cairn(env, "whoami", "--json").stdout)
    assert who["name"] == "alice" and who["teams"] == ["sre"]
    [sre] = who["team_sources"]
    assert sre["sources"] == ["claim"] and sre["standing_until"] is not None
    shown = _cairn(env, "whoami").stdout
    assert "sre" in shown and "claim" in shown

    # A minute before the ID token expires, the CLI refreshes it (and keeps the new one).
    soon = datetime.now(UTC) + timedelta(seconds=30)
    conf.write_text(conf.read_text().replace(kept["login"]["expires_at"], soon.isoformat()))
    assert json.loads(_cairn(env, "whoami", "--json").stdout)["name"] == "alice"
    fresh = tomllib.loads(conf.read_text())["login"]
    # (the ID token itself may be the same bytes when it is made within the same second)
    assert fresh["refresh_token"] != kept["login"]["refresh_token"]  # rotated by the provider
    assert datetime.fromisoformat(fresh["expires_at"]) > soon + timedelta(minutes=30)
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600

    # alice's team owns a schedule; its fire acts for her with no token of hers: the claim
    # seen in her last token stands for it (CAIRN_OIDC_CLAIM_SEEN_S), and for no longer.
    cron, dag = start_cron(core, tmp_path / "cron"), start_dag(core, tmp_path / "dag")
    try:
        bearer = {"Authorization": f"Bearer {fresh['id_token']}"}
        with httpx.Client(base_url=dag.url, headers=bearer, timeout=10) as alice:
            flow = {"name": "etl", "team": "sre", "nodes": [{"name": "x", "task": spec()}]}
            assert alice.post("/v1/workflows", json=flow).status_code == 201
            run = alice.post("/v1/workflows/etl/runs", json={})
            assert run.status_code == 201, run.text
            node_task = "SELECT owner, team FROM core.tasks WHERE labels->>'cairn.dag/run' = %s"
            found = wait_for(lambda: db.execute(node_task, (str(run.json()["id"]),)).fetchone())
            assert found == ("alice", "sre")
        with httpx.Client(base_url=cron.url, headers=bearer, timeout=10) as alice:
            body = {
                "name": "sre-nightly",
                "expression": "30 2 * * *",
                "team": "sre",
                "target": {"kind": "task", "task": spec()},
            }
            made = alice.post("/v1/schedules", json=body)
            assert made.status_code == 201, made.text
            fired = alice.post(f"/v1/schedules/{made.json()['id']}/trigger").json()
            assert fired["outcome"] == "submitted", fired
            assert db.execute(
                "SELECT owner, team FROM core.tasks WHERE id = %s", (fired["task_id"],)
            ).fetchone() == ("alice", "sre")
        # Later, alice's token has expired (backdated, as the clock would): a fire for her
        # (what cron and dag send, with no token of hers) stands on her last seen claim,
        # and the lease of what it submits is kept as long; past CAIRN_OIDC_CLAIM_SEEN_S
        # the claim has lapsed and the fire is refused.
        db.execute("UPDATE core.team_claims SET until = now() - interval '1 s'")
        for_alice = {ON_BEHALF_OF: "alice"}
        with core.client("scheduler", "service") as service:
            fire = service.post("/v1/tasks", json=spec(team="sre"), headers=for_alice)
            assert fire.status_code == 201, fire.text
            assert db.execute(
                "SELECT until = standing_until AND until > now() + interval '6 days'"
                " FROM core.team_claims WHERE member = 'alice'"
            ).fetchone() == (True,)
            db.execute(
                "UPDATE core.team_claims SET until = now() - interval '1 s',"
                " standing_until = now() - interval '1 s'"
            )
            late = service.post("/v1/tasks", json=spec(team="sre"), headers=for_alice)
        assert late.status_code == 403
        assert "'alice' is not a member of team 'sre'" in late.json()["detail"]
    finally:
        cron.stop()
        dag.stop()

    # The refresh token revoked and the ID token run out: the CLI says so, core says 401.
    with httpx.Client(timeout=10) as http:
        signin_lib.revoke(http, f"{idp.issuer}/token/revocation", "cairn", fresh["refresh_token"])
    past = datetime.now(UTC) - timedelta(seconds=5)
    conf.write_text(conf.read_text().replace(fresh["expires_at"], past.isoformat()))
    ended = _cairn(env, "whoami")
    assert ended.exit_code == 1 and "run `cairn login`" in ended.stderr and "401" in ended.stderr

    out = _cairn(env, "logout")
    assert out.exit_code == 0 and "signed out" in out.stdout
    assert "login" not in tomllib.loads(conf.read_text()) and "url" in conf.read_text()
    assert _cairn(env, "logout").stdout.strip() == "not signed in"
