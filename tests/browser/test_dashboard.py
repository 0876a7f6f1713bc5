"""The dashboard in a real browser (Debian's chromium, headless) against a running
system: log in with a token, watch a task succeed, cancel one, see a run's graph drawn,
and the queues, workers and schedules pages filled from the three services' APIs."""

from __future__ import annotations

import re
import time

import httpx
import psycopg
from playwright.sync_api import Page, Route, expect

from libs.common.settings import libpq_url
from tests.browser.conftest import System, log_in, screenshot
from tests.fixtures.dag import node, workflow
from tests.support import spec, wait_for


def client(system: System, base: str, name: str, role: str = "user") -> httpx.Client:
    headers = {"Authorization": f"Bearer {system.token(name, role)}"}
    return httpx.Client(base_url=base, headers=headers, timeout=10)


def test_a_wrong_token_is_refused_and_a_good_one_logs_in(page: Page, system: System) -> None:
    page.goto(system.core.url + "/ui")
    page.fill("#token", "cairn_not-a-token")
    page.click("#login")
    expect(page.locator(".login .error")).to_contain_text("Unknown or revoked token")
    screenshot(page, "login")
    log_in(page, system, "alice")
    expect(page.locator("#whoami")).to_have_text("alice (user)")


def test_a_submitted_task_is_seen_reaching_succeeded(page: Page, system: System) -> None:
    log_in(page, system, "alice")
    with client(system, system.core.url, "alice") as alice:
        task = alice.post("/v1/tasks", json=spec(name="nightly-report")).json()
    row = page.locator(f"tr[data-task-id='{task['id']}']")
    expect(row).to_be_visible()
    expect(row.locator("[data-state='succeeded']")).to_be_visible()
    screenshot(page, "tasks")
    row.locator("a").click()
    expect(page.locator("#task-state [data-state='succeeded']")).to_be_visible()
    expect(page.locator("tr[data-attempt-id]")).to_have_count(1)
    expect(page.locator("#cancel")).to_be_disabled()
    screenshot(page, "task")


def test_a_task_is_cancelled_from_its_page(page: Page, system: System) -> None:
    with client(system, system.core.url, "alice") as alice:
        task = alice.post("/v1/tasks", json=spec(name="stuck", args=["hold"])).json()
        wait_for(lambda: alice.get(f"/v1/tasks/{task['id']}").json()["state"] == "running")
        log_in(page, system, "alice")
        page.goto(f"{system.core.url}/ui#/tasks/{task['id']}")
        expect(page.locator("#task-state [data-state='running']")).to_be_visible()
        page.click("#cancel")
        expect(page.locator("#task-state [data-state='cancelled']")).to_be_visible()
        assert alice.get(f"/v1/tasks/{task['id']}").json()["state"] == "cancelled"


def test_another_user_sees_none_of_alices_tasks(page: Page, system: System) -> None:
    with client(system, system.core.url, "alice") as alice:
        task = alice.post("/v1/tasks", json=spec(name="private")).json()
    log_in(page, system, "bob")
    expect(page.locator("table")).to_contain_text("nothing here")
    assert page.locator("tr[data-task-id]").count() == 0
    page.goto(f"{system.core.url}/ui#/tasks/{task['id']}")
    expect(page.locator(".error")).to_contain_text("not found")
    page.goto(f"{system.core.url}/ui#/workers")
    expect(page.locator(".error")).to_contain_text("role may not see")


def test_a_workflow_run_is_drawn_with_its_node_states(page: Page, system: System) -> None:
    body = workflow("diamond", [node("a"), node("b", "a"), node("c", "a"), node("d", "b", "c")])
    with client(system, system.dag.url, "alice") as alice:
        assert alice.post("/v1/workflows", json=body).status_code in (200, 201)
        run = alice.post("/v1/workflows/diamond/runs", json={}).json()
        wait_for(lambda: alice.get(f"/v1/runs/{run['id']}").json()["state"] == "succeeded", 30)
    log_in(page, system, "alice")
    page.goto(f"{system.core.url}/ui#/runs")
    page.locator(f"tr[data-run-id='{run['id']}'] a[href='#/runs/{run['id']}']").click()
    nodes = page.locator("#run-graph g.node")
    expect(nodes).to_have_count(4)
    for name in "abcd":
        drawn = page.locator(f"#run-graph g.node[data-node='{name}']")
        expect(drawn).to_have_attribute("data-state", "succeeded")
        assert drawn.locator("rect").get_attribute("fill") == "#2e9b4f"
    assert page.locator("#run-graph path.edge").count() == 4
    screenshot(page, "run")


def test_queues_workers_and_schedules_pages(page: Page, system: System) -> None:
    with client(system, system.cron.url, "alice") as alice:
        body = {
            "name": "hourly-backup",
            "expression": "0 * * * *",
            "target": {"kind": "task", "task": spec(name="backup")},
        }
        created = alice.post("/v1/schedules", json=body)
        assert created.status_code == 201, created.text
    log_in(page, system, "alice")
    page.goto(f"{system.core.url}/ui#/schedules")
    row = page.locator(f"tr[data-schedule-id='{created.json()['id']}']")
    expect(row).to_contain_text("hourly-backup")
    expect(row.locator("svg.timeline circle.fire")).to_have_count(24)
    screenshot(page, "schedules")
    with client(system, system.core.url, "alice") as alice:
        later = spec(name="later", queue="reports", run_at="2999-01-01T00:00:00Z")
        alice.post("/v1/tasks", json=later).raise_for_status()
    with page.expect_request(lambda r: r.url.endswith("/v1/queues")) as asked:
        page.goto(f"{system.core.url}/ui#/queues")
    # the backlog's counts, shared while at most one refresh old (db.readings)
    assert asked.value.header_value("cache-control") == "max-age=2"
    expect(page.locator("tr[data-queue='reports'] td").nth(1)).to_have_text("1")
    expect(page.locator("svg.chart").first).to_be_visible()
    screenshot(page, "queues")
    log_in(page, system, "root", "admin")
    page.goto(f"{system.core.url}/ui#/workers")
    worker = page.locator(f"tr[data-worker-id='{system.worker.id}']")
    expect(worker).to_contain_text("test-worker")
    expect(worker).to_contain_text("s ago")
    expect(worker.locator("td").nth(8)).to_contain_text("ago")  # the agent's last turn
    screenshot(page, "workers")


def test_the_queues_page_accepts_older_counts_while_counting_is_slow(
    page: Page, system: System
) -> None:
    """While its calls take long (here core's answers to ``/v1/queues`` held 1.1 s), the
    Queues page asks for counts up to twenty times that old, and says they may be."""
    asked: list[str | None] = []

    def slow(route: Route) -> None:
        asked.append(route.request.header_value("cache-control"))
        time.sleep(1.1)
        route.continue_()

    log_in(page, system, "alice")
    page.route("**/v1/queues", slow)
    page.goto(f"{system.core.url}/ui#/queues")
    note = page.locator("main p.muted", has_text="Counting the backlog takes long")
    expect(note).to_have_text(re.compile(r"these counts may be up to [0-9]+ s old"), timeout=15_000)
    said = re.search(r"up to ([0-9]+) s old", note.text_content() or "")
    assert said is not None
    assert 22 <= int(said.group(1)) <= 60  # twenty times the 1.1 s at least
    assert asked[0] == "max-age=2"
    assert f"max-age={said.group(1)}" in asked[1:]  # what the page says, it asked for


def test_a_tasks_page_shows_its_policy(page: Page, system: System) -> None:
    body = spec(
        name="policy",
        queue="nobody-serves",
        timeout_s=600,
        max_wait_s=3600,
        retry={"poison_window_s": 7200, "never": {"exit_codes": [3]}, "always": {"signals": [15]}},
        placement={"required": ["disk=ssd"], "anti_affinity": "host"},
    )
    with client(system, system.core.url, "alice") as alice:
        task = alice.post("/v1/tasks", json=body).json()
    log_in(page, system, "alice")
    page.goto(f"{system.core.url}/ui#/tasks/{task['id']}")
    expect(page.locator("#task-timeout")).to_have_text("600 s")
    expect(page.locator("#task-start-by")).not_to_have_text("—")
    expect(page.locator("#task-retry")).to_have_text(
        "poison after 3 crashes within 2.0 h · never retried: exit 3 · always retried: signal 15"
    )
    expect(page.locator("#task-placement")).to_have_text("requires disk=ssd; one per host")
    expect(page.locator("#task-pending")).to_have_text("no live worker serves queue nobody-serves")


def test_a_running_tasks_page_shows_its_progress_and_checkpoint(page: Page, system: System) -> None:
    with client(system, system.core.url, "alice") as alice:
        body = spec(name="long-import", args=["hold"], progress_timeout_s=600)
        task = alice.post("/v1/tasks", json=body).json()
        wait_for(lambda: alice.get(f"/v1/tasks/{task['id']}").json()["state"] == "running")
        attempt = alice.get(f"/v1/tasks/{task['id']}").json()["current_attempt_id"]
    worker = system.worker
    note = {"attempt_id": attempt, "fraction": 0.4, "message": "step 2 of 5", "checkpoint": "AAEC"}
    with httpx.Client(base_url=system.core.url, headers=worker.http.headers, timeout=10) as w:
        w.post(f"/v1/workers/{worker.id}/turn", json={"progress": [note]}).raise_for_status()
    log_in(page, system, "alice")
    page.goto(f"{system.core.url}/ui#/tasks/{task['id']}")
    shown = page.locator("#task-progress")
    expect(shown).to_contain_text(f"40% step 2 of 5 · attempt {attempt}")
    expect(shown).to_contain_text("ends after 600 s without progress")
    expect(shown.locator(".bar")).to_be_visible()
    expect(page.locator("#task-checkpoint")).to_contain_text(f"3 bytes from attempt {attempt}")
    screenshot(page, "task-progress")


def test_a_task_stored_under_older_rules_is_shown(page: Page, system: System) -> None:
    """Its digest in upper case, as an older core took it: the page shows the task (its
    read was a 500, which the page showed as an error)."""
    with client(system, system.core.url, "alice") as alice:
        task = alice.post("/v1/tasks", json=spec(name="old-row", queue="nobody-serves")).json()
    with psycopg.connect(libpq_url(system.core.db_url), autocommit=True) as db:
        db.execute(
            "UPDATE core.tasks SET artifact_sha256 = upper(artifact_sha256) WHERE id = %s",
            (task["id"],),
        )
    log_in(page, system, "alice")
    expect(page.locator(f"tr[data-task-id='{task['id']}']")).to_be_visible()
    page.goto(f"{system.core.url}/ui#/tasks/{task['id']}")
    expect(page.locator("#task-state [data-state='waiting']")).to_be_visible()
    expect(page.locator("dd", has_text="file:///bin/true")).to_be_visible()
