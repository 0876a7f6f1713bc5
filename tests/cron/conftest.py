"""The cron service in a thread, over real HTTP to a real core, with a clock the test sets."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from services.cron.app import create_app
from services.cron.engine import CronEngine
from services.cron.settings import CronSettings
from tests.support import Core, free_port, make_token, serve_in_thread


class FakeClock:
    """A wall clock the test moves by hand (jumps, skews, steps)."""

    def __init__(self, start: datetime) -> None:
        self._now = start
        self._lock = threading.Lock()

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def real(self, at: datetime) -> datetime:
        """Where ``at`` would fall in real time if this clock ran at speed 1 from now."""
        return datetime.now(UTC) + (at - self.now())

    def set(self, at: datetime) -> None:
        with self._lock:
            self._now = at

    def advance(self, **delta: float) -> datetime:
        with self._lock:
            self._now += timedelta(**delta)
            return self._now


@dataclass
class Cron:
    url: str
    core: Core
    server: uvicorn.Server
    thread: threading.Thread
    app: Any
    tokens: dict[str, str] = field(default_factory=dict)

    @property
    def engine(self) -> CronEngine:
        engine: CronEngine = self.app.state.cron
        return engine

    def client(self, name: str = "alice", role: str = "user") -> httpx.Client:
        if name not in self.core.tokens:
            self.core.tokens[name] = make_token(self.core.db_url, name, role)
        return httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {self.core.tokens[name]}"},
            timeout=httpx.Timeout(30.0, connect=5.0),
        )

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def cron_settings(core: Core, home: Path, **overrides: Any) -> CronSettings:
    if "cron" not in core.tokens:
        core.tokens["cron"] = make_token(core.db_url, "cron", "service")
    values: dict[str, Any] = {
        "home": home,
        "database_url": core.db_url,
        "url": core.url,
        "token": core.tokens["cron"],
        "token_cache_s": 0,
        "cron_leader_poll_s": 0.1,
        "cron_tick_s": 0.02,
        "cron_retry_max_s": 0.2,
        # Fires at their slot, as these tests step the clock to it; the lead has its own.
        "cron_lead_s": 0,
        **overrides,
    }
    return CronSettings(**values)


def start_cron(core: Core, home: Path, clock: Any = None, **overrides: Any) -> Cron:
    port = free_port()
    settings = cron_settings(core, home, cron_port=port, **overrides)
    app = create_app(settings, core.db_url, clock=clock)
    server, thread = serve_in_thread(app, port, "cron")
    return Cron(f"http://127.0.0.1:{port}", core, server, thread, app)


# A Monday, so weekly expressions are easy to reason about.
EPOCH = datetime(2027, 1, 4, 12, 0, 30, tzinfo=UTC)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(EPOCH)


@pytest.fixture
def cron(core: Core, tmp_path: Path, clock: FakeClock) -> Iterator[Cron]:
    server = start_cron(core, tmp_path, clock)
    yield server
    server.stop()
