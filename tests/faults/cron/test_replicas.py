"""Two cron replicas as real processes on one database, on a clock running 30x fast:
one leads, none fires twice, none misses; kill -9 of the leader and the standby carries on."""

from __future__ import annotations

import signal
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.integration.cron.test_api import schedule
from tests.support import Core, free_port, make_token, spawn_service, stop_process, wait_for

SPEED = 30.0  # a virtual minute every two real seconds
SCHEDULES = 20


def status(url: str) -> dict[str, Any] | None:
    try:
        answer = httpx.get(url + "/v1/cron/status", headers=HEADERS, timeout=2)
    except httpx.HTTPError:
        return None
    return answer.json() if answer.status_code == 200 else None


HEADERS: dict[str, str] = {}


@pytest.mark.slow
def test_two_replicas_fire_each_slot_once_through_a_leader_kill(
    core: Core, tmp_path: Path, db: psycopg.Connection[tuple[Any, ...]]
) -> None:
    service = make_token(core.db_url, "cron", "service")
    alice = make_token(core.db_url, "alice", "user")
    HEADERS["Authorization"] = f"Bearer {alice}"
    virtual_start = datetime(2027, 1, 4, 12, 0, 10, tzinfo=UTC)
    warp = f"{time.time()},{virtual_start.isoformat()},{SPEED}"
    env = {
        "CAIRN_URL": core.url,
        "CAIRN_TOKEN": service,
        "CAIRN_CRON_CLOCK_WARP": warp,
        "CAIRN_CRON_LEADER_POLL_S": "0.2",
        "CAIRN_CRON_TICK_S": "0.05",
        "CAIRN_TOKEN_CACHE_S": "0",
        "CAIRN_MIGRATE_ON_START": "false",
    }
    ports = [free_port(), free_port()]
    procs = [
        spawn_service("services.cron", "CAIRN_CRON_PORT", core.db_url, tmp_path / f"c{i}", p, **env)
        for i, p in enumerate(ports)
    ]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        with httpx.Client(base_url=urls[1], headers=HEADERS) as client:
            for n in range(SCHEDULES):
                body = schedule(name=f"s{n}", expression="* * * * *", timezone="UTC")
                assert client.post("/v1/schedules", json=body).status_code == 201
        leaders = wait_for(
            lambda: [i for i, u in enumerate(urls) if (status(u) or {}).get("leader")]
        )
        assert len(leaders) == 1
        leader = leaders[0]
        standby = 1 - leader
        time.sleep(7.0)  # about three virtual minutes under the first leader
        stop_process(procs[leader], signal.SIGKILL)
        wait_for(lambda: (status(urls[standby]) or {}).get("leader"), timeout=5)
        time.sleep(7.0)  # about three more under the second
        stop_process(procs[standby])
    finally:
        for proc in procs:
            stop_process(proc, signal.SIGKILL)
    fires = db.execute(
        "SELECT schedule_id, fire_time, outcome, task_id FROM cron.fires ORDER BY 1, 2"
    ).fetchall()
    by_schedule: dict[int, list[tuple[datetime, str]]] = {}
    for sid, at, outcome, _ in fires:
        by_schedule.setdefault(sid, []).append((at, outcome))
    assert len(by_schedule) == SCHEDULES
    for sid, rows in by_schedule.items():
        times = [at for at, _ in rows]
        # Every minute from the first fire to the last, each once; only a fire caught by
        # the final stop may still be pending.
        assert times == [times[0] + timedelta(minutes=i) for i in range(len(times))], sid
        assert len(times) >= 5, sid
        assert {o for _, o in rows[:-1]} == {"submitted"}, (sid, rows)
    keys = Counter(
        k
        for (k,) in db.execute(
            "SELECT idempotency_key FROM core.tasks WHERE labels ? 'cairn.cron/schedule'"
        )
    )
    assert keys and max(keys.values()) == 1
    submitted = sum(1 for *_, outcome, task in fires if outcome == "submitted" and task)
    assert sum(keys.values()) >= submitted
