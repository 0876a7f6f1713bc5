"""Core is killed with SIGKILL while a webhook holds a delivery open; a fresh core takes the
delivery over when its lease ends, carries on following the feed from the cursor kept in
the database, and every notification reaches the receiver exactly once."""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from libs.common.settings import libpq_url
from tests.support import (
    LOOPBACK_WEBHOOKS,
    free_port,
    make_token,
    spawn_core,
    spec,
    stop_process,
    wait_for,
)
from tests.webhooks import Receiver, subscribe

pytestmark = pytest.mark.slow

NOTIFY_ENV = {
    "CAIRN_MIGRATE_ON_START": "false",
    "CAIRN_NOTIFY_INTERVAL_S": "0.05",
    "CAIRN_NOTIFY_BACKOFF_BASE_S": "0.05",
    "CAIRN_NOTIFY_BACKOFF_CAP_S": "0.2",
    # Long enough that the held delivery is still leased to the first core when it dies.
    "CAIRN_NOTIFY_TIMEOUT_S": "10",
    "CAIRN_NOTIFY_LEASE_S": "11",
    "CAIRN_NOTIFY_ALLOW_CIDRS": LOOPBACK_WEBHOOKS,
}


def _client(url: str, token: str) -> httpx.Client:
    return httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=httpx.Timeout(30.0)
    )


def _bury(url: str, alice: str, worker: str, count: int) -> list[int]:
    with _client(url, alice) as client:
        ids = [client.post("/v1/tasks", json=spec()).json()["id"] for _ in range(count)]
    with _client(url, worker) as agent:
        offer = {"hostname": "w.test", "queues": ["default"], "cpu": 64, "memory_mb": 65536}
        registered = agent.post("/v1/workers", json=offer).json()
        worker_id = registered["worker"]["id"]
        agent.headers["X-Cairn-Worker-Lease"] = registered["lease"]
        claimed: list[dict[str, Any]] = []
        while len(claimed) < count:
            room = {"cpu": 64, "memory_mb": 65536, "max": count}
            claimed += agent.post(f"/v1/workers/{worker_id}/claim", json=room).json()["attempts"]
        for attempt in claimed:
            agent.post(
                f"/v1/workers/{worker_id}/attempts/{attempt['attempt_id']}/report",
                json={"outcome": "failed", "retryable": False, "error": "boom"},
            )
    return ids


def _outbox(db_url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq_url(db_url)) as conn:
        return conn.execute(
            "SELECT delivery_id::text, state, tries FROM core.notifications ORDER BY id"
        ).fetchall()


def test_a_delivery_cut_by_kill_9_is_delivered_once_by_the_next_core(
    db_url: str, tmp_path: Path
) -> None:
    alice = make_token(db_url, "alice", "user")
    worker = make_token(db_url, "w", "worker")
    cron = make_token(db_url, "cron", "service")
    hook = Receiver(fail_first=1, hold=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    core = spawn_core(db_url, tmp_path, port, **NOTIFY_ENV)
    try:
        with _client(url, alice) as client:
            made = subscribe(client, hook.url, events=["task.dead", "fire.failed"])
        event = {"event": "fire.failed", "owner": "alice", "key": "schedule 1 at t0"}
        with _client(url, cron) as service:
            assert service.post("/v1/notifications/events", json=event).json() == {"queued": 1}
        hook.held.wait(20)
        assert hook.held.is_set(), "the first delivery never arrived"
        # While that one hangs, the others go through (a slow webhook holds only its own).
        before = _bury(url, alice, worker, 3)
        wait_for(lambda: sum(s == "delivered" for _, s, _ in _outbox(db_url)) == 3, timeout=30)
        stop_process(core, signal.SIGKILL)
        hook.release()  # answers into a closed connection
        core = spawn_core(db_url, tmp_path, port, **NOTIFY_ENV)
        after = _bury(url, alice, worker, 2)

        def settled() -> bool:
            rows = _outbox(db_url)
            return len(rows) == 6 and all(state == "delivered" for _, state, _ in rows)

        wait_for(settled, timeout=60)
    finally:
        stop_process(core)
        hook.close()
    rows = _outbox(db_url)
    tries = Counter(r.delivery_id for r in hook.all())
    accepted = Counter(r.delivery_id for r in hook.accepted())
    assert set(tries) == {delivery_id for delivery_id, _, _ in rows}
    assert set(tries.values()) == {2}, tries
    assert set(accepted.values()) == {1}, accepted
    assert [t for _, _, t in rows] == [2] * 6
    tasks = sorted(
        r.doc["data"]["task"]["id"] for r in hook.accepted() if r.doc["event"] != "fire.failed"
    )
    assert tasks == sorted(before + after)
    assert all(r.signed_by(made["secret"]) for r in hook.all())
