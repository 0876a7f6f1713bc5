"""Core is killed with SIGKILL in the middle of submissions; clients retry with the same
idempotency keys against a fresh core: every submission ends up as exactly one task. And
killed while it writes concurrent submissions together (``ops.groupcommit``): every one
it answered is stored."""

from __future__ import annotations

import asyncio
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


def test_no_answered_submission_is_lost_when_core_is_killed_mid_group(
    db_url: str, tmp_path: Path
) -> None:
    token = make_token(db_url, "alice", "user")
    port = free_port()
    core = spawn_core(db_url, tmp_path, port, CAIRN_MIGRATE_ON_START="false")
    answered: dict[int, str] = {}
    cut: list[str] = []

    async def client(no: int, http: httpx.AsyncClient) -> None:
        for i in range(10_000):
            name = f"c{no}-{i}"
            try:
                answer = await http.post("/v1/tasks", json=spec(name=name))
            except httpx.TransportError:
                cut.append(name)  # in flight when core died: stored or not, unanswered
                return
            assert answer.status_code == 201, answer.text
            answered[answer.json()["id"]] = name

    async def load() -> None:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
            limits=httpx.Limits(max_connections=32),
        ) as http:
            clients = [asyncio.create_task(client(n, http)) for n in range(32)]
            while len(answered) < 100:
                await asyncio.sleep(0.01)
            core.send_signal(signal.SIGKILL)
            await asyncio.gather(*clients)

    try:
        asyncio.run(load())
    finally:
        stop_process(core, signal.SIGKILL)
    assert cut  # core died with submissions in flight
    with psycopg.connect(libpq_url(db_url)) as conn:
        stored = dict(conn.execute("SELECT id, name FROM core.tasks").fetchall())
        [largest] = conn.execute(
            "SELECT max(n) FROM (SELECT count(*) AS n FROM core.tasks GROUP BY xmin::text) g"
        ).fetchone()
    assert answered.items() <= stored.items()
    assert set(stored.values()) - set(answered.values()) <= set(cut)
    assert largest > 1  # they were written in groups
