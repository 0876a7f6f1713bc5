"""Each service's /docs in Debian's chromium: Swagger UI draws the service's operations
from files of the service's own origin, and the page's policy refuses nothing it needs
(no request leaves the origin, no Content-Security-Policy violation is reported), and an
operation can be tried from it."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from playwright.sync_api import ConsoleMessage, Page

from tests.browser.conftest import System, screenshot


@pytest.mark.parametrize(
    ("service", "title", "operation"),
    [
        ("core", "Cairn core", "/v1/tasks"),
        ("cron", "Cairn cron", "/v1/schedules"),
        ("dag", "Cairn DAG", "/v1/workflows"),
    ],
)
def test_docs_render_from_the_services_own_origin_under_its_policy(
    page: Page, system: System, service: str, title: str, operation: str
) -> None:
    url = getattr(system, service).url
    requested: list[str] = []
    complaints: list[str] = []
    page.on("request", lambda request: requested.append(request.url))

    def heard(message: ConsoleMessage) -> None:
        if message.type in ("error", "warning"):
            complaints.append(message.text)

    page.on("console", heard)
    page.on("requestfailed", lambda request: complaints.append(f"failed {request.url}"))
    answer = page.goto(url + "/docs")
    assert answer is not None and answer.status == 200
    assert "script-src 'self'" in answer.headers["content-security-policy"]
    page.wait_for_selector(f".info .title:has-text('{title}')")
    page.wait_for_selector(f".opblock-summary-path[data-path='{operation}']")
    # Trying an operation works under the policy: the answer is drawn, highlighted.
    page.click(".opblock-summary-path[data-path='/healthz']")
    page.click(".try-out__btn")
    page.click(".execute")
    page.wait_for_selector(".live-responses-table .response-col_status:has-text('200')")
    screenshot(page, f"docs-{service}")
    origin = "{0.scheme}://{0.netloc}".format(urlsplit(url))
    assert requested and all(r.startswith(origin + "/") for r in requested), requested
    assert not [c for c in complaints if "Content Security Policy" in c or "failed" in c]
    assert not complaints, complaints
