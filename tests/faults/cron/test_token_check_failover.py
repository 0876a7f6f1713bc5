"""Cron's check of its callers' tokens asks every core it is given (``CAIRN_CORE_URLS``):
with the first of two real core processes killed, a valid token still passes through the
other, and a bad one is still a 401; and a service given a URL there that it cannot send to
does not start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support import free_port, make_token, spawn_cores, spawn_service, stop_process


def test_a_killed_core_passes_the_token_check_to_the_other(db_url: str, tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    places = [(tmp_path / f"core{i}", port) for i, port in enumerate(ports)]
    cores = spawn_cores(db_url, places, CAIRN_MIGRATE_ON_START="false")
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


@pytest.mark.parametrize(
    ("module", "port_variable"), [("cron", "CAIRN_CRON_PORT"), ("dag", "CAIRN_DAG_PORT")]
)
def test_a_core_url_without_its_scheme_stops_the_start_naming_the_setting(
    module: str, port_variable: str, db_url: str, tmp_path: Path
) -> None:
    # "host:port" for "http://host:port": it started, then failed every call to that core
    # (UnsupportedProtocol), a lone one every caller's token check with a 503.
    env = {
        **os.environ,
        "CAIRN_DATABASE_URL": db_url,
        "CAIRN_HOME": str(tmp_path / "home"),
        port_variable: str(free_port()),
        "CAIRN_CORE_URLS": f"127.0.0.1:{free_port()}",
        "CAIRN_MIGRATE_ON_START": "false",
    }
    run = subprocess.run(
        [sys.executable, "-m", f"services.{module}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0
    assert "CAIRN_CORE_URLS: '127.0.0.1:" in run.stderr, run.stderr
    assert "is not an http(s) URL" in run.stderr, run.stderr
