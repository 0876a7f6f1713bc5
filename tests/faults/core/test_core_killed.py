"""Core is killed with SIGKILL in the middle of submissions; clients retry with the same
idempotency keys against a fresh core: every submission ends up as exactly one task."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import httpx
import psycopg
import pytest

from libs.common.settings import libpq_url
from tests.support import free_port, make_token, spawn_core, spec, stop_process, wait_for

pytestmark = pytest.mark.slow

PER_CLIENT = 60


def test_every_submission_is_accounted_for_after_kill_9(db_url: str, tmp_path: Path) -> None:
    token = make_token(db_url, "alice", "user")
    port = free_port()
    core = spawn_core(db_url, tmp_path, port, CAIRN_MIGRATE_ON_START="false")
    results: dict[str, int] = {}
    lock = threading.Lock()

    def submit(client_no: int) -> None:
        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {token}"},
            timeout=5,
        ) as client:
            for i in range(PER_CLIENT):
                key = f"c{client_no}-{i}"
                while True:
                    try:
                        answer = client.post("/v1/tasks", json=spec(idempotency_key=key))
                    except httpx.TransportError:
                        continue
                    if answer.status_code in (200, 201):
                        with lock:
                            results[key] = answer.json()["id"]
                        break

    clients = [threading.Thread(target=submit, args=(n,)) for n in range(4)]
    for thread in clients:
        thread.start()
    wait_for(lambda: len(results) > 40, timeout=30)
    stop_process(core, signal.SIGKILL)
    core = spawn_core(db_url, tmp_path, port, CAIRN_MIGRATE_ON_START="false")
    try:
        for thread in clients:
            thread.join(timeout=120)
    finally:
        stop_process(core)
    assert len(results) == 4 * PER_CLIENT
    with psycopg.connect(libpq_url(db_url)) as conn:
        rows = conn.execute("SELECT idempotency_key, id FROM core.tasks").fetchall()
    assert dict(rows) == results
