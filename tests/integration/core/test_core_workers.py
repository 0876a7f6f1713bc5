"""Core as several uvicorn worker processes on one port (``CAIRN_CORE_WORKERS``): each
serves with its own app, pools and loops, and SIGTERM stops them all."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import psycopg

from services.core.db.feed import LISTENER_NAME
from tests.support import free_port, make_token, spawn_core, spec, stop_process, wait_for

DB = psycopg.Connection[tuple[Any, ...]]


def _listeners(db: DB) -> int:
    """Core processes connected: each has one LISTEN connection of its own."""
    row = db.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name = %s",
        (LISTENER_NAME,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_two_worker_processes_serve_one_port_and_stop_on_sigterm(
    db_url: str, tmp_path: Path, db: DB
) -> None:
    port = free_port()
    proc = spawn_core(db_url, tmp_path, port, CAIRN_CORE_WORKERS="2")
    try:
        wait_for(lambda: _listeners(db) == 2, timeout=30)
        token = make_token(db_url, "alice", "user")
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers) as alice:
            ids = []
            for _ in range(20):
                # A fresh connection each time, so the kernel spreads them over both.
                answer = alice.post("/v1/tasks", json=spec(), headers={"Connection": "close"})
                assert answer.status_code == 201, answer.text
                ids.append(answer.json()["id"])
            assert {alice.get(f"/v1/tasks/{i}").json()["state"] for i in ids} == {"waiting"}
        row = db.execute("SELECT count(*) FROM core.tasks").fetchone()
        assert row == (20,)
    finally:
        code = stop_process(proc, signal.SIGTERM)
    assert code == 0
    wait_for(lambda: _listeners(db) == 0, timeout=30)
