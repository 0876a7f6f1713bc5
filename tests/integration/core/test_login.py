"""Signing in against a real OpenID provider (panva's oidc-provider, tests/fixtures/idp.py):
the dashboard's authorization code flow with PKCE into a session cookie, its CSRF rule,
signing out; and the clear 4xx answers of a bad or refused sign-in. ``cairn login``'s
device flow is in tests/integration/cli/test_login.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from tests.fixtures.idp import Idp, available, form, start_idp
from tests.support import Core, free_port, spec, start_core

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
    signin: tuple[Idp, Core], db: Any
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
        assert browser.post(f"{core.url}/v1/login/logout").status_code == 403
        out = browser.post(f"{core.url}/v1/login/logout", headers={"X-CSRF-Token": csrf})
        assert out.status_code == 204
        assert db.execute("SELECT count(*) FROM core.sessions").fetchone()[0] == 0
        assert "cairn_session" not in browser.cookies
        browser.cookies.set("cairn_session", cookie)  # kept by someone: it is over anyway
        ended = browser.get(f"{core.url}/v1/whoami")
        assert ended.status_code == 401 and "sign in again" in ended.json()["detail"]


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
