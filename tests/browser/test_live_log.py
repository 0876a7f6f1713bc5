"""The task page shows the log as it is written (docs/logs.md): a worker ships chunks of a
running attempt and the page shows each without a reload, then the attempt's end."""

from __future__ import annotations

from playwright.sync_api import Page, expect

from tests.browser.conftest import System, log_in, screenshot
from tests.browser.test_dashboard import client
from tests.support import register_worker, spec

QUEUE = "live-logs"  # a queue of its own: the system's worker serves only default


def test_the_task_page_shows_the_log_live_and_the_attempts_end(page: Page, system: System) -> None:
    with (
        client(system, system.core.url, "alice") as alice,
        client(system, system.core.url, "log-shipper", "worker") as worker,
    ):
        offer = {"hostname": "shipper", "queues": [QUEUE], "cpu": 1, "memory_mb": 1024}
        worker_id = register_worker(worker, offer)
        task = alice.post("/v1/tasks", json=spec(name="chatty", queue=QUEUE)).json()
        room = {"cpu": 1, "memory_mb": 1024, "max": 1, "wait": 10}
        [attempt] = worker.post(f"/v1/workers/{worker_id}/claim", json=room).json()["attempts"]
        attempt_id = attempt["attempt_id"]

        def ship(offset: int, text: str) -> None:
            chunk = {"attempt_id": attempt_id, "offset": offset, "length": len(text), "text": text}
            answer = worker.post(f"/v1/workers/{worker_id}/logs", json={"chunks": [chunk]})
            assert answer.json()["items"][0]["status"] == 200, answer.text

        ship(0, "first line\n")
        log_in(page, system, "alice")
        page.goto(f"{system.core.url}/ui#/tasks/{task['id']}")
        expect(page.locator("#log")).to_have_text("first line\n")
        page.evaluate("window.notReloaded = true")
        ship(11, "second <b>line</b>\n")
        expect(page.locator("#log")).to_have_text("first line\nsecond <b>line</b>\n")
        expect(page.locator("#log b")).to_have_count(0)  # text, never markup
        expect(page.locator("#log-status")).to_have_text(f"attempt {attempt_id}: running")
        screenshot(page, "task-live-log")
        report = {"outcome": "succeeded", "exit_code": 0}
        path = f"/v1/workers/{worker_id}/attempts/{attempt_id}/report"
        worker.post(path, json=report).raise_for_status()
        expect(page.locator("#log-status")).to_have_text(
            f"attempt {attempt_id} ended: succeeded; task succeeded"
        )
        assert page.evaluate("window.notReloaded") is True
