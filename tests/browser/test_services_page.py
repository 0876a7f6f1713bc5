"""The Services page (Debian's chromium, headless): each of the caller's services with its
revision, its rollout, its ready replicas against the count and where the ready ones
listen, as core's API has them; another user sees none of them."""

from __future__ import annotations

import httpx
import psycopg
from playwright.sync_api import Page, expect

from libs.common.settings import libpq_url
from tests.browser.conftest import System, log_in, screenshot
from tests.support import spec, wait_for


def test_a_services_revision_readiness_and_endpoints_are_shown(page: Page, system: System) -> None:
    # The system's worker holds the replicas (args "hold") and reports one of the two
    # ready, with its address and port, as an agent does.
    template = spec(
        name="web", kind="service", args=["hold"], service={"ports": [{"name": "http"}]}
    )
    body = {"name": "web", "replicas": 2, "template": template}
    headers = {"Authorization": f"Bearer {system.token('alice')}"}
    with httpx.Client(base_url=system.core.url, headers=headers, timeout=10) as alice:
        assert alice.post("/v1/services", json=body).status_code == 201
    with psycopg.connect(libpq_url(system.core.db_url), autocommit=True) as db:
        running = (
            "SELECT array_agg(t.current_attempt_id ORDER BY t.id) FROM core.tasks t"
            " WHERE t.name = 'web' AND t.state = 'running'"
        )
        attempts = wait_for(
            lambda: (found := db.execute(running).fetchone()[0]) and len(found) == 2 and found,
            timeout=20,
        )
    ready = {
        "attempt_id": attempts[0],
        "ready": True,
        "address": "10.0.3.17",
        "ports": {"http": 40811},
    }
    unready = {
        "attempt_id": attempts[1],
        "ready": False,
        "address": "10.0.3.18",
        "ports": {"http": 40812},
    }
    answer = system.worker.http.post(
        f"/v1/workers/{system.worker.id}/replicas", json={"items": [ready, unready]}
    )
    assert answer.status_code == 200, answer.text

    log_in(page, system, "alice")
    page.click("nav a[href='#/services']")
    row = page.locator("#services tr[data-service='web']")
    expect(row.locator("[data-ready]")).to_have_text("1 / 2")
    expect(row.locator("td").nth(1)).to_have_text("1")
    expect(row.locator("[data-rollout]")).to_have_text("progressing")
    expect(row.locator("td.endpoints")).to_have_text("http 10.0.3.17:40811")
    screenshot(page, "services")

    log_in(page, system, "bob")
    page.goto(f"{system.core.url}/ui#/services")
    expect(page.locator("#services")).to_contain_text("nothing here")
