"""Signing in to the dashboard in a real browser (Debian's chromium, headless) at a real
OpenID provider (panva's oidc-provider, tests/fixtures/idp.py): "Sign in", the
provider's own login and consent pages, back on the dashboard with a session cookie that
the page's script cannot read; a task cancelled with it (the CSRF token sent by the
script); the schedule and run pages, which read cron and dag, filled with no token
pasted (a token core mints for the session, kept in the page's memory only); and
signing out."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect, sync_playwright

from services.cron.app import create_app as create_cron
from services.dag.app import create_app as create_dag
from tests.browser.conftest import CHROMIUM, screenshot
from tests.fixtures.cron import Cron, cron_settings
from tests.fixtures.dag import DagServer, dag_settings
from tests.fixtures.idp import available, start_idp
from tests.support import Core, free_port, make_token, serve_in_thread, spec, start_core

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))


@pytest.fixture
def system(db_url: str, tmp_path: Path) -> Iterator[tuple[Core, Cron, DagServer]]:
    """Core signing in at the provider, with the cron and dag its pages read."""
    port, cron_port, dag_port = free_port(), free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    cron_url, dag_url = f"http://127.0.0.1:{cron_port}", f"http://127.0.0.1:{dag_port}"
    with start_idp(tmp_path / "idp.log", [f"{url}/v1/login/callback"]) as idp:
        core = start_core(
            db_url,
            tmp_path,
            port=port,
            cron_url=cron_url,
            dag_url=dag_url,
            **idp.core_settings(url),
        )
        cron_app = create_cron(cron_settings(core, tmp_path / "cron", cron_port=cron_port), db_url)
        cron = Cron(cron_url, core, *serve_in_thread(cron_app, cron_port, "cron"), cron_app)
        token = make_token(db_url, "dag-service", "service")
        dag_app = create_dag(dag_settings(url, db_url, tmp_path / "dag", dag_port, token), db_url)
        dag = DagServer(dag_url, core, *serve_in_thread(dag_app, dag_port, "dag"))
        try:
            yield core, cron, dag
        finally:
            dag.stop()
            cron.stop()
            core.stop()


@pytest.fixture
def signin_core(system: tuple[Core, Cron, DagServer]) -> Core:
    return system[0]


@pytest.fixture
def task(signin_core: Core) -> dict[str, Any]:
    """alice's task, made through the API before the browser starts; it waits (run_at)."""
    with signin_core.client("alice") as alice:
        made: dict[str, Any] = alice.post(
            "/v1/tasks", json=spec(run_at="2099-01-01T00:00:00Z")
        ).json()
    return made


@pytest.fixture
def schedule_and_run(system: tuple[Core, Cron, DagServer]) -> tuple[int, int]:
    """alice's schedule (in cron) and a run of her workflow (in dag), made with her token;
    no worker runs its node."""
    _, cron, dag = system
    with cron.client("alice") as alice:
        body = {
            "name": "nightly",
            "expression": "30 2 * * *",
            "target": {"kind": "task", "task": spec()},
        }
        made = alice.post("/v1/schedules", json=body)
        assert made.status_code == 201, made.text
    with dag.client("alice") as alice:
        flow = {"name": "etl", "nodes": [{"name": "x", "task": spec()}]}
        assert alice.post("/v1/workflows", json=flow).status_code == 201
        run = alice.post("/v1/workflows/etl/runs", json={})
        assert run.status_code == 201, run.text
    return made.json()["id"], run.json()["id"]


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
    signin_core: Core,
    task: dict[str, Any],
    schedule_and_run: tuple[int, int],
    db: Any,
    page: Page,
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

    # cron's and dag's pages, with no token pasted: the page asks core for one bound to
    # the session and keeps it in memory only.
    schedule_id, run_id = schedule_and_run
    page.goto(f"{core.url}/ui#/schedules")
    expect(page.locator(f"tr[data-schedule-id='{schedule_id}']")).to_contain_text("nightly")
    page.goto(f"{core.url}/ui#/runs/{run_id}")
    expect(page.locator("#run-state a")).to_have_text("etl")
    assert page.evaluate("sessionStorage.length + localStorage.length") == 0
    assert db.execute("SELECT count(*) FROM core.session_tokens").fetchone()[0] == 1

    page.click("#logout")
    expect(page.locator("#signin")).to_be_visible()
    assert db.execute("SELECT count(*) FROM core.sessions").fetchone()[0] == 0
    assert db.execute("SELECT count(*) FROM core.session_tokens").fetchone()[0] == 0
