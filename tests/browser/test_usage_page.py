"""The Usage page (Debian's chromium, headless): a month's accounting by owner, team and
queue, each figure the API's; an admin sees everyone's, a user their own and their
teams'; the month picker shows an earlier month."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, date, datetime, timedelta

import httpx
import psycopg
import pytest
from playwright.sync_api import Page, expect
from sqlalchemy.ext.asyncio import create_async_engine

from libs.common.settings import libpq_url
from services.core.db import accounting
from tests.browser.conftest import System, log_in, screenshot
from tests.support import spec, wait_for

NOW = datetime.now(UTC).strftime("%Y-%m")
BEFORE = (date.today().replace(day=1) - timedelta(days=1)).strftime("%Y-%m")


def _client(system: System, name: str, role: str = "user") -> httpx.Client:
    headers = {"Authorization": f"Bearer {system.token(name, role)}"}
    return httpx.Client(base_url=system.core.url, headers=headers, timeout=10)


def _roll_up(db_url: str) -> None:
    async def once() -> None:
        engine = create_async_engine(db_url)
        try:
            async with engine.begin() as conn:
                await accounting.roll_up(conn, 10_000)
        finally:
            await engine.dispose()

    # Playwright's event loop owns this thread: asyncio.run in another.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, once()).result()


@pytest.fixture(scope="module")
def used(system: System) -> dict[str, dict]:
    """alice runs a task of her own and one for team ml; bob one; the system's worker
    runs them and the roll-up counts them. Last month, from before the tasks' retention,
    bob's sums alone."""
    with _client(system, "root", "admin") as root:
        assert root.post("/v1/teams", json={"name": "ml"}).status_code == 201
        assert root.put("/v1/teams/ml/members/alice").status_code == 200
    with _client(system, "alice") as alice, _client(system, "bob") as bob:
        bodies = ((alice, spec()), (alice, spec(team="ml")), (bob, spec()))
        ids = [client.post("/v1/tasks", json=body).json()["id"] for client, body in bodies]
    with psycopg.connect(libpq_url(system.core.db_url), autocommit=True) as db:
        done = "SELECT count(*) = 3 FROM core.tasks WHERE id = ANY(%s) AND state = 'succeeded'"
        wait_for(lambda: db.execute(done, (ids,)).fetchone()[0], timeout=20)
    _roll_up(system.core.db_url)
    with psycopg.connect(libpq_url(system.core.db_url), autocommit=True) as db:
        db.execute(
            "INSERT INTO core.usage_monthly (month, owner, team, queue, attempts, wall_s,"
            " cpu_s, cpu_reserved_s, memory_mb_s, peak_memory_mb)"
            " VALUES (%s, 'bob', '', 'default', 7, 700, 650.5, 1400, 2048000, 300)",
            (date.fromisoformat(BEFORE + "-01"),),
        )
        db.execute(
            "INSERT INTO core.usage_monthly_devices (month, owner, team, queue, device,"
            " device_s) VALUES (%s, 'bob', '', 'default', 'gpu', 7200)",
            (date.fromisoformat(BEFORE + "-01"),),
        )
    with _client(system, "root", "admin") as root:
        return {
            by: {
                a["key"]: a
                for a in root.get("/v1/usage/accounts", params={"by": by, "month": NOW}).json()[
                    "items"
                ]
            }
            for by in ("owner", "team", "queue")
        }


def _row(page: Page, by: str, key: str):
    return page.locator(f"#usage-{by} tr[data-key='{key}']")


def _shown(page: Page, by: str) -> list[str]:
    return page.locator(f"#usage-{by} tr[data-key]").evaluate_all(
        "rows => rows.map(r => r.dataset.key)"
    )


def test_an_admin_sees_everyones_month_and_picks_an_earlier_one(
    page: Page, system: System, used: dict[str, dict]
) -> None:
    log_in(page, system, "root", "admin")
    page.click("nav a[href='#/usage']")
    expect(_row(page, "owner", "alice")).to_be_visible()
    assert sorted(_shown(page, "owner")) == ["alice", "bob"]
    assert _shown(page, "team") == ["ml"]
    assert _shown(page, "queue") == ["default"]
    for by, key in (("owner", "alice"), ("owner", "bob"), ("team", "ml"), ("queue", "default")):
        row = _row(page, by, key)
        figures = used[by][key]
        expect(row.locator("td").nth(1)).to_have_text(str(figures["attempts"]))
        cell = row.locator("[data-cpu-reserved-s]")
        assert float(cell.get_attribute("data-cpu-reserved-s")) == figures["cpu_reserved_s"]
        gb = float(row.locator("[data-memory-gb-s]").get_attribute("data-memory-gb-s"))
        assert gb == pytest.approx(figures["memory_mb_s"] / 1024)
        expect(row.locator("[data-device-s]")).to_have_text("—")
    assert used["owner"]["alice"]["attempts"] == 2 and used["team"]["ml"]["attempts"] == 1
    screenshot(page, "usage")

    page.fill("#usage-month", BEFORE)
    expect(page).to_have_url(f"{system.core.url}/ui#/usage?month={BEFORE}")
    expect(_row(page, "owner", "bob").locator("[data-cpu-s]")).to_have_text("650.5")
    expect(_row(page, "owner", "bob").locator("[data-memory-gb-s]")).to_have_text("2000.0")
    # the devices the attempts held, by name (this month's ran none)
    expect(_row(page, "owner", "bob").locator("[data-device-s]")).to_have_text("gpu 7200.0")
    assert _shown(page, "owner") == ["bob"]
    expect(page.locator("#usage-team")).to_contain_text("nothing here")


def test_a_user_sees_only_their_own_and_their_teams_use(
    page: Page, system: System, used: dict[str, dict]
) -> None:
    log_in(page, system, "bob")
    page.goto(f"{system.core.url}/ui#/usage")
    expect(_row(page, "owner", "bob")).to_be_visible()
    assert _shown(page, "owner") == ["bob"]
    expect(page.locator("#usage-team")).to_contain_text("nothing here")
    queue = _row(page, "queue", "default")
    expect(queue.locator("td").nth(1)).to_have_text("1")  # bob's one attempt, not all three
    log_in(page, system, "alice")
    page.goto(f"{system.core.url}/ui#/usage")
    expect(_row(page, "team", "ml")).to_be_visible()
    assert _shown(page, "owner") == ["alice"]
    expect(_row(page, "owner", "alice").locator("td").nth(1)).to_have_text("2")
