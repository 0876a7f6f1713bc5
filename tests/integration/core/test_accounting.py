"""Usage accounting: the leader rolls what ended attempts used up into monthly sums per
owner, team and queue (``db/accounting.py``), read through ``GET /v1/usage/accounts``.
Asserted against the attempts' own figures in the database; each attempt counted once,
whatever pages and passes; users see their own and their teams' sums only."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.ext.asyncio import create_async_engine
from typer.testing import CliRunner

from cairn.cli import app
from services.core.db import accounting
from tests.integration.system.test_metrics import scrape, value
from tests.support import Core, TurnWorker, cli_as, spec, wait_for

DB = psycopg.Connection[tuple[Any, ...]]
ROOM = {"cpu": 8, "memory_mb": 16384, "max": 8}
MONTH = datetime.now(UTC).strftime("%Y-%m")


pytestmark = pytest.mark.core(usage_interval_s=0.1, heartbeat_timeout_s=3600.0)


def _run(core: Core, worker: TurnWorker, submitted: list[tuple[str, dict[str, Any]]]) -> None:
    """Submit each (owner, spec), lease them all, report each with its own figures."""
    for owner, body in submitted:
        with core.client(owner) as client:
            assert client.post("/v1/tasks", json=body).status_code == 201
    leased: list[dict[str, Any]] = []
    while len(leased) < len(submitted):
        leased += worker.turn(claim=ROOM)["attempts"]
    reports = [
        {
            "attempt_id": a["attempt_id"],
            "outcome": "succeeded" if i % 2 == 0 else "failed",
            "exit_code": i % 2,
            "retryable": False,
            "cpu_seconds": 0.25 * (i + 1),
            "peak_memory_mb": 10.0 * (i + 1),
        }
        for i, a in enumerate(leased)
    ]
    verdicts = worker.turn(reports=reports)["reports"]
    assert [v["status"] for v in verdicts] == [200] * len(reports)


def _expected(db: DB, by: str) -> dict[str, dict[str, float]]:
    """The sums, computed here from the attempts' own rows."""
    column = {"owner": "t.owner", "team": "t.team", "queue": "t.queue"}[by]
    rows = db.execute(
        f"SELECT {column}, count(*), sum(a.cpu_seconds),"
        " sum(EXTRACT(EPOCH FROM a.ended_at - a.started_at) * a.charge_cpu),"
        " sum(EXTRACT(EPOCH FROM a.ended_at - a.started_at) * a.charge_memory_mb),"
        " max(a.peak_memory_mb)"
        " FROM core.attempts a JOIN core.tasks t ON t.id = a.task_id"
        f" WHERE {column} IS NOT NULL GROUP BY {column}"
    ).fetchall()
    return {
        key: {
            "attempts": n,
            "cpu_s": round(float(cpu), 3),
            "cpu_reserved_s": round(float(cores), 3),
            "memory_mb_s": round(float(mb), 3),
            "peak_memory_mb": round(float(peak), 3),
        }
        for key, n, cpu, cores, mb, peak in rows
    }


def _accounts(core: Core, who: str, by: str, role: str = "user") -> dict[str, dict[str, float]]:
    with core.client(who, role) as client:
        answer = client.get("/v1/usage/accounts", params={"by": by, "month": MONTH})
    assert answer.status_code == 200, answer.text
    assert (answer.json()["month"], answer.json()["by"]) == (MONTH, by)
    return {
        item["key"]: {k: item[k] for k in ("attempts", "cpu_s", "cpu_reserved_s",
                                            "memory_mb_s", "peak_memory_mb")}
        for item in answer.json()["items"]
    }  # fmt: skip


def test_the_months_sums_are_the_attempts_own_figures_counted_once(core: Core, db: DB) -> None:
    with core.client("root", "admin") as root:
        assert root.post("/v1/teams", json={"name": "data"}).status_code == 201
        assert root.put("/v1/teams/data/members/alice").status_code == 200
    worker = TurnWorker(core, "w-accounting")
    res = {"resources": {"cpu": 2, "memory_mb": 512}}
    _run(
        core,
        worker,
        [
            ("alice", spec(**res)),
            ("alice", spec(team="data", **res)),
            ("alice", spec(team="data", resources={"cpu": 1, "memory_mb": 128})),
            ("bob", spec(**res)),
        ],
    )
    db.autocommit = True
    everyone = _expected(db, "owner")
    assert sum(v["attempts"] for v in everyone.values()) == 4
    # The leader's loop rolls them up (each event read once): the API shows the sums.
    wait_for(lambda: _accounts(core, "root", "owner", "admin") == everyone, timeout=15)
    assert _accounts(core, "root", "team", "admin") == _expected(db, "team")
    assert _accounts(core, "root", "queue", "admin") == _expected(db, "queue")
    # Users: their own by owner and queue, their teams' by team; never another's.
    assert _accounts(core, "alice", "owner") == {"alice": everyone["alice"]}
    assert _accounts(core, "bob", "owner") == {"bob": everyone["bob"]}
    assert _accounts(core, "bob", "team") == {}
    assert _accounts(core, "alice", "team") == _expected(db, "team")
    assert _accounts(core, "bob", "queue")["default"]["attempts"] == 1
    # The month per queue in Prometheus (no label per owner).
    queues = _expected(db, "queue")["default"]
    samples = scrape(core.url)
    assert value(samples, "cairn_usage_attempts", queue="default") == 4
    assert value(samples, "cairn_usage_cpu_seconds", queue="default") == queues["cpu_s"]
    reserved = value(samples, "cairn_usage_cpu_reserved_seconds", queue="default")
    assert reserved == pytest.approx(queues["cpu_reserved_s"], abs=1e-3)


def test_a_page_is_counted_once_whatever_passes_run(core: Core, db: DB) -> None:
    worker = TurnWorker(core, "w-pages")
    _run(core, worker, [("carol", spec()) for _ in range(5)])
    db.autocommit = True
    want = _expected(db, "owner")["carol"]
    wait_for(lambda: _accounts(core, "root", "owner", "admin").get("carol") == want, timeout=15)

    async def passes() -> None:
        engine = create_async_engine(core.db_url)
        try:
            for limit in (1, 2, 1000):  # more passes, over pages of every size: nothing new
                async with engine.begin() as conn:
                    await accounting.roll_up(conn, limit)
        finally:
            await engine.dispose()

    asyncio.run(passes())
    assert _accounts(core, "root", "owner", "admin")["carol"] == want


def test_cairn_usage_prints_the_month_by_queue(
    core: Core, db: DB, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cairn: CliRunner = cli_as(core, monkeypatch, tmp_path, "dave")
    worker = TurnWorker(core, "w-cli")
    _run(core, worker, [("dave", spec(resources={"cpu": 1, "memory_mb": 1024}))])
    wait_for(lambda: _accounts(core, "dave", "queue").get("default"), timeout=15)
    shown = cairn.invoke(app, ["usage", "--by", "queue", "--month", MONTH])
    assert shown.exit_code == 0, shown.output
    assert f"usage in {MONTH}, by queue" in shown.output
    assert "default" in shown.output and "core-h reserved" in shown.output
    bad = cairn.invoke(app, ["usage", "--month", "2026-13"])
    assert bad.exit_code != 0 and "month" in bad.output


def test_a_month_that_is_not_one_is_refused_naming_the_field(core: Core) -> None:
    with core.client("alice") as alice:
        for bad in ("2026-13", "2026-1", "december", "2026-12-01", "0000-01"):
            answer = alice.get("/v1/usage/accounts", params={"month": bad})
            assert answer.status_code == 422, bad
            assert "month" in answer.text
        assert alice.get("/v1/usage/accounts", params={"by": "host"}).status_code == 422
        empty = alice.get("/v1/usage/accounts", params={"month": "1999-01"})
        assert empty.status_code == 200 and empty.json()["items"] == []
