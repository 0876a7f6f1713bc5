"""Cron's check of its callers' tokens asks every core it is given (``CAIRN_CORE_URLS``):
with the first of two real core processes killed, a valid token still passes through the
other, and a bad one is still a 401."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx

from tests.support import free_port, make_token, spawn_core, spawn_service, stop_process


def test_a_killed_core_passes_the_token_check_to_the_other(db_url: str, tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    cores = [
        spawn_core(db_url, tmp_path / f"core{i}", port, CAIRN_MIGRATE_ON_START="false")
        for i, port in enumerate(ports)
    ]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    cron_port = free_port()
    try:
        cron = spawn_service(
            "services.cron",
            "CAIRN_CRON_PORT",
            db_url,
            tmp_path / "cron",
            cron_port,
            CAIRN_URL=urls[0],
            CAIRN_CORE_URLS=",".join(urls),
            CAIRN_TOKEN=make_token(db_url, "cron", "service"),
            CAIRN_TOKEN_CACHE_S="0",
            CAIRN_MIGRATE_ON_START="false",
        )
        try:
            alice = make_token(db_url, "alice", "user")
            stop_process(cores[0], signal.SIGKILL)
            with httpx.Client(base_url=f"http://127.0.0.1:{cron_port}", timeout=30) as client:
                mine = client.get("/v1/schedules", headers={"Authorization": f"Bearer {alice}"})
                bad = client.get("/v1/schedules", headers={"Authorization": "Bearer nope"})
        finally:
            stop_process(cron)
    finally:
        for core in cores:
            stop_process(core)
    assert cores[0].returncode == -signal.SIGKILL
    assert mine.status_code == 200, mine.text
    assert mine.json()["items"] == []
    assert bad.status_code == 401, bad.text
