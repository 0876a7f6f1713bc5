"""Wake-ups that scale with the work, not with the fleet (docs/architecture.md,
"Wake-ups"), on two real core replicas over one database: waiting claims cost the
database nothing while nothing happens; an announced task wakes as many waiting claims
as it can use, on whichever replica they wait, not all of them; a drained worker's
waiting claim answers at once; on SIGTERM core answers its waiting claims instead of
holding the shutdown for their long polls; and a worker's report grows the room of its
claim waiting on the other replica."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg

from tests.support import (
    TurnWorker,
    free_port,
    make_token,
    spawn_cores,
    spec,
    start_core,
    stop_process,
    wait_for,
)

DB = psycopg.Connection[tuple[Any, ...]]
CLAIMS = 12
WAIT_S = 20.0
ENV = {"CAIRN_CLAIM_SWEEP_S": "30", "CAIRN_HEARTBEAT_TIMEOUT_S": "600"}


def _metric(bases: list[str], name: str) -> int:
    """The metric ``name``, over its labels and the replicas."""
    total = 0.0
    for base in bases:
        for line in httpx.get(base + "/metrics").text.splitlines():
            if line.split(" ", 1)[0].split("{", 1)[0] == name:
                total += float(line.rsplit(" ", 1)[1])
    return int(total)


def _looks(bases: list[str]) -> int:
    """Looks by woken claims, over the replicas (``cairn_claim_looks_total``)."""
    return _metric(bases, "cairn_claim_looks_total")


async def _register(base: str, token: str, n: int) -> list[tuple[int, str]]:
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token}"}) as c:
        out = []
        for i in range(n):
            answer = await c.post(
                "/v1/workers",
                json={"hostname": f"w{i}", "queues": ["default"], "cpu": 4, "memory_mb": 4096},
            )
            answer.raise_for_status()
            out.append((answer.json()["worker"]["id"], answer.json()["lease"]))
        return out


async def _claim(base: str, token: str, worker: tuple[int, str]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}", "X-Cairn-Worker-Lease": worker[1]}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=WAIT_S + 30) as c:
        answer = await c.post(
            f"/v1/workers/{worker[0]}/turn",
            json={"claim": {"cpu": 4, "memory_mb": 4096, "max": 4, "wait": WAIT_S}},
        )
        answer.raise_for_status()
        return dict(answer.json())


def test_waiting_claims_cost_nothing_and_a_task_wakes_one_of_them_on_either_replica(
    db_url: str, tmp_path: Path, db: DB
) -> None:
    ports = [free_port(), free_port()]
    cores = spawn_cores(db_url, [(tmp_path / f"c{i}", p) for i, p in enumerate(ports)], **ENV)
    bases = [f"http://127.0.0.1:{p}" for p in ports]
    worker_token = make_token(db_url, "fleet", "worker")
    user = {"Authorization": f"Bearer {make_token(db_url, 'alice', 'user')}"}
    admin = {"Authorization": f"Bearer {make_token(db_url, 'root', 'admin')}"}

    async def run() -> None:
        workers = await _register(bases[0], worker_token, CLAIMS)
        claims = [
            asyncio.create_task(_claim(bases[i % 2], worker_token, w))
            for i, w in enumerate(workers)
        ]
        # Every claim is in its replica's line (it joins before its first look, which a
        # woken claim's looks counted below do not include), found nothing, waits.
        await asyncio.to_thread(
            wait_for, lambda: _metric(bases, "cairn_claims_waiting") == CLAIMS, 10
        )
        assert not any(c.done() for c in claims)

        # Idle: twelve waiting claims look no more (the old code re-polled each twice a
        # second: 72 looks here). The sweep is set to 30 s in this test.
        before = await asyncio.to_thread(_looks, bases)
        await asyncio.sleep(3.0)
        assert await asyncio.to_thread(_looks, bases) == before

        # One task, submitted to replica 1: exactly one claim (on either replica) takes
        # it at once; the others keep waiting. It cost one look on each replica at most
        # (the count reaches both), not one per waiting claim.
        before = await asyncio.to_thread(_looks, bases)
        async with httpx.AsyncClient(base_url=bases[1], headers=user) as alice:
            answer = await alice.post("/v1/tasks", json=spec())
            assert answer.status_code == 201, answer.text
        done, _ = await asyncio.wait(claims, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1
        [first] = done
        assert len(first.result()["attempts"]) == 1
        assert first.result()["waited"] is True  # the agent's reports go at once
        await asyncio.sleep(1.0)
        assert sum(c.done() for c in claims) == 1
        assert 1 <= await asyncio.to_thread(_looks, bases) - before <= 2

        # Three tasks at once: claims answer with all three between them (one claim may
        # take them all: each has room for four); at most three looks on each replica.
        before = await asyncio.to_thread(_looks, bases)
        async with httpx.AsyncClient(base_url=bases[0], headers=user) as alice:
            answer = await alice.post("/v1/tasks/batch", json={"tasks": [spec()] * 3})
            assert answer.status_code in (200, 201), answer.text
        deadline = time.monotonic() + 5

        def leased() -> int:
            return sum(len(c.result()["attempts"]) for c in claims if c.done())

        while leased() < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert leased() == 4
        await asyncio.sleep(0.5)
        assert leased() == 4
        assert 1 <= await asyncio.to_thread(_looks, bases) - before <= 6

        # A drained worker's waiting claim answers at once, whichever replica it waits on.
        waiting = [(w, c) for w, c in zip(workers, claims, strict=True) if not c.done()]
        (wid, _), claim = waiting[0]
        async with httpx.AsyncClient(base_url=bases[0], headers=admin) as root:
            began = time.monotonic()
            assert (await root.post(f"/v1/workers/{wid}/drain")).status_code == 200
        drained = await asyncio.wait_for(claim, 5)
        assert drained["state"] == "draining" and drained["attempts"] == []
        assert time.monotonic() - began < 3

        # SIGTERM: each replica answers its waiting claims and stops well inside their wait.
        still = [c for c in claims if not c.done()]
        assert still
        began = time.monotonic()
        codes = await asyncio.gather(
            *(asyncio.to_thread(stop_process, p, signal.SIGTERM) for p in cores)
        )
        # uvicorn re-raises the signal once it has shut down gracefully
        assert all(code in (0, -signal.SIGTERM) for code in codes), codes
        assert time.monotonic() - began < 10
        rest = await asyncio.gather(*still, return_exceptions=True)
        assert all(isinstance(r, dict) and r["attempts"] == [] for r in rest), rest

    try:
        asyncio.run(run())
    finally:
        for proc in cores:
            stop_process(proc, signal.SIGTERM)
    wait_for(lambda: _running(db) == 4, timeout=5)


def _running(db: DB) -> int:
    row = db.execute("SELECT count(*) FROM core.tasks WHERE state = 'running'").fetchone()
    assert row is not None
    return int(row[0])


def test_a_report_on_one_replica_grows_the_room_of_its_workers_claim_waiting_on_the_other(
    db_url: str, tmp_path: Path
) -> None:
    """A claim sent with the room its worker had while an attempt ran (200 MB of 600)
    waits on replica 1; that attempt's report, a turn of its own on replica 0, frees its
    400 MB: the claim leases the next 400 MB task at once, not when its wait runs out."""
    quiet = {"claim_sweep_s": 30, "heartbeat_timeout_s": 600}
    cores = [start_core(db_url, tmp_path / f"c{i}", **quiet) for i in range(2)]
    bases = [core.url for core in cores]
    token = make_token(db_url, "fleet", "worker")
    user = {"Authorization": f"Bearer {make_token(db_url, 'alice', 'user')}"}
    big = spec(resources={"cpu": 1, "memory_mb": 400})
    try:
        with httpx.Client(base_url=bases[0], headers={"Authorization": f"Bearer {token}"}) as c:
            offer = {"hostname": "w", "queues": ["default"], "cpu": 4, "memory_mb": 600}
            answer = c.post("/v1/workers", json=offer)
            answer.raise_for_status()
            wid, lease = answer.json()["worker"]["id"], answer.json()["lease"]
        heads = {"Authorization": f"Bearer {token}", "X-Cairn-Worker-Lease": lease}
        near, far = (httpx.Client(base_url=b, headers=heads, timeout=60) for b in bases)
        with near, far, httpx.Client(base_url=bases[0], headers=user) as alice:
            for _ in range(2):
                assert alice.post("/v1/tasks", json=big).status_code == 201
            room = {"cpu": 4, "memory_mb": 600, "max": 4}
            [first] = near.post(f"/v1/workers/{wid}/turn", json={"claim": room}).json()["attempts"]
            # Room for one at a time: the second waits. The agent's next claim says what
            # it has left while the first runs.
            left = {"cpu": 3, "memory_mb": 200, "max": 3, "wait": WAIT_S}

            async def run() -> tuple[dict[str, Any], float]:
                claim = asyncio.create_task(
                    asyncio.to_thread(far.post, f"/v1/workers/{wid}/turn", json={"claim": left})
                )
                await asyncio.sleep(1.0)  # it looked, found nothing that fits, waits
                assert not claim.done()
                report = {"attempt_id": first["attempt_id"], "outcome": "succeeded"}
                began = time.monotonic()
                answer = await asyncio.to_thread(
                    near.post, f"/v1/workers/{wid}/turn", json={"reports": [report]}
                )
                assert answer.status_code == 200, answer.text
                assert answer.json()["reports"][0]["status"] == 200
                claimed = await asyncio.wait_for(claim, WAIT_S + 10)
                return claimed.json(), time.monotonic() - began

            claimed, took = asyncio.run(run())
            assert len(claimed["attempts"]) == 1
            assert took < 3.0, f"the waiting claim leased {took:.1f} s after the report"
    finally:
        for core in cores:
            core.stop()


def test_a_report_costs_its_workers_waiting_claim_no_look_when_nothing_waits(
    db_url: str, tmp_path: Path
) -> None:
    """A hop of a chain: the worker's next claim looked and found nothing waiting; the
    report of the attempt before it frees room, which cannot make that claim lease
    anything (nothing waits), so it costs no look; the next task announced wakes it."""
    core = start_core(db_url, tmp_path / "c", claim_sweep_s=30, heartbeat_timeout_s=600)
    token = make_token(db_url, "fleet", "worker")
    user = {"Authorization": f"Bearer {make_token(db_url, 'alice', 'user')}"}
    task = spec(queue="chain-hop", resources={"cpu": 1, "memory_mb": 100})
    try:
        # 30 s, not httpx's 5: a fresh core's first write waited longer than 5 s for its
        # commit in a CI run beside the system tests (load 15)
        with httpx.Client(
            base_url=core.url, headers={"Authorization": f"Bearer {token}"}, timeout=30
        ) as c:
            offer = {"hostname": "w", "queues": ["chain-hop"], "cpu": 4, "memory_mb": 600}
            answer = c.post("/v1/workers", json=offer)
            answer.raise_for_status()
            wid, lease = answer.json()["worker"]["id"], answer.json()["lease"]
        heads = {"Authorization": f"Bearer {token}", "X-Cairn-Worker-Lease": lease}
        agent = httpx.Client(base_url=core.url, headers=heads, timeout=60)
        courier = httpx.Client(base_url=core.url, headers=heads, timeout=60)
        with agent, courier, httpx.Client(base_url=core.url, headers=user, timeout=30) as alice:
            assert alice.post("/v1/tasks", json=task).status_code == 201
            room = {"cpu": 4, "memory_mb": 600, "max": 4}
            [first] = agent.post(f"/v1/workers/{wid}/turn", json={"claim": room}).json()["attempts"]
            left = {"cpu": 3, "memory_mb": 500, "max": 3, "wait": WAIT_S}

            async def run() -> tuple[dict[str, Any], int, int]:
                claim = asyncio.create_task(
                    asyncio.to_thread(agent.post, f"/v1/workers/{wid}/turn", json={"claim": left})
                )
                await asyncio.sleep(0.5)  # it looked, found nothing, waits
                looks = _looks([core.url])
                report = {"attempt_id": first["attempt_id"], "outcome": "succeeded"}
                answer = await asyncio.to_thread(
                    courier.post, f"/v1/workers/{wid}/turn", json={"reports": [report]}
                )
                assert answer.json()["reports"][0]["status"] == 200
                await asyncio.sleep(0.5)
                assert not claim.done()
                after_report = _looks([core.url])
                assert alice.post("/v1/tasks", json=task).status_code == 201
                claimed = await asyncio.wait_for(claim, WAIT_S + 10)
                return claimed.json(), after_report - looks, _looks([core.url]) - looks

            claimed, wasted, looks = asyncio.run(run())
            assert wasted == 0, "the report woke a claim that had nothing to find"
            assert len(claimed["attempts"]) == 1 and looks == 1
    finally:
        core.stop()


def test_a_report_that_ends_a_task_under_a_held_key_wakes_another_workers_claim(
    db_url: str, tmp_path: Path, db: DB
) -> None:
    # One replica, no sweep within the test: a claim held back by a concurrency key waits;
    # the report that ends the key's running task, sent alone by another worker, wakes
    # it at once (the replica remembers that its claims held work back: ops.dispatch.Holds,
    # one per replica, not per request).
    core = start_core(db_url, tmp_path, heartbeat_timeout_s=3600.0, claim_sweep_s=30.0)
    w1, w2 = TurnWorker(core, "w1"), TurnWorker(core, "w2")
    try:
        with core.client("alice") as alice:
            key = {"key": "db-main", "limit": 1}
            for _ in range(2):
                alice.post("/v1/tasks", json=spec(concurrency=key)).raise_for_status()
        room = {"cpu": 4, "memory_mb": 4096, "max": 4}
        [running] = w1.turn(claim=room)["attempts"]
        box: dict[str, Any] = {}

        def wait() -> None:
            started = time.monotonic()
            box["answer"] = w2.turn(claim={**room, "wait": 10})
            box["took"] = time.monotonic() - started

        waiting = threading.Thread(target=wait)
        waiting.start()
        wait_for(lambda: _looks_held(core.url) >= 1, timeout=10)  # held back: it waits
        time.sleep(0.2)
        report = {"attempt_id": running["attempt_id"], "outcome": "succeeded", "exit_code": 0}
        assert w1.turn(reports=[report])["reports"][0]["status"] == 200
        waiting.join(15)
        assert len(box["answer"]["attempts"]) == 1
        assert box["took"] < 5  # woken by the report, not by the wait's end (10 s)
    finally:
        w1.http.close()
        w2.http.close()
        core.stop()


def _looks_held(base: str) -> float:
    """Candidates this replica's claims held back by a concurrency key."""
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith('cairn_claim_held_total{reason="concurrency"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
