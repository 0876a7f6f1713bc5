"""Team sharing in the dashboard (Debian's chromium, headless): a teammate sees and
cancels a team's task; an outsider sees nothing, and the task's page is not found."""

from __future__ import annotations

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.browser.conftest import System, log_in
from tests.support import spec


def _client(system: System, name: str, role: str = "user") -> httpx.Client:
    headers = {"Authorization": f"Bearer {system.token(name, role)}"}
    return httpx.Client(base_url=system.core.url, headers=headers, timeout=10)


@pytest.fixture(scope="module")
def team_task(system: System) -> dict:
    """A task alice gives to team sre (alice, carol); it waits, far in the future."""
    with _client(system, "root", "admin") as root:
        assert root.post("/v1/teams", json={"name": "sre"}).status_code == 201
        for member in ("alice", "carol"):
            assert root.put(f"/v1/teams/sre/members/{member}").status_code == 200
    with _client(system, "alice") as alice:
        later = spec(name="shared-nightly", team="sre", run_at="2099-01-01T00:00:00Z")
        made: dict = alice.post("/v1/tasks", json=later).json()
        return made


def test_an_outsider_sees_nothing_of_the_teams_work(
    page: Page, system: System, team_task: dict
) -> None:
    log_in(page, system, "mallory")
    expect(page.locator("table")).to_contain_text("nothing here")
    assert page.locator("tr[data-task-id]").count() == 0
    page.goto(f"{system.core.url}/ui#/tasks/{team_task['id']}")
    expect(page.locator(".error")).to_contain_text("not found")


def test_a_teammate_sees_and_cancels_the_teams_task(
    page: Page, system: System, team_task: dict
) -> None:
    log_in(page, system, "carol")
    row = page.locator(f"tr[data-task-id='{team_task['id']}']")
    expect(row).to_be_visible()
    row.locator("a").click()
    page.click("#cancel")
    expect(page.locator("#task-state [data-state='cancelled']")).to_be_visible()
    with _client(system, "alice") as alice:
        assert alice.get(f"/v1/tasks/{team_task['id']}").json()["state"] == "cancelled"
