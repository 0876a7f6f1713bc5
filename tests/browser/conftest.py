"""A whole system for the browser: core (serving /ui), cron and dag in threads over real
HTTP on 127.0.0.1, a worker claiming through core's API, and Debian's chromium driven
headless by Playwright (never a downloaded browser). One of each per module."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from libs.common.embedded import EmbeddedPostgres
from libs.common.settings import libpq_url
from services.cron.app import create_app as create_cron
from services.dag.app import create_app as create_dag
from tests.fixtures.cron import Cron, cron_settings
from tests.fixtures.dag import DagServer, Worker, dag_settings
from tests.support import Core, free_port, make_token, serve_in_thread, start_core

CHROMIUM = os.environ.get("CAIRN_CHROMIUM", "/usr/bin/chromium")
SCREENSHOTS = os.environ.get("CAIRN_SCREENSHOTS")


@dataclass
class System:
    core: Core
    cron: Cron
    dag: DagServer
    worker: Worker

    def token(self, name: str, role: str = "user") -> str:
        if name not in self.core.tokens:
            # Playwright's sync API runs an event loop in this thread: asyncio.run elsewhere.
            with ThreadPoolExecutor(1) as pool:
                made = pool.submit(make_token, self.core.db_url, name, role)
                self.core.tokens[name] = made.result()
        return self.core.tokens[name]


@pytest.fixture(scope="module")
def module_db(pg_server: EmbeddedPostgres, template_db: str) -> Iterator[str]:
    name = "b_" + uuid.uuid4().hex[:16]
    admin = libpq_url(pg_server.url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {template_db}")
    yield pg_server.url.rsplit("/", 1)[0] + "/" + name
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="module")
def system(module_db: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    home = tmp_path_factory.mktemp("system")
    cron_port, dag_port = free_port(), free_port()
    cron_url, dag_url = f"http://127.0.0.1:{cron_port}", f"http://127.0.0.1:{dag_port}"
    core = start_core(module_db, home / "core", cron_url=cron_url, dag_url=dag_url)
    settings = cron_settings(core, home / "cron", cron_port=cron_port, dag_url=dag_url)
    app = create_cron(settings, module_db)
    server, thread = serve_in_thread(app, cron_port, "cron")
    cron = Cron(cron_url, core, server, thread, app)
    token = make_token(module_db, "dag-service", "service")
    dag_app = create_dag(
        dag_settings(core.url, module_db, home / "dag", dag_port, token), module_db
    )
    dag_server, dag_thread = serve_in_thread(dag_app, dag_port, "dag")
    dag = DagServer(dag_url, core, dag_server, dag_thread)
    worker = Worker(core, delay_s=0.2)
    yield System(core, cron, dag, worker)
    worker.stop()
    dag.stop()
    cron.stop()
    core.stop()


@pytest.fixture(scope="module")
def browser(system: System) -> Iterator[Browser]:
    """Started after the system: the system's set-up runs asyncio.run, which Playwright's
    event loop in this thread would refuse."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium chromium-driver")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"]
        )
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    opened = context.new_page()
    opened.set_default_timeout(15_000)
    yield opened
    context.close()


def log_in(page: Page, system: System, name: str, role: str = "user") -> None:
    token = system.token(name, role)
    page.goto(system.core.url + "/ui")
    page.evaluate("sessionStorage.clear()")
    page.reload()
    page.fill("#token", token)
    page.click("#login")
    page.wait_for_selector(f"#whoami:has-text('{name}')")


def screenshot(page: Page, name: str) -> None:
    """With ``CAIRN_SCREENSHOTS=DIR`` (``make screenshots``), keep the page as DIR/NAME.png."""
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        page.wait_for_timeout(300)  # let the last refresh paint
        page.screenshot(path=str(Path(SCREENSHOTS) / f"{name}.png"), full_page=True)
