"""Signing in to the dashboard in a real browser (Debian's chromium, headless) at a real
OpenID provider (panva's oidc-provider, tests/fixtures/idp.py): "Sign in", the
provider's own login and consent pages, back on the dashboard with a session cookie that
the page's script cannot read; a task cancelled with it (the CSRF token sent by the
script), and signing out."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect, sync_playwright

from tests.browser.conftest import CHROMIUM, screenshot
from tests.fixtures.idp import available, start_idp
from tests.support import Core, free_port, spec, start_core

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))


@pytest.fixture
def signin_core(db_url: str, tmp_path: Path) -> Iterator[Core]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with start_idp(tmp_path / "idp.log", [f"{url}/v1/login/callback"]) as idp:
        core = start_core(db_url, tmp_path, port=port, **idp.core_settings(url))
        try:
            yield core
        finally:
            core.stop()


@pytest.fixture
def task(signin_core: Core) -> dict[str, Any]:
    """alice's task, made through the API before the browser starts; it waits (run_at)."""
    with signin_core.client("alice") as alice:
        made: dict[str, Any] = alice.post(
            "/v1/tasks", json=spec(run_at="2099-01-01T00:00:00Z")
        ).json()
    return made


@pytest.fixture
def page(signin_core: Core, task: dict[str, Any]) -> Iterator[Page]:
    """Started after core: its set-up runs asyncio.run, which Playwright's event loop in
    this thread would refuse."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium chromium-driver")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"]
        )
        opened = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
        opened.set_default_timeout(15_000)
        yield opened
        browser.close()


def test_a_person_signs_in_at_the_provider_acts_and_signs_out(
    signin_core: Core, task: dict[str, Any], db: Any, page: Page
) -> None:
    core = signin_core
    page.goto(core.url + "/ui")
    screenshot(page, "sign-in")
    page.click("#signin")
    # The provider's own pages: its login form, then its consent.
    page.fill("input[name=login]", "alice")
    page.fill("input[name=password]", "any")
    page.click("button[type=submit]")
    page.click("button[type=submit]")
    expect(page.locator("#whoami")).to_have_text("alice (user)")
    cookies = {c["name"]: c for c in page.context.cookies()}
    assert cookies["cairn_session"]["httpOnly"] and cookies["cairn_session"]["sameSite"] == "Lax"
    assert "cairn_session" not in page.evaluate("document.cookie")
    assert page.evaluate("sessionStorage.length") == 0  # no token in the page

    page.goto(f"{core.url}/ui#/tasks/{task['id']}")
    page.click("#cancel")
    expect(page.locator("#task-state [data-state='cancelled']")).to_be_visible()
    assert db.execute("SELECT state FROM core.tasks WHERE id = %s", (task["id"],)).fetchone() == (
        "cancelled",
    )

    page.click("#logout")
    expect(page.locator("#signin")).to_be_visible()
    assert db.execute("SELECT count(*) FROM core.sessions").fetchone()[0] == 0
